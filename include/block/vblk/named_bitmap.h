// NamedBitmap and BitmapSet: the named dirty bitmaps a node carries (QEMU's
// BdrvDirtyBitmap list on a BlockDriverState).
//
// Every node owns one BitmapSet. The generic request path (node.cc) marks
// every enabled bitmap of the node a write, write-zeroes, discard or copy
// offload reaches, at that node's offsets, so every driver gets dirty
// tracking without knowing about it. QMP's block-dirty-bitmap-* commands
// (src/qmp/commands_bitmap.cc) create, change and query them; persistent
// bitmaps are stored by the format (qcow2's `bitmaps` extension).
//
// Ownership: the set owns its bitmaps (unique_ptr, so a NamedBitmap* stays
// valid until that bitmap is removed). Thread-safety: none (the node's loop).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "vblk/dirty_bitmap.h"
#include "vblk/result.h"

namespace vblk {

// QEMU's BDRV_BITMAP_MAX_NAME_SIZE.
inline constexpr size_t kMaxBitmapNameSize = 1023;

struct NamedBitmap {
  NamedBitmap(std::string n, uint64_t size, uint64_t granularity) : name(std::move(n)), bits(size, granularity) {}

  std::string name;
  DirtyBitmap bits;
  bool enabled = true;        // writes mark it ("recording")
  bool persistent = false;    // the format stores it on close
  bool busy = false;          // an operation (a backup job) uses it
  bool readonly = false;      // loaded from an image opened read-only
  bool inconsistent = false;  // stored with in_use set: the image was not closed cleanly
  // While an operation (a backup with a bitmap) owns the bitmap: it is busy
  // and disabled, and this anonymous bitmap of the same set records writes
  // instead (QEMU's successor). The operation ends with abdicate_successor
  // or reclaim_successor.
  NamedBitmap* successor = nullptr;

  bool recording() const { return enabled || (successor && successor->enabled); }
};

// What an operation needs of a bitmap (QEMU's BdrvDirtyBitmap flags for
// bdrv_dirty_bitmap_check).
enum BitmapCheck : unsigned {
  kBitmapBusy = 1u << 0,
  kBitmapRo = 1u << 1,
  kBitmapInconsistent = 1u << 2,
  kBitmapDefault = kBitmapBusy | kBitmapRo | kBitmapInconsistent,
  kBitmapAllowRo = kBitmapBusy | kBitmapInconsistent,
};

// QEMU's bdrv_dirty_bitmap_check, with its messages ("Bitmap 'x' is
// currently in use by another operation and cannot be used", ...).
Status check_bitmap(const NamedBitmap& b, unsigned flags);

// bdrv_get_default_bitmap_granularity: the node's cluster size clamped to
// [4 KiB, 64 KiB] where it has one (cluster_size != 0), else 64 KiB.
uint64_t default_bitmap_granularity(uint64_t cluster_size);

// Merges `src` into `dst` (block-dirty-bitmap-merge's size check and text);
// `dst` is unchanged on error.
Status merge_bitmap(DirtyBitmap& dst, const DirtyBitmap& src);

class BitmapSet {
 public:
  // Newest first (QEMU inserts at the head of its list, and queries list
  // them in that order). Anonymous bitmaps (successors) have an empty name.
  const std::vector<std::unique_ptr<NamedBitmap>>& list() const { return list_; }
  bool empty() const { return list_.empty(); }
  // By name; never an anonymous bitmap.
  NamedBitmap* find(std::string_view name) const;
  // Whether the set has a named bitmap.
  bool has_named() const;

  // A new enabled, clean bitmap over `size` bytes. QEMU's
  // bdrv_create_dirty_bitmap errors: "Bitmap already exists: x",
  // "Bitmap name too long: x". `granularity` is a power of two.
  Result<NamedBitmap*> create(std::string name, uint64_t size, uint64_t granularity);
  // Adds a bitmap built elsewhere (loaded from an image) as the newest.
  NamedBitmap* adopt(std::unique_ptr<NamedBitmap> b);
  // false if there is no such bitmap.
  bool remove(std::string_view name);

  // QEMU's bdrv_dirty_bitmap_create_successor: `b` becomes busy and
  // disabled; a new anonymous bitmap (the newest of the set) records as `b`
  // did. Fails if `b` is busy.
  Status create_successor(NamedBitmap& b);
  // The operation succeeded: the successor takes `b`'s name and settings
  // and `b` goes (bdrv_dirty_bitmap_abdicate). Returns the bitmap now
  // carrying the name.
  NamedBitmap& abdicate_successor(NamedBitmap& b);
  // The operation failed or never meant to touch `b`: the successor's bits
  // are merged back into `b` and the successor goes (bdrv_reclaim_dirty_bitmap).
  NamedBitmap& reclaim_successor(NamedBitmap& b);

  // Marks [offset, offset+bytes) in every enabled bitmap.
  void mark(uint64_t offset, uint64_t bytes) {
    for (auto& b : list_)
      if (b->enabled) b->bits.set(offset, bytes);
  }
  // The node's length changed (truncate): bitmaps follow, keeping their bits
  // below the new size (QEMU's bdrv_dirty_bitmap_truncate).
  void resize(uint64_t size);

 private:
  std::vector<std::unique_ptr<NamedBitmap>> list_;
};

// SHA-256 of the bitmap's leaf words as QEMU's hbitmap_sha256 hashes them
// (at least one 64-bit word, little-endian), as lowercase hex: what
// x-debug-block-dirty-bitmap-sha256 answers.
std::string bitmap_sha256(const DirtyBitmap& b);

}  // namespace vblk
