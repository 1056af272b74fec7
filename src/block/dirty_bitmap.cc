// The hierarchical dirty bitmap (see include/block/vblk/dirty_bitmap.h).
//
// Invariant: for every level k > 0, bit i of level k is set iff word i of
// level k-1 is non-zero. set() and reset() keep it by propagating ranges of
// word indices upwards; find_set() descends from the summary to the leaf.
#include "vblk/dirty_bitmap.h"

#include <algorithm>
#include <bit>
#include <cassert>

namespace vblk {

namespace {
constexpr uint64_t kAll = ~0ull;
uint64_t words_for(uint64_t bits) { return (bits + 63) / 64; }
// Mask of bits [lo, hi] within one word (0 <= lo <= hi <= 63).
uint64_t mask(unsigned lo, unsigned hi) {
  uint64_t upper = hi == 63 ? kAll : ((1ull << (hi + 1)) - 1);
  return upper & (kAll << lo);
}
}  // namespace

DirtyBitmap::DirtyBitmap(uint64_t size, uint64_t granularity) : size_(size), gran_(granularity) {
  assert(granularity && std::has_single_bit(granularity));
  shift_ = static_cast<unsigned>(std::countr_zero(granularity));
  nbits_ = (size + gran_ - 1) >> shift_;
  uint64_t bits = nbits_;
  do {
    levels_.emplace_back(words_for(bits), 0);
    bits = words_for(bits);
  } while (bits > 1);
}

uint64_t DirtyBitmap::cluster_bytes(uint64_t cluster) const {
  if (cluster + 1 < nbits_) return gran_;
  return size_ - (cluster << shift_);
}

void DirtyBitmap::set_bits(unsigned level, uint64_t first, uint64_t last) {
  auto& w = levels_[level];
  const uint64_t fw = first / 64, lw = last / 64;
  for (uint64_t i = fw; i <= lw; ++i) {
    unsigned lo = i == fw ? first % 64 : 0;
    unsigned hi = i == lw ? last % 64 : 63;
    uint64_t m = mask(lo, hi);
    if (level == 0) dirty_bits_ += static_cast<uint64_t>(std::popcount(m & ~w[i]));
    w[i] |= m;
  }
  if (level + 1 < levels_.size()) set_bits(level + 1, fw, lw);
}

void DirtyBitmap::reset_bits(unsigned level, uint64_t first, uint64_t last) {
  auto& w = levels_[level];
  const uint64_t fw = first / 64, lw = last / 64;
  for (uint64_t i = fw; i <= lw; ++i) {
    unsigned lo = i == fw ? first % 64 : 0;
    unsigned hi = i == lw ? last % 64 : 63;
    uint64_t m = mask(lo, hi);
    if (level == 0) dirty_bits_ -= static_cast<uint64_t>(std::popcount(m & w[i]));
    w[i] &= ~m;
  }
  if (level + 1 >= levels_.size()) return;
  // Words strictly inside the range are now zero; the edge words may not be.
  uint64_t a = w[fw] == 0 ? fw : fw + 1;
  uint64_t b = lw;
  if (w[lw] != 0) {
    if (lw == 0) return;
    b = lw - 1;
  }
  if (a <= b) reset_bits(level + 1, a, b);
}

void DirtyBitmap::set(uint64_t offset, uint64_t bytes) {
  if (bytes == 0 || offset >= size_) return;
  uint64_t end = std::min(size_, offset + bytes);
  set_bits(0, cluster_of(offset), cluster_of(end - 1));
}

void DirtyBitmap::reset(uint64_t offset, uint64_t bytes) {
  if (bytes == 0 || offset >= size_) return;
  uint64_t end = std::min(size_, offset + bytes);
  reset_bits(0, cluster_of(offset), cluster_of(end - 1));
}

bool DirtyBitmap::get(uint64_t offset) const {
  if (offset >= size_) return false;
  uint64_t c = cluster_of(offset);
  return (levels_[0][c / 64] >> (c % 64)) & 1;
}

uint64_t DirtyBitmap::find_set(unsigned level, uint64_t bit) const {
  const auto& w = levels_[level];
  uint64_t wi = bit / 64;
  if (wi >= w.size()) return kNone;
  uint64_t m = w[wi] & (kAll << (bit % 64));
  if (m) return wi * 64 + static_cast<uint64_t>(std::countr_zero(m));
  // The summary level names the next non-zero word.
  uint64_t next;
  if (level + 1 < levels_.size()) {
    next = find_set(level + 1, wi + 1);
  } else {
    next = kNone;
    for (uint64_t i = wi + 1; i < w.size(); ++i)
      if (w[i]) {
        next = i;
        break;
      }
  }
  if (next == kNone || next >= w.size()) return kNone;
  return next * 64 + static_cast<uint64_t>(std::countr_zero(w[next]));
}

uint64_t DirtyBitmap::find_clear(uint64_t bit, uint64_t end_bit) const {
  const auto& w = levels_[0];
  while (bit < end_bit) {
    uint64_t m = ~w[bit / 64] & (kAll << (bit % 64));
    if (m) return std::min(end_bit, (bit / 64) * 64 + static_cast<uint64_t>(std::countr_zero(m)));
    bit = (bit / 64 + 1) * 64;
  }
  return end_bit;
}

std::optional<uint64_t> DirtyBitmap::next_dirty(uint64_t offset, uint64_t end) const {
  end = std::min(end, size_);
  if (offset >= end) return std::nullopt;
  uint64_t c = find_set(0, cluster_of(offset));
  if (c == kNone || c >= nbits_) return std::nullopt;
  uint64_t at = c << shift_;
  if (at >= end) return std::nullopt;
  return at;
}

std::optional<uint64_t> DirtyBitmap::next_clean(uint64_t offset, uint64_t end) const {
  end = std::min(end, size_);
  if (offset >= end) return std::nullopt;
  uint64_t end_bit = cluster_of(end - 1) + 1;
  uint64_t c = find_clear(cluster_of(offset), end_bit);
  if (c >= end_bit) return std::nullopt;
  return c << shift_;
}

bool DirtyBitmap::next_dirty_area(uint64_t offset, uint64_t end, uint64_t max_bytes, uint64_t& area_offset,
                                  uint64_t& area_bytes) const {
  end = std::min(end, size_);
  auto start = next_dirty(offset, end);
  if (!start) return false;
  uint64_t limit = end;
  if (max_bytes) {
    uint64_t cap = std::max(gran_, max_bytes & ~(gran_ - 1));
    limit = std::min(limit, *start + cap);
  }
  auto clean = next_clean(*start, limit);
  uint64_t stop = clean ? *clean : limit;
  area_offset = *start;
  area_bytes = stop - *start;
  return true;
}

uint64_t DirtyBitmap::count() const {
  if (dirty_bits_ == 0) return 0;
  uint64_t bytes = dirty_bits_ << shift_;
  // A dirty partial last cluster counts only its real bytes.
  if (nbits_ && get((nbits_ - 1) << shift_)) bytes -= gran_ - cluster_bytes(nbits_ - 1);
  return bytes;
}

uint64_t DirtyBitmap::count(uint64_t offset, uint64_t bytes) const {
  if (bytes == 0 || offset >= size_) return 0;
  uint64_t first = cluster_of(offset), last = cluster_of(std::min(size_, offset + bytes) - 1);
  const auto& w = levels_[0];
  uint64_t n = 0;
  for (uint64_t i = first / 64; i <= last / 64; ++i) {
    unsigned lo = i == first / 64 ? first % 64 : 0;
    unsigned hi = i == last / 64 ? last % 64 : 63;
    n += static_cast<uint64_t>(std::popcount(w[i] & mask(lo, hi)));
  }
  uint64_t out = n << shift_;
  if (last == nbits_ - 1 && get(last << shift_)) out -= gran_ - cluster_bytes(last);
  return out;
}

void DirtyBitmap::merge_from(const DirtyBitmap& src) {
  if (src.gran_ == gran_ && src.size_ == size_) {
    // Same layout: OR the leaf words, counting the new bits, and rebuild the
    // summary levels above the words that changed.
    const auto& sw = src.levels_[0];
    for (uint64_t i = 0; i < sw.size(); ++i) {
      uint64_t add = sw[i] & ~levels_[0][i];
      if (!add) continue;
      dirty_bits_ += static_cast<uint64_t>(std::popcount(add));
      levels_[0][i] |= add;
      if (levels_.size() > 1) set_bits(1, i, i);
    }
    return;
  }
  uint64_t pos = 0, off = 0, len = 0;
  while (src.next_dirty_area(pos, src.size_, 0, off, len)) {
    set(off, len);
    pos = off + len;
  }
}

}  // namespace vblk
