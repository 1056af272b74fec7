// FilterNode: see include/block/vblk/filter_node.h.
#include "vblk/filter_node.h"

namespace vblk {

FilterNode::FilterNode(Loop& loop, std::string driver, std::shared_ptr<Node> file)
    : Node(loop, std::move(driver)), filtered_(file.get()) {
  limits_ = filtered_->limits();
  caps_ = filtered_->caps();
  caps_.native_fua = true;  // passed down; the child emulates it if it must
  caps_.copy_range = false;
  caps_.supports_backing = false;
  set_length(filtered_->length());
  set_read_only(filtered_->read_only());
  add_child("file", std::move(file));
  set_format(this);
}

void FilterNode::set_filtered(std::shared_ptr<Node> n) {
  filtered_ = n.get();
  caps_.reports_dirty_flag = filtered_->caps().reports_dirty_flag;
  replace_child("file", std::move(n));
}

Task<Status> FilterNode::do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) {
  co_return co_await filtered_->read(offset, buf, flags);
}

Task<Status> FilterNode::do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  co_return co_await filtered_->write(offset, buf, flags);
}

Task<Status> FilterNode::do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  // If zeroes must be written as data, this node's own request path does it
  // (once), not the child again.
  co_return co_await filtered_->write_zeroes(offset, bytes, flags | kReqNoFallback);
}

Task<Status> FilterNode::do_discard(uint64_t offset, uint64_t bytes) {
  co_return co_await filtered_->discard(offset, bytes);
}

Task<Status> FilterNode::do_flush() { co_return co_await filtered_->flush(); }

Task<Result<BlockStatus>> FilterNode::do_block_status(uint64_t offset, uint64_t bytes) {
  co_return BlockStatus{.flags = kStatusRaw | kStatusOffsetValid, .bytes = bytes, .map = offset, .file = filtered_};
}

Task<Status> FilterNode::do_truncate(uint64_t length, bool exact) {
  VBLK_CO_TRY(co_await filtered_->truncate(length, exact));
  set_length(filtered_->length());
  co_return Status{};
}

}  // namespace vblk
