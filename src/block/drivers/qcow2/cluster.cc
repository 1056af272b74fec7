// L1/L2: mapping guest offsets to host clusters, and making L2 tables
// writable (allocating or copying them). Lock held throughout.
#include <fmt/format.h>

#include <algorithm>

#include "drivers/qcow2/qcow2.h"

namespace vblk::qcow2 {

uint64_t Qcow2Node::l2_entry(MetaCache::Ref& t, uint64_t i) const { return be64(t.data() + i * l2_entry_size_); }
uint64_t Qcow2Node::l2_bitmap(MetaCache::Ref& t, uint64_t i) const {
  return l2_entry_size_ == 16 ? be64(t.data() + i * 16 + 8) : 0;
}
void Qcow2Node::set_l2_entry(MetaCache::Ref& t, uint64_t i, uint64_t entry, uint64_t bitmap) {
  put64(t.data() + i * l2_entry_size_, entry);
  if (l2_entry_size_ == 16) put64(t.data() + i * 16 + 8, bitmap);
  t.mark_dirty();
}

namespace {
struct Classified {
  ClusterType type;
  uint64_t host;  // cluster host offset (Normal/ZeroAlloc) or the entry (Compressed)
};
}  // namespace

Task<Result<Mapping>> Qcow2Node::lookup(uint64_t offset, uint64_t max_bytes, bool for_write,
                                        const std::vector<uint64_t>* other_l1) {
  const std::vector<uint64_t>& l1 = other_l1 ? *other_l1 : l1_.vec();
  const uint64_t l1i = offset >> (h_.cluster_bits + l2_bits_);
  const uint64_t in_cluster = offset & (cs_ - 1);
  Mapping m;
  // A run never crosses an L2 table: cap at its end.
  const uint64_t table_span = uint64_t{1} << (h_.cluster_bits + l2_bits_);
  uint64_t table_end = (l1i + 1) << (h_.cluster_bits + l2_bits_);
  const uint64_t asked = max_bytes;
  max_bytes = std::min(max_bytes, table_end - offset);
  if (l1i >= l1.size() || !(l1[l1i] & kL1OffsetMask)) {
    // No L2 table: for readers (block status, map) the run goes on over
    // the following L1 entries without one, a table's span per entry
    // instead of one answer per table. Writers allocate per table.
    if (!for_write) {
      for (uint64_t i = l1i + 1; table_end - offset < asked && (i >= l1.size() || !(l1[i] & kL1OffsetMask)); ++i) {
        if (i >= l1.size()) {
          table_end = offset + asked;  // beyond the table: unallocated to the end
          break;
        }
        table_end += table_span;
      }
      max_bytes = std::min(asked, table_end - offset);
    }
    m.bytes = max_bytes;
    co_return m;
  }
  uint64_t l2_off = l1[l1i] & kL1OffsetMask;
  VBLK_CO_TRY(co_await check_l2_offset(l2_off, l1i));
  auto t = co_await l2_cache_->get(l2_off);
  if (!t) co_return t.take_error();
  uint64_t l2i = (offset >> h_.cluster_bits) & (l2_entries_ - 1);

  // Classify one (sub)cluster: with extended L2 the unit is a subcluster.
  const uint64_t unit = l2_entry_size_ == 16 ? cs_ / kSubclusters : cs_;
  auto classify = [&](uint64_t idx, uint64_t sub, Result<Classified>& out) {
    uint64_t e = l2_entry(*t, idx);
    if (e & kOflagCompressed) {
      out = Classified{ClusterType::Compressed, e};
      return;
    }
    uint64_t host = e & kL2OffsetMask;
    if (host % cs_ && for_write && idx == l2i && (e & kOflagCopied)) {
      out = Error(EIO, fmt::format("{} cluster offset {} unaligned (guest offset: {})",
                                   (e & kOflagZero) && l2_entry_size_ == 8 ? "Preallocated zero" : "Data", hex(host),
                                   hex(offset)));
      return;
    }
    if (host % cs_) {
      out = Error(EIO, fmt::format("Cluster allocation offset {} unaligned (L2 offset: {}, L2 index: {})", hex(host),
                                   hex(l2_off), hex(idx)));
      return;
    }
    if (l2_entry_size_ == 16) {
      uint64_t bm = l2_bitmap(*t, idx);
      bool alloc = bm & (1ull << sub), zero = bm & (1ull << (sub + 32));
      if (alloc && zero) {
        out = Error(EIO, fmt::format("Subcluster {} of L2 index {} is both allocated and zero", sub, hex(idx)));
        return;
      }
      if (zero)
        out = host ? Classified{ClusterType::ZeroAlloc, host} : Classified{ClusterType::ZeroPlain, 0};
      else if (alloc)
        out = host ? Classified{ClusterType::Normal, host} : Classified{ClusterType::Unallocated, 0};
      else
        out = host ? Classified{ClusterType::UnallocatedAlloc, host} : Classified{ClusterType::Unallocated, 0};
      return;
    }
    if (e & kOflagZero)
      out = Classified{host ? ClusterType::ZeroAlloc : ClusterType::ZeroPlain, host};
    else if (host)
      out = Classified{ClusterType::Normal, host};
    else
      out = Classified{ClusterType::Unallocated, 0};
  };

  uint64_t sub = (in_cluster / unit);
  Result<Classified> first = Classified{};
  classify(l2i, sub, first);
  if (!first) {
    (void)co_await mark_corrupt(first.error().message);
    co_return Error(EIO);
  }
  m.type = first->type;
  m.copied = m.type == ClusterType::Normal && (l2_entry(*t, l2i) & kOflagCopied);
  const bool has_host =
      m.type == ClusterType::Normal || m.type == ClusterType::ZeroAlloc || m.type == ClusterType::UnallocatedAlloc;
  if (has_host) m.host = first->host + (in_cluster / unit) * unit + (offset % unit);
  if (m.type == ClusterType::Compressed) {
    m.host = first->host;
    m.bytes = std::min(max_bytes, cs_ - in_cluster);  // one cluster at a time
    co_return m;
  }
  // Extend the run over following units with the same type (and, for
  // Normal, contiguous host offsets and the same COPIED state).
  uint64_t run = std::min(max_bytes, unit - (offset % unit));
  if (l2_entry_size_ == 8 && (m.type == ClusterType::Unallocated || m.type == ClusterType::Normal)) {
    // Standard entries, one per cluster: an unallocated run is a run of
    // zero words and a contiguous data run one of words a cluster apart
    // (same flags), so the scan compares words instead of classifying each
    // entry (map and block status of a large sparse image walk millions).
    uint64_t prev = l2_entry(*t, l2i);
    if (m.type == ClusterType::Normal || prev == 0) {
      const uint64_t step = m.type == ClusterType::Normal ? cs_ : 0;
      for (uint64_t idx = l2i + 1; run < max_bytes && idx < l2_entries_; ++idx) {
        const uint64_t e = l2_entry(*t, idx);
        if (e != prev + step) break;
        prev = e;
        run += std::min(cs_, max_bytes - run);
      }
      m.bytes = run;
      co_return m;
    }
  }
  uint64_t expect_host = m.host + run;
  uint64_t idx = l2i, s = sub;
  while (run < max_bytes) {
    if (++s * unit >= cs_) {
      s = 0;
      if (++idx >= l2_entries_) break;
    }
    Result<Classified> c = Classified{};
    classify(idx, s, c);
    if (!c || c->type != m.type) break;
    if (has_host) {
      uint64_t h = c->host + s * unit;
      bool copied = l2_entry(*t, idx) & kOflagCopied;
      if (h != expect_host || copied != m.copied) break;
      expect_host += unit;
    }
    run += std::min(unit, max_bytes - run);
  }
  m.bytes = run;
  co_return m;
}

Task<Status> Qcow2Node::write_l1_entry(uint64_t index) {
  // Write the 512-byte sector holding the entry, synced: the L1 table is
  // updated in place and must never be half-new after a crash.
  uint64_t first = index & ~uint64_t{63};
  uint8_t buf[512] = {};
  for (uint64_t i = 0; i < 64 && first + i < l1_.size(); ++i) put64(buf + i * 8, l1_[first + i]);
  uint64_t len = std::min<uint64_t>(512, (l1_.size() - first) * 8);
  len = (len + 511) & ~uint64_t{511};
  VBLK_CO_TRY(co_await checked_write(kOlActiveL1, h_.l1_table_offset + first * 8, {buf, len}, kReqFua));
  co_return Status{};
}

Task<Result<MetaCache::Ref>> Qcow2Node::l2_for_write(uint64_t offset) {
  const uint64_t l1i = offset >> (h_.cluster_bits + l2_bits_);
  if (l1i >= l1_.size()) co_return Error(EIO, "Write beyond the L1 table");
  uint64_t entry = l1_[l1i];
  uint64_t old = entry & kL1OffsetMask;
  // A corrupt entry must not send the table (or its copy) somewhere else.
  VBLK_CO_TRY(co_await check_l2_offset(old, l1i));
  if (old && (entry & kOflagCopied)) co_return co_await l2_cache_->get(old);
  // Allocate a new table: a copy of the shared one (snapshots), or empty.
  auto where = co_await alloc_clusters(1);
  if (!where) co_return where.take_error();
  MetaCache::Ref fresh;
  if (old) {
    AlignedBuffer copy(cs_);
    {
      auto src = co_await l2_cache_->get(old);
      if (!src) co_return src.take_error();
      std::memcpy(copy.data(), src->data(), cs_);
    }
    auto dst = co_await l2_cache_->get_empty(*where);
    if (!dst) co_return dst.take_error();
    std::memcpy(dst->data(), copy.data(), cs_);
    fresh = std::move(*dst);
  } else {
    auto dst = co_await l2_cache_->get_empty(*where);
    if (!dst) co_return dst.take_error();
    fresh = std::move(*dst);
  }
  // A copy of a shared table is verbatim: refcounts count paths (each L1
  // table reaching a cluster holds a reference), so the data clusters keep
  // theirs, and their COPIED flags (clear while shared) stay right.
  fresh.mark_dirty();
  // The table and the refcounts it relies on (its own cluster's among them)
  // reach the disk before the L1 entry that makes it reachable.
  auto fl = co_await l2_cache_->set_dependency(rb_cache_.get());
  if (fl) fl = co_await l2_cache_->flush();
  if (!fl) {
    // Not on disk and not linked: dropped with its cluster (QEMU's
    // l2_allocate failure path), so it neither leaks nor blocks later flushes.
    fresh = MetaCache::Ref();
    l2_cache_->discard(*where);
    (void)co_await update_refcount(*where, cs_, -1);
    co_return fl.take_error();
  }
  l1_.set(l1i, *where | kOflagCopied);
  if (auto st = co_await write_l1_entry(l1i); !st) {
    l1_.set(l1i, entry);  // the table on disk still has the old entry
    co_return st.take_error();
  }
  // The shared table lost a reference (a crash before this only leaks).
  if (old) VBLK_CO_TRY(co_await update_refcount(old, cs_, -1));
  co_return std::move(fresh);
}

// QEMU allocates an L2 table when the first write needs it: the refcounts
// flushed, the table written and flushed, the L1 sector written with FUA,
// three syncs per table, and every write waits for them. A writer that
// knows its ranges ahead (an incremental backup into a fresh overlay
// touches a table per 512 MiB of disk) gets all its tables in one run:
// three syncs per batch. Only entries with no table at all are handled
// here; a shared table (snapshots) is copied by l2_for_write as before.
Task<Status> Qcow2Node::prepare_writes(std::span<const WriteRange> ranges) {
  if (read_only() || corrupt()) co_return Status{};
  const unsigned shift = h_.cluster_bits + l2_bits_;
  std::vector<uint64_t> want;
  for (const WriteRange& r : ranges) {
    if (!r.bytes) continue;
    const uint64_t last = std::min<uint64_t>((r.offset + r.bytes - 1) >> shift, l1_.size() - 1);
    for (uint64_t i = r.offset >> shift; i <= last; ++i)
      if (want.empty() || want.back() != i) want.push_back(i);
  }
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());

