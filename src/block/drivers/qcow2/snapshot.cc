// Internal snapshots (qcow2.txt "Snapshots"; QEMU's block/qcow2-snapshot.c).
//
// A snapshot is an entry in the snapshot table naming a copy of the active
// L1 table. Creating one shares every L2 table and data cluster between the
// two L1 tables (refcounts go up by one per L1 table that reaches them) and
// clears OFLAG_COPIED in the active tables, so the next write copies instead
// of writing in place (l2_for_write copies a shared L2 table; write_cluster_run
// allocates for a data cluster without COPIED).
//
// Crash safety: a step that makes something reachable comes after the
// refcounts that cover it are on disk; a step that frees comes after the
// commit that makes it unreachable. The commit points are the synced writes
// of the header (snapshot table pointer) and of the active L1 table. Where
// two on-disk structures must change together (COPIED flags in L1/L2 and
// refcounts in refcount blocks) the order is always the conservative one: a
// crash can leave a cluster with refcount one and no COPIED flag (an
// unneeded copy on the next write, reported by qemu-img check as an
// OFLAG_COPIED error and repaired by -r all), never a COPIED flag on a
// shared cluster.
#include <fmt/format.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "drivers/qcow2/qcow2.h"
#include "drivers/qcow2/table_reader.h"
#include "vblk/buffer.h"

