// The virtio-blk device (virtio 1.x, 5.2) over a node, for whichever
// transport carries its rings: vhost-user (blk_export.cc) or VDUSE
// (export/vduse). Requests go to the node with many in flight; buffers
// scattered in the driver's memory go through bounce buffers of bounded
// total size.
//
// Write cache: the device tells the driver the truth. With writethrough
// off it advertises a volatile write cache (wce = 1), so the driver sends
// flushes and each reaches the node; with writethrough on, or after the
// driver turns the cache off (a write of the wce byte, where the transport
// lets the driver write the configuration space), every write is durable
// (FUA) before it completes.
#pragma once

#include <memory>
#include <string>

#include "vblk/loop.h"
#include "vblk/node_ref.h"
#include "vhost_user/device.h"
#include "vhost_user/protocol.h"

namespace vblk::vhost {

// Where a transport that outlives its daemon (VDUSE) keeps count of the
// writes answered and the flushes that covered them, for the daemon that
// takes a device over: it reports them, and where it cannot know what its
// predecessor did (no log) its first flush fails rather than vouch.
class WriteLedger {
 public:
  virtual ~WriteLedger() = default;
  // A write, write-zeroes or discard was answered successfully.
  virtual void answered() = 0;
  // A flush starts: what it will cover.
  virtual uint64_t flush_begins() = 0;
  // That flush succeeded.
  virtual void flushed(uint64_t covered) = 0;
  // False while writes answered by a daemon that is gone were never
  // flushed: the next flush must fail, or it would vouch for them.
  virtual bool flush_can_vouch() = 0;
};

struct VirtioBlkOptions {
  bool writable = false;
  bool writethrough = false;
  uint32_t logical_block_size = 512;
  uint16_t num_queues = 1;
  uint32_t seg_max = 128 - 2;  // as qemu-storage-daemon 7.2's vhost-user-blk
  // VIRTIO_BLK_F_CONFIG_WCE: the driver may turn the write cache off.
  // VDUSE's configuration space is read-only to the driver (the kernel
  // refuses a device that offers it).
  bool config_wce = true;
  // VIRTIO_BLK_F_MQ even with one queue (QEMU's vhost-user-blk server
  // does; its vduse-blk offers it only with more than one).
  bool mq_always = true;
  std::string serial = "vhost_user_blk";  // what GET_ID answers
  // Writes are answered only once they outlive this process (kReqSurviveKill):
  // for transports where a next daemon takes the device over (VDUSE) and
  // vouches for them with its first flush.
  bool survive_kill = false;
  WriteLedger* ledger = nullptr;  // the transport's, if any
};

class VirtioBlk : public Device {
 public:
  // `node` is the export's and outlives the device.
  static std::unique_ptr<VirtioBlk> create(Loop& loop, NodeRef& node, VirtioBlkOptions o);
  // The configuration space as it is now.
  virtual BlkConfig config() const = 0;
};

}  // namespace vblk::vhost
