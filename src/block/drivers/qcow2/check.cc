// qcow2 consistency check and repair, as `qemu-img check [-r leaks|all]`.
//
// The algorithm is QEMU's (block/qcow2-refcount.c, qcow2-snapshot.c,
// qcow2-bitmap.c), reimplemented: every cluster the metadata references is
// counted into an in-memory refcount table (IMRT) — the header, the active
// L1 table and its L2 tables and data, the snapshots' L1/L2 tables, the
// snapshot table, the refcount table and blocks, the bitmap directory and
// bitmap tables — with each entry checked on the way. The IMRT is then
// compared with the refcounts on disk: more on disk is a leak, less is an
// error. Finally the OFLAG_COPIED bits are checked against the (possibly
// repaired) refcounts.
//
// Repair follows QEMU: -r leaks sets leaked clusters' refcounts to the
// computed value; -r all also raises refcounts that are too low, rebuilds
// the whole refcount structure from the IMRT when a referenced cluster has
// no refcount (or a refcount block is broken), zeroes misaligned
// preallocated L2 entries and fixes OFLAG_COPIED bits. Messages on stderr
// are QEMU's, word for word, so the output of `vblk check` can be compared
// with qemu-img's.
//
// A snapshot table whose entries need repair (extra data too long or
// missing, too many entries) is rewritten after the refcount repair, as
// QEMU's qcow2_check_fix_snapshot_table does.
//
// Not done (QEMU does): the overlap-check option and corruption events on
// repair writes (the repair has its own cached-mode check); external data
// files and encryption (vblk refuses those images at open).
#include <errno.h>
#include <inttypes.h>

#include <algorithm>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <string>
#include <vector>

#include "drivers/qcow2/bitmap_format.h"
#include "drivers/qcow2/qcow2.h"
#include "drivers/qcow2/table_reader.h"
#include "vblk/buffer.h"

namespace vblk::qcow2 {

namespace {

constexpr uint64_t kReftOffsetMask = 0xfffffffffffffe00ull;
constexpr uint64_t kReftReservedMask = 0x1ffull;
constexpr uint64_t kL2BitmapAllAlloc = 0x00000000ffffffffull;
constexpr uint64_t kL2BitmapAllZeroes = 0xffffffff00000000ull;

// Snapshot table (QCowSnapshotHeader is 40 bytes, then extra data, id, name).
constexpr uint64_t kSnapshotHeaderSize = 40;
constexpr uint32_t kSnapshotKnownExtra = 24;  // QCowSnapshotExtraData
constexpr uint32_t kSnapshotMinExtraV3 = 16;  // vm_state_size_large + disk_size

constexpr uint64_t kMaxSnapshotsSize = 1024ull * kMaxSnapshots;

// check_l1/check_l2 flag: update the allocation statistics (active L1 only).
constexpr int kCheckFragInfo = 0x2;

// Everything goes to stderr as QEMU prints it (fprintf, or error_report with
// the program name in front).
[[gnu::format(printf, 1, 2)]] void say(const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  std::vfprintf(stderr, f, ap);
  va_end(ap);
}

void report(const std::string& msg) { std::fprintf(stderr, "%s: %s\n", program_invocation_short_name, msg.c_str()); }

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

enum class L2Type { Unallocated, ZeroPlain, ZeroAlloc, Normal, Compressed };

void add_result(CheckResult& out, const CheckResult& in, bool allocation_info) {
  out.corruptions += in.corruptions;
  out.leaks += in.leaks;
  out.check_errors += in.check_errors;
  out.corruptions_fixed += in.corruptions_fixed;
  out.leaks_fixed += in.leaks_fixed;
  if (allocation_info) {
    out.image_end_offset = in.image_end_offset;
    out.total_clusters = in.total_clusters;
    out.allocated_clusters = in.allocated_clusters;
    out.fragmented_clusters = in.fragmented_clusters;
    out.compressed_clusters = in.compressed_clusters;
  }
}

}  // namespace

struct Qcow2Checker {
  Qcow2Node& q;
  Node& file;
  const uint64_t cs;
  const uint32_t bits;

  explicit Qcow2Checker(Qcow2Node& node) : q(node), file(*node.file_), cs(node.cs_), bits(node.h_.cluster_bits) {}

  // The in-memory refcount table: refcounts packed like refcount blocks (so
  // a rebuild writes slices of it), its byte size a whole number of
  // clusters. size() is QEMU's nb_clusters.
  class Imrt {
   public:
    explicit Imrt(Qcow2Node& q) : q_(q) {}
    int64_t size() const { return size_; }
    // False if n is beyond anything a real image needs (the check allows
    // at most INT_MAX clusters in the file, and references one cluster past
    // its end): offsets from hostile metadata.
    bool grow(int64_t n) {
      if (n <= size_) return true;
      if (n < 0 || n > static_cast<int64_t>(INT_MAX) + 2) return false;
      uint64_t bytes = round_up((static_cast<uint64_t>(n) * q_.refcount_bits_ + 7) / 8, q_.cs_);
      if (bytes > data_.size()) data_.resize(bytes, 0);
      size_ = n;
      return true;
    }
    uint64_t get(int64_t i) const { return q_.refcount_get(data_.data(), static_cast<uint64_t>(i)); }
    void set(int64_t i, uint64_t v) { q_.refcount_set(data_.data(), static_cast<uint64_t>(i), v); }
    void clear() { std::fill(data_.begin(), data_.end(), 0); }
    // The refcount block covering block index `rbi`, as it would be on disk.
    const uint8_t* block(uint64_t rbi) const { return data_.data() + rbi * q_.cs_; }

   private:
    Qcow2Node& q_;
    std::vector<uint8_t> data_;
    int64_t size_ = 0;
  };

  struct Snapshot {
    uint64_t l1_offset = 0;
    uint32_t l1_size = 0;
    uint32_t extra_data_size = 0;
    std::string id, name;
  };
  std::vector<Snapshot> snapshots;
  // The same entries in full, as qcow2_read_snapshots keeps them in check
  // mode: what a repair writes back.
  std::vector<qcow2::Snapshot> full;
  uint64_t snapshots_offset = 0;
  uint64_t snapshots_size = 0;
  // Clusters whose refcount a repair dropped to zero: discarded in the file.
  std::vector<uint64_t> freed;

  int64_t file_len() const { return static_cast<int64_t>(file.length()); }

  L2Type classify(uint64_t e) const {
    if (e & kOflagCompressed) return L2Type::Compressed;
    if ((e & kOflagZero) && q.l2_entry_size_ != 16) return (e & kL2OffsetMask) ? L2Type::ZeroAlloc : L2Type::ZeroPlain;
    if (!(e & kL2OffsetMask)) return L2Type::Unallocated;
    return L2Type::Normal;
  }

