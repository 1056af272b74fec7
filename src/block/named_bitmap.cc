// Named dirty bitmaps of a node (see include/vblk/named_bitmap.h).
#include "vblk/named_bitmap.h"

#include <algorithm>
#include <cstring>

#include "util/sha256.h"

namespace vblk {

Status check_bitmap(const NamedBitmap& b, unsigned flags) {
  if ((flags & kBitmapBusy) && b.busy)
    return Error(EBUSY, "Bitmap '" + b.name + "' is currently in use by another operation and cannot be used");
  if ((flags & kBitmapRo) && b.readonly)
    return Error(EPERM, "Bitmap '" + b.name + "' is readonly and cannot be modified");
  if ((flags & kBitmapInconsistent) && b.inconsistent)
    // QEMU adds a hint ("Try block-dirty-bitmap-remove to delete this bitmap
    // from disk") that QMP does not show.
    return Error(EINVAL, "Bitmap '" + b.name + "' is inconsistent and cannot be used");
  return {};
}

NamedBitmap* BitmapSet::find(std::string_view name) const {
  for (auto& b : list_)
    if (b->name == name) return b.get();
  return nullptr;
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

void BitmapSet::resize(uint64_t size) {
  for (auto& b : list_) {
    if (b->bits.size() == size) continue;
    DirtyBitmap nb(size, b->bits.granularity());
    uint64_t pos = 0, off = 0, len = 0;
    while (b->bits.next_dirty_area(pos, b->bits.size(), 0, off, len)) {
      nb.set(off, len);
      pos = off + len;
    }
    b->bits = std::move(nb);
  }
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
