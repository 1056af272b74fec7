// Named dirty bitmaps of a node (see include/block/vblk/named_bitmap.h).
#include "vblk/named_bitmap.h"

#include <algorithm>
#include <cstring>

#include "vblk/sha256.h"

namespace vblk {

Status check_bitmap(const NamedBitmap& b, unsigned flags) {
  if ((flags & kBitmapBusy) && b.busy)
    return Error(EBUSY, "Bitmap '" + b.name + "' is currently in use by another operation and cannot be used");
  if ((flags & kBitmapRo) && b.readonly)
    return Error(EPERM, "Bitmap '" + b.name + "' is readonly and cannot be modified");
  if ((flags & kBitmapInconsistent) && b.inconsistent) {
    // QEMU's hint: qemu-img prints it, QMP does not show it.
    Error e(EINVAL, "Bitmap '" + b.name + "' is inconsistent and cannot be used");
    e.hint = "Try block-dirty-bitmap-remove to delete this bitmap from disk";
    return e;
  }
  return {};
}

uint64_t default_bitmap_granularity(uint64_t cluster_size) {
  return cluster_size ? std::clamp<uint64_t>(cluster_size, 4096, 65536) : 65536;
}

Status merge_bitmap(DirtyBitmap& dst, const DirtyBitmap& src) {
  if (src.size() != dst.size())
    return Error(EINVAL, "Bitmaps are of different sizes (destination size is " + std::to_string(dst.size()) +
                             ", source size is " + std::to_string(src.size()) + ") and can't be merged");
  dst.merge_from(src);
  return {};
}

NamedBitmap* BitmapSet::find(std::string_view name) const {
  if (name.empty()) return nullptr;
  for (auto& b : list_)
    if (b->name == name) return b.get();
  return nullptr;
}

bool BitmapSet::has_named() const {
  return std::any_of(list_.begin(), list_.end(), [](auto& b) { return !b->name.empty(); });
}

Result<NamedBitmap*> BitmapSet::create(std::string name, uint64_t size, uint64_t granularity) {
  if (find(name)) return Error(EEXIST, "Bitmap already exists: " + name);
  if (name.size() > kMaxBitmapNameSize) return Error(EINVAL, "Bitmap name too long: " + name);
  return adopt(std::make_unique<NamedBitmap>(std::move(name), size, granularity));
}

NamedBitmap* BitmapSet::adopt(std::unique_ptr<NamedBitmap> b) {
  list_.insert(list_.begin(), std::move(b));
  return list_.front().get();
}

bool BitmapSet::remove(std::string_view name) {
  auto it = std::find_if(list_.begin(), list_.end(), [&](auto& b) { return b->name == name; });
  if (it == list_.end()) return false;
  list_.erase(it);
  return true;
}

namespace {
void resize_bits(DirtyBitmap& bits, uint64_t size) {
  if (bits.size() == size) return;
  DirtyBitmap nb(size, bits.granularity());
  uint64_t pos = 0, off = 0, len = 0;
  while (bits.next_dirty_area(pos, bits.size(), 0, off, len)) {
    nb.set(off, len);
    pos = off + len;
  }
  bits = std::move(nb);
}
}  // namespace

void BitmapSet::resize(uint64_t size) {
  for (auto& b : list_) resize_bits(b->bits, size);
}

Status BitmapSet::create_successor(NamedBitmap& b) {
  VBLK_TRY(check_bitmap(b, kBitmapBusy));
  if (b.successor) return Error(EBUSY, "Cannot create a successor for a bitmap that already has one");
  NamedBitmap* child = adopt(std::make_unique<NamedBitmap>(std::string(), b.bits.size(), b.bits.granularity()));
  child->enabled = b.enabled;
  b.successor = child;
  b.busy = true;
  b.enabled = false;
  return {};
}

NamedBitmap& BitmapSet::abdicate_successor(NamedBitmap& b) {
  NamedBitmap* child = b.successor;
  if (!child) return b;
  child->name = b.name;
  child->persistent = b.persistent;
  child->readonly = b.readonly;
  b.successor = nullptr;
  auto it = std::find_if(list_.begin(), list_.end(), [&](auto& p) { return p.get() == &b; });
  if (it != list_.end()) list_.erase(it);
  return *child;
}

NamedBitmap& BitmapSet::reclaim_successor(NamedBitmap& b) {
  NamedBitmap* child = b.successor;
  if (!child) return b;
  b.bits.merge_from(child->bits);
  b.enabled = child->enabled;
  b.successor = nullptr;
  b.busy = false;
  auto it = std::find_if(list_.begin(), list_.end(), [&](auto& p) { return p.get() == child; });
  if (it != list_.end()) list_.erase(it);
  return b;
}

std::string bitmap_sha256(const DirtyBitmap& b) {
  // QEMU hashes its leaf array of unsigned longs (64-bit, little-endian on
  // the hosts vblk runs on); an empty bitmap still has one word.
  const auto& w = b.leaf_words();
  std::vector<uint8_t> bytes(std::max<size_t>(w.size(), 1) * 8, 0);
  for (size_t i = 0; i < w.size(); ++i)
    for (int j = 0; j < 8; ++j) bytes[i * 8 + j] = static_cast<uint8_t>(w[i] >> (8 * j));
  return sha256_hex(bytes);
}

}  // namespace vblk
