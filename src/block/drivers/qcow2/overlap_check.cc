// QEMU's metadata overlap check (qcow2_check_metadata_overlap and
// qcow2_pre_write_overlap_check) and corruption signal
// (qcow2_signal_corruption), on the node's in-memory tables.
//
// Every write into the image file goes through overlaps() first: guest data
// (in place, allocating, copy-on-write, zeroed, compressed) with ign = 0,
// metadata with its own kind ignored. A hit refuses the write and marks the
// image corrupt; from then on the node takes no writes.
#include <fmt/format.h>

#include <cstdio>

#include "drivers/qcow2/qcow2.h"
#include "vblk/buffer.h"
#include "vblk/trace.h"

namespace vblk::qcow2 {

uint32_t Qcow2Node::metadata_overlap(uint32_t chk, uint64_t offset, uint64_t size) const {
  if (!size) return 0;
  if ((chk & kOlMainHeader) && offset < cs_) return kOlMainHeader;
  // QEMU compares whole clusters.
  const uint64_t first = offset >> h_.cluster_bits;
  const uint64_t last = (offset + size - 1) >> h_.cluster_bits;
  const uint64_t start = first << h_.cluster_bits, end = (last + 1) << h_.cluster_bits;
  auto hit = [&](uint64_t o, uint64_t n) { return n && o < end && start < o + n; };
  if ((chk & kOlActiveL1) && hit(h_.l1_table_offset, l1_.size() * 8)) return kOlActiveL1;
  if ((chk & kOlRefcountTable) && hit(h_.refcount_table_offset, rt_.size() * 8)) return kOlRefcountTable;
  if ((chk & kOlSnapshotTable) && hit(h_.snapshots_offset, snapshots_size_)) return kOlSnapshotTable;
  if ((chk & kOlInactiveL1) && ol_inactive_l1_.hits(start, end)) return kOlInactiveL1;
  if (chk & kOlActiveL2) {
    // Rebuilt only after an L2 offset in the L1 table changed.
    if (ol_l2_.built_from != l1_.generation()) {
      ol_l2_.rebuild(l1_.vec(), kL1OffsetMask, h_.cluster_bits);
      ol_l2_.built_from = l1_.generation();
    }
    if (ol_l2_.hits(first, last)) return kOlActiveL2;
  }
  if (chk & kOlRefcountBlock) {
    if (ol_rb_.built_from != rt_.generation()) {
      ol_rb_.rebuild(rt_.vec(), ~uint64_t{511}, h_.cluster_bits);
      ol_rb_.built_from = rt_.generation();
    }
    if (ol_rb_.hits(first, last)) return kOlRefcountBlock;
  }
  if ((chk & kOlInactiveL2) && ol_inactive_l2_.hits(first, last)) return kOlInactiveL2;
  if ((chk & kOlBitmapDirectory) && (h_.autoclear_features & kAutoclearBitmaps) && h_.has_bitmaps_extension &&
      h_.bitmaps_extension.size() >= 24 &&
      hit(be64(h_.bitmaps_extension.data() + 16), be64(h_.bitmaps_extension.data() + 8)))
    return kOlBitmapDirectory;
  return 0;
}

Task<Status> Qcow2Node::refuse_overlap(uint32_t ol, uint64_t offset, uint64_t size) {
  (void)co_await signal_corruption(
      true, static_cast<int64_t>(offset), static_cast<int64_t>(size),
      fmt::format("Preventing invalid write on metadata (overlaps with {})", overlap_name(ol)));
  co_return Error(EIO);
}

Task<Status> Qcow2Node::checked_write(uint32_t ign, uint64_t offset, std::span<const uint8_t> data, uint32_t flags) {
  if (uint32_t ol = overlaps(ign, offset, data.size())) co_return co_await refuse_overlap(ol, offset, data.size());
  co_return co_await file_->write(offset, data, flags);
}

Task<Status> Qcow2Node::signal_corruption(bool fatal, int64_t offset, int64_t size, const std::string& msg) {
  fatal = fatal && !read_only();
  VBLK_TRACE(kQcow2, "'{}' corruption{}: {}", node_name(), fatal ? " (fatal)" : "", msg);
  if (signaled_corruption_ && (!fatal || corrupt())) co_return Status{};
  if (fatal)
    std::fprintf(stderr, "qcow2: Marking image as corrupt: %s; further corruption events will be suppressed\n",
                 msg.c_str());
  else
    std::fprintf(stderr, "qcow2: Image is corrupt: %s; further non-fatal corruption events will be suppressed\n",
                 msg.c_str());
  report_corruption(CorruptionEvent{msg, offset, size, fatal});
  signaled_corruption_ = true;
  if (!fatal) co_return Status{};
  // QEMU's qcow2_mark_corrupt: the bit in memory first, so that nothing is
  // written from here on (do_write refuses), then on disk (v3 only).
  h_.incompatible_features |= kIncompatCorrupt;
  check_dead_ = true;  // and nothing else reaches the file (flush, close)
  if (h_.version < 3) co_return Status{};
  uint8_t b[8];
  put64(b, h_.incompatible_features);
  VBLK_CO_TRY(co_await file_->write(72, {b, 8}));
  co_return co_await file_->flush();
}

Task<Status> Qcow2Node::index_snapshots() {
  ol_inactive_l1_.clear();
  for (const auto& sn : snapshots_) ol_inactive_l1_.add(sn.l1_table_offset, uint64_t{sn.l1_size} * 8);
  ol_inactive_l1_.sort();
  ol_inactive_l2_.clear();
  if (!(overlap_check_ & kOlInactiveL2)) co_return Status{};
  // QEMU reads the snapshots' L1 tables on every checked write; they never
  // change while they are inactive, so reading them once is enough.
  for (const auto& sn : snapshots_) {
    // A table past the end of the file reads as zeroes: nothing to index
    // (and a hostile table of snapshots costs no reads).
    if (!sn.l1_size || uint64_t{sn.l1_size} * 8 > kMaxL1Bytes || sn.l1_table_offset >= file_->length()) continue;
    AlignedBuffer b(align_up(uint64_t{sn.l1_size} * 8, 512));
    VBLK_CO_TRY(co_await file_->read(sn.l1_table_offset, b.span()));
    for (uint32_t i = 0; i < sn.l1_size; ++i) {
      const uint64_t off = be64(b.data() + uint64_t{i} * 8) & kL1OffsetMask;
      if (!off) continue;
      ol_inactive_l2_.add(off >> h_.cluster_bits);
      if (off & (cs_ - 1)) ol_inactive_l2_.add((off >> h_.cluster_bits) + 1);
    }
  }
  ol_inactive_l2_.sort();
  co_return Status{};
}

Task<Status> Qcow2Node::check_l2_offset(uint64_t l2_off, uint64_t l1i) {
  if (!(l2_off & (cs_ - 1))) co_return Status{};
  (void)co_await mark_corrupt(fmt::format("L2 table offset {} unaligned (L1 index: {})", hex(l2_off), hex(l1i)));
  co_return Error(EIO);
}

Task<Result<uint64_t>> Qcow2Node::refblock_offset(uint64_t rti) {
  if (rti >= rt_.size()) co_return uint64_t{0};
  const uint64_t rb = rt_[rti] & ~uint64_t{511};
  if (rb & (cs_ - 1)) {
    (void)co_await mark_corrupt(fmt::format("Refblock offset {} unaligned (reftable index: {})", hex(rb), hex(rti)));
    co_return Error(EIO);
  }
  co_return rb;
}

}  // namespace vblk::qcow2
