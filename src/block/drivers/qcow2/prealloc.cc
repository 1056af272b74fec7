// Preallocation (create -o preallocation=..., resize --preallocation=...),
// laid out as QEMU lays it out so that the images match cluster for cluster:
//
//   metadata  per L2 range: the L2 table, then the range's data clusters in
//             one run (QEMU's preallocate_co); the file grows sparsely.
//   falloc,   refcount structures covering the whole new area first (a new
//   full      refcount table at the end of the used file: QEMU's
//             qcow2_refcount_area), then every data cluster in one run that
//             the file driver allocates (fallocate) or writes (zeroes), then
//             the L2 tables, which land in free space (often the old
//             refcount table's cluster) and after the data.
//
// Entries are linked as QEMU's preallocation links them: host | COPIED, and
// with extended L2 the subcluster bitmap untouched (the subclusters stay
// unallocated, so a backing file still shows through).
#include <fmt/format.h>

#include "drivers/qcow2/qcow2.h"

namespace vblk::qcow2 {

namespace {

// An entry that can stay as it is: a cluster of its own (COPIED), not
// compressed. Anything else gets a new cluster.
bool keeps_cluster(uint64_t e) { return (e & kL2OffsetMask) && (e & kOflagCopied) && !(e & kOflagCompressed); }

}  // namespace

Task<Result<uint64_t>> Qcow2Node::link_run(uint64_t first, uint64_t n, uint64_t host, uint64_t head_end,
                                           uint64_t tail_from) {
  if (head_end % cs_ && head_end / cs_ == first) {
    // The guest bytes of the cluster before the old end move along.
    // (do_read would take the lock we hold: look up and read here.)
    AlignedBuffer b(head_end % cs_, std::max<size_t>(limits_.buffer_alignment, 512));
    for (uint64_t done = 0; done < b.size();) {
      auto m = co_await lookup(first * cs_ + done, b.size() - done);
      if (!m) co_return m.take_error();
      uint64_t len = std::min<uint64_t>(m->bytes, b.size() - done);
      VBLK_CO_TRY(co_await read_mapping(first * cs_ + done, *m, b.span().subspan(done, len)));
      done += len;
    }
    VBLK_CO_TRY(encrypt_for(host, b.span()));
    VBLK_CO_TRY(co_await checked_write(0, host, b.span()));
  }
  if (tail_from % cs_ && tail_from / cs_ == first + n - 1) {
    AlignedBuffer z(cs_ - tail_from % cs_, std::max<size_t>(limits_.buffer_alignment, 512));
    z.zero();
    VBLK_CO_TRY(encrypt_for(host + (n - 1) * cs_ + tail_from % cs_, z.span()));
    VBLK_CO_TRY(co_await checked_write(0, host + (n - 1) * cs_ + tail_from % cs_, z.span()));
  }
  // The entries reach the disk after the refcounts of their clusters and
  // after the data (full mode wrote zeroes there).
  l2_cache_->depends_on_flush();
  if (lazy_refcounts_) VBLK_CO_TRY(co_await mark_dirty());
  if (!dirty_flag()) VBLK_CO_TRY(co_await l2_cache_->set_dependency(rb_cache_.get()));
  uint64_t done = 0;
  while (done < n) {
    uint64_t guest = (first + done) * cs_;
    uint64_t l2i = (first + done) & (l2_entries_ - 1);
    uint64_t count = std::min(n - done, l2_entries_ - l2i);
    auto t = co_await l2_for_write(guest);
    if (!t) co_return t.take_error();
    std::vector<uint64_t> old;
    for (uint64_t i = 0; i < count; ++i) {
      uint64_t e = l2_entry(*t, l2i + i);
      if ((e & kL2OffsetMask) || (e & kOflagCompressed)) old.push_back(e);
      set_l2_entry(*t, l2i + i, (host + (done + i) * cs_) | kOflagCopied, l2_bitmap(*t, l2i + i));
    }
    // What the entries replaced is freed after them (QEMU's link_l2).
    for (uint64_t e : old) VBLK_CO_TRY(co_await free_entry(e));
    done += count;
  }
  co_return host + n* cs_;
}

Task<Status> Qcow2Node::prealloc_metadata(uint64_t from, uint64_t to) {
  const uint64_t end = align_up(to, cs_) / cs_;
  uint64_t ci = from / cs_;
  uint64_t file_end = 0;
  while (ci < end) {
    // One L2 range at a time: its table first (allocated by l2_for_write),
    // then its clusters that need one, in contiguous runs.
    uint64_t l2i = ci & (l2_entries_ - 1);
    uint64_t n = std::min(end - ci, l2_entries_ - l2i);
    std::vector<bool> keep(n);
    {
      auto t = co_await l2_for_write(ci * cs_);
      if (!t) co_return t.take_error();
      for (uint64_t i = 0; i < n; ++i) keep[i] = keeps_cluster(l2_entry(*t, l2i + i));
    }
    for (uint64_t i = 0; i < n;) {
      if (keep[i]) {
        ++i;
        continue;
      }
      uint64_t j = i;
      while (j < n && !keep[j]) ++j;
      auto host = co_await alloc_clusters(j - i);
      if (!host) co_return host.take_error();
      auto e = co_await link_run(ci + i, j - i, *host, from, to);
      if (!e) co_return e.take_error();
      file_end = *e;
      i = j;
    }
    ci += n;
  }
  // Reads of the allocated clusters must not fail past the end of the file:
  // the file grows (sparsely) over the last one allocated.
  if (file_end > file_->length()) VBLK_CO_TRY(co_await file_->truncate(file_end, false));
  co_return Status{};
}

Task<Result<uint64_t>> Qcow2Node::refcount_area(uint64_t start, uint64_t additional) {
  // Refcount blocks and table clusters needed to count every cluster up to
  // start + additional, themselves included (fixed point, as QEMU's
  // qcow2_refcount_metadata_size without its generous increase).
  const uint64_t per_table_cluster = cs_ / 8;
  const uint64_t clusters = start + additional;
  uint64_t blocks = 0, table = 0, n = 0, last = 0;
  do {
    last = n;
    blocks = (clusters + table + blocks + rb_entries_ - 1) / rb_entries_;
    table = (blocks + per_table_cluster - 1) / per_table_cluster;
    n = clusters + blocks + table;
  } while (n != last);
  if (blocks > kMaxRefcountTableBytes) co_return Error(EFBIG, "Failed to resize refcount structures: File too large");
  const uint64_t area_index = start / rb_entries_;
  const uint64_t table_size = align_up(blocks, per_table_cluster);
  const uint64_t table_clusters = table_size / per_table_cluster;
  if (table_size * 8 > kMaxRefcountTableBytes)
    co_return Error(EFBIG, "Failed to resize refcount structures: File too large");

  std::vector<uint64_t> nt(table_size, 0);
  for (uint64_t i = 0; i < std::min<uint64_t>(rt_.size(), table_size); ++i) nt[i] = rt_[i];
  uint64_t new_blocks = 0;
  for (uint64_t i = area_index; i < blocks; ++i)
    if (!(nt[i] & ~511ull)) ++new_blocks;
  // New blocks first, then the table; every cluster of both counts once.
  const uint64_t table_at = start + new_blocks;
  const uint64_t end = table_at + table_clusters;
  uint64_t block_at = start;
  for (uint64_t i = area_index; i < blocks; ++i) {
    MetaCache::Ref b;
    if (nt[i] & ~511ull) {
      uint64_t off = nt[i] & ~511ull;
      if (off % cs_) co_return Error(EIO, "Refcount block offset unaligned");
      auto r = co_await rb_cache_->get(off);
      if (!r) co_return r.take_error();
      b = std::move(*r);
    } else {
      auto r = co_await rb_cache_->get_empty(block_at * cs_);
      if (!r) co_return r.take_error();
      b = std::move(*r);
      std::memset(b.data(), 0, cs_);
      b.mark_dirty();
      nt[i] = block_at * cs_;
      ++block_at;
    }
    uint64_t first_covered = i * rb_entries_;
    if (first_covered < end) {
      uint64_t j = first_covered < start ? start - first_covered : 0;
      uint64_t stop = std::min(end - first_covered, rb_entries_);
      for (; j < stop; ++j) {
        if (refcount_get(b.data(), j) != 0) co_return Error(EIO, "Refcount area is not free");
        refcount_set(b.data(), j, 1);
      }
      b.mark_dirty();
    }
  }
  VBLK_CO_TRY(co_await rb_cache_->flush());
  AlignedBuffer tb(table_clusters * cs_);
  tb.zero();
  for (uint64_t i = 0; i < table_size; ++i) put64(tb.data() + i * 8, nt[i]);
  VBLK_CO_TRY(co_await checked_write(0, table_at * cs_, tb.span()));
  VBLK_CO_TRY(co_await file_->flush());
  uint8_t hdr[12];
  put64(hdr, table_at * cs_);
  put32(hdr + 8, static_cast<uint32_t>(table_clusters));
  VBLK_CO_TRY(co_await file_->write(48, {hdr, 12}));
  VBLK_CO_TRY(co_await file_->flush());
  const uint64_t old_off = h_.refcount_table_offset, old_clusters = h_.refcount_table_clusters;
  h_.refcount_table_offset = table_at * cs_;
  h_.refcount_table_clusters = static_cast<uint32_t>(table_clusters);
  rt_.assign(std::move(nt));
  VBLK_CO_TRY(co_await update_refcount(old_off, old_clusters * cs_, -1));
  co_return end;
}

Task<Status> Qcow2Node::prealloc_data(uint64_t from, uint64_t to, Prealloc mode) {
  const uint64_t first = from / cs_;
  // (Even with no data cluster, QEMU builds the refcount area.)
  const uint64_t nb_data = align_up(to, cs_) / cs_ - first;
  // The used end of the file: one past the last cluster with a reference.
  uint64_t file_clusters = (file_->length() + cs_ - 1) / cs_;
  uint64_t used = file_clusters;
  for (uint64_t ci = file_clusters; ci-- > 0;) {
    auto rc = co_await get_refcount(ci);
    if (!rc) co_return rc.take_error();
    if (*rc) {
      used = ci + 1;
      break;
    }
  }
  // Refcounts for the data and for every L2 table it may need (one more
  // for a range not aligned to L2 boundaries), so none is allocated later.
  const uint64_t nb_l2 = (nb_data + l2_entries_ - 1) / l2_entries_ + 1;
  auto start = co_await refcount_area(used, nb_data + nb_l2);
  if (!start) co_return start.take_error();
  VBLK_CO_TRY(co_await update_refcount(*start * cs_, nb_data * cs_, +1));
  auto st = co_await file_->truncate((*start + nb_data) * cs_, false, mode);
  if (!st) {
    (void)co_await update_refcount(*start * cs_, nb_data * cs_, -1);
    co_return st.error().prefixed("Failed to resize underlying file");
  }
  // Everything freed so far (the old refcount table) is free on disk once
  // the caches are: QEMU reuses it at once, for the first L2 table.
  VBLK_CO_TRY(co_await rb_cache_->flush());
  for (uint64_t ci : quarantine_) free_cluster_index_ = std::min(free_cluster_index_, ci);
  quarantine_.clear();
  if (nb_data) {
    auto e = co_await link_run(first, nb_data, *start * cs_, from);
    if (!e) co_return e.take_error();
  }
  co_return Status{};
}

}  // namespace vblk::qcow2
