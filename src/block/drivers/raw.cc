// The `raw` format driver: the bytes of its `file` child, optionally a window
// of them (`offset`, `size`). Everything passes through with the offset added;
// block status answers "ask the child" (kStatusRaw), as QEMU's raw does.
#include <algorithm>

#include "perm_rules.h"
#include "vblk/image_format.h"
#include "vblk/open.h"

namespace vblk {
namespace {

class RawNode final : public Node, public ImageFormat {
 public:
  RawNode(Loop& loop, std::shared_ptr<Node> file, uint64_t offset, uint64_t size)
      : Node(loop, "raw"), offset_(offset), file_(file.get()) {
    limits_ = file_->limits();
    caps_ = file_->caps();
    caps_.native_fua = true;     // FUA is passed down; the child emulates it if needed
    caps_.cache_status = false;  // its answers are the child's, cached there
    set_length(size);
    add_child("file", std::move(file));
    set_format(this);
  }

  // QEMU's raw_get_info asks the file (rbd: its object size); whether info
  // shows dirty-flag is the file's too (caps_, copied above).
  uint64_t cluster_size() const override { return image::cluster_size(*file_); }
  // A file known only by its options (json:{...}, e.g. rbd) makes the raw
  // node's name json:{"driver": "raw", "file": {...}}, as QEMU's
  // bdrv_refresh_filename builds it.
  std::string filename() const override {
    std::string f = file_->filename();
    if (f.rfind("json:", 0) != 0) return f;
    return "json:{\"driver\": \"raw\", \"file\": " + f.substr(5) + "}";
  }

  // The whole file passes through as a filter's child would; a window of it
  // (offset, size) is data whose size must not change (QEMU's raw_child_perm:
  // write and resize only when a user asks for them).
  PermPair child_perm(const Child& c, PermPair self) const override {
    if (!offset_ && !has_size_) return Node::child_perm(c, self);
    PermPair p = perm_rules::storage(self, false, true, !read_only(), false);
    p.perm = (p.perm & ~(kPermWrite | kPermResize)) | (self.perm & (kPermWrite | kPermResize));
    return p;
  }
  Node* copy_target(uint64_t& offset) override {
    offset += offset_;
    return file_->copy_target(offset);
  }

  // QEMU's bdrv_snapshot_* fall back to the primary child when the format
  // has no snapshots of its own: raw over rbd lists, creates, applies and
  // deletes the RBD image's snapshots.
  bool supports_snapshots() const override { return image::supports_snapshots(*file_); }
  std::vector<SnapshotInfo> snapshots() const override { return image::snapshots(*file_); }
  Task<Status> snapshot_create(SnapshotInfo& sn) override { co_return co_await image::snapshot_create(*file_, sn); }
  Task<Status> snapshot_goto(const std::string& id_or_name) override {
    auto st = co_await image::snapshot_goto(*file_, id_or_name);
    if (st && !offset_ && !has_size_) set_length(file_->length());
    co_return st;
  }
  Task<Status> snapshot_delete(const std::string& id, const std::string& name) override {
    co_return co_await image::snapshot_delete(*file_, id, name);
  }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override {
    co_return co_await file_->read(offset + offset_, buf, flags);
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    co_return co_await file_->write(offset + offset_, buf, flags);
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    co_return co_await file_->write_zeroes(offset + offset_, bytes, flags | kReqNoFallback);
  }
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    co_return co_await file_->discard(offset + offset_, bytes);
  }
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override {
    co_return BlockStatus{
        .flags = kStatusRaw | kStatusOffsetValid, .bytes = bytes, .map = offset + offset_, .file = file_};
  }
  Task<Status> do_copy_range_to(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes,
                                uint32_t flags) override {
    co_return co_await file_->copy_range(offset + offset_, dst, dst_offset, bytes, flags);
  }
  Task<Status> do_truncate(uint64_t length, bool exact) override {
    if (offset_ != 0 || has_size_) co_return Error(ENOTSUP, "Cannot resize a raw image with offset or size options");
    VBLK_CO_TRY(co_await file_->truncate(length, exact));
    set_length(file_->length());
    co_return Status{};
  }
  Task<Status> do_truncate_prealloc(uint64_t length, bool exact, Prealloc p) override {
    if (offset_ != 0 || has_size_) co_return Error(ENOTSUP, "Cannot resize a raw image with offset or size options");
    VBLK_CO_TRY(co_await file_->truncate(length, exact, p));
    set_length(file_->length());
    co_return Status{};
  }

 public:
  bool has_size_ = false;

 private:
  uint64_t offset_;
  Node* file_;
};

}  // namespace

namespace drivers {

int probe_raw(std::span<const uint8_t>) { return 1; }  // anything is raw, weakly

Result<std::shared_ptr<Node>> open_raw(OpenContext& ctx, Json& opts) {
  auto offset = take_size(opts, "offset");
  VBLK_TRY(offset);
  auto size = take_size(opts, "size");
  VBLK_TRY(size);
  auto ro = take_bool(opts, "read-only");
  VBLK_TRY(ro);
  OpenContext child_ctx = ctx;
  child_ctx.read_only = ro->value_or(ctx.read_only);
  auto file = open_child(child_ctx, opts, "file", true);
  VBLK_TRY(file);
  VBLK_TRY(check_write_without_resize(**file));
  uint64_t off = offset->value_or(0);
  uint64_t flen = (*file)->length();
  if (off > flen)
    return Error(EINVAL, "The sum of offset (" + std::to_string(off) +
                             ") and size (0) has to be smaller or equal to the  actual size of the containing file (" +
                             std::to_string(flen) + ")");
  uint64_t len = size->value_or(flen - off);
  if (*size && off + len > flen)
    return Error(EINVAL, "The sum of offset (" + std::to_string(off) + ") and size (" + std::to_string(len) +
                             ") has to be smaller or equal to the  actual size of the containing file (" +
                             std::to_string(flen) + ")");
  if (*size && len % 512) return Error(EINVAL, "Specified size is not multiple of 512");
  auto node = std::make_shared<RawNode>(ctx.loop, *file, off, len);
  node->has_size_ = size->has_value();
  node->set_read_only(child_ctx.read_only || (*file)->read_only());
  return std::shared_ptr<Node>(node);
}

namespace {

// QEMU's raw_create_opts: the size; the protocol adds its own.
const CreateOpt kRawCreateOpts[] = {{"size", CreateOptKind::Size, nullptr, "Virtual disk size"}};

// raw is its protocol's bytes as they are: the protocol creates it.
Task<Status> create_raw(Loop& loop, const CreateRequest& req) {
  co_return co_await protocol_for_filename(req.filename).create(loop, req);
}

}  // namespace

extern const DriverInfo raw_driver = {.name = "raw",
                                      .kind = DriverKind::Format,
                                      .open = open_raw,
                                      .probe = probe_raw,
                                      .create_opts = kRawCreateOpts,
                                      .create = create_raw};

}  // namespace drivers
}  // namespace vblk
