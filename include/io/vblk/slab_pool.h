// SlabPool: recycled I/O buffers cut from 2 MiB huge-page slabs, in
// power-of-two size classes.
//
// Why classes: a pool of one piece size (the largest chunk, 1 MiB) hands a
// 64 KiB request a 1 MiB piece, and 64 workers copying the scattered 64 KiB
// clusters of an incremental backup then touch 64 MiB of fresh memory. The
// kernel zeroes each huge page on first touch, which under virtualisation
// costs milliseconds per page (measured: 15 % of the daemon's CPU in
// clear_page for a 410 MiB incremental backup). With classes the same
// workers touch 4 MiB.
//
// Ownership: the pool owns every slab until it is destroyed; take() lends a
// piece, give() returns it (with the same size that take() was asked for).
// Pieces in use are bounded by their callers (block-copy's memory budget),
// so the slabs are too: at most one budget per class in use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "vblk/buffer.h"

namespace vblk {

class SlabPool {
 public:
  // Pieces are at least min_piece bytes (a power of two, at least 4 KiB,
  // which also makes every piece that aligned).
  explicit SlabPool(size_t min_piece = 64 << 10);
  SlabPool(const SlabPool&) = delete;
  SlabPool& operator=(const SlabPool&) = delete;

  std::span<uint8_t> take(size_t bytes);
  void give(std::span<uint8_t> piece);

  size_t slab_bytes() const { return slab_bytes_; }  // memory mapped so far

 private:
  size_t piece_size(size_t bytes) const;

  size_t min_piece_;
  size_t slab_bytes_ = 0;
  std::vector<AlignedBuffer> slabs_;
  std::map<size_t, std::vector<uint8_t*>> free_;  // piece size -> free pieces
};

}  // namespace vblk
