// The copy-before-write filter (see include/copy/vblk/copy_before_write.h) and
// its blockdev options, as QEMU 7.2 names them: file, target, bitmap,
// on-cbw-error, cbw-timeout.
#include "vblk/copy_before_write.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stop_token>

#include "drivers.h"
#include "vblk/buffer.h"
#include "vblk/chain.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"

namespace vblk {

uint64_t cbw_cluster_size(const Node& target) { return std::max<uint64_t>(64 << 10, image::cluster_size(target)); }

CopyBeforeWrite::CopyBeforeWrite(Loop& loop, std::shared_ptr<Node> file, std::shared_ptr<Node> target, CbwOptions opts)
    : FilterNode(loop, "copy-before-write", std::move(file)),
      target_(target.get()),
      on_error_(opts.on_error),
      timeout_ns_(uint64_t{opts.timeout_s} * 1000000000ull),
      orphans_(loop),
      unheld_(loop),
      inside_(loop),
      drain_wake_(loop),
      buffer_users_(loop) {
  if (!opts.copy.cluster_size) opts.copy.cluster_size = cbw_cluster_size(*target_);
  // A target over the source (fleecing's temporary image backed by it) is
  // read by others while copies land: a copy waits for their reads of the
  // range, or a read could find the cluster unallocated, go down to the
  // source and see the guest's new data (QEMU's is_fleecing).
  if (chain_contains(*target_, filtered())) opts.copy.write_flags |= kReqSerialising;
  add_child("target", std::move(target));
  bcs_ = std::make_unique<BlockCopyState>(filtered(), *target_, opts.copy);
  // Without a bitmap option every cluster is still to be copied: the
  // snapshot is the whole disk as of now.
  bcs_->bitmap().set_all();
  snapshot_begin();
}

CopyBeforeWrite::~CopyBeforeWrite() {
  // The drain and buffered copies refer to the filter: stop_buffer() (run
  // by close() and by the backup job) must have waited for them.
  if (buffer_users_.count()) {
    std::fprintf(stderr, "vblk: internal error: copy-before-write destroyed with its COW buffer busy\n");
    std::abort();
  }
}

PermPair CopyBeforeWrite::child_perm(const Child& c, PermPair self) const {
  if (c.role == "target") return PermPair{kPermWrite, kPermAll & ~kPermResize};
  PermPair p = self;
  if (!refs().empty()) {
    if (self.perm & kPermWrite) p.perm |= kPermConsistentRead;
    p.shared &= ~(kPermWrite | kPermResize);
  }
  return p;
}

Task<void> CopyBeforeWrite::quiesce() { co_await orphans_.wait(); }

Task<void> CopyBeforeWrite::hold_writes() {
  held_ = true;
  unheld_.reset();
  co_await inside_.wait();
  co_await orphans_.wait();
  // (release_target may have come meanwhile.) With COW-buffer data still
  // to be written the target stays until the filter is gone.
  quiet_ = held_ && drain_writes_ == 0 && buffer_empty();
}

void CopyBeforeWrite::release_target() {
  if (quiet_ && !detached_) {
    detached_ = true;
    replace_child("target", nullptr);
  }
  quiet_ = false;
  held_ = false;
  unheld_.set();
}

Task<Status> CopyBeforeWrite::copy_before_write(uint64_t offset, uint64_t bytes) {
  while (held_) co_await unheld_.wait();
  if (detached_) co_return Status{};  // the job is over: nothing to keep
  inside_.add();
  Status st = co_await copy_old_data(offset, bytes);
  inside_.done();
  co_return st;
}

Task<Status> CopyBeforeWrite::copy_old_data(uint64_t offset, uint64_t bytes) {
  if (!snapshot_error_.ok() || bytes == 0) co_return Status{};
  bcs_->note_foreground();
  const uint64_t cs = bcs_->options().cluster_size;
  const uint64_t begin = align_down(offset, cs);
  const uint64_t end = std::min(align_up(offset + bytes, cs), align_up(length(), cs));
  if (begin >= end) co_return Status{};
  Status st;
  std::optional<Status> buffered;
  if (buffer_ && !buffer_stopping_) {
    buffered = co_await buffered_copy(begin, end);
    if (!buffered) ++sync_copies_;  // buffer and spill full
  }
  if (buffered) {
    st = *buffered;
  } else if (!timeout_ns_) {
    st = co_await bcs_->copy(begin, end - begin, /*ignore_ratelimit=*/true);
  } else {
    // Wait for the copy at most cbw-timeout; a copy that takes longer is
    // cancelled (its running tasks finish on their own, tracked in orphans_
    // so the state is not destroyed under them).
    auto stop = std::make_shared<std::stop_source>();
    orphans_.add();
    auto call = bcs_->copy_async(begin, end - begin, true, [this, stop](BlockCopyCall&) {
      stop->request_stop();
      orphans_.done();
    });
    if (!call->finished()) co_await loop().sleep(std::chrono::nanoseconds(timeout_ns_), stop->get_token());
    if (!call->finished()) {
      call->cancel();
      st = Error(ETIMEDOUT);
    } else if (call->failed()) {
      st = call->status();
    } else if (call->cancelled()) {
      st = Error(ECANCELED);
    }
  }
  if (!st.ok() && on_error_ == OnCbwError::BreakGuestWrite) co_return st;
  // break-snapshot: the guest write wins; the snapshot is no longer whole.
  if (!st.ok() && snapshot_error_.ok()) snapshot_error_ = st;
  // Fleecing: the snapshot now reads these clusters from the target; reads
  // of the source still running must end before the guest changes it.
  co_await snapshot_release(begin, end, st.ok());
  co_return Status{};
}

Task<Status> CopyBeforeWrite::do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  VBLK_CO_TRY(co_await copy_before_write(offset, buf.size()));
  co_return co_await filtered().write(offset, buf, flags);
}