  // QEMU's qcow2_signal_corruption: fatal (and marking the image corrupt)
  // only when the image is writable; reported once.
  Task<void> signal_corruption(const std::string& msg) {
    const bool fatal = !q.read_only();
    if (q.check_signaled_ && (!fatal || q.corrupt())) co_return;
    if (fatal) {
      say("qcow2: Marking image as corrupt: %s; further corruption events will be suppressed\n", msg.c_str());
      q.h_.incompatible_features |= kIncompatCorrupt;
      if (q.h_.version >= 3) {
        uint8_t b[8];
        put64(b, q.h_.incompatible_features);
        if ((co_await file.write(72, {b, 8})).ok()) (void)co_await file.flush();
      }
      q.check_dead_ = true;  // QEMU drops the driver: nothing more happens to the image
    } else {
      say("qcow2: Image is corrupt: %s; further non-fatal corruption events will be suppressed\n", msg.c_str());
    }
    q.check_signaled_ = true;
  }

  // ---- metadata overlap checks before repair writes (QEMU's
  // qcow2_check_metadata_overlap with its default "cached" set)
  enum Overlap : int {
    kOlMainHeader = 1 << 0,
    kOlActiveL1 = 1 << 1,
    kOlActiveL2 = 1 << 2,
    kOlRefcountTable = 1 << 3,
    kOlRefcountBlock = 1 << 4,
    kOlSnapshotTable = 1 << 5,
    kOlInactiveL1 = 1 << 6,
    kOlBitmapDirectory = 1 << 8,
  };

  int overlaps(int ign, uint64_t offset, uint64_t size) const {
    const int chk = (kOlMainHeader | kOlActiveL1 | kOlActiveL2 | kOlRefcountTable | kOlRefcountBlock |
                     kOlSnapshotTable | kOlInactiveL1 | kOlBitmapDirectory) &
                    ~ign;
    if (!size) return 0;
    if ((chk & kOlMainHeader) && offset < cs) return kOlMainHeader;
    size = round_up((offset & (cs - 1)) + size, cs);
    offset &= ~(cs - 1);
    auto hit = [&](uint64_t o, uint64_t n) { return n && o < offset + size && offset < o + n; };
    if ((chk & kOlActiveL1) && q.h_.l1_size && hit(q.h_.l1_table_offset, uint64_t{q.h_.l1_size} * 8))
      return kOlActiveL1;
    if ((chk & kOlRefcountTable) && hit(q.h_.refcount_table_offset, q.rt_.size() * 8)) return kOlRefcountTable;
    if ((chk & kOlSnapshotTable) && hit(snapshots_offset, snapshots_size)) return kOlSnapshotTable;
    if (chk & kOlInactiveL1)
      for (const Snapshot& sn : snapshots)
        if (hit(sn.l1_offset, uint64_t{sn.l1_size} * 8)) return kOlInactiveL1;
    if (chk & kOlActiveL2)
      for (uint64_t e : q.l1_)
        if ((e & kL1OffsetMask) && hit(e & kL1OffsetMask, cs)) return kOlActiveL2;
    if (chk & kOlRefcountBlock)
      for (uint64_t e : q.rt_)
        if ((e & kReftOffsetMask) && hit(e & kReftOffsetMask, cs)) return kOlRefcountBlock;
    if ((chk & kOlBitmapDirectory) && (q.h_.autoclear_features & kAutoclearBitmaps) &&
        q.h_.bitmaps_extension.size() == 24 &&
        hit(be64(q.h_.bitmaps_extension.data() + 16), be64(q.h_.bitmaps_extension.data() + 8)))
      return kOlBitmapDirectory;
    return 0;
  }

  // QEMU's qcow2_pre_write_overlap_check: an overlap marks the image
  // corrupt and fails with EIO.
  Task<Status> pre_write_check(int ign, uint64_t offset, uint64_t size) {
    const int ol = overlaps(ign, offset, size);
    if (!ol) co_return Status{};
    const char* name = "qcow2_header";
    switch (ol) {
      case kOlActiveL1: name = "active L1 table"; break;
      case kOlActiveL2: name = "active L2 table"; break;
      case kOlRefcountTable: name = "refcount table"; break;
      case kOlRefcountBlock: name = "refcount block"; break;
      case kOlSnapshotTable: name = "snapshot table"; break;
      case kOlInactiveL1: name = "inactive L1 table"; break;
      case kOlBitmapDirectory: name = "bitmap directory"; break;
      default: break;
    }
    co_await signal_corruption(std::string("Preventing invalid write on metadata (overlaps with ") + name + ")");
    co_return Error(EIO);
  }

  // ---- refcounts on disk (QEMU's qcow2_get_refcount)

  // The refcount block for reftable index rti: an empty Ref when there is
  // none (every refcount it would hold is 0).
  Task<Result<MetaCache::Ref>> disk_refblock(uint64_t rti) {
    if (rti >= q.rt_.size()) co_return MetaCache::Ref{};
    uint64_t off = q.rt_[rti] & kReftOffsetMask;
    if (!off) co_return MetaCache::Ref{};
    if (off % cs) {
      char m[128];
      std::snprintf(m, sizeof m, "Refblock offset %#" PRIx64 " unaligned (reftable index: %#" PRIx64 ")", off, rti);
      co_await signal_corruption(m);
      co_return Error(EIO);
    }
    co_return co_await q.rb_cache_->get(off);
  }

  Task<Result<uint64_t>> disk_refcount(uint64_t cluster) {
    auto b = co_await disk_refblock(cluster / q.rb_entries_);
    if (!b) co_return b.take_error();
    if (!*b) co_return uint64_t{0};
    co_return q.refcount_get(b->data(), cluster % q.rb_entries_);
  }

  // ---- building the IMRT

  // QEMU's qcow2_inc_refcounts_imrt. Fails (a check error) only when the
  // IMRT cannot grow that far.
  Status inc(CheckResult& res, Imrt& t, int64_t offset, int64_t size) {
    if (size <= 0) return {};
    // The last cluster may be partly beyond the end of the file; a whole
    // cluster beyond it is an error.
    if (offset + size - file_len() >= static_cast<int64_t>(cs)) {
      say("ERROR: counting reference for region exceeding the end of the file by one cluster or more: "
          "offset 0x%" PRIx64 " size 0x%" PRIx64 "\n",
          static_cast<uint64_t>(offset), static_cast<uint64_t>(size));
      res.corruptions++;
      return {};
    }
    uint64_t start = static_cast<uint64_t>(offset) & ~(cs - 1);
    uint64_t last = static_cast<uint64_t>(offset + size - 1) & ~(cs - 1);
    for (uint64_t c = start; c <= last; c += cs) {
      int64_t k = static_cast<int64_t>(c >> bits);
      if (k >= t.size() && !t.grow(k + 1)) {
        res.check_errors++;
        return Error(ENOMEM);
      }
      uint64_t rc = t.get(k);
      if (rc == q.refcount_max_) {
        say("ERROR: overflow cluster offset=0x%" PRIx64 "\n", c);
        say("Use qemu-img amend to increase the refcount entry width or qemu-img convert to create a clean copy if "
            "the image cannot be opened for writing\n");
        res.corruptions++;
        continue;
      }
      t.set(k, rc + 1);
    }
    return {};
  }

