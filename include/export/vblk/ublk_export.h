// A ublk export: a node served to the kernel's own block layer as
// /dev/ublkbN through the ublk driver (Linux 6.0+, module ublk_drv), so the
// host (or a guest of it) mounts a file system on a vblk image without a
// VM, NBD or FUSE in between. qemu-storage-daemon has no such export; the
// options follow its other exports' (type=ublk: num-queues, queue-depth,
// logical-block-size, writable) plus dev-id and recovery.
//
// The daemon adds the device on /dev/ublk-control, maps each queue's
// request descriptors from /dev/ublkcN, and keeps one FETCH command per
// tag in an io_uring of its own; the driver completes a fetch when a
// request arrives (its data already copied into the tag's buffer for a
// write), and the reply goes back with the next fetch in one command
// (COMMIT_AND_FETCH_REQ). The device advertises a volatile write cache and
// FUA, so the kernel's flushes and FUA writes reach the node.
//
// Ownership: the export holds its node through a NodeRef with an export's
// permissions (consistent reads, writes if writable, no resize by others).
// One loop; control commands that block run on the loop's thread pool.
#pragma once

#include <cstdint>
#include <memory>

#include "vblk/block_export.h"
#include "vblk/loop.h"

namespace vblk::ublk {

struct Options {
  std::shared_ptr<Node> node;
  bool writable = false;
  uint16_t num_queues = 1;            // 1 to 64
  uint16_t queue_depth = 128;         // 1 to 4096
  uint32_t logical_block_size = 512;  // 512 to 4096, a power of two
  int64_t dev_id = -1;                // -1: the driver picks
  // The device outlives a killed daemon: its queues wait (requests in
  // flight are reissued) until a daemon started with the same dev-id takes
  // it back (UBLK_F_USER_RECOVERY_REISSUE). Off: the device fails its I/O
  // once the daemon is gone, and the next start with its dev-id replaces it.
  bool recovery = false;
};

class UblkExport : public BlockExport {
 public:
  // Adds the device and starts serving its queues; /dev/ublkbN exists
  // once ready() has succeeded. Errors in the driver's words.
  static Result<std::unique_ptr<UblkExport>> create(Loop& loop, Options o);
  virtual uint32_t dev_id() const = 0;
};

}  // namespace vblk::ublk
