// vblk loadvm: the VM-state stream of an internal snapshot, written to a
// file or a pipe, with the disk reverted to the snapshot first as QEMU's
// `loadvm` reverts it (QEMU's load_snapshot), so that
//   qemu-system-x86_64 ... -incoming "exec:vblk loadvm disk.qcow2 s1 --vmstate-out -"
// restores what `savevm` (QEMU's or vblk's) saved. --state-only leaves
// the disk alone and opens it read-only (-U allowed).
//
// All or nothing: what can fail is tried before the revert (the snapshot,
// the output), and the revert itself is taken back when the stream fails
// after it (snapshot_revert.h).
#include <fcntl.h>
#include <getopt.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>

#include "common.h"
#include "vblk/image_format.h"
#include "vblk/snapshot_revert.h"
#include "vblk/vmstate.h"

namespace vblk::cli {

namespace {

constexpr size_t kWriteChunk = 1 << 20;

// Streams [0, size) of the snapshot's state to fd. `where` says which side failed.
Task<Status> load_stream(Loop& loop, Node& node, const std::string& id, uint64_t size, int fd, VmstateOptions opts,
                         std::string* where) {
  VmstateReader rd(node, id, size, opts);
  AlignedBuffer out(kWriteChunk);
  size_t len = 0;
  std::function<long()> wr = [&]() -> long {
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::write(fd, out.data() + done, len - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return -errno;
      done += static_cast<size_t>(n);
    }
    return 0;
  };
  Status st;
  for (uint64_t pos = 0; pos < size; pos += len) {
    len = static_cast<size_t>(std::min<uint64_t>(out.size(), size - pos));
    st = co_await rd.read(pos, out.span().subspan(0, len));
    if (!st) {
      *where = "Error while reading VM state";
      break;
    }
    // In the thread pool: the reads ahead go on while a slow consumer drains.
    const long r = co_await loop.run_blocking(wr);
    if (r < 0) {
      st = Error(static_cast<int>(-r));
      *where = "Error while writing VM state";
      break;
    }
  }
  co_await rd.close();
  co_return st;
}

}  // namespace

int cmd_loadvm(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS, OPT_VMSTATE_OUT, OPT_STATE_ONLY, OPT_WORKERS };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"vmstate-out", required_argument, nullptr, OPT_VMSTATE_OUT},
      {"state-only", no_argument, nullptr, OPT_STATE_ONLY},
      {"workers", required_argument, nullptr, OPT_WORKERS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  ImageArgs a;
  a.read_only = false;
  std::string cache = "writeback", output;
  bool state_only = false, force_share = false;
  VmstateOptions opts;
  if (int rc = for_each_option(
          argc, argv, ":f:t:hqU", longopts,
          [&] {
            std::printf(
                "usage: %s loadvm [--image-opts] [-f fmt] [-t cache] [-q] [-U] [--state-only] [--workers n] "
                "--vmstate-out file|- filename tag\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': a.format = optarg; break;
              case 't': cache = optarg; break;
              case 'q': break;
              case 'U': force_share = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
              case OPT_VMSTATE_OUT: output = optarg; break;
              case OPT_STATE_ONLY: state_only = true; break;
              case OPT_WORKERS: {
                auto n = parse_ulong(optarg, 64);
                if (!n || *n == 0) error_exit(std::string("Invalid number of workers: '") + optarg + "'");
                opts.workers = static_cast<unsigned>(*n);
                break;
              }
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (optind != argc - 2) error_exit("Expecting image file name and snapshot tag");
  if (output.empty()) error_exit("Expecting --vmstate-out file|-");
  a.filename = argv[optind];
  const std::string tag = argv[optind + 1];
  if (!parse_cache_mode(cache, a.cache)) {
    error_report("Invalid cache option: " + cache);
    return 1;
  }
  a.read_only = state_only;
  if (force_share && !a.read_only) {
    error_report("Could not open '" + a.filename + "': force-share=on can only be used with read-only images");
    return 1;
  }
  a.force_share = force_share;

  Loop loop;
  auto node = open_cli_image(loop, a);
  if (!node) return 1;
  if (!image::supports_vmstate(*node) || !image::supports_snapshots(*node)) {
    error_report("Device '" + a.filename + "' does not support VM state snapshots");
    return 1;
  }
  // By name first, then by id (QEMU's bdrv_snapshot_find).
  const auto list = image::snapshots(*node);
  const SnapshotInfo* sn = nullptr;
  for (const auto& s : list)
    if (s.name == tag) {
      sn = &s;
      break;
    }
  for (const auto& s : list)
    if (!sn && s.id == tag) sn = &s;
  if (!sn) {
    error_report("Snapshot '" + tag + "' does not exist in device '" + a.filename + "'");
    return 1;
  }
  // Everything that can fail before the disk changes: the output first.
  int fd = 1;
  if (output != "-") {
    fd = ::open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      error_report("Could not open '" + output + "': " + std::strerror(errno));
      return 1;
    }
  }
  // All or nothing: the stream can still fail after the revert (a full
  // disk, a consumer that goes away), and the revert cannot wait for the
  // stream's end (QEMU starts the guest once it has the stream). So the
  // revert is an undoable one (snapshot_revert.h), taken back on failure.
  SnapshotRevert revert({node.get()}, {a.filename});
  if (!state_only) {
    auto st = loop.run(revert.revert(sn->id));
    if (!st) {
      error_report(st.error().what());
      if (fd != 1) ::close(fd);
      return 1;
    }
  }
  // A consumer that goes away early (QEMU refusing the stream) is an error
  // to report, not a signal to die of.
  std::signal(SIGPIPE, SIG_IGN);
  std::string where;
  auto st = loop.run(load_stream(loop, *node, sn->id, sn->vm_state_size, fd, opts, &where));
  int ret = 0;
  if (!st) {
    error_report(where + ": " + std::strerror(st.error().code));
    ret = 1;
  }
  if (fd != 1 && ::close(fd) != 0 && !ret) {
    error_report("Error while writing VM state: " + std::string(std::strerror(errno)));
    ret = 1;
  }
  if (!a.read_only) {
    auto rst = loop.run(ret ? revert.rollback() : revert.commit());
    if (!rst) {
      error_report(rst.error().what());
      ret = 1;
    }
    auto fst = loop.run(node->flush());
    if (!fst && !ret) {
      error_report(fst.error().what());
      ret = 1;
    }
  }
  return ret;
}

}  // namespace vblk::cli