  // Makes L2 entry i a plain zero cluster on disk (the entry pointed to a
  // misaligned preallocated cluster). QEMU's fix_l2_entry_by_zero.
  Task<Status> fix_l2_entry_by_zero(CheckResult& res, uint64_t l2_offset, uint8_t* table, uint64_t i, bool active,
                                    bool* overlap) {
    const uint64_t esz = q.l2_entry_size_;
    uint8_t* p = table + i * esz;
    if (esz == 16) {
      uint64_t bm = be64(p + 8);
      bm |= bm << 32;
      bm &= kL2BitmapAllZeroes;
      put64(p + 8, bm);
      put64(p, 0);
    } else {
      put64(p, kOflagZero);
    }
    const int ol = active ? kOlActiveL2 : 0;
    auto st = co_await pre_write_check(ol, l2_offset + i * esz, esz);
    if (!st) {
      *overlap = true;
      say("ERROR: Overlap check failed\n");
      res.check_errors++;
      co_return st;
    }
    st = co_await file.write(l2_offset + i * esz, {p, esz});
    if (st) st = co_await file.flush();
    if (!st) {
      say("ERROR: Failed to overwrite L2 table entry: %s\n", std::strerror(st.error().code));
      res.check_errors++;
      co_return st;
    }
    q.l2_cache_->discard(l2_offset & ~(cs - 1));
    res.corruptions--;
    res.corruptions_fixed++;
    co_return Status{};
  }

