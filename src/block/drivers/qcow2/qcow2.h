// The qcow2 format driver (QEMU's docs/interop/qcow2.txt).
//
// Split by concern, as QEMU splits it:
//   format.{h,cc}    header and entry encodings
//   cache.{h,cc}     bounded LRU metadata cache with write-back ordering
//   refcount.cc      refcount table and blocks, cluster allocation and freeing
//   cluster.cc       L1/L2 lookup and update, L2 allocation
//   compress.cc      compressed cluster writes
//   io.cc            read, write (allocation + copy-on-write, subclusters),
//                    block status, flush
//   zero.cc          zero writes and discard by L2 entry
//   open.cc          open, header update, options
//   create.cc        image creation
//   check.cc         consistency check and repair (qemu-img check)
//   overlap.{h,cc}   the overlap-check option and its sorted indexes
//   overlap_check.cc the metadata overlap check on every write, corruption
//                    signalling (QEMU's qcow2_signal_corruption)
//   snapshot.cc      internal snapshots: table, create, apply, delete
//   bitmap.cc        persistent dirty bitmaps (the `bitmaps` extension)
//   shrink.cc        resize --shrink: freeing, punching, truncating the file
//   crypt.cc         LUKS encryption (crypt_method 2): the volume in the
//                    image's clusters, data encrypted by host offset
//
// Metadata (L1, L2 and refcount caches, the allocation state) is guarded by
// `lock_`, a coroutine mutex held across metadata I/O but never across guest
// data I/O. Allocating writes register the guest clusters they are filling in
// `allocs_`; another write touching those clusters waits for it, so
// overlapping copy-on-write is ordered.
//
// Crash safety, in order: a new cluster's refcount reaches the disk before any
// L2 entry that points to it (L2 cache depends on refcount cache); a new L2
// table is written and flushed before the L1 entry that points to it; a new
// refcount block is written and flushed before the refcount table entry;
// table moves are flushed before the header points to them. A crash can leak
// clusters, never corrupt.
#pragma once

#include <memory>
#include <unordered_set>
#include <vector>

#include "drivers/luks/create.h"
#include "drivers/qcow2/cache.h"
#include "drivers/qcow2/format.h"
#include "drivers/qcow2/overlap.h"
#include "vblk/image_format.h"
#include "vblk/node.h"
#include "vblk/open.h"
#include "vblk/sync.h"

namespace vblk::qcow2 {

// UnallocatedAlloc: a subcluster (extended L2) not allocated, in a cluster
// that has a host cluster.
enum class ClusterType { Unallocated, UnallocatedAlloc, ZeroPlain, ZeroAlloc, Normal, Compressed };

// Where a guest range lives: a run of bytes from the looked-up offset.
struct Mapping {
  ClusterType type = ClusterType::Unallocated;
  uint64_t host = 0;    // Normal: host offset of the first byte; Compressed: the L2 entry
  uint64_t bytes = 0;   // length of the run with this type (and contiguous host)
  bool copied = false;  // Normal: refcount is exactly one, writable in place
};

// One entry of the snapshot table (QEMU's QCowSnapshot).
struct Snapshot {
  uint64_t l1_table_offset = 0;
  uint32_t l1_size = 0;
  std::string id, name;
  uint32_t date_sec = 0, date_nsec = 0;
  uint64_t vm_clock_nsec = 0;
  uint64_t vm_state_size = 0;
  uint32_t extra_data_size = 0;
  uint64_t disk_size = 0;
  uint64_t icount = UINT64_MAX;
  std::vector<uint8_t> unknown_extra;  // extra data past what we know, kept
};

// One entry of the bitmap directory (QEMU's Qcow2BitmapDirEntry).
struct BitmapDirEntry {
  uint64_t table_offset = 0;
  uint32_t table_size = 0;  // entries
  uint32_t flags = 0;       // in_use, auto
  uint8_t type = 1;         // dirty tracking
  uint8_t granularity_bits = 16;
  std::string name;
  std::vector<uint8_t> extra;
};

class Qcow2Node final : public Node, public ImageFormat {
 public:
  Qcow2Node(Loop& loop, std::shared_ptr<Node> file);
  ~Qcow2Node() override;

