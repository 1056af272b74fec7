// Refcounts: the refcount table (in memory, written through), refcount blocks
// (through rb_cache_), cluster allocation and freeing. Lock held throughout.
#include <fmt/format.h>

#include "drivers/qcow2/qcow2.h"
#include "vblk/trace.h"

namespace vblk::qcow2 {

uint64_t Qcow2Node::refcount_get(const uint8_t* b, uint64_t i) const {
  switch (refcount_bits_) {
    case 1:
    case 2:
    case 4: {
      uint64_t bit = i * refcount_bits_;
      return (b[bit / 8] >> (bit % 8)) & ((1u << refcount_bits_) - 1);
    }
    case 8: return b[i];
    case 16: return be16(b + i * 2);
    case 32: return be32(b + i * 4);
    default: return be64(b + i * 8);
  }
}

void Qcow2Node::refcount_set(uint8_t* b, uint64_t i, uint64_t v) const {
  switch (refcount_bits_) {
    case 1:
    case 2:
    case 4: {
      uint64_t bit = i * refcount_bits_;
      uint8_t mask = static_cast<uint8_t>(((1u << refcount_bits_) - 1) << (bit % 8));
      b[bit / 8] = static_cast<uint8_t>((b[bit / 8] & ~mask) | ((v << (bit % 8)) & mask));
      break;
    }
    case 8: b[i] = static_cast<uint8_t>(v); break;
    case 16: put16(b + i * 2, static_cast<uint16_t>(v)); break;
    case 32: put32(b + i * 4, static_cast<uint32_t>(v)); break;
    default: put64(b + i * 8, v); break;
  }
}

Task<Result<uint64_t>> Qcow2Node::get_refcount(uint64_t ci) {
  auto rb = co_await refblock_offset(ci / rb_entries_);
  if (!rb) co_return rb.take_error();
  if (!*rb) co_return uint64_t{0};
  auto t = co_await rb_cache_->get(*rb);
  if (!t) co_return t.take_error();
  co_return refcount_get(t->data(), ci % rb_entries_);
}

Task<Result<uint64_t>> Qcow2Node::refcount_of(uint64_t ci) {
  auto g = co_await lock_.scoped();
  co_return co_await get_refcount(ci);
}

Task<Status> Qcow2Node::check_new_clusters(uint64_t offset, uint64_t bytes) {
  const uint32_t ol = metadata_overlap(kOlCached, offset, bytes);
  if (!ol) co_return Status{};
  co_return co_await refuse_overlap(ol, offset, bytes);
}

// First run of n free clusters at or after free_cluster_index_. Scans a
// refcount block at a time: one cache lookup per block, not per cluster
// (a hostile or fragmented image can make the search cover every cluster).
Task<Result<uint64_t>> Qcow2Node::find_free(uint64_t n) {
  uint64_t start = free_cluster_index_, run = 0;
  const uint64_t covered = rt_.size() * rb_entries_;
  auto free_at = [&](uint64_t ci) {
    if (run == 0) start = ci;
    return ++run == n;
  };
  for (uint64_t ci = start;;) {
    // Beyond what the refcount table covers every cluster is free.
    if (ci >= covered) {
      if (quarantine_.count(ci)) {
        run = 0;
        ++ci;
        continue;
      }
      if (run == 0) start = ci;
      co_return start;
    }
    const uint64_t rti = ci / rb_entries_, end = (rti + 1) * rb_entries_;
    auto rb = co_await refblock_offset(rti);
    if (!rb) co_return rb.take_error();
    if (!*rb) {  // no block: every refcount in its range is 0
      for (; ci < end; ++ci) {
        if (quarantine_.count(ci)) {
          run = 0;
        } else if (free_at(ci)) {
          co_return start;
        }
      }
      continue;
    }
    auto t = co_await rb_cache_->get(*rb);
    if (!t) co_return t.take_error();
    const uint8_t* b = t->data();  // no suspension below: the entry stays put
    for (; ci < end; ++ci) {
      if (refcount_get(b, ci % rb_entries_) != 0 || quarantine_.count(ci)) {
        run = 0;
      } else if (free_at(ci)) {
        co_return start;
      }
    }
  }
}

// Makes sure every refcount block covering [first, first+n) exists. Returns
// true if it had to allocate (free space moved: the caller searches again).
Task<Result<bool>> Qcow2Node::ensure_refblocks(uint64_t first, uint64_t n) {
  uint64_t lo = first / rb_entries_, hi = (first + n - 1) / rb_entries_;
  for (uint64_t rti = lo; rti <= hi; ++rti) {
    if (rti < rt_.size() && (rt_[rti] & ~511ull)) continue;
    if (rti >= rt_.size()) {
      VBLK_CO_TRY(co_await grow_refcount_table(rti + 1));
      co_return true;
    }
    // Place the new block in the first free cluster. If that cluster is one
    // the block itself describes, the block holds its own refcount.
    auto where = co_await find_free(1);
    if (!where) co_return where.take_error();
    uint64_t bci = *where;
    VBLK_CO_TRY(co_await check_new_clusters(bci * cs_, cs_));
    auto t = co_await rb_cache_->get_empty(bci * cs_);
    if (!t) co_return t.take_error();
    if (bci / rb_entries_ == rti) {
      refcount_set(t->data(), bci % rb_entries_, 1);
    } else {
      auto more = co_await ensure_refblocks(bci, 1);
      if (!more) co_return more.take_error();
      if (*more) {  // allocating for the block's own refcount moved things
        rb_cache_->discard(bci * cs_);
        co_return true;
      }
      VBLK_CO_TRY(co_await update_refcount(bci * cs_, cs_, +1));
    }
    // The block and the refcounts it relies on reach the disk before the
    // table points to it.
    if (auto fl = co_await rb_cache_->flush(); !fl) {
      // Not written (ENOSPC...), and nothing points to it: forgotten, or
      // the dirty block would fail every later flush and strand the L2
      // entries waiting for the refcounts.
      rb_cache_->discard(bci * cs_);
      if (bci / rb_entries_ != rti) (void)co_await update_refcount(bci * cs_, cs_, -1);
      co_return fl.take_error();
    }
    uint8_t e[8];
    put64(e, bci * cs_);
    VBLK_CO_TRY(co_await checked_write(kOlRefcountTable, h_.refcount_table_offset + rti * 8, {e, 8}));
    rt_.set(rti, bci * cs_);
    VBLK_CO_TRY(co_await file_->flush());
    co_return true;
  }
  co_return false;
}

// Moves the refcount table to a bigger one at the end of what it covers,
// together with the refcount blocks describing the new area.
Task<Status> Qcow2Node::grow_refcount_table(uint64_t min_entries) {
  const uint64_t per_cluster = cs_ / 8;
  uint64_t entries = std::max<uint64_t>(min_entries, rt_.size() + rt_.size() / 2 + 1);
  uint64_t start = rt_.size() * rb_entries_;  // first cluster no block covers
  uint64_t table_clusters = 0, blocks = 0;
  for (;;) {
    table_clusters = (entries + blocks + per_cluster - 1) / per_cluster;
    uint64_t area = table_clusters + blocks;
    uint64_t need_blocks = (area + rb_entries_ - 1) / rb_entries_;
    uint64_t need_entries = std::max(entries, rt_.size() + need_blocks);
    if (need_blocks == blocks && need_entries <= table_clusters * per_cluster) break;
    blocks = need_blocks;
    entries = need_entries;
  }
  if (table_clusters * cs_ > kMaxRefcountTableBytes) co_return Error(EFBIG, "Refcount table too large");
  const uint64_t table_off = start * cs_;
  const uint64_t blocks_off = table_off + table_clusters * cs_;
  // New refcount blocks: every cluster of the area has refcount one.
  for (uint64_t b = 0; b < blocks; ++b) {
    AlignedBuffer blk(cs_);
    blk.zero();
    uint64_t first = start + b * rb_entries_;
    for (uint64_t ci = first; ci < start + table_clusters + blocks && ci < first + rb_entries_; ++ci)
      refcount_set(blk.data(), ci - first, 1);
    VBLK_CO_TRY(co_await checked_write(0, blocks_off + b * cs_, blk.span()));
  }
  AlignedBuffer table(table_clusters * cs_);
  table.zero();
  std::vector<uint64_t> new_rt(table_clusters * per_cluster, 0);
  for (uint64_t i = 0; i < rt_.size(); ++i) new_rt[i] = rt_[i];
  for (uint64_t b = 0; b < blocks; ++b) new_rt[rt_.size() + b] = blocks_off + b * cs_;
  for (uint64_t i = 0; i < new_rt.size(); ++i) put64(table.data() + i * 8, new_rt[i]);
  VBLK_CO_TRY(co_await checked_write(0, table_off, table.span()));
  VBLK_CO_TRY(co_await rb_cache_->flush());  // includes a file flush
  // Switch the header to the new table (one sector, synced).
  uint64_t old_off = h_.refcount_table_offset, old_clusters = h_.refcount_table_clusters;
  uint8_t hdr[12];
  put64(hdr, table_off);
  put32(hdr + 8, static_cast<uint32_t>(table_clusters));
  VBLK_CO_TRY(co_await file_->write(48, {hdr, 12}));
  VBLK_CO_TRY(co_await file_->flush());
  h_.refcount_table_offset = table_off;
  h_.refcount_table_clusters = static_cast<uint32_t>(table_clusters);
  rt_.assign(std::move(new_rt));
  // The old table's clusters are free now (a crash before this only leaks).
  VBLK_CO_TRY(co_await update_refcount(old_off, old_clusters * cs_, -1));
  co_return Status{};
}

Task<Status> Qcow2Node::update_refcount(uint64_t offset, uint64_t length, int64_t delta) {
  if (length == 0) co_return Status{};
  if (delta < 0) VBLK_CO_TRY(co_await rb_cache_->set_dependency(l2_cache_.get()));
  uint64_t first = offset / cs_, last = (offset + length - 1) / cs_;
  for (uint64_t ci = first; ci <= last; ++ci) {
    uint64_t rti = ci / rb_entries_;
    auto rb = co_await refblock_offset(rti);
    if (!rb) co_return rb.take_error();
    if (!*rb) {
      if (delta < 0) {
        (void)co_await mark_corrupt(
            fmt::format("Decreasing the refcount of cluster {} that has no refcount block", hex(ci)));
        co_return Error(EIO);
      }
      auto more = co_await ensure_refblocks(ci, 1);
      if (!more) co_return more.take_error();
    }
    auto t = co_await rb_cache_->get(rt_[rti] & ~uint64_t{511});
    if (!t) co_return t.take_error();
    uint64_t old = refcount_get(t->data(), ci % rb_entries_);
    if ((delta < 0 && old < static_cast<uint64_t>(-delta)) ||
        (delta > 0 && refcount_max_ - old < static_cast<uint64_t>(delta))) {
      (void)co_await mark_corrupt(
          fmt::format("Refcount of cluster {} would {} (is {})", hex(ci), delta < 0 ? "underflow" : "overflow", old));
      co_return Error(delta < 0 ? EIO : ERANGE);
    }
    uint64_t nv = old + static_cast<uint64_t>(delta);
    refcount_set(t->data(), ci % rb_entries_, nv);
    t->mark_dirty();
    if (nv == 0) {
      // Not reusable before the next flush: until then an L2 entry on disk
      // may still point here, and new data must not appear through it.
      quarantine_.insert(ci);
      if (freed_sink_) freed_sink_->push_back(ci);
      // Compressed data is never packed into a cluster that was freed (it
      // may be reused for anything after the next flush).
      if (free_byte_offset_ / cs_ == ci) free_byte_offset_ = 0;
      // A freed table must never be written back over reused space.
      l2_cache_->discard(ci * cs_);
      rb_cache_->discard(ci * cs_);
    }
  }
  co_return Status{};
}

Task<Result<uint64_t>> Qcow2Node::alloc_clusters(uint64_t n) {
  for (;;) {
    auto start = co_await find_free(n);
    if (!start) co_return start.take_error();
    // A refcount block this run needs goes right after the run, as in QEMU
    // (its allocator has moved past the run when it finds the block
    // missing); then the run is searched again from where it was.
    const uint64_t saved = free_cluster_index_;
    free_cluster_index_ = *start + n;
    auto moved = co_await ensure_refblocks(*start, n);
    free_cluster_index_ = saved;
    if (!moved) co_return moved.take_error();
    if (*moved) continue;
    VBLK_CO_TRY(co_await check_new_clusters(*start * cs_, n * cs_));
    VBLK_CO_TRY(co_await update_refcount(*start * cs_, n * cs_, +1));
    free_cluster_index_ = *start + n;
    VBLK_TRACE(kQcow2, "'{}' alloc {} cluster(s) at {:#x}", node_name(), n, *start * cs_);
    co_return *start* cs_;
  }
}

Task<Status> Qcow2Node::abort_alloc(uint64_t host, uint64_t bytes, Error err) {
  // Nothing points to the new clusters yet: dropping their references
  // frees them (a failure here only leaks them, as before).
  (void)co_await update_refcount(host, bytes, -1);
  co_return err;
}

Task<Result<uint64_t>> Qcow2Node::alloc_bytes(uint64_t bytes) {
  // QEMU's qcow2_alloc_bytes: compressed data is packed behind the previous
  // piece while it fits; otherwise it starts in a fresh cluster, or spills
  // into the next cluster when that one is the next free cluster anyway.
  // Every cluster a piece touches counts it once in its refcount.
  uint64_t offset = free_byte_offset_;
  if (offset) {
    auto rc = co_await get_refcount(offset / cs_);
    if (!rc) co_return rc.take_error();
    // Full refcount, or freed since (then it waits in quarantine): move on.
    if (*rc == refcount_max_ || *rc == 0) offset = 0;
  }
  const uint64_t free_in_cluster = offset ? cs_ - offset % cs_ : 0;
  if (!offset || free_in_cluster < bytes) {
    uint64_t fresh = 0;
    for (;;) {  // a free cluster, not yet taken: update_refcount below takes it
      auto start = co_await find_free(1);
      if (!start) co_return start.take_error();
      auto moved = co_await ensure_refblocks(*start, 1);
      if (!moved) co_return moved.take_error();
      if (*moved) continue;
      fresh = *start * cs_;
      break;
    }
    free_cluster_index_ = fresh / cs_ + 1;
    if (!offset || (offset + cs_ - 1) / cs_ * cs_ != fresh) offset = fresh;
  }
  VBLK_CO_TRY(co_await update_refcount(offset, bytes, +1));
  free_byte_offset_ = (offset + bytes) % cs_ ? offset + bytes : 0;
  co_return offset;
}

}  // namespace vblk::qcow2
