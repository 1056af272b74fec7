// qcow2 persistent dirty bitmaps: the `bitmaps` header extension, the bitmap
// directory, bitmap tables and data clusters (docs/interop/qcow2.txt), with
// QEMU's rules (block/qcow2-bitmap.c):
//
// - Open: bitmaps are loaded into the node's BitmapSet (persistent; enabled
//   if the entry has the `auto` flag). An entry already marked in_use was
//   not stored cleanly: it becomes an inconsistent bitmap without data. A
//   read-write open then marks every loaded entry in_use on disk (autoclear
//   bit dropped, directory rewritten in place, bit set again), so a crash
//   leaves them inconsistent instead of silently stale. An extension
//   without the autoclear bit was touched by a program that does not know
//   bitmaps: it is ignored (and dropped on a read-write open).
// - Close (read-write): every persistent, consistent bitmap is written to new
//   data clusters and a new table, then a new directory, then the header;
//   only after that are the old tables, data and directory freed. A crash in
//   between leaks clusters and never loses the previous state.
// - block-dirty-bitmap-remove of a stored bitmap rewrites the directory at
//   once and frees its clusters.
#include <fmt/format.h>

#include <bit>
#include <cstdio>

#include "drivers/qcow2/bitmap_format.h"
#include "drivers/qcow2/qcow2.h"
#include "vblk/buffer.h"