  static Result<std::shared_ptr<Node>> open(OpenContext& ctx, Json& opts);
  // `file` holds metadata and data (QEMU's storage rule: written and
  // resized whenever the image is writable, never shared for writing);
  // `backing` is read for its data only.
  PermPair child_perm(const Child& c, PermPair self) const override;
  // Creates a qcow2 image on `file` (an open, empty, writable protocol node).
  struct CreateOptions {
    uint64_t size = 0;
    uint32_t cluster_size = 65536;
    uint32_t refcount_bits = 16;
    bool lazy_refcounts = false;
    bool extended_l2 = false;
    uint8_t compression_type = kCompressionZlib;
    std::string backing_file, backing_format;
    std::string preallocation = "off";
    uint32_t version = 3;
    // The file is emptied first (qemu-img create). blockdev-create writes
    // over what the node holds without shrinking it, as QEMU does.
    bool truncate_file = true;
    // encrypt.format=luks: the volume (luks::format) stored in the image.
    std::shared_ptr<const luks::Formatted> encrypt;
  };
  static Task<Status> create(Loop& loop, std::shared_ptr<Node> file, const CreateOptions& o);

  const Header& header() const { return h_; }
  bool corrupt() const { return h_.incompatible_features & kIncompatCorrupt; }
  Node* backing() const { return backing_; }
  std::string backing_filename() const { return h_.backing_file; }

  uint64_t cluster_size() const override { return cs_; }
  // The missing L2 tables of the ranges, allocated in one batch (cluster.cc).
  Task<Status> prepare_writes(std::span<const WriteRange> ranges) override;
  std::string backing_file_name() const override { return h_.backing_file; }
  std::string backing_file_format() const override { return h_.backing_format; }
  Task<Status> set_backing(std::shared_ptr<Node> backing, const std::string& file, const std::string& fmt) override;
  Task<Status> change_backing_file(const std::string& file, const std::string& fmt) override;
  Task<Status> make_empty() override;
  std::optional<FormatInfo> format_info() const override;
  bool dirty_flag() const override { return h_.incompatible_features & kIncompatDirty; }
  bool encrypted() const override { return h_.crypt_method != kCryptNone; }
  // With encrypt.key-secret, QEMU names the node by its options.
  std::string filename() const override;

  // For tests and check: the refcount of a host cluster.
  Task<Result<uint64_t>> refcount_of(uint64_t cluster_index);
  Task<Status> do_close() override;
  // Changes the virtual size (growing the L1 table if needed), preparing
  // the new area as `prealloc` asks (prealloc.cc).
  Task<Status> resize(uint64_t size, Prealloc prealloc = Prealloc::Off);
  // Checks an image's size for create: L1 must fit.
  static Status check_create_size(uint64_t size, uint32_t cluster_size, bool extended_l2);
  // QEMU's qcow2_co_create checks, in its order and words, for options
  // given as BlockdevCreateOptionsQcow2 (blockdev-create): the size a
  // multiple of 512, the version's features, the cluster size, backing file
  // and preallocation, refcount width. `refcount_bits` is the option as given.
  static Status check_create_options(const CreateOptions& o, int64_t refcount_bits);

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override;
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_flush() override;
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_truncate(uint64_t length, bool exact) override;
  Task<Status> do_truncate_prealloc(uint64_t length, bool exact, Prealloc prealloc) override;
  // ---- ImageFormat hooks
  void backing_changed(Node* b) override { backing_ = b; }
  // Bitmaps stored, caches flushed, dirty bit cleared: a close's work.
  Task<Status> prepare_read_only() override { return do_close(); }

