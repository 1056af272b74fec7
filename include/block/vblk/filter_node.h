// FilterNode: a node over one `file` child that it passes requests to —
// QEMU's filter drivers (blkdebug, throttle, copy-before-write). The base
// takes the child's limits, capabilities, length and read-only state and
// forwards every request unchanged; a filter overrides only what it does
// differently (inject an error, wait for a throttle, copy old data first).
//
// What a filter never is: a copy-offload source (an offloaded copy would
// bypass the filter) or a node with a backing file. Block status answers
// "ask the child" (kStatusRaw), as QEMU's filters do.
//
// Ownership: the child is owned through Node's child list; filtered() is a
// plain pointer to it. Thread-safety: loop thread only, like every node.
#pragma once

#include <memory>
#include <string>

#include "vblk/image_format.h"
#include "vblk/node.h"

namespace vblk {

class FilterNode : public Node, public ImageFormat {
 public:
  FilterNode(Loop& loop, std::string driver, std::shared_ptr<Node> file);

  Node& filtered() const { return *filtered_; }
  Task<Status> prepare_writes(std::span<const WriteRange> ranges) override {
    co_return co_await filtered_->prepare_writes(ranges);
  }
  // QEMU's bdrv_get_info looks through a filter: a backup or mirror into a
  // throttled target picks the target's cluster size (rbd: its object size).
  // Only that: a filter has no image info, snapshots or checks of its own
  // (the facet's defaults); whether info shows dirty-flag follows the
  // filtered node (caps).
  uint64_t cluster_size() const override { return image::cluster_size(*filtered_); }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override;
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_flush() override;
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_truncate(uint64_t length, bool exact) override;
  // Makes `n` the filtered child in place of the old one (which loses this
  // parent at once).
  void set_filtered(std::shared_ptr<Node> n);

 private:
  Node* filtered_;
};

}  // namespace vblk
