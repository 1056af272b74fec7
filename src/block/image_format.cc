// ImageFormat's defaults and the vblk::image helpers (image_format.h).
#include "vblk/image_format.h"

#include <cstring>

namespace vblk {

namespace {

// The defaults' answers, shared by a facet that does not override a method
// and by a node without the facet.
Error no_checks() { return Error(ENOTSUP, "This image format does not support checks"); }
Error no_snapshots() { return Error(ENOTSUP, "Block driver does not support snapshots"); }
Error no_vmstate() { return Error(ENOTSUP, "Block driver does not support VM state"); }
Error no_persistent_bitmaps(const Node& n) {
  return Error(ENOTSUP, "Can't store persistent bitmaps to " + n.node_name() + ": " + std::strerror(ENOTSUP));
}

}  // namespace

Task<Status> ImageFormat::set_backing(std::shared_ptr<Node>, const std::string&, const std::string&) {
  co_return Error(ENOTSUP);
}

Task<Status> ImageFormat::change_backing_file(const std::string&, const std::string&) { co_return Error(ENOTSUP); }

Task<Status> ImageFormat::make_empty() { co_return Error(ENOTSUP); }

Task<Result<CheckResult>> ImageFormat::check(uint32_t) { co_return no_checks(); }

Status ImageFormat::can_store_new_bitmap(const std::string&, uint64_t) const { return no_persistent_bitmaps(*node_); }
Task<Status> ImageFormat::remove_persistent_bitmap(const std::string&) { co_return Status{}; }

Task<Status> ImageFormat::snapshot_create(SnapshotInfo&) { co_return Error(ENOTSUP); }
Task<Status> ImageFormat::snapshot_goto(const std::string&) { co_return no_snapshots(); }
Task<Status> ImageFormat::snapshot_delete(const std::string&, const std::string&) { co_return no_snapshots(); }

Task<Status> ImageFormat::write_vmstate(uint64_t, std::span<const uint8_t>) { co_return no_vmstate(); }
Task<Status> ImageFormat::read_vmstate(uint64_t, std::span<uint8_t>, const std::string&) { co_return no_vmstate(); }
Task<Status> ImageFormat::discard_vmstate(uint64_t) { co_return no_vmstate(); }

Task<Status> ImageFormat::prepare_read_only() { co_return co_await node_->flush(); }

namespace image {

uint64_t cluster_size(const Node& n) { return n.format() ? n.format()->cluster_size() : 0; }
std::string backing_file_name(const Node& n) { return n.format() ? n.format()->backing_file_name() : std::string(); }
std::string backing_file_format(const Node& n) {
  return n.format() ? n.format()->backing_file_format() : std::string();
}

Task<Status> set_backing(Node& n, std::shared_ptr<Node> backing, const std::string& file, const std::string& fmt) {
  if (!n.format()) co_return Error(ENOTSUP);
  co_return co_await n.format()->set_backing(std::move(backing), file, fmt);
}

Task<Status> change_backing_file(Node& n, const std::string& file, const std::string& fmt) {
  if (!n.format()) co_return Error(ENOTSUP);
  co_return co_await n.format()->change_backing_file(file, fmt);
}

Task<Status> make_empty(Node& n) {
  if (!n.format()) co_return Error(ENOTSUP);
  co_return co_await n.format()->make_empty();
}

Task<Result<CheckResult>> check(Node& n, uint32_t fix) {
  if (!n.format()) co_return no_checks();
  co_return co_await n.format()->check(fix);
}

Status can_store_new_bitmap(const Node& n, const std::string& name, uint64_t granularity) {
  return n.format() ? n.format()->can_store_new_bitmap(name, granularity) : no_persistent_bitmaps(n);
}

Task<Status> remove_persistent_bitmap(Node& n, const std::string& name) {
  if (!n.format()) co_return Status{};
  co_return co_await n.format()->remove_persistent_bitmap(name);
}

bool supports_snapshots(const Node& n) { return n.format() && n.format()->supports_snapshots(); }
std::vector<SnapshotInfo> snapshots(const Node& n) {
  return n.format() ? n.format()->snapshots() : std::vector<SnapshotInfo>{};
}

Task<Status> snapshot_create(Node& n, SnapshotInfo& sn) {
  if (!n.format()) co_return Error(ENOTSUP);
  co_return co_await n.format()->snapshot_create(sn);
}

Task<Status> snapshot_goto(Node& n, const std::string& id_or_name) {
  if (!n.format()) co_return no_snapshots();
  co_return co_await n.format()->snapshot_goto(id_or_name);
}

Task<Status> snapshot_delete(Node& n, const std::string& id, const std::string& name) {
  if (!n.format()) co_return no_snapshots();
  co_return co_await n.format()->snapshot_delete(id, name);
}

bool supports_vmstate(const Node& n) { return n.format() && n.format()->supports_vmstate(); }

Task<Status> write_vmstate(Node& n, uint64_t pos, std::span<const uint8_t> buf) {
  if (!n.format()) co_return no_vmstate();
  co_return co_await n.format()->write_vmstate(pos, buf);
}

Task<Status> read_vmstate(Node& n, uint64_t pos, std::span<uint8_t> buf, const std::string& snapshot_id) {
  if (!n.format()) co_return no_vmstate();
  co_return co_await n.format()->read_vmstate(pos, buf, snapshot_id);
}

Task<Status> discard_vmstate(Node& n, uint64_t bytes) {
  if (!n.format()) co_return no_vmstate();
  co_return co_await n.format()->discard_vmstate(bytes);
}

}  // namespace image

}  // namespace vblk
