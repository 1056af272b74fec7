// DirtyBitmap: which clusters of a disk are "dirty" (still to copy, or
// written since some point), one bit per `granularity` bytes.
//
// The API speaks bytes; a range sets or resets every cluster it touches, so
// callers that reset must pass cluster-aligned ranges (the block-copy engine
// always does). The bitmap is hierarchical, like QEMU's HBitmap: level 0 holds
// one bit per cluster, and each level above holds one bit per 64-bit word of
// the level below, set iff that word is non-zero. Finding the next dirty
// cluster therefore skips clean regions 64^k clusters at a time, so a scan of
// a nearly clean multi-TiB disk costs microseconds, and set/reset/count stay
// O(words touched). Memory: size/granularity/8 bytes plus ~1/63 of that for
// the upper levels (4 TiB at 64 KiB clusters: 8 MiB).
//
// Ownership: plain value type. Thread-safety: none (one loop owns it).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace vblk {

class DirtyBitmap {
 public:
  // granularity must be a power of two; size may be any byte count (the last
  // cluster may be partial).
  DirtyBitmap(uint64_t size, uint64_t granularity);

  uint64_t size() const { return size_; }
  uint64_t granularity() const { return gran_; }

  // Marks / clears every cluster that [offset, offset+bytes) touches (clamped
  // to size).
  void set(uint64_t offset, uint64_t bytes);
  void reset(uint64_t offset, uint64_t bytes);
  void set_all() { set(0, size_); }
  void reset_all() { reset(0, size_); }

  // Is the cluster containing offset dirty?
  bool get(uint64_t offset) const;

  // First dirty byte (cluster start, at least `offset` rounded down to its
  // cluster) in [offset, end), or nullopt.
  std::optional<uint64_t> next_dirty(uint64_t offset, uint64_t end) const;
  // First clean cluster start in [offset, end), or nullopt.
  std::optional<uint64_t> next_clean(uint64_t offset, uint64_t end) const;

  // The first dirty run in [offset, end), at most max_bytes long (0: no cap;
  // a non-zero cap is rounded down to whole clusters, at least one). Returns
  // false if nothing in the range is dirty. The run ends at `end` or size at
  // the latest.
  bool next_dirty_area(uint64_t offset, uint64_t end, uint64_t max_bytes, uint64_t& area_offset,
                       uint64_t& area_bytes) const;

  // Dirty bytes in the whole bitmap (a partial last cluster counts as its
  // real length), kept up to date on every change: O(1).
  uint64_t count() const;
  // Dirty bytes in [offset, offset+bytes), counted by whole clusters clamped
  // to the range's cluster-aligned hull and to size.
  uint64_t count(uint64_t offset, uint64_t bytes) const;
  // Dirty clusters (whole bits; QEMU's hbitmap counts `count << granularity`).
  uint64_t dirty_clusters() const { return dirty_bits_; }

  // The leaf level: bit i of word i/64 is cluster i (QEMU's HBitmap keeps
  // the same layout, which x-debug-block-dirty-bitmap-sha256 hashes).
  const std::vector<uint64_t>& leaf_words() const { return levels_[0]; }

  // Marks every cluster of `this` that a dirty area of `src` touches (QEMU's
  // hbitmap_merge: sizes should match; granularities may differ).
  void merge_from(const DirtyBitmap& src);

 private:
  static constexpr uint64_t kNone = ~0ull;
  uint64_t cluster_of(uint64_t offset) const { return offset >> shift_; }
  void set_bits(unsigned level, uint64_t first, uint64_t last);    // inclusive bit indices
  void reset_bits(unsigned level, uint64_t first, uint64_t last);  // inclusive bit indices
  uint64_t find_set(unsigned level, uint64_t bit) const;           // kNone if none
  uint64_t find_clear(uint64_t bit, uint64_t end_bit) const;       // level 0 only, end_bit if none
  uint64_t cluster_bytes(uint64_t cluster) const;

  uint64_t size_;
  uint64_t gran_;
  unsigned shift_;
  uint64_t nbits_;                             // clusters
  uint64_t dirty_bits_ = 0;                    // set bits at level 0
  std::vector<std::vector<uint64_t>> levels_;  // levels_[0] is the leaf
};

}  // namespace vblk