namespace vblk::qcow2 {

namespace {

uint64_t entry_size(size_t name_size, size_t extra_size) {
  return align_up(kBitmapDirEntrySize + name_size + extra_size, 8);
}
uint64_t entry_size(const BitmapDirEntry& e) { return entry_size(e.name.size(), e.extra.size()); }

// Bytes of the disk one bitmap data cluster covers.
uint64_t covered_bytes(uint64_t cs, unsigned gran_bits) { return (cs * 8) << gran_bits; }

// Entries of a bitmap table for a disk of `len` bytes.
uint64_t table_entries(uint64_t len, uint64_t cs, unsigned gran_bits) {
  uint64_t bits = (len + (1ull << gran_bits) - 1) >> gran_bits;
  return (bits + cs * 8 - 1) / (cs * 8);
}

}  // namespace

Task<Result<std::vector<BitmapDirEntry>>> Qcow2Node::read_bitmap_directory() {
  const auto& x = h_.bitmaps_extension;
  if (x.size() != 24) co_return Error(EINVAL, "bitmaps_ext: Invalid extension length");
  const uint32_t nb = be32(x.data());
  const uint64_t dir_size = be64(x.data() + 8), dir_offset = be64(x.data() + 16);
  if (be32(x.data() + 4) != 0) co_return Error(EINVAL, "bitmaps_ext: Reserved field is not zero");
  if (nb > kMaxBitmaps)
    co_return Error(EINVAL,
                    fmt::format("bitmaps_ext: File {} has {} bitmaps, exceeding the QEMU supported maximum of {}",
                                file_->filename(), nb, kMaxBitmaps));
  if (nb == 0) co_return Error(EINVAL, "found bitmaps extension with zero bitmaps");
  if (dir_offset % cs_) co_return Error(EINVAL, "bitmaps_ext: invalid bitmap directory offset");
  if (dir_size > kMaxBitmapDirectorySize)
    co_return Error(
        EINVAL, fmt::format("bitmaps_ext: bitmap directory size ({}) exceeds the maximum supported size ({})", dir_size,
                            kMaxBitmapDirectorySize));

  AlignedBuffer dir(align_up(std::max<uint64_t>(dir_size, 1), 512));
  dir.zero();
  auto st = co_await file_->read(dir_offset, dir.span());
  if (!st) co_return st.error().prefixed("Failed to read bitmap directory");
  // QEMU's bitmap_list_load: its checks in its order, with its messages.
  std::vector<BitmapDirEntry> entries;
  uint64_t pos = 0;
  while (pos < dir_size) {
    if (pos + 24 > dir_size) co_return Error(EINVAL, "Broken bitmap directory");
    if (entries.size() >= nb) co_return Error(EINVAL, "More bitmaps found than specified in header extension");
    const uint8_t* p = dir.data() + pos;
    BitmapDirEntry e;
    e.table_offset = be64(p);
    e.table_size = be32(p + 8);
    e.flags = be32(p + 12);
    e.type = p[16];
    e.granularity_bits = p[17];
    const uint16_t name_size = be16(p + 18);
    const uint32_t extra_size = be32(p + 20);
    if (pos + entry_size(name_size, extra_size) > dir_size) co_return Error(EINVAL, "Broken bitmap directory");
    if (extra_size) co_return Error(EINVAL, "Bitmap extra data is not supported");
    e.name.assign(reinterpret_cast<const char*>(p + 24), name_size);
    // QEMU's check_dir_entry.
    const uint64_t phys = uint64_t{e.table_size} * cs_;
    bool bad = e.table_size == 0 || e.table_offset == 0 || e.table_offset % cs_ || e.table_size > kBmeMaxTableSize ||
               e.granularity_bits > kBmeMaxGranularityBits || e.granularity_bits < kBmeMinGranularityBits ||
               (e.flags & kBmeReservedFlags) || name_size > kBmeMaxNameSize || e.type != kDirtyTrackingBitmap ||
               phys > kBmeMaxPhysSize || (!(e.flags & kBmeInUse) && length() > ((phys * 8) << e.granularity_bits));
    if (bad) co_return Error(EINVAL, "Bitmap '" + e.name + "' doesn't satisfy the constraints");
    entries.push_back(std::move(e));
    pos += entry_size(name_size, extra_size);
  }
  if (entries.size() != nb) co_return Error(EINVAL, "Less bitmaps found than specified in header extension");
  if (pos != dir_size) co_return Error(EINVAL, "Broken bitmap directory");
  co_return entries;
}

bool Qcow2Node::table_past_eof(const BitmapDirEntry& e) const {
  // As check counts references: a last cluster partly beyond the end is
  // fine, a whole one is not.
  const uint64_t end = e.table_offset + uint64_t{e.table_size} * 8;
  return end >= file_->length() + cs_ || end < e.table_offset;
}

Task<Status> Qcow2Node::load_bitmaps(bool ro) {
  stored_bitmaps_.clear();
  if (!h_.has_bitmaps_extension) co_return Status{};
  if (!(h_.autoclear_features & kAutoclearBitmaps)) {
    std::fprintf(stderr,
                 "warning: a program lacking bitmap support modified this file, so all bitmaps are now considered "
                 "inconsistent\nSome clusters may be leaked, run 'qemu-img check -r' on the image file to fix.\n");
    if (!ro) {
      auto g = co_await lock_.scoped();
      h_.has_bitmaps_extension = false;
      h_.bitmaps_extension.clear();
      VBLK_CO_TRY(co_await write_header());
    }
    co_return Status{};
  }
  auto dir = co_await read_bitmap_directory();
  if (!dir) co_return dir.take_error();
  std::vector<BitmapDirEntry> entries = std::move(*dir);
  const uint64_t dir_offset = be64(h_.bitmaps_extension.data() + 16);
  bool needs_update = false;
  AlignedBuffer table_buf(cs_), data(cs_);
  for (auto& e : entries) {
    auto b = std::make_unique<NamedBitmap>(e.name, length(), uint64_t{1} << e.granularity_bits);
    b->persistent = true;
    b->enabled = e.flags & kBmeAuto;
    b->readonly = ro;
    if (!(e.flags & kBmeInUse) && table_past_eof(e)) {
      // QEMU reads the missing table as zeroes: a clean bitmap, so the next
      // incremental backup would miss every write it recorded. Its data is
      // gone: it is inconsistent (in_use on disk too), and `check -r all`
      // removes it.
      b->inconsistent = true;
      b->enabled = false;
      if (!ro) {
        e.flags |= kBmeInUse;
        needs_update = true;
      }
    } else if (e.flags & kBmeInUse) {
      // Data is unusable: it was not stored after the last change. QEMU's
      // bdrv_dirty_bitmap_set_inconsistent also stops it recording.
      b->inconsistent = true;
      b->enabled = false;
    } else {
      const uint64_t n = table_entries(length(), cs_, e.granularity_bits);
      const uint64_t cover = covered_bytes(cs_, e.granularity_bits);
      AlignedBuffer tb(align_up(uint64_t{e.table_size} * 8, 512));
      auto rt = co_await file_->read(e.table_offset, tb.span());
      if (!rt)
        co_return rt.error().prefixed("Could not read bitmap_table table from image for bitmap '" + e.name + "'");
      // QEMU's bitmap_table_load checks every entry, then load_bitmap_data
      // wants exactly the table this disk needs: anything else is refused
      // before the image is touched.
      for (uint64_t i = 0; i < e.table_size; ++i) {
        uint64_t ent = be64(tb.data() + i * 8);
        uint64_t off = ent & kBmeOffsetMask;
        if ((ent & kBmeReservedMask) || (off && ((ent & kBmeAllOnes) || off % cs_)))
          co_return Error(EINVAL,
                          "Could not read bitmap_table table from image for bitmap '" + e.name + "': Invalid argument");
      }
      if (n != e.table_size)
        co_return Error(EINVAL, "Could not read bitmap '" + e.name + "' from image: Invalid argument");
      for (uint64_t i = 0; i < n; ++i) {
        uint64_t ent = be64(tb.data() + i * 8);
        uint64_t off = ent & kBmeOffsetMask;
        uint64_t base = i * cover;
        if (off == 0) {
          if (ent & kBmeAllOnes) b->bits.set(base, cover);
          continue;
        }
        auto rd = co_await file_->read(off, data.span());
        if (!rd) co_return rd.error().prefixed("Could not read bitmap data");
        // Bits little-endian within each byte: bit k covers base + k << granularity.
        const uint64_t nbits =
            std::min<uint64_t>(cs_ * 8, (length() - base + (1ull << e.granularity_bits) - 1) >> e.granularity_bits);
        uint64_t run = UINT64_MAX;
        for (uint64_t k = 0; k <= nbits; ++k) {
          bool set = k < nbits && ((data.data()[k / 8] >> (k % 8)) & 1);
          if (k < nbits && k % 8 == 0 && data.data()[k / 8] == 0 && run == UINT64_MAX) {
            k += 7;
            continue;
          }
          if (set && run == UINT64_MAX) run = k;
          if (!set && run != UINT64_MAX) {
            b->bits.set(base + (run << e.granularity_bits), (k - run) << e.granularity_bits);
            run = UINT64_MAX;
          }
        }
      }
      if (!ro) {
        e.flags |= kBmeInUse;
        needs_update = true;
      }
    }
    bitmaps().adopt(std::move(b));
  }
  stored_bitmaps_ = std::move(entries);
  if (needs_update) {
    // Only the in-use flags change, in place, and nothing is written
    // through the bitmaps until this is on disk. QEMU's
    // update_ext_header_and_dir_in_place takes the header's autoclear bit
    // down around the directory write; cut between its two header writes
    // (power loss, or kill -9: scripts/kill_matrix.py hit it in 2 of 75
    // backups), the image keeps its bitmaps without the bit, and every
    // reader then ignores them: every backup chain of the image is lost.
    // Written in place with the bit up, a cut leaves each entry's flags old
    // or new (the other bytes are the same either way); an old flag is
    // still true, since no guest write has been made yet.
    auto g = co_await lock_.scoped();
    auto buf = serialize_bitmap_directory(stored_bitmaps_);
    auto st = co_await checked_write(kOlBitmapDirectory, dir_offset, {buf.data(), buf.size()});
    if (st) st = co_await flush_all();
    if (!st) co_return st.error().prefixed("Can't update bitmap directory");
  }
  co_return Status{};
}

std::vector<uint8_t> Qcow2Node::serialize_bitmap_directory(const std::vector<BitmapDirEntry>& dir) const {
  uint64_t size = 0;
  for (const auto& e : dir) size += entry_size(e);
  std::vector<uint8_t> buf(size, 0);
  uint64_t pos = 0;
  for (const auto& e : dir) {
    uint8_t* p = buf.data() + pos;
    put64(p, e.table_offset);
    put32(p + 8, e.table_size);
    put32(p + 12, e.flags);
    p[16] = e.type;
    p[17] = e.granularity_bits;
    put16(p + 18, static_cast<uint16_t>(e.name.size()));
    put32(p + 20, static_cast<uint32_t>(e.extra.size()));
    if (!e.extra.empty()) std::memcpy(p + 24, e.extra.data(), e.extra.size());
    std::memcpy(p + 24 + e.extra.size(), e.name.data(), e.name.size());
    pos += entry_size(e);
  }
  return buf;
}

Task<Status> Qcow2Node::write_bitmap_directory(std::vector<BitmapDirEntry> dir) {
  auto buf = serialize_bitmap_directory(dir);
  uint64_t where = 0;
  if (!dir.empty()) {
    auto r = co_await alloc_clusters(align_up(buf.size(), cs_) / cs_);
    if (!r) co_return r.take_error();
    where = *r;
    AlignedBuffer b(align_up(buf.size(), cs_));
    b.zero();
    std::memcpy(b.data(), buf.data(), buf.size());
    VBLK_CO_TRY(co_await checked_write(0, where, b.span()));
  }
  // Tables, data, directory and their refcounts on disk before the header
  // points at them.
  VBLK_CO_TRY(co_await flush_all());
  uint64_t old_offset = 0, old_size = 0;
  if (h_.has_bitmaps_extension && h_.bitmaps_extension.size() == 24 && (h_.autoclear_features & kAutoclearBitmaps)) {
    old_size = be64(h_.bitmaps_extension.data() + 8);
    old_offset = be64(h_.bitmaps_extension.data() + 16);
  }
  if (dir.empty()) {
    h_.has_bitmaps_extension = false;
    h_.bitmaps_extension.clear();
    h_.autoclear_features &= ~kAutoclearBitmaps;
  } else {
    h_.has_bitmaps_extension = true;
    h_.bitmaps_extension.assign(24, 0);
    put32(h_.bitmaps_extension.data(), static_cast<uint32_t>(dir.size()));
    put64(h_.bitmaps_extension.data() + 8, buf.size());
    put64(h_.bitmaps_extension.data() + 16, where);
    h_.autoclear_features |= kAutoclearBitmaps;
  }
  VBLK_CO_TRY(co_await write_header());
  stored_bitmaps_ = std::move(dir);
  if (old_size) VBLK_CO_TRY(co_await free_unreferenced(old_offset, old_size));
  co_return Status{};
}

Task<Status> Qcow2Node::free_bitmap_clusters(uint64_t table_offset, uint32_t table_size) {
  if (!table_offset || !table_size) co_return Status{};
  AlignedBuffer tb(align_up(uint64_t{table_size} * 8, 512));
  VBLK_CO_TRY(co_await file_->read(table_offset, tb.span()));
  for (uint32_t i = 0; i < table_size; ++i) {
    uint64_t off = be64(tb.data() + uint64_t{i} * 8) & kBmeOffsetMask;
    if (off) VBLK_CO_TRY(co_await free_unreferenced(off, cs_));
  }
  co_return co_await free_unreferenced(table_offset, uint64_t{table_size} * 8);
}

Task<Status> Qcow2Node::store_bitmaps() {
  std::vector<BitmapDirEntry> dir = stored_bitmaps_;
  struct Old {
    uint64_t offset;
    uint32_t size;
  };
  std::vector<Old> drop;
  bool need_write = false;
  AlignedBuffer data(cs_);
  // In the node's order (newest first): new entries join the directory in
  // that order, as QEMU's FOR_EACH_DIRTY_BITMAP appends them.
  for (const auto& bp : bitmaps().list()) {
    const NamedBitmap& b = *bp;
    if (!b.persistent || b.inconsistent || b.readonly) continue;
    need_write = true;
    const unsigned gb = static_cast<unsigned>(std::countr_zero(b.bits.granularity()));
    const uint64_t n = table_entries(b.bits.size(), cs_, gb);
    const uint64_t cover = covered_bytes(cs_, gb);
    std::vector<uint64_t> table(n, 0);
    const auto& words = b.bits.leaf_words();
    const uint64_t words_per_cluster = cs_ / 8;
    for (uint64_t i = 0; i < n; ++i) {
      if (!b.bits.next_dirty(i * cover, (i + 1) * cover)) continue;
      data.zero();
      for (uint64_t w = 0; w < words_per_cluster && i * words_per_cluster + w < words.size(); ++w)
        for (int j = 0; j < 8; ++j)
          data.data()[w * 8 + j] = static_cast<uint8_t>(words[i * words_per_cluster + w] >> (8 * j));
      auto r = co_await alloc_clusters(1);
      if (!r) co_return r.take_error();
      VBLK_CO_TRY(co_await checked_write(0, *r, data.span()));
      table[i] = *r;
    }
    const uint64_t tbytes = align_up(std::max<uint64_t>(n, 1) * 8, cs_);
    AlignedBuffer tb(tbytes);
    tb.zero();
    for (uint64_t i = 0; i < n; ++i) put64(tb.data() + i * 8, table[i]);
    auto r = co_await alloc_clusters(tbytes / cs_);
    if (!r) co_return r.take_error();
    VBLK_CO_TRY(co_await checked_write(0, *r, tb.span()));
    BitmapDirEntry* e = nullptr;
    for (auto& d : dir)
      if (d.name == b.name) e = &d;
    if (!e) {
      dir.push_back({});
      e = &dir.back();
      e->name = b.name;
    } else {
      drop.push_back({e->table_offset, e->table_size});
    }
    e->table_offset = *r;
    e->table_size = static_cast<uint32_t>(n);
    e->flags = b.enabled ? kBmeAuto : 0;
    e->type = kDirtyTrackingBitmap;
    e->granularity_bits = static_cast<uint8_t>(gb);
  }
  if (!need_write) co_return Status{};
  VBLK_CO_TRY(co_await write_bitmap_directory(std::move(dir)));
  // The directory no longer reaches the old tables.
  for (const auto& o : drop) VBLK_CO_TRY(co_await free_bitmap_clusters(o.offset, o.size));
  co_return co_await flush_all();
}

Status Qcow2Node::can_store_new_bitmap(const std::string& name, uint64_t granularity) const {
  auto fail = [&](const std::string& why) {
    return Error(EINVAL, "Can't make bitmap '" + name + "' persistent in '" + node_name() + "': " + why);
  };
  // A loaded bitmap of that name answers as creating it would (QEMU 7.2).
  if (bitmaps().find(name)) return Error(EEXIST, "Bitmap already exists: " + name);
  if (h_.version < 3) return fail("Cannot store dirty bitmaps in qcow2 v2 files");
  const unsigned gb = static_cast<unsigned>(std::countr_zero(granularity));
  if (gb > kBmeMaxGranularityBits)
    return fail(fmt::format("Granularity exceeds maximum ({} bytes)", 1ull << kBmeMaxGranularityBits));
  if (gb < kBmeMinGranularityBits)
    return fail(fmt::format("Granularity is under minimum ({} bytes)", 1ull << kBmeMinGranularityBits));
  const uint64_t bits = (length() + granularity - 1) / granularity;
  const uint64_t bitmap_bytes = (bits + 7) / 8;
  if (bitmap_bytes > kBmeMaxPhysSize || bitmap_bytes > kBmeMaxTableSize * cs_)
    return fail("Too much space will be occupied by the bitmap. Use larger granularity");
  if (name.size() > kBmeMaxNameSize)
    return fail(fmt::format("Name length exceeds maximum ({} characters)", kBmeMaxNameSize));
  if (stored_bitmaps_.empty()) return {};
  if (stored_bitmaps_.size() >= kMaxBitmaps) return fail("Maximum number of persistent bitmaps is already reached");
  uint64_t dir_size = 0;
  for (const auto& e : stored_bitmaps_) dir_size += entry_size(e);
  if (dir_size + entry_size(name.size(), 0) > kMaxBitmapDirectorySize)
    return fail("Not enough space in the bitmap directory");
  for (const auto& e : stored_bitmaps_)
    if (e.name == name) return fail("Bitmap with the same name is already stored");
  return {};
}

Task<Status> Qcow2Node::remove_persistent_bitmap(const std::string& name) {
  auto g = co_await lock_.scoped();
  std::vector<BitmapDirEntry> dir;
  const BitmapDirEntry* gone = nullptr;
  for (const auto& e : stored_bitmaps_) {
    if (e.name == name)
      gone = &e;
    else
      dir.push_back(e);
  }
  if (!gone) co_return Status{};  // never stored: nothing on disk
  const uint64_t offset = gone->table_offset;
  const uint32_t size = gone->table_size;
  VBLK_CO_TRY(co_await write_bitmap_directory(std::move(dir)));
  VBLK_CO_TRY(co_await free_bitmap_clusters(offset, size));
  co_return co_await flush_all();
}

Task<Result<std::vector<std::string>>> Qcow2Node::drop_bitmaps_past_eof() {
  std::vector<std::string> gone;
  std::vector<BitmapDirEntry> keep;
  // Check mode has not loaded the bitmaps: the directory is read here. One
  // that does not parse is the check's to report, not this repair's.
  if (!h_.has_bitmaps_extension || !(h_.autoclear_features & kAutoclearBitmaps)) co_return gone;
  auto dir = co_await read_bitmap_directory();
  if (!dir) co_return gone;
  for (const auto& e : *dir) {
    if (table_past_eof(e))
      gone.push_back(e.name);
    else
      keep.push_back(e);
  }
  if (gone.empty()) co_return gone;
  const uint64_t dir_offset = be64(h_.bitmaps_extension.data() + 16);
  // No allocation while check counts references: the shorter directory is
  // written where the old one was, with the autoclear bit down meanwhile
  // (QEMU's update_ext_header_and_dir_in_place). Clusters it no longer
  // needs are leaks for the same check to repair.
  h_.autoclear_features &= ~kAutoclearBitmaps;
  if (keep.empty()) {
    h_.has_bitmaps_extension = false;
    h_.bitmaps_extension.clear();
    VBLK_CO_TRY(co_await write_header());
  } else {
    VBLK_CO_TRY(co_await write_header());
    auto buf = serialize_bitmap_directory(keep);
    VBLK_CO_TRY(co_await checked_write(kOlBitmapDirectory, dir_offset, {buf.data(), buf.size()}));
    VBLK_CO_TRY(co_await flush_all());
    put32(h_.bitmaps_extension.data(), static_cast<uint32_t>(keep.size()));
    put64(h_.bitmaps_extension.data() + 8, buf.size());
    h_.autoclear_features |= kAutoclearBitmaps;
    VBLK_CO_TRY(co_await write_header());
  }
  VBLK_CO_TRY(co_await flush_all());
  if (!stored_bitmaps_.empty()) stored_bitmaps_ = std::move(keep);
  for (const auto& name : gone) bitmaps().remove(name);
  co_return gone;
}

std::vector<Qcow2BitmapInfo> Qcow2Node::bitmaps_info() const {
  std::vector<Qcow2BitmapInfo> list;
  for (const auto& e : stored_bitmaps_)
    list.push_back({.name = e.name,
                    .granularity = uint64_t{1} << e.granularity_bits,
                    .in_use = (e.flags & kBmeInUse) != 0,
                    .autoload = (e.flags & kBmeAuto) != 0});
  return list;
}

}  // namespace vblk::qcow2