 private:
  friend struct Qcow2Opener;
  // ---- open.cc
  Task<Status> load(OpenContext& ctx, bool read_only);
  Task<Status> write_header();
  // h_ becomes h, written; h_ unchanged if the write fails.
  Task<Status> write_header_as(Header h);
  // set_backing to another name of the same format, crash-safe (open.cc).
  Task<Status> rename_backing(Header h);
  // A fatal corruption (QEMU's qcow2_signal_corruption(bs, true, -1, -1, ...)).
  Task<Status> mark_corrupt(const std::string& why) { return signal_corruption(true, -1, -1, why); }
  // lazy_refcounts: the dirty bit goes to disk before the first L2 entry
  // whose refcount may not; cleared on a clean close (QEMU's
  // qcow2_mark_dirty/qcow2_mark_clean).
  Task<Status> mark_dirty();
  Task<Status> mark_clean();

  // ---- cluster.cc (lock held)
  // for_write: an unaligned in-place cluster gets the write path's message
  // (QEMU's handle_copied) instead of the read path's.
  // l1: another L1 table to look in (a snapshot's, for its VM state);
  // nullptr is the active one.
  Task<Result<Mapping>> lookup(uint64_t offset, uint64_t max_bytes, bool for_write = false,
                               const std::vector<uint64_t>* l1 = nullptr);
  Task<Result<bool>> reads_as_zero(uint64_t offset, uint64_t bytes);
  // The L2 table for guest offset, allocated (and made writable) if needed.
  Task<Result<MetaCache::Ref>> l2_for_write(uint64_t offset);
  uint64_t l2_entry(MetaCache::Ref& t, uint64_t index) const;
  uint64_t l2_bitmap(MetaCache::Ref& t, uint64_t index) const;
  void set_l2_entry(MetaCache::Ref& t, uint64_t index, uint64_t entry, uint64_t bitmap);
  Task<Status> write_l1_entry(uint64_t index);
  // Moves the active L1 table to a bigger one of `entries` (lock held).
  Task<Status> grow_l1_table(uint64_t entries);
  // Frees what an L2 entry referenced (a cluster, or compressed sectors).
  Task<Status> free_entry(uint64_t entry);

  // ---- refcount.cc (lock held)
  Task<Result<uint64_t>> get_refcount(uint64_t cluster_index);
  Task<Status> update_refcount(uint64_t offset, uint64_t length, int64_t delta);
  // Allocates n contiguous clusters; returns the host offset.
  Task<Result<uint64_t>> alloc_clusters(uint64_t n);
  // QEMU's qcow2_alloc_cluster_abort: a write into newly allocated
  // clusters failed (ENOSPC...) before anything pointed to them; their
  // references are dropped so no cluster leaks. Returns `err`.
  Task<Status> abort_alloc(uint64_t host, uint64_t bytes, Error err);
  // Allocates `bytes` (< one cluster) for compressed data, packing them.
  Task<Result<uint64_t>> alloc_bytes(uint64_t bytes);
  Task<Result<uint64_t>> find_free(uint64_t n);
  // Marks the image corrupt and fails if a new allocation overlaps metadata
  // (always the "cached" set, whatever overlap-check says: refcounts of a
  // hostile image can call such clusters free, and the allocator must not
  // build on them).
  Task<Status> check_new_clusters(uint64_t offset, uint64_t bytes);
  Task<Result<bool>> ensure_refblocks(uint64_t first_cluster, uint64_t n);
  Task<Status> grow_refcount_table(uint64_t min_entries);
  uint64_t refcount_get(const uint8_t* block, uint64_t index) const;
  void refcount_set(uint8_t* block, uint64_t index, uint64_t value) const;

  // ---- shrink.cc
  Task<Status> shrink(uint64_t size);
  Task<Status> shrink_reftable();
  // While set, update_refcount appends every cluster it frees (shrink
  // punches them in the file afterwards).
  std::vector<uint64_t>* freed_sink_ = nullptr;

