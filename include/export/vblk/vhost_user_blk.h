// A vhost-user-blk export: a node served as a virtio-blk device to a VM
// (QEMU's -device vhost-user-blk-pci) or any vhost-user front end, over a
// unix socket, with qemu-storage-daemon's options (type=vhost-user-blk:
// num-queues, logical-block-size, writable, writethrough).
//
// Write cache: the device tells the driver the truth. With writethrough
// off (the default) it advertises a volatile write cache (wce = 1), so the
// guest sends flushes and each reaches the node; with writethrough on, or
// after the driver turns the cache off (SET_CONFIG of wce = 0), every write
// is durable (FUA) before it completes.
//
// Ownership: the export holds its node through a NodeRef with the
// permissions an export claims (consistent reads, writes if writable, no
// resize by others). One loop.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "vblk/block_export.h"
#include "vblk/net.h"
#include "vblk/node_ref.h"

namespace vblk::vhost {

struct BlkOptions {
  std::shared_ptr<Node> node;
  bool writable = false;
  bool writethrough = false;
  uint32_t logical_block_size = 512;  // a power of two, 512 to kMaxLogicalBlockSize
  uint16_t num_queues = 1;            // at least 1
  // A queue with work outstanding that has not moved for this long is
  // reported (stderr) with its ring indices; 0: never. Negative: the
  // environment's VBLK_VHOST_STALL_SECONDS, else 60.
  double stall_seconds = -1;
};
// QEMU's MAX_BLOCK_SIZE (util/block-helpers.h).
constexpr uint32_t kMaxLogicalBlockSize = 2u << 20;

class BlkExport : public BlockExport {
 public:
  // Claims the node and serves front ends on `listener`, one at a time,
  // until remove(); `unix_path` (if any) is unlinked then. EINVAL for
  // options out of range, a permission conflict as QEMU words it.
  static Result<std::unique_ptr<BlkExport>> create(Loop& loop, BlkOptions o, Fd listener, std::string unix_path = {});

  // A front end that broke the protocol, with why (default: stderr).
  virtual void set_error_handler(std::function<void(const std::string&)> fn) = 0;
};

}  // namespace vblk::vhost
