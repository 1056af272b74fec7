// vblk savevm: an internal snapshot of a disk carrying a VM-state stream
// read from a file or a pipe, so that QEMU's
//   migrate "exec:vblk savevm disk.qcow2 s1 --vmstate -"
// saves a VM as its own `savevm s1` would (QEMU's save_snapshot).
//
// The VM's own image lock: see wait_for_image.
//
// All or nothing: the stream goes to the active VM state area first
// (VmstateWriter), and only once all of it is on disk does the snapshot
// table commit. On any error before that there is no snapshot, and the
// area's clusters are freed again, so `check` finds nothing.
#include <fcntl.h>
#include <getopt.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <vector>

#include "cli/common.h"
#include "vblk/vmstate.h"

namespace vblk::cli {

namespace {

constexpr size_t kReadChunk = 1 << 20;  // large reads: one syscall per MiB of stream

struct SaveResult {
  Status st;
  std::string context;  // what failed, for the message
  uint64_t bytes = 0;
};

// Reads each of `fds` to its end, in order, into the node's VM state area.
Task<SaveResult> save_stream(Loop& loop, Node& node, std::vector<int> fds, VmstateOptions opts) {
  SaveResult r;
  VmstateWriter w(node, opts);
  AlignedBuffer in(kReadChunk);
  int fd = -1;
  std::function<long()> rd = [&]() -> long {
    for (;;) {
      ssize_t n = ::read(fd, in.data(), in.size());
      if (n >= 0) return n;
      if (errno != EINTR) return -errno;
    }
  };
  for (size_t i = 0; i < fds.size() && r.st; ++i) {
    fd = fds[i];
    for (;;) {
      // In the thread pool: a slow producer must not stall the writes in flight.
      const long got = co_await loop.run_blocking(rd);
      if (got < 0) {
        r.st = Error(static_cast<int>(-got));
        r.context = "Error while reading VM state";
        break;
      }
      if (got == 0) break;
      auto st = co_await w.write(r.bytes, in.span().subspan(0, static_cast<size_t>(got)));
      r.bytes += static_cast<uint64_t>(got);
      if (!st) break;  // flush() below reports it
    }
  }
  auto st = co_await w.flush();
  if (r.st && !st) {
    r.st = st;
    r.context = "Error while writing VM state";
  }
  co_return r;
}

uint64_t now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000 + static_cast<uint64_t>(ts.tv_nsec) / 1000000;
}

// The image is in use: QEMU migrating into `exec:vblk savevm` holds its
// image's write lock until the end of the migration (it lets go just
// before the stream's last byte). Meanwhile the stream goes to an unnamed
// spill file, and the open is retried; a short grace after the end of the
// stream, then the lock error stands. Returns the spill file (read from
// its start) and the node, or no node.
std::shared_ptr<Node> wait_for_image(Loop& loop, ImageArgs& a, int in, int* spill, bool* eof) {
  const char* tmp = std::getenv("TMPDIR");
  *spill = ::open(tmp && *tmp ? tmp : "/var/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (*spill < 0) return nullptr;
  std::vector<uint8_t> buf(kReadChunk);
  uint64_t eof_at = 0, next_try = now_ms() + 100;
  for (;;) {
    if (!*eof) {
      pollfd p{in, POLLIN, 0};
      if (::poll(&p, 1, 100) > 0) {
        const ssize_t n = ::read(in, buf.data(), buf.size());
        if (n < 0 && errno != EINTR && errno != EAGAIN) return nullptr;
        if (n == 0) {
          *eof = true;
          eof_at = now_ms();
        }
        for (ssize_t done = 0; n > 0 && done < n;) {
          const ssize_t k = ::write(*spill, buf.data() + done, static_cast<size_t>(n - done));
          if (k < 0 && errno != EINTR) return nullptr;
          if (k > 0) done += k;
        }
      }
    } else {
      ::usleep(50 * 1000);
    }
    if (now_ms() < next_try) continue;
    next_try = now_ms() + 100;
    auto node = open_cli_image(loop, a);
    if (node) {
      ::lseek(*spill, 0, SEEK_SET);
      return node;
    }
    if (a.open_error->code != EAGAIN) return nullptr;
    if (*eof && now_ms() - eof_at > 3000) return nullptr;
  }
}

}  // namespace

int cmd_savevm(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS, OPT_VMSTATE, OPT_WORKERS, OPT_BUFFER_SIZE, OPT_VM_CLOCK };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"vmstate", required_argument, nullptr, OPT_VMSTATE},
      {"workers", required_argument, nullptr, OPT_WORKERS},
      {"buffer-size", required_argument, nullptr, OPT_BUFFER_SIZE},
      {"vm-clock", required_argument, nullptr, OPT_VM_CLOCK},
      {nullptr, 0, nullptr, 0},
  };
  optind = 0;
  ImageArgs a;
  a.read_only = false;
  std::string cache = "writeback", input;
  bool quiet = false;
  VmstateOptions opts;
  uint64_t vm_clock = 0;
  int c;
  while ((c = getopt_long(argc, argv, ":f:t:hq", longopts, nullptr)) != -1) {
    switch (c) {
      case ':': missing_argument(argv, optind);
      case '?': unrecognized_option(argv, optind);
      case 'h':
        std::printf("usage: %s savevm [--image-opts] [-f fmt] [-t cache] [-q] [--workers n] [--buffer-size size] "
                    "[--vm-clock ns] --vmstate file|- filename tag\n", g_prog.c_str());
        return 0;
      case 'f': a.format = optarg; break;
      case 't': cache = optarg; break;
      case 'q': quiet = true; break;
      case OPT_OBJECT: break;
      case OPT_IMAGE_OPTS: a.image_opts = true; break;
      case OPT_VMSTATE: input = optarg; break;
      case OPT_WORKERS: {
        auto n = parse_ulong(optarg, 64);
        if (!n || *n == 0) error_exit(std::string("Invalid number of workers: '") + optarg + "'");
        opts.workers = static_cast<unsigned>(*n);
        break;
      }
      case OPT_BUFFER_SIZE: {
        auto n = cvtnum("buffer size", optarg, int64_t{1} << 30);
        if (!n) return 1;
        opts.buffer_size = static_cast<uint64_t>(*n);
        break;
      }
      case OPT_VM_CLOCK: {
        auto n = parse_ulong(optarg, ULONG_MAX);
        if (!n) error_exit(std::string("Invalid VM clock: '") + optarg + "'");
        vm_clock = *n;
        break;
      }
    }
  }
  (void)quiet;
  if (optind != argc - 2) error_exit("Expecting image file name and snapshot tag");
  if (input.empty()) error_exit("Expecting --vmstate file|-");
  a.filename = argv[optind];
  const std::string tag = std::string(argv[optind + 1]).substr(0, 255);  // QEMUSnapshotInfo.name is char[256]
  if (!parse_cache_mode(cache, a.cache)) {
    error_report("Invalid cache option: " + cache);
    return 1;
  }

  int fd = 0;
  if (input != "-") {
    fd = ::open(input.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      error_report("Could not open '" + input + "': " + std::strerror(errno));
      return 1;
    }
  }
  Loop loop;
  Error open_error;
  a.open_error = &open_error;
  auto node = open_cli_image(loop, a);
  int spill = -1;
  bool eof = false;
  struct stat in_st;
  if (!node && open_error.code == EAGAIN && fstat(fd, &in_st) == 0 && !S_ISREG(in_st.st_mode))
    node = wait_for_image(loop, a, fd, &spill, &eof);
  if (!node) {
    error_report_hint("Could not open '" + a.filename + "': " + open_error.what(), open_error);
    return 1;
  }
  if (!node->supports_vmstate() || !node->supports_snapshots()) {
    error_report("Device '" + a.filename + "' does not support VM state snapshots");
    return 1;
  }
  // The date is the moment the state was taken, as QEMU stamps it before
  // saving.
  timeval tv;
  gettimeofday(&tv, nullptr);

  int ret = 0;
  std::vector<int> fds;
  if (spill >= 0) fds.push_back(spill);
  if (!eof) fds.push_back(fd);
  SaveResult r = loop.run(save_stream(loop, *node, fds, opts));
  if (fd != 0) ::close(fd);
  if (spill >= 0) ::close(spill);
  std::string old_id;
  for (const auto& sn : node->snapshots())
    if (sn.name == tag) old_id = sn.id;
  if (r.st) {
    SnapshotInfo sn;
    sn.name = tag;
    sn.vm_state_size = r.bytes;
    sn.date_sec = static_cast<uint32_t>(tv.tv_sec);
    sn.date_nsec = static_cast<uint32_t>(tv.tv_usec * 1000);
    sn.vm_clock_nsec = vm_clock;
    sn.icount = UINT64_MAX;  // QEMU records none without record/replay
    r.st = loop.run(node->snapshot_create(sn));
    r.context = "Error while creating snapshot on '" + a.filename + "'";
    // QEMU's savevm replaces a snapshot of the same name; the old one goes
    // only once the new one is committed.
    if (r.st && !old_id.empty()) {
      auto st = loop.run(node->snapshot_delete(old_id, tag));
      if (!st) {
        error_report("Error while deleting snapshot '" + tag + "' (id " + old_id + ") on '" + a.filename +
                     "': " + st.error().what());
        ret = 1;
      }
    }
  }
  if (!r.st) {
    ret = 1;
    error_report(r.context + ": " + std::strerror(r.st.error().code));
    // Nothing refers to the stream's clusters: give them back (a failure
    // here only leaks, which check -r leaks reclaims).
    (void)loop.run(node->discard_vmstate(std::max<uint64_t>(r.bytes, 1)));
  }
  auto st = loop.run(node->flush());
  if (!st && !ret) {
    error_report(st.error().what());
    ret = 1;
  }
  return ret;
}

}  // namespace vblk::cli