  // ---- prealloc.cc (lock held)
  // preallocation=metadata over guest [from, to): L2 tables and data
  // clusters allocated, the file grown (sparse) to cover them.
  Task<Status> prealloc_metadata(uint64_t from, uint64_t to);
  // preallocation=falloc|full: refcount structures for the whole new area
  // first, then the data clusters in one run, then their L2 entries.
  Task<Status> prealloc_data(uint64_t from, uint64_t to, Prealloc mode);
  // QEMU's qcow2_refcount_area: a new refcount table (and the refcount
  // blocks missing) at start_cluster covering `additional` more clusters;
  // returns the first cluster after them.
  Task<Result<uint64_t>> refcount_area(uint64_t start_cluster, uint64_t additional);
  // Links guest clusters [first, first+n) to host clusters from `host` on.
  // Like QEMU's link_l2 for a preallocation, it first copies the guest
  // bytes of the first cluster before `head_end` and writes zeroes after
  // `tail_from` in the last one (0: none).
  Task<Result<uint64_t>> link_run(uint64_t first, uint64_t n, uint64_t host, uint64_t head_end = 0,
                                  uint64_t tail_from = 0);

  // ---- overlap_check.cc: QEMU's overlap check and corruption signal
  // The first kind in `kinds` (in QEMU's order) that [offset, offset+size)
  // touches, rounded out to clusters as QEMU does; 0 if none.
  uint32_t metadata_overlap(uint32_t kinds, uint64_t offset, uint64_t size) const;
  // The pre-write check: the configured kinds minus `ign` (a metadata write
  // ignores its own kind). Cheap enough for every data write.
  uint32_t overlaps(uint32_t ign, uint64_t offset, uint64_t size) const {
    const uint32_t kinds = overlap_check_ & ~ign;
    return kinds ? metadata_overlap(kinds, offset, size) : 0;
  }
  // A refused write: "Preventing invalid write on metadata", fatal; EIO.
  Task<Status> refuse_overlap(uint32_t ol, uint64_t offset, uint64_t size);
  // A metadata write into the file, refused if it overlaps other metadata.
  Task<Status> checked_write(uint32_t ign, uint64_t offset, std::span<const uint8_t> data, uint32_t flags = 0);
  // QEMU's qcow2_signal_corruption: fatal only if the image is writable (the
  // corrupt bit set, no more writes); reported on stderr and to the node's
  // corruption handler once (a fatal one after a non-fatal one too).
  Task<Status> signal_corruption(bool fatal, int64_t offset, int64_t size, const std::string& msg);
  // The snapshot table changed: index its L1 tables (and, for "all", the L2
  // tables they reach, read from the file).
  Task<Status> index_snapshots();
  // Whether an L1 entry's L2 offset can be used; marks the image corrupt
  // (QEMU's message) if not. 0 is fine (unallocated).
  Task<Status> check_l2_offset(uint64_t l2_offset, uint64_t l1_index);
  // The refcount block of refcount table index rti: 0 when none; marks the
  // image corrupt if the offset is unaligned.
  Task<Result<uint64_t>> refblock_offset(uint64_t rti);
  uint32_t overlap_check_ = kOlCached;
  mutable ClusterSet ol_l2_, ol_rb_;
  ClusterSet ol_inactive_l2_;
  RangeSet ol_inactive_l1_;