  auto guard = co_await lock_.scoped();
  std::vector<uint64_t> missing;
  for (uint64_t i : want)
    if (l1_[i] == 0) missing.push_back(i);
  // Batches bound the tables pinned in the cache at once.
  constexpr size_t kBatch = 32;
  for (size_t b = 0; b < missing.size(); b += kBatch) {
    std::vector<uint64_t> idx;
    for (size_t k = b; k < std::min(missing.size(), b + kBatch); ++k) idx.push_back(missing[k]);
    if (idx.empty()) continue;
    auto where = co_await alloc_clusters(idx.size());
    if (!where) co_return where.take_error();
    std::vector<MetaCache::Ref> tables;
    Status st{};
    for (size_t k = 0; k < idx.size() && st; ++k) {
      auto t = co_await l2_cache_->get_empty(*where + k * cs_);
      if (!t) {
        st = t.take_error();
        break;
      }
      t->mark_dirty();
      tables.push_back(std::move(*t));
    }
    // The tables and their refcounts reach the disk before any L1 entry.
    if (st) st = co_await l2_cache_->set_dependency(rb_cache_.get());
    if (st) st = co_await l2_cache_->flush();
    if (!st) {
      tables.clear();
      for (size_t k = 0; k < idx.size(); ++k) l2_cache_->discard(*where + k * cs_);
      (void)co_await update_refcount(*where, idx.size() * cs_, -1);
      co_return st;
    }
    tables.clear();
    for (size_t k = 0; k < idx.size(); ++k) l1_.set(idx[k], (*where + k * cs_) | kOflagCopied);
    // One synced write per 512-byte L1 sector (64 entries).
    for (size_t k = 0; k < idx.size(); ++k) {
      if (k && idx[k] / 64 == idx[k - 1] / 64) continue;
      if (auto w = co_await write_l1_entry(idx[k]); !w) {
        // Entries not yet on disk are dropped; their tables only leak.
        for (size_t j = k; j < idx.size(); ++j) l1_.set(idx[j], 0);
        co_return w;
      }
    }
  }
  co_return Status{};
}

Task<Status> Qcow2Node::free_entry(uint64_t e) {
  if (e & kOflagCompressed) {
    const uint32_t x = 62 - (h_.cluster_bits - 8);
    uint64_t host = e & ((1ull << x) - 1);
    uint64_t sectors = ((e >> x) & ((1ull << (h_.cluster_bits - 8)) - 1)) + 1;
    uint64_t len = sectors * 512 - (host & 511);
    co_return co_await update_refcount(host, len, -1);
  }
  uint64_t host = e & kL2OffsetMask;
  if (!host) co_return Status{};
  // QEMU's qcow2_free_any_cluster: an unaligned offset is reported (not
  // fatal) and nothing is freed, rather than freeing some other cluster.
  if (host & (cs_ - 1)) {
    (void)co_await signal_corruption(false, -1, -1, fmt::format("Cannot free unaligned cluster {}", hex(host)));
    co_return Status{};
  }
  co_return co_await update_refcount(host, cs_, -1);
}

}  // namespace vblk::qcow2
