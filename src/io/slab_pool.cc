#include "vblk/slab_pool.h"

#include <algorithm>
#include <bit>

namespace vblk {

namespace {
constexpr size_t kSlab = 2 << 20;  // one transparent huge page
}  // namespace

SlabPool::SlabPool(size_t min_piece) : min_piece_(std::bit_ceil(std::max<size_t>(min_piece, kDefaultBufferAlign))) {}

size_t SlabPool::piece_size(size_t bytes) const { return std::bit_ceil(std::max(bytes, min_piece_)); }

std::span<uint8_t> SlabPool::take(size_t bytes) {
  const size_t piece = piece_size(bytes);
  std::vector<uint8_t*>& list = free_[piece];
  if (list.empty()) {
    // A huge page cut into pieces, or one piece of its own when larger
    // (AlignedBuffer::huge aligns both to 2 MiB).
    const size_t slab = std::max(piece, kSlab);
    slabs_.push_back(AlignedBuffer::huge(slab));
    slab_bytes_ += slab;
    uint8_t* base = slabs_.back().data();
    for (size_t off = 0; off + piece <= slab; off += piece) list.push_back(base + off);
    // Hand out the lowest address first: the pieces of one huge page are
    // used together.
    std::reverse(list.begin(), list.end());
  }
  uint8_t* p = list.back();
  list.pop_back();
  return {p, bytes};
}

void SlabPool::give(std::span<uint8_t> piece) { free_[piece_size(piece.size())].push_back(piece.data()); }

}  // namespace vblk