  // ---- crypt.cc: LUKS encryption (QEMU's qcow2 crypto header and
  // qcow2_co_encrypt/decrypt with crypt_physical_offset): each 512-byte
  // sector of a data cluster is encrypted with its host offset / 512 as the
  // IV's sector number. Zero, unallocated and compressed clusters are not
  // encrypted (QEMU reads compressed ones as they are).
  // The `encrypt` options: the format check and, unless only described
  // (no_io), the key unlocked (load, after the tables).
  Task<Status> open_crypto(OpenContext& ctx);
  // Stores `f` in new clusters and points the header at them (create).
  Task<Status> set_up_encryption(const luks::Formatted& f);
  // Data cluster bytes at `host` into `out` (decrypted if encrypted).
  Task<Status> read_data(uint64_t host, std::span<uint8_t> out);
  // `data` written to data clusters at `host` (encrypted through a bounce
  // buffer if encrypted; the caller's buffer stays as it is).
  Task<Status> write_data(uint64_t host, std::span<const uint8_t> data, uint32_t flags = 0);
  // Encrypts `buf`, bound for `host`, in place (a buffer of our own).
  Status encrypt_for(uint64_t host, std::span<uint8_t> buf);
  std::optional<LuksInfo> encrypt_info() const;
  std::optional<std::string> encrypt_format_;  // the open options' encrypt.format
  std::optional<std::string> key_secret_;      // encrypt.key-secret
  std::unique_ptr<luks::Volume> crypt_;        // the LUKS header; its cipher once unlocked

  // ---- io.cc
  Task<Result<bool>> detect_metadata_preallocation();
  Task<Status> read_mapping(uint64_t offset, const Mapping& m, std::span<uint8_t> out);
  Task<Status> read_compressed(uint64_t entry, uint64_t in_cluster, std::span<uint8_t> out);
  // Whole compressed clusters whose stored bytes lie back to back in the
  // file (as qemu-img convert -c and QEMU's compressed writes leave them):
  // one file read for all, then one inflate job for the batch.
  struct CompressedRun {
    uint64_t host_lo = 0, host_hi = 0;                              // the stored bytes of every cluster
    std::vector<std::pair<uint64_t, std::span<uint8_t>>> clusters;  // (L2 entry, output)
  };
  // The stored byte range of a compressed cluster's L2 entry.
  void compressed_range(uint64_t entry, uint64_t& host, uint64_t& bytes) const;
  Task<Status> read_compressed_run(CompressedRun run);
  Task<Status> write_cluster_run(uint64_t offset, std::span<const uint8_t> buf, uint64_t* done);
  // ---- compress.cc
  Task<Status> write_compressed(uint64_t offset, std::span<const uint8_t> buf);
  Task<Status> write_compressed_cluster(uint64_t guest, std::span<const uint8_t> data);
  // Extended L2: one cluster's covered subclusters (with partial-subcluster COW).
  Task<Status> write_subclusters(uint64_t offset, std::span<const uint8_t> buf, uint64_t* done);

  // ---- zero.cc
  // Waits (lock held; let go while waiting) until no allocating write claims
  // a cluster of [first, last]; true if it had to wait (lookups are stale).
  Task<bool> wait_allocs(uint64_t first, uint64_t last);
  // QEMU's is_zero: the range reads as zeroes by metadata alone (lock held).
  Task<Result<bool>> is_zero_fast(uint64_t offset, uint64_t bytes);
  Task<Status> zero_clusters(uint64_t a, uint64_t e, bool may_unmap);
  Task<Result<bool>> zero_subclusters(uint64_t guest, uint32_t first, uint32_t count);
  Task<Result<bool>> zeroize(uint64_t offset, uint64_t bytes, bool may_unmap);
  Task<Status> zeroes(uint64_t offset, uint64_t bytes, uint32_t flags);
  // full: discarded clusters become unallocated even over a backing file
  // (used when shrinking: the range leaves the disk).
  Task<Status> discard_range(uint64_t offset, uint64_t bytes, bool full);
  Task<Status> discard_clusters(uint64_t a, uint64_t e, bool full);  // whole clusters, lock held

