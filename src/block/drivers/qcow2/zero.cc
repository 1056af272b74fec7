// Zero writes and discards by L2 entry, as QEMU makes them, so that the same
// request sequence leaves the same allocation (qemu-img map) in both:
//
// - Zeroes work in units of clusters, or subclusters with extended L2 (the
//   subcluster zero bits). A partial unit becomes a zero unit without data
//   when the rest of it already reads as zeroes by metadata alone (QEMU's
//   is_zero: zero clusters, or unallocated with no backing file, through
//   qcow2 backing files) and it holds no data; otherwise zeroes are written.
// - Whole clusters: the entry keeps its host cluster unless unmapping is
//   allowed (and a compressed cluster is always dropped).
// - Discard is advisory and works on whole clusters only (plus the partial
//   last cluster of the image): the cluster becomes zero if a backing file
//   could show through or it held something, else it stays as it is.
#include "drivers/qcow2/qcow2.h"

namespace vblk::qcow2 {

namespace {
constexpr uint64_t kAllZeroes = 0xffffffff00000000ull;  // extended L2: every subcluster reads as zero
}

// Waits (lock held, released while waiting) for allocating writes into the
// guest cluster ci.
Task<bool> Qcow2Node::wait_allocs(uint64_t first, uint64_t last) {
  bool waited = false;
  for (;;) {
    CoEvent* busy = nullptr;
    for (auto& a : allocs_)
      if (a.first <= last && first <= a.last) busy = a.done;
    if (!busy) co_return waited;
    lock_.unlock();
    co_await busy->wait();
    co_await lock_.lock();
    waited = true;
  }
}

Task<Result<bool>> Qcow2Node::is_zero_fast(uint64_t offset, uint64_t bytes) {
  if (offset >= length()) co_return true;
  bytes = std::min(bytes, length() - offset);
  while (bytes) {
    auto m = co_await lookup(offset, bytes);
    if (!m) co_return m.take_error();
    uint64_t n = std::min(m->bytes, bytes);
    switch (m->type) {
      case ClusterType::ZeroPlain:
      case ClusterType::ZeroAlloc: break;
      case ClusterType::Unallocated:
      case ClusterType::UnallocatedAlloc:
        if (backing_) {
          // Only a qcow2 backing file knows zeroes from metadata; QEMU asks
          // a raw one without looking for holes, which reports data.
          auto* q = dynamic_cast<Qcow2Node*>(backing_);
          if (!q || offset + n > q->length()) co_return false;
          co_await q->lock_.lock();
          auto z = co_await q->is_zero_fast(offset, n);
          q->lock_.unlock();
          if (!z) co_return z.take_error();
          if (!*z) co_return false;
        }
        break;
      default: co_return false;
    }
    offset += n;
    bytes -= n;
  }
  co_return true;
}

// Zeroes whole clusters [a, e) by their entries (a cluster aligned; e too,
// or the image end). Lock held.
Task<Status> Qcow2Node::zero_clusters(uint64_t a, uint64_t e, bool may_unmap) {
  for (uint64_t guest = a; guest < e; guest += cs_) {
    co_await wait_allocs(guest / cs_, guest / cs_);
    auto t = co_await l2_for_write(guest);
    if (!t) co_return t.take_error();
    uint64_t l2i = (guest >> h_.cluster_bits) & (l2_entries_ - 1);
    uint64_t old = l2_entry(*t, l2i), old_bitmap = l2_bitmap(*t, l2i);
    const bool compressed = old & kOflagCompressed;
    const bool allocated = compressed || (old & kL2OffsetMask);
    const bool unmap = compressed || (may_unmap && allocated);
    uint64_t nw = unmap ? 0 : old, bitmap = old_bitmap;
    if (l2_entry_size_ == 16)
      bitmap = kAllZeroes;
    else
      nw |= kOflagZero;
    if (nw == old && bitmap == old_bitmap) continue;
    set_l2_entry(*t, l2i, nw, bitmap);
    if (unmap) VBLK_CO_TRY(co_await free_entry(old));
  }
  co_return Status{};
}

// Extended L2: makes `count` subclusters from `first` of the cluster at
// guest read as zero. false: the cluster is compressed (write zeroes).
Task<Result<bool>> Qcow2Node::zero_subclusters(uint64_t guest, uint32_t first, uint32_t count) {
  co_await wait_allocs(guest / cs_, guest / cs_);
  auto t = co_await l2_for_write(guest);
  if (!t) co_return t.take_error();
  uint64_t l2i = (guest >> h_.cluster_bits) & (l2_entries_ - 1);
  uint64_t e = l2_entry(*t, l2i);
  if (e & kOflagCompressed) co_return false;
  uint64_t range = (count >= 32 ? 0xffffffffull : ((1ull << count) - 1)) << first;
  uint64_t bitmap = l2_bitmap(*t, l2i);
  uint64_t nb = (bitmap | (range << 32)) & ~range;
  if (nb != bitmap) set_l2_entry(*t, l2i, e, nb);
  co_return true;
}

// Zeroes [offset, offset+bytes), unit aligned (or ending at the image end),
// by metadata. false: something could not be (write zeroes instead).
Task<Result<bool>> Qcow2Node::zeroize(uint64_t offset, uint64_t bytes, bool may_unmap) {
  const uint64_t end = offset + bytes;
  if (h_.version < 3) {
    // No zero flag. Without a backing file a discarded cluster reads as
    // zeroes (QEMU does the same); with one, zeroes must be written.
    if (backing_) co_return false;
    VBLK_CO_TRY(co_await discard_clusters(offset, (end + cs_ - 1) / cs_ * cs_, false));
    co_return true;
  }
  if (l2_entry_size_ != 16) {
    VBLK_CO_TRY(co_await zero_clusters(offset, (end + cs_ - 1) / cs_ * cs_, may_unmap));
    co_return true;
  }
  const uint64_t sc = cs_ / kSubclusters;
  uint64_t pos = offset;
  while (pos < end) {
    uint64_t cluster = pos / cs_ * cs_;
    uint64_t stop = std::min(end, cluster + cs_);
    if (pos == cluster && (stop == cluster + cs_ || stop == length())) {
      VBLK_CO_TRY(co_await zero_clusters(cluster, cluster + cs_, may_unmap));
    } else {
      auto first = static_cast<uint32_t>((pos - cluster) / sc);
      auto last = static_cast<uint32_t>((stop - cluster + sc - 1) / sc);
      auto r = co_await zero_subclusters(cluster, first, last - first);
      if (!r) co_return r.take_error();
      if (!*r) co_return false;
    }
    pos = stop;
  }
  co_return true;
}

Task<Status> Qcow2Node::zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  const bool may_unmap = flags & kReqMayUnmap;
  const uint64_t unit = l2_entry_size_ == 16 ? cs_ / kSubclusters : cs_;
  const uint64_t end = offset + bytes;
  uint64_t pos = offset;
  while (pos < end) {
    // Split as QEMU's generic layer does: the partial head unit, the aligned
    // middle, the partial tail unit.
    uint64_t num = end - pos;
    if (pos % unit)
      num = std::min(num, unit - pos % unit);
    else if (end % unit && num > unit)
      num -= end % unit;
    const uint64_t u0 = pos / unit * unit;
    uint64_t tail = (pos + num + unit - 1) / unit * unit - (pos + num);
    if (pos + num == length()) tail = 0;
    bool done = false;
    {
      auto g = co_await lock_.scoped();
      co_await wait_allocs(pos / cs_, pos / cs_);
      bool ok = true;
      if (pos != u0 || tail) {
        // A partial unit: only if the rest reads as zero and it holds no data.
        auto z1 = co_await is_zero_fast(u0, pos - u0);
        if (!z1) co_return z1.take_error();
        auto z2 = co_await is_zero_fast(pos + num, tail);
        if (!z2) co_return z2.take_error();
        ok = *z1 && *z2;
        if (ok) {
          auto m = co_await lookup(u0, unit);
          if (!m) co_return m.take_error();
          ok = m->type != ClusterType::Normal && m->type != ClusterType::Compressed;
        }
      }
      if (ok) {
        uint64_t zb = (pos != u0 || tail) ? std::min(unit, length() - u0) : num;
        auto r = co_await zeroize(u0, zb, may_unmap);
        if (!r) co_return r.take_error();
        done = *r;
      }
    }
    if (!done) {
      if (flags & kReqNoFallback) co_return Error(ENOTSUP);
      AlignedBuffer z(num);
      z.zero();
      VBLK_CO_TRY(co_await do_write(pos, z.span(), 0));
    }
    pos += num;
  }
  co_return Status{};
}

