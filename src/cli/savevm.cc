// vblk savevm: an internal snapshot of a disk carrying a VM-state stream
// read from a file or a pipe, so that QEMU's
//   migrate "exec:vblk savevm disk.qcow2 s1 --vmstate -"
// saves a VM as its own `savevm s1` would (QEMU's save_snapshot).
//
// The VM's own image lock: see wait_for_image.
//
// A stream that starts with QEMU's magic ('QEVM') must be a whole QEMU
// migration stream (MigrationStreamCheck): a QEMU killed mid-migration
// leaves no snapshot. Other streams are stored as they are.
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
#include <optional>
#include <vector>

#include "common.h"
#include "vblk/image_format.h"
#include "vblk/migration_stream.h"
#include "vblk/vmstate.h"

namespace vblk::cli {

namespace {

constexpr size_t kReadChunk = 1 << 20;  // large reads: one syscall per MiB of stream
// Reads of the spill file: it is read back once, O_DIRECT, one read at a
// time while the writer's workers write, so each read's latency counts:
// 1 MiB reads gave 408 MB/s here, 8 MiB ones keep the disk busy.
constexpr size_t kSpillReadChunk = 8 << 20;

struct SaveResult {
  Status st;
  std::string context;  // what failed, for the message
  uint64_t bytes = 0;
};

// A stream that starts with QEMU's magic is QEMU's migration stream and
// must be a whole one (MigrationStreamCheck): a QEMU killed mid-migration
// must not leave a snapshot that only fails when loaded. Other streams
// are stored as they are (savevm is a general VM-state API too). A
// stream shorter than the magic but a prefix of it is a cut one.
class StreamFormat {
 public:
  Status feed(std::span<const uint8_t> d) {
    if (!decided_) {
      const size_t k = std::min(4 - head_.size(), d.size());
      head_.insert(head_.end(), d.begin(), d.begin() + static_cast<std::ptrdiff_t>(k));
      d = d.subspan(k);
      if (head_.size() < 4) return Status{};
      decided_ = true;
      if (MigrationStreamCheck::has_magic(head_)) {
        check_.emplace();
        VBLK_TRY(check_->feed(head_));
      }
    }
    if (check_) return check_->feed(d);
    return Status{};
  }
  Status finish() {
    if (check_) return check_->finish();
    if (!decided_ && !head_.empty() && std::equal(head_.begin(), head_.end(), "QEVM"))
      return Error(EINVAL, "Invalid VM state stream: it ends early, in its header (truncated?)");
    return Status{};
  }

 private:
  bool decided_ = false;
  std::vector<uint8_t> head_;
  std::optional<MigrationStreamCheck> check_;
};

// Reads each of `fds` to its end, in order, into the node's VM state area.
Task<SaveResult> save_stream(Loop& loop, Node& node, std::vector<int> fds, VmstateOptions opts) {
  SaveResult r;
  VmstateWriter w(node, opts);
  AlignedBuffer in(kSpillReadChunk);
  int fd = -1;
  std::function<long()> rd = [&]() -> long {
    for (;;) {
      ssize_t n = ::read(fd, in.data(), in.size());
      if (n >= 0) return n;
      if (errno != EINTR) return -errno;
    }
  };
  StreamFormat fmt;
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
      auto data = in.span().subspan(0, static_cast<size_t>(got));
      r.st = fmt.feed(data);
      if (!r.st) break;  // not QEMU's stream after all: no use reading on
      auto st = co_await w.write(r.bytes, data);
      r.bytes += static_cast<uint64_t>(got);
      if (!st) break;  // flush() below reports it
    }
  }
  if (r.st) r.st = fmt.finish();
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
//
// The spill is written with O_DIRECT in 4 MiB pieces where the file system
// allows: the stream is read back once, so the page cache would only cost
// (fresh page-cache pages filled at ~200 MB/s on the test machines, where
// the disk takes 1.5 GB/s). The tail is padded to the block and the file
// then cut to the stream's exact length.
class SpillFile {
 public:
  bool open() {
    const char* tmp = std::getenv("TMPDIR");
    const char* dir = tmp && *tmp ? tmp : "/var/tmp";
    fd_ = ::open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC | O_DIRECT, 0600);
    if (fd_ < 0) fd_ = ::open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    return fd_ >= 0;
  }
  int fd() const { return fd_; }
  bool append(const uint8_t* p, size_t n) {
    while (n) {
      const size_t k = std::min(n, buf_.size() - fill_);
      std::memcpy(buf_.data() + fill_, p, k);
      fill_ += k;
      p += k;
      n -= k;
      if (fill_ == buf_.size() && !write_out(buf_.size())) return false;
    }
    return true;
  }
  // Writes what is buffered (padded to 4 KiB), cuts the file to the
  // stream's length and rewinds it.
  bool finish() {
    const uint64_t len = written_ + fill_;
    if (fill_ && !write_out((fill_ + 4095) / 4096 * 4096)) return false;
    if (::ftruncate(fd_, static_cast<off_t>(len)) != 0) return false;
    return ::lseek(fd_, 0, SEEK_SET) == 0;
  }