  Header h_;
  Node* file_;
  Node* backing_ = nullptr;
  uint64_t cs_ = 0;       // cluster size
  uint32_t l2_bits_ = 0;  // log2(entries per L2 table)
  uint64_t l2_entries_ = 0;
  uint32_t l2_entry_size_ = 8;  // 16 with extended L2
  uint64_t rb_entries_ = 0;     // refcount entries per block
  uint32_t refcount_bits_ = 16;
  uint64_t refcount_max_ = 0;
  OffsetTable l1_{kL1OffsetMask};
  OffsetTable rt_{~uint64_t{511}};
  std::unique_ptr<MetaCache> l2_cache_;
  std::unique_ptr<MetaCache> rb_cache_;
  CoMutex lock_;
  // Inflate jobs of this node on the thread pool (read_compressed): a few
  // per core, so the pool's queue stays short (bounded) but never runs dry.
  static unsigned inflate_jobs();
  CoSemaphore inflate_slots_{loop(), inflate_jobs()};
  // Clusters smaller than this inflate on the loop (a pool hop costs more).
  static constexpr uint64_t kInflateOffloadMin = 16 << 10;
  // Clusters per compressed run (read_compressed_run): 1 MiB of 64 KiB
  // clusters, the copy engine's chunk.
  static constexpr size_t kCompressedRunClusters = 16;
  uint64_t free_cluster_index_ = 0;
  uint64_t free_byte_offset_ = 0;  // packing point for compressed writes
  bool header_dirty_ = false;
  bool no_io_ = false;           // opened only to be described (info): no consistent read of the file
  bool lazy_refcounts_ = false;  // the lazy-refcounts option (default: the header's bit)
  bool signaled_corruption_ = false;
  bool prealloc_checked_ = false;
  bool metadata_prealloc_ = false;
  // Clusters freed since the last flush: not handed out again until then.
  std::unordered_set<uint64_t> quarantine_;

  // Guest cluster ranges being filled by allocating writes.
  struct Alloc {
    uint64_t first, last;  // guest cluster indices, inclusive
    CoEvent* done;
  };
  std::vector<Alloc> allocs_;
  // Claims guest clusters [first, last] for an allocating write until it goes
  // out of scope; then the claim leaves allocs_ and its waiters wake.
  class AllocClaim {
   public:
    AllocClaim(Qcow2Node& q, uint64_t first, uint64_t last) : q_(q), done_(q.loop()) {
      q_.allocs_.push_back({first, last, &done_});
    }
    ~AllocClaim() {
      for (auto it = q_.allocs_.begin(); it != q_.allocs_.end(); ++it)
        if (it->done == &done_) {
          q_.allocs_.erase(it);
          break;
        }
      done_.set();
    }
    AllocClaim(const AllocClaim&) = delete;
    AllocClaim& operator=(const AllocClaim&) = delete;

   private:
    Qcow2Node& q_;
    CoEvent done_;
  };

  // ---- snapshot.cc: internal snapshots
 public:
  bool supports_snapshots() const override { return true; }
  std::vector<SnapshotInfo> snapshots() const override;
  Task<Status> snapshot_create(SnapshotInfo& sn) override;
  Task<Status> snapshot_goto(const std::string& id_or_name) override;
  Task<Status> snapshot_delete(const std::string& id, const std::string& name) override;
  const std::vector<Snapshot>& snapshot_table() const { return snapshots_; }

 private:
  Task<Status> read_snapshots();
  // Writes `table` to new clusters, points the header to it, frees the old.
  Task<Status> write_snapshots(std::vector<Snapshot> table);
  // Adds delta to the refcount of every L2 table and cluster `l1` reaches.
  // dry_run: only checks that nothing reached overlaps other metadata
  // (EIO, image marked corrupt) and no refcount would overflow (EINVAL).
  Task<Status> l1_refcounts(const std::vector<uint64_t>& l1, int64_t delta, bool dry_run = false);
  // Sets OFLAG_COPIED in `l1` and the L2 tables it reaches exactly where
  // the refcount is one (clear_all: clears it everywhere). The active L1
  // table (l1_) is written back when it changes.
  Task<Status> fix_copied(std::vector<uint64_t>& l1, bool clear_all);
  // fix_copied on the active table, written back if it changed.
  Task<Status> fix_active_copied(bool clear_all);
  Task<Result<std::vector<uint64_t>>> read_l1(uint64_t offset, uint32_t size);
  // The whole active L1 table, checked against the metadata but `ign`.
  Task<Status> write_l1_table(uint32_t ign = 0);
  Task<Status> flush_all();
  // kReqSurviveKill: dirty L2 and refcount tables written to the file (in
  // dependency order, the last write not synced).
  Task<Status> metadata_to_file();
  Task<void> wait_allocs();
  // Drops one reference to each cluster of the range; a range with a free
  // cluster is reported and left alone (QEMU's qcow2_free_clusters).
  Task<Status> free_unreferenced(uint64_t offset, uint64_t length);
  int find_snapshot(const std::string& id, const std::string& name) const;
  std::vector<Snapshot> snapshots_;
  uint64_t snapshots_size_ = 0;

