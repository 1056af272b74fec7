// Shrinking a qcow2 image (resize --shrink), as QEMU's qcow2_co_truncate:
// the clusters past the new end are freed and their space given back to
// the file system (punched, as QEMU's QCOW2_DISCARD_ALWAYS does), the L2
// tables no longer reachable and empty refcount blocks freed, and the file cut after its last used
// cluster.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "drivers/qcow2/qcow2.h"
#include "vblk/buffer.h"

namespace vblk::qcow2 {

Task<Status> Qcow2Node::shrink(uint64_t size) {
  std::vector<uint64_t> freed;
  freed_sink_ = &freed;
  struct Unsink {
    Qcow2Node* q;
    ~Unsink() { q->freed_sink_ = nullptr; }
  } unsink{this};

  const uint64_t from = align_up(size, cs_);
  if (from < h_.size) VBLK_CO_TRY(co_await discard_range(from, h_.size - from, true));
  auto g = co_await lock_.scoped();
  // L2 tables wholly past the end: their entries are zero now; the L1
  // entries are cleared on disk before the tables are freed (a crash in
  // between leaks, never leaves an L1 entry to a reused cluster).
  const uint64_t per_l1 = cs_ * l2_entries_;
  const uint64_t keep = (size + per_l1 - 1) / per_l1;
  std::vector<uint64_t> tables;
  for (uint64_t i = keep; i < l1_.size(); ++i) {
    if (l1_[i] & kL1OffsetMask) tables.push_back(l1_[i] & kL1OffsetMask);
    l1_.set(i, 0);
  }
  if (!tables.empty()) {
    VBLK_CO_TRY(co_await l2_cache_->flush());
    VBLK_CO_TRY(co_await write_l1_table());
    for (uint64_t t : tables) VBLK_CO_TRY(co_await update_refcount(t, cs_, -1));
  }
  // The freed clusters' L2 entries and refcounts on disk before a refcount
  // block can leave the table.
  VBLK_CO_TRY(co_await flush_all());
  VBLK_CO_TRY(co_await shrink_reftable());
  h_.size = size;
  VBLK_CO_TRY(co_await write_header());
  set_length(size);
  VBLK_CO_TRY(co_await flush_all());
  freed_sink_ = nullptr;

  // Freed clusters (still free: nothing allocated since) give their space back.
  std::sort(freed.begin(), freed.end());
  for (size_t i = 0; i < freed.size();) {
    size_t j = i + 1;
    while (j < freed.size() && freed[j] == freed[j - 1] + 1) ++j;
    (void)co_await file_->discard(freed[i] * cs_, (j - i) * cs_);
    i = j;
  }
  // The file ends after its last cluster in use (QEMU's
  // qcow2_get_last_cluster); a failure only warns, as in QEMU.
  const uint64_t file_len = file_->length();
  int64_t last = -1;
  // (A partial last cluster counts: a snapshot table may end there.)
  for (uint64_t ci = (file_len + cs_ - 1) / cs_; ci-- > 0;) {
    auto rc = co_await get_refcount(ci);
    if (!rc) co_return rc.take_error();
    if (*rc) {
      last = static_cast<int64_t>(ci);
      break;
    }
  }
  if (last < 0) {
    (void)co_await mark_corrupt("There are no references in the refcount table.");
    co_return Error(EIO);
  }
  const uint64_t end = static_cast<uint64_t>(last + 1) * cs_;
  if (end < file_len) {
    auto st = co_await file_->truncate(end, false);
    if (!st) std::fprintf(stderr, "warning: Failed to truncate the tail of the image: %s\n", st.error().what().c_str());
  }
  co_return Status{};
}

Task<Status> Qcow2Node::shrink_reftable() {
  // QEMU's qcow2_shrink_reftable: a refcount block that counts nothing but
  // (maybe) itself is dropped. The table goes to disk first, then the
  // blocks are freed, each while its table entry still points to it (a
  // block may hold its own refcount).
  std::vector<uint64_t> table = rt_;
  std::vector<size_t> unused;
  for (size_t i = 0; i < rt_.size(); ++i) {
    const uint64_t off = rt_[i] & ~511ull;
    if (!off) continue;
    auto b = co_await rb_cache_->get(off);
    if (!b) co_return b.take_error();
    const uint64_t self = off / cs_;
    bool empty = true;
    for (uint64_t k = 0; k < rb_entries_ && empty; ++k)
      if (!(self / rb_entries_ == i && self % rb_entries_ == k) && refcount_get(b->data(), k)) empty = false;
    if (empty) {
      table[i] = 0;
      unused.push_back(i);
    }
  }
  if (unused.empty()) co_return Status{};
  AlignedBuffer t(uint64_t(h_.refcount_table_clusters) * cs_);
  t.zero();
  for (size_t i = 0; i < table.size(); ++i) put64(t.data() + i * 8, table[i]);
  VBLK_CO_TRY(co_await checked_write(kOlRefcountTable, h_.refcount_table_offset, t.span(), kReqFua));
  for (size_t i : unused) {
    VBLK_CO_TRY(co_await update_refcount(rt_[i] & ~511ull, cs_, -1));
    rt_.set(i, 0);
  }
  co_return Status{};
}

}  // namespace vblk::qcow2