 private:
  bool write_out(size_t n) {
    if (n > fill_) std::memset(buf_.data() + fill_, 0, n - fill_);
    for (size_t done = 0; done < n;) {
      const ssize_t k = ::pwrite(fd_, buf_.data() + done, n - done, static_cast<off_t>(written_ + done));
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return false;
      done += static_cast<size_t>(k);
    }
    written_ += fill_ < n ? fill_ : n;
    fill_ = 0;
    return true;
  }
  int fd_ = -1;
  AlignedBuffer buf_{4 << 20};
  size_t fill_ = 0;
  uint64_t written_ = 0;
};

std::shared_ptr<Node> wait_for_image(Loop& loop, ImageArgs& a, int in, int* spill, bool* eof) {
  SpillFile sf;
  if (!sf.open()) return nullptr;
  *spill = sf.fd();
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
        if (n > 0 && !sf.append(buf.data(), static_cast<size_t>(n))) return nullptr;
      }
    } else {
      ::usleep(50 * 1000);
    }
    if (now_ms() < next_try) continue;
    next_try = now_ms() + 100;
    auto node = open_cli_image(loop, a);
    if (node) {
      if (!sf.finish()) return nullptr;
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
  ImageArgs a;
  a.read_only = false;
  std::string cache = "writeback", input;
  bool quiet = false;
  VmstateOptions opts;
  uint64_t vm_clock = 0;
  if (int rc = for_each_option(
          argc, argv, ":f:t:hq", longopts,
          [&] {
            std::printf(
                "usage: %s savevm [--image-opts] [-f fmt] [-t cache] [-q] [--workers n] [--buffer-size size] "
                "[--vm-clock ns] --vmstate file|- filename tag\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': a.format = optarg; break;
              case 't': cache = optarg; break;
              case 'q': quiet = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
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
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
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
  // A pipe of 1 MiB (the kernel's default is 64 KiB): fewer, larger reads
  // and fewer wake-ups of the producer. Not a pipe, or no room: as it is.
  (void)::fcntl(fd, F_SETPIPE_SZ, 1 << 20);
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
  if (!image::supports_vmstate(*node) || !image::supports_snapshots(*node)) {
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
  for (const auto& sn : image::snapshots(*node))
    if (sn.name == tag) old_id = sn.id;
  if (r.st) {
    SnapshotInfo sn;
    sn.name = tag;
    sn.vm_state_size = r.bytes;
    sn.date_sec = static_cast<uint32_t>(tv.tv_sec);
    sn.date_nsec = static_cast<uint32_t>(tv.tv_usec * 1000);
    sn.vm_clock_nsec = vm_clock;
    sn.icount = UINT64_MAX;  // QEMU records none without record/replay
    r.st = loop.run(image::snapshot_create(*node, sn));
    r.context = "Error while creating snapshot on '" + a.filename + "'";
    // QEMU's savevm replaces a snapshot of the same name; the old one goes
    // only once the new one is committed.
    if (r.st && !old_id.empty()) {
      auto st = loop.run(image::snapshot_delete(*node, old_id, tag));
      if (!st) {
        error_report("Error while deleting snapshot '" + tag + "' (id " + old_id + ") on '" + a.filename +
                     "': " + st.error().what());
        ret = 1;
      }
    }
  }
  if (!r.st) {
    ret = 1;
    error_report(r.context.empty() ? r.st.error().what() : r.context + ": " + std::strerror(r.st.error().code));
    // Nothing refers to the stream's clusters: give them back (a failure
    // here only leaks, which check -r leaks reclaims).
    (void)loop.run(image::discard_vmstate(*node, std::max<uint64_t>(r.bytes, 1)));
  }
  auto st = loop.run(node->flush());
  if (!st && !ret) {
    error_report(st.error().what());
    ret = 1;
  }
  return ret;
}

}  // namespace vblk::cli