Task<Status> CopyBeforeWrite::do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  VBLK_CO_TRY(co_await copy_before_write(offset, bytes));
  co_return co_await filtered().write_zeroes(offset, bytes, flags);
}

Task<Status> CopyBeforeWrite::do_discard(uint64_t offset, uint64_t bytes) {
  VBLK_CO_TRY(co_await copy_before_write(offset, bytes));
  co_return co_await filtered().discard(offset, bytes);
}

Task<Status> CopyBeforeWrite::do_truncate(uint64_t, bool) {
  co_return Error(ENOTSUP, "Cannot resize a node under a copy-before-write filter");
}

namespace drivers {

Result<std::shared_ptr<Node>> open_copy_before_write(OpenContext& ctx, Json& opts) {
  auto file = open_child(ctx, opts, "file", true);
  VBLK_TRY(file);
  auto target = open_child(ctx, opts, "target", true);
  VBLK_TRY(target);
  CbwOptions o;
  // `bitmap`: only the clusters this named bitmap has dirty are copied
  // before writes (QEMU's block_dirty_bitmap_lookup, then the bitmap merged
  // into block-copy's own).
  NamedBitmap* sync_bitmap = nullptr;
  if (auto bitmap = take_dict(opts, "bitmap")) {
    auto node = take_string(*bitmap, "node");
    VBLK_TRY(node);
    auto name = take_string(*bitmap, "name");
    VBLK_TRY(name);
    std::shared_ptr<Node> owner = ctx.graph ? ctx.graph->find(node->value_or("")) : nullptr;
    if (!owner) return Error(ENOENT, "Node '" + node->value_or("") + "' not found");
    sync_bitmap = owner->bitmaps().find(name->value_or(""));
    if (!sync_bitmap) return Error(ENOENT, "Dirty bitmap '" + name->value_or("") + "' not found");
  }
  auto on_err = take_string(opts, "on-cbw-error");
  VBLK_TRY(on_err);
  if (*on_err) {
    if (**on_err == "break-guest-write") {
      o.on_error = OnCbwError::BreakGuestWrite;
    } else if (**on_err == "break-snapshot") {
      o.on_error = OnCbwError::BreakSnapshot;
    } else {
      return Error(EINVAL, "Parameter 'on-cbw-error' does not accept value '" + **on_err + "'");
    }
  }
  auto timeout = take_size(opts, "cbw-timeout");
  VBLK_TRY(timeout);
  if (*timeout) {
    if (**timeout > UINT32_MAX) return Error(EINVAL, "Parameter 'cbw-timeout' expects uint32_t");
    o.timeout_s = static_cast<uint32_t>(**timeout);
  }
  // vblk's COW buffer in front of the target (fleecing: the fleecing image).
  auto buf_size = take_size(opts, "x-cow-buffer-size");
  VBLK_TRY(buf_size);
  auto spill_dir = take_string(opts, "x-cow-spill-dir");
  VBLK_TRY(spill_dir);
  auto spill_size = take_size(opts, "x-cow-spill-size");
  VBLK_TRY(spill_size);
  auto spill_direct = take_bool(opts, "x-cow-spill-direct");
  VBLK_TRY(spill_direct);
  CowBufferOptions buffer{buf_size->value_or(0), spill_dir->value_or(""), spill_size->value_or(0),
                          spill_direct->value_or(true)};
  if (!buffer.memory_size && (buffer.spill_size || *spill_dir || *spill_direct))
    return Error(EINVAL, "x-cow-spill-dir, x-cow-spill-size and x-cow-spill-direct need x-cow-buffer-size");
  if ((*file)->length() != (*target)->length()) return Error(EINVAL, "Source and target image have different sizes");
  auto cbw = std::make_shared<CopyBeforeWrite>(ctx.loop, *file, *target, o);
  if (buffer.memory_size) VBLK_TRY(cbw->enable_buffer(buffer));
  if (sync_bitmap) {
    // block_copy_state_new: bdrv_merge_dirty_bitmap's checks, with its prefix.
    const std::string prefix =
        "Cannot create block-copy-state: Failed to merge bitmap '" + sync_bitmap->name + "' to internal copy-bitmap: ";
    if (auto st = check_bitmap(*sync_bitmap, kBitmapAllowRo); !st) return Error(EINVAL, prefix + st.error().what());
    DirtyBitmap& bits = cbw->bcs().bitmap();
    if (sync_bitmap->bits.size() != bits.size())
      return Error(EINVAL, prefix + "Bitmaps are of different sizes (destination size is " +
                               std::to_string(bits.size()) + ", source size is " +
                               std::to_string(sync_bitmap->bits.size()) + ") and can't be merged");
    bits.reset_all();
    bits.merge_from(sync_bitmap->bits);
    cbw->snapshot_begin();  // the snapshot holds the bitmap's clusters only
  }
  return std::shared_ptr<Node>(cbw);
}

}  // namespace drivers
}  // namespace vblk