  // ---- vmstate.cc: the VM state area after the disk end
 public:
  bool supports_vmstate() const override { return true; }
  Task<Status> write_vmstate(uint64_t pos, std::span<const uint8_t> buf) override;
  Task<Status> read_vmstate(uint64_t pos, std::span<uint8_t> buf, const std::string& snapshot_id) override;
  Task<Status> discard_vmstate(uint64_t bytes) override;
  // Guest offset of the VM state for a disk of `disk_size` bytes: the first
  // L1 entry past the disk (QEMU's qcow2_vm_state_offset).
  uint64_t vm_state_offset(uint64_t disk_size) const;

 private:
  // The L1 table of the snapshot last read from (by its table's offset);
  // dropped whenever the snapshot table changes.
  uint64_t vmstate_l1_from_ = 0;
  std::vector<uint64_t> vmstate_l1_;

  // ---- bitmap.cc: persistent dirty bitmaps
 public:
  Status can_store_new_bitmap(const std::string& name, uint64_t granularity) const override;
  Task<Status> remove_persistent_bitmap(const std::string& name) override;
  // Loads the stored bitmaps into bitmaps() and, read-write, marks them
  // in_use on disk (at open, after any repair).
  Task<Status> load_bitmaps(bool read_only);
  // Stores every persistent bitmap (close, lock held).
  Task<Status> store_bitmaps();
  // check -r all: removes the stored bitmaps whose table lies beyond the end
  // of the file (their data is gone) from the directory, rewritten in place,
  // and from bitmaps(); returns their names. Lock held (by check).
  Task<Result<std::vector<std::string>>> drop_bitmaps_past_eof();
  const std::vector<BitmapDirEntry>& stored_bitmaps() const { return stored_bitmaps_; }

 private:
  // format-specific "bitmaps": the directory as on disk (QEMU reads it there).
  std::vector<Qcow2BitmapInfo> bitmaps_info() const;
  std::vector<uint8_t> serialize_bitmap_directory(const std::vector<BitmapDirEntry>& dir) const;
  // The directory the `bitmaps` extension points at, each entry checked
  // (QEMU's bitmap_list_load and check_dir_entry, with their messages).
  Task<Result<std::vector<BitmapDirEntry>>> read_bitmap_directory();
  // The entry's table reaches a whole cluster beyond the end of the file.
  bool table_past_eof(const BitmapDirEntry& e) const;
  // Writes `dir` to new clusters, points the header at it (autoclear bit set,
  // or the extension dropped when empty), frees the old directory (lock held).
  Task<Status> write_bitmap_directory(std::vector<BitmapDirEntry> dir);
  // Frees a bitmap table and the data clusters it references (lock held).
  Task<Status> free_bitmap_clusters(uint64_t table_offset, uint32_t table_size);
  std::vector<BitmapDirEntry> stored_bitmaps_;  // the directory on disk, in order

  // ---- check.cc: qemu-img check and repair (QEMU's qcow2_co_check)
 public:
  Task<Result<CheckResult>> check(uint32_t fix) override;

 private:
  friend struct Qcow2Checker;
  bool check_signaled_ = false;  // a corruption was reported (QEMU reports once)
  bool check_dead_ = false;      // a fatal corruption stopped a repair: the node is unusable
};

}  // namespace vblk::qcow2