namespace vblk::qcow2 {

namespace {

Status validate_l1(uint64_t offset, uint64_t entries, uint64_t cs, const char* name) {
  if (entries > kMaxL1Bytes / 8) return Error(EFBIG, fmt::format("{} too large", name));
  if (static_cast<uint64_t>(INT64_MAX) - entries * 8 < offset || offset % cs)
    return Error(EINVAL, fmt::format("{} offset invalid", name));
  return {};
}

uint64_t entry_bytes(const Snapshot& sn) {
  return kSnapshotHeaderBytes + std::max(kSnapshotExtraBytes, sn.extra_data_size) + sn.id.size() + sn.name.size();
}

}  // namespace

// ---- the table

Task<Status> Qcow2Node::read_snapshots() {
  snapshots_.clear();
  snapshots_size_ = 0;
  const uint64_t start = h_.snapshots_offset;
  uint64_t offset = start, table_length = 0;
  TableReader table(*file_);
  auto fail = [](const Error& e) {
    return Error(e.code, std::string("Failed to read snapshot table: ") + std::strerror(e.code));
  };
  for (uint32_t i = 0; i < h_.nb_snapshots; ++i) {
    table_length = align_up(table_length, 8);
    offset = align_up(offset, 8);
    uint8_t h[kSnapshotHeaderBytes];
    auto st = co_await table.read(offset, {h, sizeof h});
    if (!st) co_return fail(st.error());
    offset += sizeof h;
    Snapshot sn;
    sn.l1_table_offset = be64(h);
    sn.l1_size = be32(h + 8);
    const uint16_t id_size = be16(h + 12), name_size = be16(h + 14);
    sn.date_sec = be32(h + 16);
    sn.date_nsec = be32(h + 20);
    sn.vm_clock_nsec = be64(h + 24);
    sn.vm_state_size = be32(h + 32);
    sn.extra_data_size = be32(h + 36);
    if (sn.extra_data_size > kMaxSnapshotExtraData)
      co_return Error(EFBIG, fmt::format("Too much extra metadata in snapshot table entry {}\n"
                                         "You can force-remove this extra metadata with qemu-img check -r all",
                                         i));
    uint8_t extra[kSnapshotExtraBytes] = {};
    const uint32_t known = std::min(kSnapshotExtraBytes, sn.extra_data_size);
    if (known) {
      st = co_await table.read(offset, {extra, known});
      if (!st) co_return fail(st.error());
    }
    offset += known;
    if (sn.extra_data_size >= 8) sn.vm_state_size = be64(extra);
    sn.disk_size = sn.extra_data_size >= 16 ? be64(extra + 8) : length();
    sn.icount = sn.extra_data_size >= 24 ? be64(extra + 16) : UINT64_MAX;
    if (sn.extra_data_size > kSnapshotExtraBytes) {
      sn.unknown_extra.resize(sn.extra_data_size - kSnapshotExtraBytes);
      st = co_await table.read(offset, sn.unknown_extra);
      if (!st) co_return fail(st.error());
      offset += sn.unknown_extra.size();
    }
    std::vector<uint8_t> names(size_t{id_size} + name_size);
    if (!names.empty()) {
      st = co_await table.read(offset, names);
      if (!st) co_return fail(st.error());
    }
    // C strings in QEMU: a NUL ends them early.
    sn.id = std::string(reinterpret_cast<const char*>(names.data()), id_size).c_str();
    sn.name = std::string(reinterpret_cast<const char*>(names.data()) + id_size, name_size).c_str();
    offset += names.size();
    table_length += kSnapshotHeaderBytes + sn.extra_data_size + id_size + name_size;
    if (table_length > kMaxSnapshotsBytes || offset - start > static_cast<uint64_t>(INT_MAX))
      co_return Error(EFBIG, fmt::format("Snapshot table is too big\n"
                                         "You can force-remove all {} overhanging snapshots with qemu-img check -r all",
                                         h_.nb_snapshots - i));
    snapshots_.push_back(std::move(sn));
  }
  snapshots_size_ = offset - start;
  co_return co_await index_snapshots();
}

Task<Status> Qcow2Node::write_snapshots(std::vector<Snapshot> table) {
  uint64_t size = 0;
  for (const auto& sn : table) {
    size = align_up(size, 8) + entry_bytes(sn);
    if (size > kMaxSnapshotsBytes) co_return Error(EFBIG);
  }
  AlignedBuffer buf(std::max<uint64_t>(align_up(size, cs_), 512));
  buf.zero();
  uint64_t p = 0;
  for (const auto& sn : table) {
    p = align_up(p, 8);
    uint8_t* h = buf.data() + p;
    put64(h, sn.l1_table_offset);
    put32(h + 8, sn.l1_size);
    put16(h + 12, static_cast<uint16_t>(sn.id.size()));
    put16(h + 14, static_cast<uint16_t>(sn.name.size()));
    put32(h + 16, sn.date_sec);
    put32(h + 20, sn.date_nsec);
    put64(h + 24, sn.vm_clock_nsec);
    // A VM state too big for 32 bits reads as "none" to old readers.
    put32(h + 32, sn.vm_state_size <= 0xffffffffull ? static_cast<uint32_t>(sn.vm_state_size) : 0);
    put32(h + 36, std::max(kSnapshotExtraBytes, sn.extra_data_size));
    p += kSnapshotHeaderBytes;
    put64(buf.data() + p, sn.vm_state_size);
    put64(buf.data() + p + 8, sn.disk_size);
    put64(buf.data() + p + 16, sn.icount);
    p += kSnapshotExtraBytes;
    if (!sn.unknown_extra.empty()) std::memcpy(buf.data() + p, sn.unknown_extra.data(), sn.unknown_extra.size());
    p += sn.unknown_extra.size();
    std::memcpy(buf.data() + p, sn.id.data(), sn.id.size());
    p += sn.id.size();
    std::memcpy(buf.data() + p, sn.name.data(), sn.name.size());
    p += sn.name.size();
  }
  // New clusters, their refcounts on disk, then the table, then the header.
  uint64_t where = 0;
  if (size) {
    auto r = co_await alloc_clusters(align_up(size, cs_) / cs_);
    if (!r) co_return r.take_error();
    where = *r;
    VBLK_CO_TRY(co_await flush_all());
    VBLK_CO_TRY(co_await checked_write(0, where, buf.span().subspan(0, align_up(size, cs_))));
    VBLK_CO_TRY(co_await file_->flush());
  }
  uint8_t hd[12];
  put32(hd, static_cast<uint32_t>(table.size()));
  put64(hd + 4, where);
  VBLK_CO_TRY(co_await file_->write(60, {hd, sizeof hd}, kReqFua));
  VBLK_CO_TRY(co_await file_->flush());
  const uint64_t old = h_.snapshots_offset, old_size = snapshots_size_;
  h_.nb_snapshots = static_cast<uint32_t>(table.size());
  h_.snapshots_offset = where;
  snapshots_ = std::move(table);
  snapshots_size_ = size;
  vmstate_l1_from_ = 0;  // a new snapshot may reuse a freed table's place
  VBLK_CO_TRY(co_await index_snapshots());
  // The old table is unreachable now (a crash before this only leaks it).
  if (old_size) VBLK_CO_TRY(co_await free_unreferenced(old, old_size));
  co_return Status{};
}

std::vector<SnapshotInfo> Qcow2Node::snapshots() const {
  std::vector<SnapshotInfo> out;
  for (const auto& sn : snapshots_)
    out.push_back(SnapshotInfo{.id = sn.id,
                               .name = sn.name,
                               .vm_state_size = sn.vm_state_size,
                               .date_sec = sn.date_sec,
                               .date_nsec = sn.date_nsec,
                               .vm_clock_nsec = sn.vm_clock_nsec,
                               .icount = sn.icount});
  return out;
}

int Qcow2Node::find_snapshot(const std::string& id, const std::string& name) const {
  for (size_t i = 0; i < snapshots_.size(); ++i) {
    const auto& sn = snapshots_[i];
    if ((id.empty() || sn.id == id) && (name.empty() || sn.name == name)) return static_cast<int>(i);
  }
  return -1;
}

// ---- refcounts and flags

Task<Status> Qcow2Node::free_unreferenced(uint64_t offset, uint64_t length) {
  // QEMU's qcow2_free_clusters: a refcount that would drop below zero is
  // reported and the whole range left alone; it is not fatal.
  for (uint64_t ci = offset / cs_; ci <= (offset + length - 1) / cs_; ++ci) {
    auto rc = co_await get_refcount(ci);
    if (!rc) co_return rc.take_error();
    if (*rc == 0) {
      std::fprintf(stderr, "qcow2_free_clusters failed: %s\n", std::strerror(EINVAL));
      co_return Status{};
    }
  }
  co_return co_await update_refcount(offset, length, -1);
}

Task<Result<std::vector<uint64_t>>> Qcow2Node::read_l1(uint64_t offset, uint32_t size) {
  std::vector<uint64_t> l1(size, 0);
  if (!size) co_return l1;
  AlignedBuffer b(align_up(uint64_t{size} * 8, 512));
  VBLK_CO_TRY(co_await file_->read(offset, b.span()));
  for (uint32_t i = 0; i < size; ++i) l1[i] = be64(b.data() + uint64_t{i} * 8);
  co_return l1;
}

Task<Status> Qcow2Node::write_l1_table(uint32_t ign) {
  AlignedBuffer b(align_up(std::max<uint64_t>(l1_.size() * 8, 1), 512));
  b.zero();
  for (size_t i = 0; i < l1_.size(); ++i) put64(b.data() + i * 8, l1_[i]);
  co_return co_await checked_write(kOlActiveL1 | ign, h_.l1_table_offset, b.span(), kReqFua);
}

Task<Status> Qcow2Node::flush_all() {
  VBLK_CO_TRY(co_await l2_cache_->write_dirty());  // dependencies go first
  VBLK_CO_TRY(co_await rb_cache_->write_dirty());
  VBLK_CO_TRY(co_await file_->flush());
  // Everything freed so far is free on disk too: it may be reused now.
  for (uint64_t ci : quarantine_) free_cluster_index_ = std::min(free_cluster_index_, ci);
  quarantine_.clear();
  co_return Status{};
}

Task<void> Qcow2Node::wait_allocs() {
  while (!allocs_.empty()) {
    CoEvent* ev = allocs_.front().done;
    lock_.unlock();
    co_await ev->wait();
    co_await lock_.lock();
  }
}

Task<Status> Qcow2Node::l1_refcounts(const std::vector<uint64_t>& l1, int64_t delta, bool dry_run) {
  AlignedBuffer copy(cs_);
  // Dry run: count what each cluster would gain, and refuse (as QEMU does,
  // with EINVAL) if a refcount would exceed what refcount_bits can hold,
  // before anything changes.
  std::unordered_map<uint64_t, uint64_t> gain;
  auto apply = [&](uint64_t off, uint64_t len, bool is_l2) -> Task<Status> {
    if (!dry_run) co_return co_await update_refcount(off, len, delta);
    // Tables and data of a snapshot must not be other metadata: adjusting
    // refcounts (and later COPIED flags) through them would write there.
    // (Always the cached kinds: this guards vblk's own writes through them.)
    const uint32_t kinds = is_l2 ? kOlCached & ~(kOlActiveL1 | kOlActiveL2) : kOlCached;
    if (uint32_t ol = metadata_overlap(kinds, off, len)) co_return co_await refuse_overlap(ol, off, len);
    if (delta < 0) co_return Status{};
    for (uint64_t ci = off / cs_; ci <= (off + len - 1) / cs_; ++ci) {
      auto rc = co_await get_refcount(ci);
      if (!rc) co_return rc.take_error();
      uint64_t& g = gain[ci];
      if (refcount_max_ - *rc <= g) co_return Error(EINVAL);
      ++g;
    }
    co_return Status{};
  };
  for (size_t i = 0; i < l1.size(); ++i) {
    const uint64_t l2 = l1[i] & kL1OffsetMask;
    if (!l2) continue;
    VBLK_CO_TRY(co_await check_l2_offset(l2, i));
    {
      // A private copy: the table itself may be freed below.
      auto t = co_await l2_cache_->get(l2);
      if (!t) co_return t.take_error();
      std::memcpy(copy.data(), t->data(), cs_);
    }
    for (uint64_t j = 0; j < l2_entries_; ++j) {
      const uint64_t e = be64(copy.data() + j * l2_entry_size_);
      if (e & kOflagCompressed) {
        const uint32_t x = 62 - (h_.cluster_bits - 8);
        const uint64_t host = e & ((1ull << x) - 1);
        const uint64_t sectors = ((e >> x) & ((1ull << (h_.cluster_bits - 8)) - 1)) + 1;
        VBLK_CO_TRY(co_await apply(host, sectors * 512 - (host & 511), false));
        continue;
      }
      const uint64_t host = e & kL2OffsetMask;
      if (!host) continue;
      if (host % cs_) {
        co_await mark_corrupt(fmt::format("Cluster allocation offset {} unaligned (L2 offset: {}, L2 index: {})",
                                          hex(host), hex(l2), hex(j)));
        co_return Error(EIO);
      }
      VBLK_CO_TRY(co_await apply(host, cs_, false));
    }
    VBLK_CO_TRY(co_await apply(l2, cs_, true));
  }
  co_return Status{};
}

Task<Status> Qcow2Node::fix_copied(std::vector<uint64_t>& l1, bool clear_all) {
  for (size_t i = 0; i < l1.size(); ++i) {
    const uint64_t l2 = l1[i] & kL1OffsetMask;
    if (!l2) continue;
    {
      auto t = co_await l2_cache_->get(l2);
      if (!t) co_return t.take_error();
      for (uint64_t j = 0; j < l2_entries_; ++j) {
        const uint64_t e = l2_entry(*t, j);
        if (e & kOflagCompressed) continue;
        uint64_t ne = e & ~kOflagCopied;
        const uint64_t host = e & kL2OffsetMask;
        if (host && !clear_all) {
          auto rc = co_await get_refcount(host / cs_);
          if (!rc) co_return rc.take_error();
          if (*rc == 1) ne |= kOflagCopied;
        }
        if (ne != e) set_l2_entry(*t, j, ne, l2_bitmap(*t, j));
      }
    }
    uint64_t ne = l1[i] & ~kOflagCopied;
    if (!clear_all) {
      auto rc = co_await get_refcount(l2 / cs_);
      if (!rc) co_return rc.take_error();
      if (*rc == 1) ne |= kOflagCopied;
    }
    l1[i] = ne;
  }
  co_return Status{};
}

Task<Status> Qcow2Node::fix_active_copied(bool clear_all) {
  std::vector<uint64_t> l1 = l1_.vec();
  VBLK_CO_TRY(co_await fix_copied(l1, clear_all));
  if (l1 == l1_.vec()) co_return Status{};
  l1_.assign(std::move(l1));
  // Only COPIED flags changed: QEMU's qcow2_update_snapshot_refcount
  // writes the active table back unchecked, so an image whose snapshot
  // shares the active L1 table's place (which `qemu-img snapshot -c`
  // handles) is not marked corrupt for it. The offsets are unchanged, so
  // a snapshot sharing the table sees the same clusters.
  co_return co_await write_l1_table(kOlInactiveL1);
}

// ---- operations

Task<Status> Qcow2Node::snapshot_create(SnapshotInfo& info) {
  if (read_only()) co_return Error(EACCES);
  if (corrupt()) co_return Error(ENOMEDIUM);
  auto g = co_await lock_.scoped();
  co_await wait_allocs();
  if (snapshots_.size() >= kMaxSnapshots) co_return Error(EFBIG);
  unsigned long id_max = 0;
  for (const auto& s : snapshots_) id_max = std::max(id_max, std::strtoul(s.id.c_str(), nullptr, 10));
  Snapshot sn;
  sn.id = std::to_string(id_max + 1);
  sn.name = info.name;
  sn.disk_size = length();
  sn.vm_state_size = info.vm_state_size;
  sn.date_sec = info.date_sec;
  sn.date_nsec = info.date_nsec;
  sn.vm_clock_nsec = info.vm_clock_nsec;
  sn.icount = info.icount;
  sn.extra_data_size = kSnapshotExtraBytes;
  VBLK_CO_TRY(co_await flush_all());
  VBLK_CO_TRY(co_await l1_refcounts(l1_, +1, true));

  // 1. Nothing in the active tables is exclusive any more: no in-place
  //    writes from here on (conservative if we crash before the commit).
  VBLK_CO_TRY(co_await fix_active_copied(true));
  VBLK_CO_TRY(co_await flush_all());
  // 2. The snapshot's L1 table: a copy of the active one.
  if (!l1_.empty()) {
    const uint64_t bytes = align_up(l1_.size() * 8, cs_);
    auto where = co_await alloc_clusters(bytes / cs_);
    if (!where) co_return where.take_error();
    sn.l1_table_offset = *where;
    AlignedBuffer b(bytes);
    b.zero();
    for (size_t i = 0; i < l1_.size(); ++i) put64(b.data() + i * 8, l1_[i]);
    VBLK_CO_TRY(co_await checked_write(0, *where, b.span()));
  }
  sn.l1_size = static_cast<uint32_t>(l1_.size());
  // 3. Everything it reaches gains a reference, on disk before the commit.
  VBLK_CO_TRY(co_await l1_refcounts(l1_, +1));
  VBLK_CO_TRY(co_await flush_all());
  // 4. Commit: the new snapshot table and the header pointing to it.
  std::vector<Snapshot> table = snapshots_;
  table.push_back(sn);
  VBLK_CO_TRY(co_await write_snapshots(std::move(table)));
  VBLK_CO_TRY(co_await flush_all());
  info.id = sn.id;
  // 5. The VM state now belongs to the snapshot; in the active tables it
  //    would only cost copy-on-write at the next snapshot (QEMU drops it
  //    too). Committed already: a failure here only leaves it shared.
  if (sn.vm_state_size) {
    const uint64_t off = vm_state_offset(sn.disk_size);
    auto st = co_await discard_clusters(off, off + align_up(sn.vm_state_size, cs_), true);
    if (st) st = co_await flush_all();
    (void)st;
  }
  co_return Status{};
}

Task<Status> Qcow2Node::snapshot_goto(const std::string& id_or_name) {
  if (read_only()) co_return Error(EACCES);
  if (corrupt()) co_return Error(ENOMEDIUM);
  // QEMU's block layer refuses first: persistent bitmaps are loaded as
  // active dirty bitmaps, and a snapshot would invalidate them.
  if (h_.has_bitmaps_extension && (h_.autoclear_features & kAutoclearBitmaps) && h_.bitmaps_extension.size() >= 4 &&
      be32(h_.bitmaps_extension.data()) > 0)
    co_return Error(EBUSY, "Device has active dirty bitmaps");
  int idx = find_snapshot(id_or_name, "");
  if (idx < 0) idx = find_snapshot("", id_or_name);
  if (idx < 0) co_return Error(ENOENT);
  const Snapshot sn = snapshots_[static_cast<size_t>(idx)];
  VBLK_CO_TRY(validate_l1(sn.l1_table_offset, sn.l1_size, cs_, "Snapshot L1 table"));
  // What can fail without changing the image is tried before the resize
  // (QEMU resizes first): the snapshot's L1 table is read and its refcounts
  // checked, so a failure there leaves the active layer's size as it was.
  {
    auto g = co_await lock_.scoped();
    co_await wait_allocs();
    auto snl1 = co_await read_l1(sn.l1_table_offset, sn.l1_size);
    if (!snl1) co_return snl1.take_error();
    VBLK_CO_TRY(co_await l1_refcounts(*snl1, +1, true));
  }
  if (sn.disk_size != length()) VBLK_CO_TRY(co_await resize(sn.disk_size));

  auto g = co_await lock_.scoped();
  co_await wait_allocs();
  VBLK_CO_TRY(co_await flush_all());
  if (sn.l1_size > l1_.size()) VBLK_CO_TRY(co_await grow_l1_table(sn.l1_size));
  auto snl1 = co_await read_l1(sn.l1_table_offset, sn.l1_size);
  if (!snl1) co_return snl1.take_error();
  snl1->resize(l1_.size(), 0);
  VBLK_CO_TRY(co_await l1_refcounts(*snl1, +1, true));
  // 1. The snapshot's clusters gain the active table's references first.
  VBLK_CO_TRY(co_await l1_refcounts(*snl1, +1));
  VBLK_CO_TRY(co_await flush_all());
  // Everything the snapshot reaches is shared now: no COPIED flags there
  // (flags in an inactive table are stale), on disk before the commit.
  VBLK_CO_TRY(co_await fix_copied(*snl1, true));
  VBLK_CO_TRY(co_await flush_all());
  // 2. Commit: the active L1 table becomes the snapshot's.
  std::vector<uint64_t> old = l1_.vec();
  l1_.assign(std::move(*snl1));
  VBLK_CO_TRY(co_await write_l1_table());
  // 3. What the old active table reached loses its reference.
  VBLK_CO_TRY(co_await l1_refcounts(old, -1));
  VBLK_CO_TRY(co_await flush_all());
  // 4. Exclusive clusters get COPIED back.
  VBLK_CO_TRY(co_await fix_active_copied(false));
  co_return co_await flush_all();
}

Task<Status> Qcow2Node::snapshot_delete(const std::string& id, const std::string& name) {
  if (read_only()) co_return Error(EACCES);
  if (corrupt()) co_return Error(ENOMEDIUM);
  int idx = find_snapshot(id, name);
  if (idx < 0) co_return Error(ENOENT, "Can't find the snapshot");
  const Snapshot sn = snapshots_[static_cast<size_t>(idx)];
  VBLK_CO_TRY(validate_l1(sn.l1_table_offset, sn.l1_size, cs_, "Snapshot L1 table"));

  auto g = co_await lock_.scoped();
  co_await wait_allocs();
  VBLK_CO_TRY(co_await flush_all());
  auto snl1 = co_await read_l1(sn.l1_table_offset, sn.l1_size);
  if (!snl1) co_return snl1.take_error();
  VBLK_CO_TRY(co_await l1_refcounts(*snl1, -1, true));
  // 1. Commit: the table without the snapshot.
  std::vector<Snapshot> table = snapshots_;
  table.erase(table.begin() + idx);
  auto st = co_await write_snapshots(std::move(table));
  if (!st)
    co_return Error(st.error().code,
                    std::string("Failed to remove snapshot from snapshot list: ") + std::strerror(st.error().code));
  // 2. Its references go (a crash from here on only leaks).
  st = co_await l1_refcounts(*snl1, -1);
  if (st && sn.l1_size) st = co_await free_unreferenced(sn.l1_table_offset, uint64_t{sn.l1_size} * 8);
  if (st) st = co_await flush_all();
  if (!st)
    co_return Error(st.error().code,
                    std::string("Failed to free the cluster and L1 table: ") + std::strerror(st.error().code));
  // 3. Clusters now exclusive to the active tables get COPIED back.
  st = co_await fix_active_copied(false);
  if (st) st = co_await flush_all();
  if (!st)
    co_return Error(st.error().code,
                    std::string("Failed to update snapshot status in disk: ") + std::strerror(st.error().code));
  co_return Status{};
}

}  // namespace vblk::qcow2
