// Metadata overlap protection (QEMU's qcow2 `overlap-check`): which kinds of
// metadata a write into the image file must not touch, the option that
// chooses them, and the in-memory indexes that make the check cheap.
//
// QEMU walks the active L1 table and the refcount table on every write; a
// data write here costs a few comparisons and two binary searches instead:
// the one-cluster structures (L2 tables, refcount blocks) are kept as sorted
// cluster lists, rebuilt only when an offset in the table that points to them
// changed (OffsetTable counts such changes), never on a data write.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vblk/options.h"
#include "vblk/result.h"

namespace vblk::qcow2 {

// QEMU's QCow2MetadataOverlap bits, in its bit order.
enum Overlap : uint32_t {
  kOlMainHeader = 1u << 0,
  kOlActiveL1 = 1u << 1,
  kOlActiveL2 = 1u << 2,
  kOlRefcountTable = 1u << 3,
  kOlRefcountBlock = 1u << 4,
  kOlSnapshotTable = 1u << 5,
  kOlInactiveL1 = 1u << 6,
  kOlInactiveL2 = 1u << 7,
  kOlBitmapDirectory = 1u << 8,
};
constexpr int kOlBits = 9;
// "constant": what is known without reading anything; "cached": plus what is
// in memory anyway; "all": plus the snapshots' L2 tables.
constexpr uint32_t kOlConstant = kOlMainHeader | kOlActiveL1 | kOlRefcountTable | kOlSnapshotTable;
constexpr uint32_t kOlCached = kOlConstant | kOlActiveL2 | kOlRefcountBlock | kOlInactiveL1 | kOlBitmapDirectory;
constexpr uint32_t kOlAll = kOlCached | kOlInactiveL2;

// The name QEMU's message uses for one bit ("active L2 table").
const char* overlap_name(uint32_t bit);

// Takes `overlap-check` (a mode, or an object with `template` and per-kind
// booleans), `overlap-check.template` and `overlap-check.<kind>` from the
// qcow2 options; the result is the set of kinds to check. Errors are QEMU's.
Result<uint32_t> take_overlap_options(Json& opts);

// The active L1 table or the refcount table in memory. Entries are read
// freely and written through set()/assign(), which count changes of the
// offsets (not of flags) so indexes derived from them know when to rebuild.
class OffsetTable {
 public:
  explicit OffsetTable(uint64_t offset_mask) : mask_(offset_mask) {}
  uint64_t operator[](size_t i) const { return v_[i]; }
  size_t size() const { return v_.size(); }
  bool empty() const { return v_.empty(); }
  auto begin() const { return v_.begin(); }
  auto end() const { return v_.end(); }
  const std::vector<uint64_t>& vec() const { return v_; }
  operator const std::vector<uint64_t>&() const { return v_; }

  void set(size_t i, uint64_t v) {
    if ((v_[i] ^ v) & mask_) ++generation_;
    v_[i] = v;
  }
  void assign(std::vector<uint64_t> v) {
    v_ = std::move(v);
    ++generation_;
  }
  void resize(size_t n) {
    v_.resize(n, 0);
    ++generation_;
  }
  uint64_t generation() const { return generation_; }

 private:
  std::vector<uint64_t> v_;
  uint64_t mask_;
  uint64_t generation_ = 1;
};

// A set of host clusters (by index), sorted: does [first, last] hit one?
class ClusterSet {
 public:
  void rebuild(const std::vector<uint64_t>& entries, uint64_t mask, uint32_t cluster_bits);
  void clear() { v_.clear(); }
  void add(uint64_t cluster) { v_.push_back(cluster); }
  void sort();
  bool hits(uint64_t first, uint64_t last) const;
  uint64_t built_from = 0;  // the OffsetTable generation it was built from

 private:
  std::vector<uint64_t> v_;
};

// Byte ranges of one kind (the snapshots' L1 tables): does a range hit one?
class RangeSet {
 public:
  void clear() { r_.clear(); }
  void add(uint64_t start, uint64_t len) {
    if (len) r_.emplace_back(start, start + len);
  }
  void sort();  // after adding: by start, with the running maximum of ends
  bool hits(uint64_t start, uint64_t end) const;

 private:
  std::vector<std::pair<uint64_t, uint64_t>> r_;  // [start, end)
  std::vector<uint64_t> max_end_;                 // max end of r_[0..i]
};

}  // namespace vblk::qcow2
