// The `snapshot-access` driver (QEMU 7.2's block/snapshot-access.c): the
// frozen view of a copy-before-write filter, for fleecing. Its one option is
// `file`, the filter. Reads, block status and discard go through the
// filter's snapshot API (include/copy/vblk/copy_before_write.h); writes and
// write-zeroes are refused with ENOTSUP, as QEMU's driver refuses them.
//
// Like QEMU, any node is accepted as `file`; one without the snapshot API
// (not a copy-before-write filter) fails every read and block status with
// ENOTSUP, and its discards do nothing.
//
// Permissions: none taken on `file`, everything shared, since the snapshot
// API needs none (QEMU's snapshot_access_child_perm). Not a filter: a
// dirty bitmap for an export of this node must be on this node.
#include <cerrno>

#include "drivers.h"
#include "vblk/copy_before_write.h"

namespace vblk {
namespace {

class SnapshotAccessNode final : public Node {
 public:
  SnapshotAccessNode(Loop& loop, std::shared_ptr<Node> file, bool discard_unmap)
      : Node(loop, "snapshot-access"),
        file_(file.get()),
        cbw_(dynamic_cast<CopyBeforeWrite*>(file.get())),
        discard_unmap_(discard_unmap) {
    // Byte-granular: the filter's children align their own requests.
    limits_ = BlockLimits{};
    limits_.max_transfer = file_->limits().max_transfer;
    caps_ = NodeCaps{};
    caps_.discard = true;
    // No image info of its own (QEMU's driver has no bdrv_get_info).
    caps_.reports_dirty_flag = false;
    set_length(file_->length());
    add_child("file", std::move(file));
  }

  std::string filename() const override { return file_->filename(); }
  PermPair child_perm(const Child&, PermPair) const override { return PermPair{0, kPermAll}; }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t) override {
    if (!cbw_) co_return Error(ENOTSUP);
    co_return co_await cbw_->snapshot_read(offset, buf);
  }
  Task<Status> do_write(uint64_t, std::span<const uint8_t>, uint32_t) override { co_return Error(ENOTSUP); }
  Task<Status> do_write_zeroes(uint64_t, uint64_t, uint32_t) override { co_return Error(ENOTSUP); }
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    // Without discard=unmap QEMU drops discards before the driver sees them
    // (an NBD trim then leaves the snapshot whole).
    if (!discard_unmap_) co_return Status{};
    if (!cbw_) co_return Error(ENOTSUP);
    co_return co_await cbw_->snapshot_discard(offset, bytes);
  }
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override {
    if (!cbw_) co_return Error(ENOTSUP);
    co_return co_await cbw_->snapshot_block_status(offset, bytes);
  }
  // Nothing of its own to flush, and no write permission on `file` that
  // would make a flush of it this node's business (QEMU flushes only the
  // children it may write).
  Task<Status> do_flush() override { co_return Status{}; }

 private:
  Node* file_;
  CopyBeforeWrite* cbw_;  // file_ when it offers the snapshot API, else null
  bool discard_unmap_;
};

}  // namespace

namespace drivers {

Result<std::shared_ptr<Node>> open_snapshot_access(OpenContext& ctx, Json& opts) {
  if (!opts.contains("file")) return Error(EINVAL, "Parameter 'file' is missing");
  auto file = open_child(ctx, opts, "file", true);
  VBLK_TRY(file);
  return std::shared_ptr<Node>(std::make_shared<SnapshotAccessNode>(ctx.loop, *file, ctx.discard_unmap));
}

}  // namespace drivers
}  // namespace vblk
