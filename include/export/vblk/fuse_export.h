// A FUSE export: a node served to the host as a regular file (the export's
// mountpoint, an existing regular file the image is mounted over), with
// qemu-storage-daemon's options (type=fuse: mountpoint, writable,
// growable, allow-other). Programs read and write the file, punch holes,
// seek to data and holes, and mount file systems on it through a loop
// device.
//
// Speaks the kernel's FUSE protocol on /dev/fuse itself, on the loop:
// many requests are read and served at once, each into a buffer of its
// own (a request's data is never shared with another's). The mount is
// made with mount(2) (root only, no fusermount), removed when the export
// is deleted or the daemon stops, and a stale one left by a killed daemon
// on the same mountpoint is cleared at the next start. With io-uring=on
// (and the kernel's fuse.enable_uring=Y) requests come through FUSE over
// io_uring instead (src/export/fuse/uring_transport.h).
#pragma once

#include <memory>
#include <string>

#include "vblk/block_export.h"
#include "vblk/loop.h"

namespace vblk::fuse {

enum class AllowOther { Off, On, Auto };

struct Options {
  std::shared_ptr<Node> node;
  std::string mountpoint;
  bool writable = false;
  bool growable = false;  // writes past the end grow the node
  AllowOther allow_other = AllowOther::Auto;
  bool io_uring = false;  // FUSE over io_uring (refused when the kernel does not allow it)
};

class FuseExport : public BlockExport {
 public:
  // Claims the node, mounts and starts serving. Errors in QEMU's words
  // ("Failed to stat 'x': ...", "'x' is not a regular file").
  static Result<std::unique_ptr<FuseExport>> create(Loop& loop, Options o);
};

}  // namespace vblk::fuse
