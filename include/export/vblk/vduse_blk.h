// A VDUSE export (qemu-storage-daemon's type=vduse-blk): a node served as
// a virtio-blk device whose driver is in the kernel itself. The daemon
// creates the device on /dev/vduse/control and serves its virtqueues from
// /dev/vduse/NAME; attaching it to the vDPA bus (`vdpa dev add name NAME
// mgmtdev vduse`) is the operator's, as with qemu-storage-daemon, and then
// the kernel's virtio_vdpa driver binds it and the disk appears as
// /dev/vdX (or vhost_vdpa hands it to a VM).
//
// The virtio-blk device is the vhost-user export's (virtio_blk.h): the same
// requests, limits and write-cache rules; only the transport differs. The
// driver's buffers live in the device's IOVA space, which the daemon maps
// from the file descriptors VDUSE_IOTLB_GET_FD hands out.
//
// Ownership: the export holds its node through a NodeRef with an export's
// permissions (consistent reads, writes if writable, no resize by
// others). One loop; the wait for VDUSE's control messages runs on the
// loop's thread pool.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "vblk/block_export.h"
#include "vblk/loop.h"

namespace vblk::vduse {

struct Options {
  std::shared_ptr<Node> node;
  std::string name;  // /dev/vduse/NAME, and the vDPA device's name
  bool writable = false;
  bool writethrough = false;
  uint16_t num_queues = 1;            // 1 to 64
  uint16_t queue_size = 256;          // a power of two, 4 to 1024
  uint32_t logical_block_size = 512;  // 512 to 4096, a power of two
  std::string serial;                 // what GET_ID answers
};

class VduseBlkExport : public BlockExport {
 public:
  // Creates the VDUSE device and its queues. A device of the same name
  // that no process serves and no driver holds is replaced; one still
  // attached whose daemon is gone is taken over (its requests in flight
  // from the log the daemon kept); one another process serves is refused
  // (EBUSY).
  static Result<std::unique_ptr<VduseBlkExport>> create(Loop& loop, Options o);
};

}  // namespace vblk::vduse