  // QEMU's check_refcounts_l2.
  Task<Status> check_l2(CheckResult& res, Imrt& t, uint64_t l2_offset, int flags, uint32_t fix, bool active) {
    AlignedBuffer table(cs);
    auto st = co_await file.read(l2_offset, table.span());
    if (!st) {
      say("ERROR: I/O error in check_refcounts_l2\n");
      res.check_errors++;
      co_return st;
    }
    const uint64_t esz = q.l2_entry_size_;
    const bool sub = esz == 16;
    const uint32_t csize_shift = 62 - (bits - 8);
    const uint64_t csize_mask = (1ull << (bits - 8)) - 1;
    const uint64_t coffset_mask = (1ull << csize_shift) - 1;
    uint64_t next_contiguous = 0;
    for (uint64_t i = 0; i < q.l2_entries_; ++i) {
      uint64_t e = be64(table.data() + i * esz);
      const uint64_t bm = sub ? be64(table.data() + i * esz + 8) : 0;
      const L2Type type = classify(e);
      if (type != L2Type::Compressed && (e & kL2StdReservedMask)) {
        say("ERROR found l2 entry with reserved bits set: %" PRIx64 "\n", e);
        res.corruptions++;
      }
      switch (type) {
        case L2Type::Compressed: {
          if (e & kOflagCopied) {
            say("ERROR: coffset=0x%" PRIx64 ": copied flag must never be set for compressed clusters\n",
                e & coffset_mask);
            e &= ~kOflagCopied;
            res.corruptions++;
          }
          if (bm) {
            say("ERROR compressed cluster %d with non-zero subcluster allocation bitmap, entry=0x%" PRIx64 "\n",
                static_cast<int>(i), e);
            res.corruptions++;
            break;
          }
          uint64_t coffset = e & coffset_mask;
          uint64_t sectors = ((e >> csize_shift) & csize_mask) + 1;
          int64_t csize = static_cast<int64_t>(sectors * 512 - (coffset & 511));
          VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(coffset), csize));
          if (flags & kCheckFragInfo) {
            // Compressed clusters count as fragmented: neighbours share sectors.
            res.allocated_clusters++;
            res.compressed_clusters++;
            res.fragmented_clusters++;
          }
          break;
        }
        case L2Type::ZeroAlloc:
        case L2Type::Normal: {
          const uint64_t offset = e & kL2OffsetMask;
          if ((bm >> 32) & bm) {
            res.corruptions++;
            say("ERROR offset=%" PRIx64 ": Allocated cluster has corrupted subcluster allocation bitmap\n", offset);
          }
          if (offset & (cs - 1)) {
            res.corruptions++;
            const bool has_data = sub ? (bm & kL2BitmapAllAlloc) != 0 : !(e & kOflagZero);
            if (!has_data) {
              const bool repair = fix & kCheckFixErrors;
              say("%s offset=%" PRIx64 ": Preallocated cluster is not properly aligned; L2 entry corrupted.\n",
                  repair ? "Repairing" : "ERROR", offset);
              if (repair) {
                bool overlap = false;
                auto fixed = co_await fix_l2_entry_by_zero(res, l2_offset, table.data(), i, active, &overlap);
                if (overlap) co_return fixed;  // something is badly wrong: stop here
                if (fixed) continue;           // the entry is unallocated now
              }
            } else {
              say("ERROR offset=%" PRIx64 ": Data cluster is not properly aligned; L2 entry corrupted.\n", offset);
            }
          }
          if (flags & kCheckFragInfo) {
            res.allocated_clusters++;
            if (next_contiguous && offset != next_contiguous) res.fragmented_clusters++;
            next_contiguous = offset + cs;
          }
          VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(offset), static_cast<int64_t>(cs)));
          break;
        }
        case L2Type::ZeroPlain: break;
        case L2Type::Unallocated:
          if (bm & kL2BitmapAllAlloc) {
            res.corruptions++;
            say("ERROR: Unallocated cluster has non-zero subcluster allocation map\n");
          }
          break;
      }
    }
    co_return Status{};
  }

  // QEMU's check_refcounts_l1.
  Task<Status> check_l1(CheckResult& res, Imrt& t, uint64_t l1_offset, uint32_t l1_size, int flags, uint32_t fix,
                        bool active) {
    if (!l1_size) co_return Status{};
    const uint64_t bytes = uint64_t{l1_size} * 8;
    VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(l1_offset), static_cast<int64_t>(bytes)));
    AlignedBuffer l1(bytes);
    auto st = co_await file.read(l1_offset, l1.span());
    if (!st) {
      say("ERROR: I/O error in check_refcounts_l1\n");
      res.check_errors++;
      co_return st;
    }
    for (uint64_t i = 0; i < l1_size; ++i) {
      const uint64_t e = be64(l1.data() + i * 8);
      if (!e) continue;
      if (e & kL1ReservedMask) {
        say("ERROR found L1 entry with reserved bits set: %" PRIx64 "\n", e);
        res.corruptions++;
      }
      const uint64_t l2_offset = e & kL1OffsetMask;
      VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(l2_offset), static_cast<int64_t>(cs)));
      if (l2_offset & (cs - 1)) {
        say("ERROR l2_offset=%" PRIx64 ": Table is not cluster aligned; L1 entry corrupted\n", l2_offset);
        res.corruptions++;
      }
      VBLK_CO_TRY(co_await check_l2(res, t, l2_offset, flags, fix, active));
    }
    co_return Status{};
  }

  // QEMU's qcow2_check_bitmaps_refcounts: the bitmap directory, the bitmap
  // tables and the bitmap data clusters.
  Task<Status> check_bitmaps(CheckResult& res, Imrt& t, uint32_t fix) {
    if (fix & kCheckFixErrors) {
      // Not in QEMU's check: there the rewrite of the bitmaps on close
      // "repairs" such an image by storing the lost bitmap as clean (a
      // missing table reads as zeroes). A bitmap whose data is gone cannot
      // say what changed: it is removed, and an incremental backup on it is
      // refused instead of silently missing writes.
      auto gone = co_await q.drop_bitmaps_past_eof();
      if (!gone) co_return gone.take_error();
      for (const auto& name : *gone) {
        say("Repairing bitmap '%s': its bitmap table lies beyond the end of the file; the bitmap is removed\n",
            name.c_str());
        res.corruptions_fixed++;
      }
    }
    const Header& h = q.h_;
    if (!h.has_bitmaps_extension || !(h.autoclear_features & kAutoclearBitmaps) || h.bitmaps_extension.size() != 24)
      co_return Status{};
    const uint8_t* x = h.bitmaps_extension.data();
    const uint32_t nb_bitmaps = be32(x);
    const uint64_t dir_size = be64(x + 8);
    const uint64_t dir_offset = be64(x + 16);
    if (nb_bitmaps == 0) co_return Status{};
    VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(dir_offset), static_cast<int64_t>(dir_size)));

    struct Table {
      uint64_t offset;
      uint32_t size;
    };
    std::vector<Table> tables;
    bool ok = dir_size != 0 && dir_size <= kMaxBitmapDirectorySize;
    if (ok) {
      AlignedBuffer dir(dir_size);
      ok = (co_await file.read(dir_offset, dir.span())).ok();
      uint64_t pos = 0;
      uint32_t count = 0;
      while (ok && pos < dir_size) {
        if (pos + kBitmapDirEntrySize > dir_size || ++count > nb_bitmaps) {
          ok = false;
          break;
        }
        const uint8_t* e = dir.data() + pos;
        const uint64_t table_offset = be64(e);
        const uint32_t table_size = be32(e + 8);
        const uint32_t flags = be32(e + 12);
        const uint8_t type = e[16];
        const uint8_t gran = e[17];
        const uint16_t name_size = be16(e + 18);
        const uint32_t extra = be32(e + 20);
        const uint64_t esize = round_up(kBitmapDirEntrySize + name_size + extra, 8);
        if (pos + esize > dir_size || extra != 0) {
          ok = false;
          break;
        }
        const uint64_t phys = uint64_t{table_size} * cs;
        bool bad = table_size == 0 || table_offset == 0 || table_offset % cs || table_size > kBmeMaxTableSize ||
                   gran > kBmeMaxGranularityBits || gran < kBmeMinGranularityBits || (flags & kBmeReservedFlags) ||
                   name_size > kBmeMaxNameSize || type != 1 || phys > kBmeMaxPhysSize;
        if (!bad && !(flags & kBmeInUse) && q.length() > ((phys * 8) << gran)) bad = true;
        if (bad) {
          ok = false;
          break;
        }
        tables.push_back({table_offset, table_size});
        pos += esize;
      }
      if (ok && (count != nb_bitmaps || pos != dir_size)) ok = false;
    }
    if (!ok) {
      res.corruptions++;
      co_return Error(EINVAL);
    }

    auto entry_ok = [&](uint64_t e) {
      if (e & kBmeReservedMask) return false;
      uint64_t off = e & kBmeOffsetMask;
      if (off && ((e & kBmeAllOnes) || off % cs)) return false;
      return true;
    };
    for (const Table& tb : tables) {
      VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(tb.offset), static_cast<int64_t>(uint64_t{tb.size} * 8)));
      AlignedBuffer table(uint64_t{tb.size} * 8);
      auto st = co_await file.read(tb.offset, table.span());
      bool valid = st.ok();
      for (uint32_t i = 0; valid && i < tb.size; ++i) valid = entry_ok(be64(table.data() + i * 8));
      if (!valid) {
        res.corruptions++;
        co_return Error(st.ok() ? EINVAL : st.error().code);
      }
      for (uint32_t i = 0; i < tb.size; ++i) {
        uint64_t off = be64(table.data() + i * 8) & kBmeOffsetMask;
        if (off) VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(off), static_cast<int64_t>(cs)));
      }
    }
    co_return Status{};
  }

  // QEMU's check_refblocks: each refcount block is counted once and must
  // have refcount 1; broken reftable entries ask for a rebuild.
  Task<Status> check_refblocks(CheckResult& res, uint32_t fix, bool& rebuild, Imrt& t) {
    for (uint64_t i = 0; i < q.rt_.size(); ++i) {
      const uint64_t offset = q.rt_[i] & kReftOffsetMask;
      const int64_t cluster = static_cast<int64_t>(offset >> bits);
      if (q.rt_[i] & kReftReservedMask) {
        say("ERROR refcount table entry %" PRId64 " has reserved bits set\n", static_cast<int64_t>(i));
        res.corruptions++;
        rebuild = true;
        continue;
      }
      if (offset & (cs - 1)) {
        say("ERROR refcount block %" PRId64 " is not cluster aligned; refcount table entry corrupted\n",
            static_cast<int64_t>(i));
        res.corruptions++;
        rebuild = true;
        continue;
      }
      if (cluster >= t.size()) {
        res.corruptions++;
        const bool repair = fix & kCheckFixErrors;
        say("%s refcount block %" PRId64 " is outside image\n", repair ? "Repairing" : "ERROR",
            static_cast<int64_t>(i));
        if (!repair) continue;
        // Grow the file so that the block exists (reading as zeroes).
        int err = 0;
        if (offset > static_cast<uint64_t>(INT64_MAX) - cs) {
          err = EINVAL;
        } else {
          auto st = co_await file.truncate(offset + cs, false);
          if (!st) {
            report(st.error().what());
            err = st.error().code;
          }
        }
        if (!err) {
          if (!t.grow(static_cast<int64_t>((file.length() + cs - 1) / cs))) {
            res.check_errors++;
            co_return Error(ENOMEM);
          }
          if (cluster >= t.size()) err = EINVAL;
        }
        if (err) {
          rebuild = true;
          say("ERROR could not resize image: %s\n", std::strerror(err));
          continue;
        }
        res.corruptions--;
        res.corruptions_fixed++;
        VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(offset), static_cast<int64_t>(cs)));
        continue;
      }
      if (offset) {
        VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(offset), static_cast<int64_t>(cs)));
        if (t.get(cluster) != 1) {
          say("ERROR refcount block %" PRId64 " refcount=%" PRIu64 "\n", static_cast<int64_t>(i), t.get(cluster));
          res.corruptions++;
          rebuild = true;
        }
      }
    }
    co_return Status{};
  }

  // QEMU's calculate_refcounts.
  Task<Status> calculate(CheckResult& res, uint32_t fix, bool& rebuild, Imrt& t) {
    VBLK_CO_TRY(inc(res, t, 0, static_cast<int64_t>(cs)));  // the header
    VBLK_CO_TRY(co_await check_l1(res, t, q.h_.l1_table_offset, q.h_.l1_size, kCheckFragInfo, fix, true));
    for (const Snapshot& sn : snapshots) {
      if (sn.l1_offset & (cs - 1)) {
        say("ERROR snapshot %s (%s) l1_offset=%#" PRIx64
            ": L1 table is not cluster aligned; snapshot table entry corrupted\n",
            sn.id.c_str(), sn.name.c_str(), sn.l1_offset);
        res.corruptions++;
        continue;
      }
      if (sn.l1_size > kMaxL1Bytes / 8) {
        say("ERROR snapshot %s (%s) l1_size=%#" PRIx32 ": L1 table is too large; snapshot table entry corrupted\n",
            sn.id.c_str(), sn.name.c_str(), sn.l1_size);
        res.corruptions++;
        continue;
      }
      VBLK_CO_TRY(co_await check_l1(res, t, sn.l1_offset, sn.l1_size, 0, fix, false));
    }
    VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(snapshots_offset), static_cast<int64_t>(snapshots_size)));
    VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(q.h_.refcount_table_offset), static_cast<int64_t>(q.rt_.size() * 8)));
    // The LUKS header and key slots of an encrypted image.
    if (q.h_.crypto_length)
      VBLK_CO_TRY(inc(res, t, static_cast<int64_t>(q.h_.crypto_offset), static_cast<int64_t>(q.h_.crypto_length)));
    VBLK_CO_TRY(co_await check_bitmaps(res, t, fix));
    co_return co_await check_refblocks(res, fix, rebuild, t);
  }

  // Sets a refcount on disk (through the refcount block cache) for a
  // cluster whose refcount block exists.
  Task<Status> set_disk_refcount(uint64_t cluster, uint64_t value) {
    auto b = co_await disk_refblock(cluster / q.rb_entries_);
    if (!b) co_return b.take_error();
    if (!*b) co_return Error(EIO);
    q.refcount_set(b->data(), cluster % q.rb_entries_, value);
    b->mark_dirty();
    if (value == 0) {
      // A freed cluster is no table any more.
      q.l2_cache_->discard(cluster * cs);
      q.rb_cache_->discard(cluster * cs);
      q.free_cluster_index_ = std::min(q.free_cluster_index_, cluster);
      freed.push_back(cluster);
    }
    co_return Status{};
  }

  // QEMU's compare_refcounts.
  Task<void> compare(CheckResult& res, uint32_t fix, bool& rebuild, int64_t& highest, Imrt& t) {
    highest = 0;
    for (int64_t i = 0; i < t.size(); ++i) {
      auto on_disk = co_await disk_refcount(static_cast<uint64_t>(i));
      if (!on_disk) {
        say("Can't get refcount for cluster %" PRId64 ": %s\n", i, std::strerror(on_disk.error().code));
        res.check_errors++;
        continue;
      }
      const uint64_t rc1 = *on_disk, rc2 = t.get(i);
      if (rc1 > 0 || rc2 > 0) highest = i;
      if (rc1 == rc2) continue;
      int64_t* num_fixed = nullptr;
      if (rc1 == 0) {
        rebuild = true;
      } else if (rc1 > rc2 && (fix & kCheckFixLeaks)) {
        num_fixed = &res.leaks_fixed;
      } else if (rc1 < rc2 && (fix & kCheckFixErrors)) {
        num_fixed = &res.corruptions_fixed;
      }
      say("%s cluster %" PRId64 " refcount=%" PRIu64 " reference=%" PRIu64 "\n",
          num_fixed ? "Repairing" : (rc1 < rc2 ? "ERROR" : "Leaked"), i, rc1, rc2);
      if (num_fixed) {
        auto st = co_await set_disk_refcount(static_cast<uint64_t>(i), rc2);
        if (st) {
          (*num_fixed)++;
          continue;
        }
      }
      if (rc1 < rc2) {
        res.corruptions++;
      } else {
        res.leaks++;
      }
    }
  }

  // ---- rebuilding the refcount structure (QEMU's rebuild_refcount_structure)

  // First fit of `count` clusters free in the IMRT at or after
  // first_free (which ends up at the first gap seen); the IMRT grows when
  // the image has no such run. Marks them used; returns the offset, or
  // -ENOMEM.
  int64_t alloc_imrt(int64_t count, Imrt& t, int64_t& first_free) {
    int64_t cluster = first_free, run = 0;
    bool first_gap = true;
    for (; cluster < t.size() && run < count; ++cluster) {
      if (!t.get(cluster)) {
        ++run;
        if (first_gap) {
          first_free = cluster;
          first_gap = false;
        }
      } else {
        run = 0;
      }
    }
    if (run < count && !t.grow(cluster + count - run)) return -ENOMEM;
    cluster -= run;
    for (int64_t i = 0; i < count; ++i) t.set(cluster + i, 1);
    return cluster * static_cast<int64_t>(cs);
  }

  // Writes the refcount blocks for every allocated cluster in [first, end)
  // as slices of the IMRT, allocating them in the IMRT where the new
  // reftable has none yet. Returns whether the reftable had to grow.
  Task<Result<bool>> write_refblocks(Imrt& t, int64_t first, int64_t end, std::vector<uint64_t>& reftable) {
    int64_t first_free = 0;
    bool grown = false;
    const int64_t per_block = static_cast<int64_t>(q.rb_entries_);
    for (int64_t cluster = first; cluster < end; ++cluster) {
      if (!t.get(cluster)) continue;
      const int64_t rbi = cluster / per_block;
      const int64_t rb_start = rbi * per_block;
      int64_t rb_offset;
      if (static_cast<int64_t>(reftable.size()) > rbi && reftable[rbi]) {
        rb_offset = static_cast<int64_t>(reftable[rbi]);
      } else {
        if (first_free < rb_start) first_free = rb_start;
        rb_offset = alloc_imrt(1, t, first_free);
        if (rb_offset < 0) co_return Error(ENOMEM, std::string("ERROR allocating refblock: ") + std::strerror(ENOMEM));
        const int64_t rb_cluster = rb_offset / static_cast<int64_t>(cs);
        if (rb_cluster >= end) end = rb_cluster + 1;  // its own refcount must be written too
        if (static_cast<int64_t>(reftable.size()) <= rbi) {
          reftable.resize(round_up(static_cast<uint64_t>(rbi + 1) * 8, cs) / 8, 0);
          grown = true;
        }
        reftable[rbi] = static_cast<uint64_t>(rb_offset);
      }
      auto st = co_await pre_write_check(0, static_cast<uint64_t>(rb_offset), cs);
      if (st) st = co_await file.write(static_cast<uint64_t>(rb_offset), {t.block(static_cast<uint64_t>(rbi)), cs});
      if (!st)
        co_return Error(st.error().code, std::string("ERROR writing refblock: ") + std::strerror(st.error().code));
      cluster = rb_start + per_block - 1;
    }
    co_return grown;
  }

  Task<Status> rebuild_refcounts(CheckResult& res, Imrt& t) {
    VBLK_CO_TRY(co_await q.rb_cache_->flush());
    q.rb_cache_->clear();
    std::vector<uint64_t> reftable;
    auto grown = co_await write_refblocks(t, 0, t.size(), reftable);
    if (!grown) {
      res.check_errors++;
      co_return grown.take_error();
    }
    int64_t rt_offset = -1;
    uint64_t rt_clusters = 0;
    do {
      int64_t first_free = 0;
      rt_clusters = (reftable.size() * 8 + cs - 1) / cs;
      rt_offset = alloc_imrt(static_cast<int64_t>(rt_clusters), t, first_free);
      if (rt_offset < 0) {
        res.check_errors++;
        co_return Error(ENOMEM, std::string("ERROR allocating reftable: ") + std::strerror(ENOMEM));
      }
      const int64_t start = rt_offset / static_cast<int64_t>(cs);
      grown = co_await write_refblocks(t, start, start + static_cast<int64_t>(rt_clusters), reftable);
      if (!grown) {
        res.check_errors++;
        co_return grown.take_error();
      }
    } while (*grown);

    AlignedBuffer buf(reftable.size() * 8);
    for (size_t i = 0; i < reftable.size(); ++i) put64(buf.data() + i * 8, reftable[i]);
    auto st = co_await pre_write_check(0, static_cast<uint64_t>(rt_offset), buf.size());
    if (st) st = co_await file.write(static_cast<uint64_t>(rt_offset), buf.span());
    if (!st) co_return Error(st.error().code, std::string("ERROR writing reftable: ") + std::strerror(st.error().code));
    uint8_t hdr[12];
    put64(hdr, static_cast<uint64_t>(rt_offset));
    put32(hdr + 8, static_cast<uint32_t>(rt_clusters));
    st = co_await file.write(48, {hdr, 12});
    if (st) st = co_await file.flush();
    if (!st) co_return Error(st.error().code, std::string("ERROR setting reftable: ") + std::strerror(st.error().code));
    q.h_.refcount_table_offset = static_cast<uint64_t>(rt_offset);
    q.h_.refcount_table_clusters = static_cast<uint32_t>(rt_clusters);
    q.rt_.assign(std::move(reftable));
    q.free_cluster_index_ = 0;
    co_return Status{};
  }

  // QEMU's check_oflag_copied: OFLAG_COPIED must be set exactly where the
  // refcount is 1, in the active L1 table and its L2 tables.
  Task<Status> check_copied(CheckResult& res, uint32_t fix) {
    bool repair;
    if (fix & kCheckFixErrors) {
      repair = true;
    } else if (fix & kCheckFixLeaks) {
      // The refcounts are right by now unless something was left unfixed.
      repair = !res.check_errors && !res.corruptions && !res.leaks;
    } else {
      repair = false;
    }
    AlignedBuffer table(cs);
    const uint64_t esz = q.l2_entry_size_;
    for (uint64_t i = 0; i < q.l1_.size(); ++i) {
      const uint64_t l1e = q.l1_[i];
      const uint64_t l2_offset = l1e & kL1OffsetMask;
      if (!l2_offset) continue;
      auto rc = co_await disk_refcount(l2_offset >> bits);
      if (!rc) continue;  // reported by compare already
      if ((*rc == 1) != ((l1e & kOflagCopied) != 0)) {
        res.corruptions++;
        say("%s OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%" PRIx64 " refcount=%" PRIu64 "\n",
            repair ? "Repairing" : "ERROR", static_cast<int>(i), l1e, *rc);
        if (repair) {
          q.l1_.set(i, *rc == 1 ? (l1e | kOflagCopied) : (l1e & ~kOflagCopied));
          const uint64_t sector = q.h_.l1_table_offset + (i & ~uint64_t{63}) * 8;
          auto st = co_await pre_write_check(kOlActiveL1, sector,
                                             std::min<uint64_t>(512, (q.l1_.size() - (i & ~uint64_t{63})) * 8));
          if (st) st = co_await q.write_l1_entry(i);
          if (!st) {
            res.check_errors++;
            co_return st;
          }
          res.corruptions--;
          res.corruptions_fixed++;
        }
      }
      auto st = co_await file.read(l2_offset, table.span());
      if (!st) {
        say("ERROR: Could not read L2 table: %s\n", std::strerror(st.error().code));
        res.check_errors++;
        co_return st;
      }
      int64_t dirty = 0;
      for (uint64_t j = 0; j < q.l2_entries_; ++j) {
        const uint64_t e = be64(table.data() + j * esz);
        const L2Type type = classify(e);
        if (type != L2Type::Normal && type != L2Type::ZeroAlloc) continue;
        auto drc = co_await disk_refcount((e & kL2OffsetMask) >> bits);
        if (!drc) continue;
        if ((*drc == 1) != ((e & kOflagCopied) != 0)) {
          res.corruptions++;
          say("%s OFLAG_COPIED data cluster: l2_entry=%" PRIx64 " refcount=%" PRIu64 "\n",
              repair ? "Repairing" : "ERROR", e, *drc);
          if (repair) {
            put64(table.data() + j * esz, *drc == 1 ? (e | kOflagCopied) : (e & ~kOflagCopied));
            ++dirty;
          }
        }
      }
      if (dirty) {
        st = co_await pre_write_check(kOlActiveL2, l2_offset, cs);
        if (!st) {
          say("ERROR: Could not write L2 table; metadata overlap check failed: %s\n", std::strerror(st.error().code));
          res.check_errors++;
          co_return st;
        }
        st = co_await file.write(l2_offset, table.span());
        if (!st) {
          say("ERROR: Could not write L2 table: %s\n", std::strerror(st.error().code));
          res.check_errors++;
          co_return st;
        }
        q.l2_cache_->discard(l2_offset);
        res.corruptions -= dirty;
        res.corruptions_fixed += dirty;
      }
    }
    co_return Status{};
  }

  // QEMU's qcow2_check_refcounts.
  Task<Status> check_refcounts(CheckResult& res, uint32_t fix) {
    const int64_t size = file_len();
    const int64_t nb_clusters = static_cast<int64_t>((static_cast<uint64_t>(size) + cs - 1) / cs);
    if (nb_clusters > INT_MAX) {
      res.check_errors++;
      co_return Error(EFBIG);
    }
    // QEMU counts the virtual size in whole sectors.
    res.total_clusters = static_cast<int64_t>((q.h_.size / 512 * 512 + cs - 1) / cs);

    Imrt t(q);
    (void)t.grow(nb_clusters);  // within INT_MAX: checked above
    bool rebuild = false;
    VBLK_CO_TRY(co_await calculate(res, fix, rebuild, t));

    // With something to fix and no rebuild, the comparison runs again
    // (fixing); this first round's counts are then discarded.
    const CheckResult pre_compare = res;
    int64_t highest = 0;
    co_await compare(res, 0, rebuild, highest, t);

    if (rebuild && (fix & kCheckFixErrors)) {
      const CheckResult old = res;
      int64_t fresh_leaks = 0;
      say("Rebuilding refcount structure\n");
      auto st = co_await rebuild_refcounts(res, t);
      if (!st) {
        report(st.error().what());
        co_return st;
      }
      res.corruptions = 0;
      res.leaks = 0;
      // The old refcount structure is unreferenced now: count again.
      rebuild = false;
      t.clear();
      VBLK_CO_TRY(co_await calculate(res, 0, rebuild, t));
      if (fix & kCheckFixLeaks) {
        // Everything the old structure used is leaked now; only leaks the
        // rebuild itself caused and could not fix remain.
        const CheckResult saved = res;
        res = CheckResult{};
        co_await compare(res, kCheckFixLeaks, rebuild, highest, t);
        if (rebuild) say("ERROR rebuilt refcount structure is still broken\n");
        fresh_leaks = res.leaks;
        res = saved;
      }
      if (res.corruptions < old.corruptions) res.corruptions_fixed += old.corruptions - res.corruptions;
      if (res.leaks < old.leaks) res.leaks_fixed += old.leaks - res.leaks;
      res.leaks += fresh_leaks;
    } else if (fix) {
      if (rebuild) {
        say("ERROR need to rebuild refcount structures\n");
        res.check_errors++;
        co_return Error(EIO);
      }
      if (res.leaks || res.corruptions) {
        res = pre_compare;
        co_await compare(res, fix, rebuild, highest, t);
      }
    }

    VBLK_CO_TRY(co_await check_copied(res, fix));
    res.image_end_offset = (highest + 1) * static_cast<int64_t>(cs);
    co_return Status{};
  }

  // ---- the snapshot table (QEMU's qcow2_check_read_snapshot_table)

  Task<Status> read_snapshot_table(CheckResult& res, uint32_t fix) {
    snapshots.clear();
    full.clear();
    snapshots_offset = snapshots_size = 0;
    // The header as it is on disk now.
    uint8_t ptr[12];
    auto st = co_await file.read(60, {ptr, 12});
    if (!st) {
      res.check_errors++;
      say("ERROR failed to read the snapshot table pointer from the image header: %s\n",
          std::strerror(st.error().code));
      co_return st;
    }
    uint32_t nb = be32(ptr);
    uint64_t offset0 = be64(ptr + 4);
    uint32_t reduced = 0, dropped = 0;
    const bool repair = fix & kCheckFixErrors;
    if (nb > kMaxSnapshots && repair) {
      say("Discarding %u overhanging snapshots\n", nb - kMaxSnapshots);
      reduced += nb - kMaxSnapshots;
      nb = kMaxSnapshots;
    }
    const char* bad = nullptr;
    int bad_code = 0;
    if (nb > kMaxSnapshots) {
      bad = "snapshot table too large";
      bad_code = EFBIG;
    } else if (static_cast<uint64_t>(INT64_MAX) - uint64_t{nb} * kSnapshotHeaderSize < offset0 || offset0 % cs) {
      bad = "snapshot table offset invalid";
      bad_code = EINVAL;
    }
    if (bad) {
      res.check_errors++;
      report(std::string("ERROR ") + bad);
      if (nb > kMaxSnapshots)
        say("You can force-remove all %u overhanging snapshots with qemu-img check -r all\n", nb - kMaxSnapshots);
      co_return Error(bad_code);
    }

    // The entries: only what check needs (the L1 tables and the table size).
    std::string fail, hint;
    int fail_code = 0;
    uint64_t offset = offset0, table_length = 0;
    TableReader table(file);
    for (uint32_t i = 0; i < nb; ++i) {
      const uint64_t pre = offset;
      table_length = round_up(table_length, 8);
      offset = round_up(offset, 8);
      uint8_t h[kSnapshotHeaderSize];
      st = co_await table.read(offset, {h, sizeof h});
      if (!st) {
        fail = std::string("Failed to read snapshot table: ") + std::strerror(st.error().code);
        fail_code = st.error().code;
        break;
      }
      offset += kSnapshotHeaderSize;
      Snapshot sn;
      sn.l1_offset = be64(h);
      sn.l1_size = be32(h + 8);
      const uint16_t id_size = be16(h + 12), name_size = be16(h + 14);
      sn.extra_data_size = be32(h + 36);
      qcow2::Snapshot fs;
      fs.l1_table_offset = sn.l1_offset;
      fs.l1_size = sn.l1_size;
      fs.date_sec = be32(h + 16);
      fs.date_nsec = be32(h + 20);
      fs.vm_clock_nsec = be64(h + 24);
      fs.vm_state_size = be32(h + 32);
      bool truncate_extra = false;
      if (sn.extra_data_size > kMaxSnapshotExtraData) {
        if (!repair) {
          fail = "Too much extra metadata in snapshot table entry " + std::to_string(i);
          hint = "You can force-remove this extra metadata with qemu-img check -r all\n";
          fail_code = EFBIG;
          break;
        }
        say("Discarding too much extra metadata in snapshot table entry %u (%u > %u)\n", i, sn.extra_data_size,
            kMaxSnapshotExtraData);
        ++dropped;
        truncate_extra = true;
      }
      // The known extra data: what the entry lacks is filled in as QEMU
      // fills it in (the VM state size from the header field, the current
      // disk size, no icount).
      const uint32_t known = std::min(kSnapshotKnownExtra, sn.extra_data_size);
      uint8_t extra[kSnapshotKnownExtra] = {};
      if (known) {
        st = co_await table.read(offset, {extra, known});
        if (!st) {
          fail = std::string("Failed to read snapshot table: ") + std::strerror(st.error().code);
          fail_code = st.error().code;
          break;
        }
      }
      if (sn.extra_data_size >= 8) fs.vm_state_size = be64(extra);
      fs.disk_size = sn.extra_data_size >= 16 ? be64(extra + 8) : q.length();
      fs.icount = sn.extra_data_size >= 24 ? be64(extra + 16) : UINT64_MAX;
      offset += known;
      if (sn.extra_data_size > kSnapshotKnownExtra) {
        const uint64_t extra_end = offset + sn.extra_data_size - kSnapshotKnownExtra;
        if (truncate_extra) sn.extra_data_size = kMaxSnapshotExtraData;
        fs.unknown_extra.resize(sn.extra_data_size - kSnapshotKnownExtra);
        st = co_await table.read(offset, fs.unknown_extra);
        if (!st) {
          fail = std::string("Failed to read snapshot table: ") + std::strerror(st.error().code);
          fail_code = st.error().code;
          break;
        }
        offset = extra_end;
      }
      fs.extra_data_size = sn.extra_data_size;
      std::vector<uint8_t> names(size_t{id_size} + name_size);
      if (!names.empty()) {
        st = co_await table.read(offset, names);
        if (!st) {
          fail = std::string("Failed to read snapshot table: ") + std::strerror(st.error().code);
          fail_code = st.error().code;
          break;
        }
      }
      sn.id.assign(reinterpret_cast<const char*>(names.data()), id_size);
      sn.name.assign(reinterpret_cast<const char*>(names.data()) + id_size, name_size);
      sn.id = sn.id.c_str();  // C strings in QEMU: stop at a NUL
      sn.name = sn.name.c_str();
      fs.id = sn.id;
      fs.name = sn.name;
      offset += id_size + name_size;
      table_length += kSnapshotHeaderSize + sn.extra_data_size + id_size + name_size;
      if (table_length > kMaxSnapshotsSize || offset - offset0 > static_cast<uint64_t>(INT_MAX)) {
        if (!repair) {
          fail = "Snapshot table is too big";
          hint = "You can force-remove all " + std::to_string(nb - i) +
                 " overhanging snapshots with qemu-img check -r all\n";
          fail_code = EFBIG;
          break;
        }
        say("Discarding %u overhanging snapshots (snapshot table is too big)\n", nb - i);
        reduced += nb - i;
        nb = i;
        offset = pre;
        break;
      }
      snapshots.push_back(std::move(sn));
      full.push_back(std::move(fs));
    }
    if (fail_code) {
      res.check_errors++;
      report("ERROR failed to read the snapshot table: " + fail);
      if (!hint.empty()) say("%s", hint.c_str());
      snapshots.clear();
      full.clear();
      co_return Error(fail_code);
    }
    snapshots_offset = offset0;
    snapshots_size = nb ? offset - offset0 : 0;
    res.corruptions += reduced + dropped;

    if (reduced) {
      // The header first: the refcount check relies on it.
      uint8_t b[4];
      put32(b, nb);
      st = co_await file.write(60, {b, 4});
      if (st) st = co_await file.flush();
      if (!st) {
        res.check_errors++;
        say("ERROR failed to update the snapshot count in the image header: %s\n", std::strerror(st.error().code));
        co_return st;
      }
      q.h_.nb_snapshots = nb;
      res.corruptions_fixed += reduced;
      res.corruptions -= reduced;
    }
    if (q.h_.version >= 3) {
      for (size_t i = 0; i < snapshots.size(); ++i) {
        if (snapshots[i].extra_data_size < kSnapshotMinExtraV3) {
          res.corruptions++;
          say("%s snapshot table entry %zu is incomplete\n", repair ? "Repairing" : "ERROR", i);
        }
      }
    }
    co_return Status{};
  }

  // QEMU's qcow2_check_fix_snapshot_table: once the refcounts are right,
  // the entries as read (overhanging ones dropped, extra data cut to the
  // maximum or completed) go to a new table; the old one is freed.
  Task<Status> fix_snapshot_table(CheckResult& res, uint32_t fix) {
    if (!res.corruptions || !(fix & kCheckFixErrors)) co_return Status{};
    q.h_.snapshots_offset = snapshots_offset;
    q.snapshots_size_ = snapshots_size;
    auto st = co_await q.write_snapshots(full);
    if (!st) {
      res.check_errors++;
      say("ERROR failed to update snapshot table: %s\n", std::strerror(st.error().code));
      co_return st;
    }
    res.corruptions_fixed += res.corruptions;
    res.corruptions = 0;
    co_return Status{};
  }

  // Clears an incompatible feature bit in the header on disk.
  Task<Status> clear_incompat(uint64_t bit) {
    if (!(q.h_.incompatible_features & bit)) co_return Status{};
    VBLK_CO_TRY(co_await q.rb_cache_->flush());
    VBLK_CO_TRY(co_await q.l2_cache_->flush());
    q.h_.incompatible_features &= ~bit;
    uint8_t b[8];
    put64(b, q.h_.incompatible_features);
    VBLK_CO_TRY(co_await file.write(72, {b, 8}));
    co_return co_await file.flush();
  }

  // QEMU's qcow2_co_check_locked.
  Task<Result<CheckResult>> run(uint32_t fix) {
    CheckResult result, snapshot_res, refcount_res;
    VBLK_CO_TRY(co_await read_snapshot_table(snapshot_res, fix));
    auto st = co_await check_refcounts(refcount_res, fix);
    add_result(result, refcount_res, true);
    if (!st) co_return st.take_error();
    st = co_await fix_snapshot_table(snapshot_res, fix);
    add_result(result, snapshot_res, false);
    if (!st) co_return st.take_error();
    if (fix && result.check_errors == 0 && result.corruptions == 0) {
      VBLK_CO_TRY(co_await clear_incompat(kIncompatDirty));
      VBLK_CO_TRY(co_await clear_incompat(kIncompatCorrupt));
    }
    co_return result;
  }
};

Task<Result<CheckResult>> Qcow2Node::check(uint32_t fix) {
  if (check_dead_) co_return Error(ENOMEDIUM);
  if (fix && read_only()) co_return Error(EACCES, "Repairing needs a writable image");
  auto g = co_await lock_.scoped();
  Qcow2Checker c(*this);
  auto r = co_await c.run(fix);
  if (fix && !check_dead_) {
    // What QEMU does on closing a writable image: caches written, the
    // dirty bit (lazy refcounts) cleared; freed clusters discarded.
    auto st = co_await rb_cache_->flush();
    if (st) st = co_await l2_cache_->flush();
    if (st) {
      // (Not those taken again since, by a rewritten snapshot table.)
      for (uint64_t ci : c.freed) {
        auto rc = co_await get_refcount(ci);
        if (rc && *rc == 0) (void)co_await file_->discard(ci * cs_, cs_);
      }
      st = co_await c.clear_incompat(kIncompatDirty);
    }
    if (!st && r) co_return st.take_error();
  }
  co_return r;
}

}  // namespace vblk::qcow2