Task<Status> Qcow2Node::discard_range(uint64_t offset, uint64_t bytes, bool full) {
  uint64_t end = offset + bytes;
  uint64_t a = (offset + cs_ - 1) / cs_ * cs_;
  uint64_t e = end / cs_ * cs_;
  if (end == length()) e = (end + cs_ - 1) / cs_ * cs_;  // the last, partial cluster counts whole
  if (e <= a) co_return Status{};
  auto g = co_await lock_.scoped();
  co_return co_await discard_clusters(a, e, full);
}

Task<Status> Qcow2Node::discard_clusters(uint64_t a, uint64_t e, bool full) {
  for (uint64_t guest = a; guest < e; guest += cs_) {
    co_await wait_allocs(guest / cs_, guest / cs_);
    const uint64_t l1i = guest >> (h_.cluster_bits + l2_bits_);
    if (l1i >= l1_.size()) break;
    if (full && !(l1_[l1i] & kL1OffsetMask)) continue;  // nothing there
    auto t = co_await l2_for_write(guest);
    if (!t) co_return t.take_error();
    uint64_t l2i = (guest >> h_.cluster_bits) & (l2_entries_ - 1);
    uint64_t old = l2_entry(*t, l2i), old_bitmap = l2_bitmap(*t, l2i);
    const bool allocated = (old & (kOflagCompressed | kL2OffsetMask)) != 0;
    uint64_t nw = old, bitmap = old_bitmap;
    if (full) {
      nw = bitmap = 0;
    } else if (backing_ || allocated) {
      // Reads must not start showing the backing file: zero where the
      // format can say so (v2 cannot; do_discard leaves v2 over a backing
      // file alone, and v2 zeroes by discard only without one).
      if (l2_entry_size_ == 16) {
        nw = 0;
        bitmap = kAllZeroes;
      } else {
        nw = h_.version >= 3 ? kOflagZero : 0;
      }
    }
    if (nw == old && bitmap == old_bitmap) continue;
    set_l2_entry(*t, l2i, nw, bitmap);
    if (allocated) VBLK_CO_TRY(co_await free_entry(old));
  }
  co_return Status{};
}

}  // namespace vblk::qcow2
