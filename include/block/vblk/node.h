// Node: one instance of a block driver (file, raw, null-co, qcow2, ...) in the
// node graph, QEMU-style. A node answers coroutine requests over byte ranges
// and may have children (a format node over its `file` child, a filter over
// the node it filters).
//
// The public methods are the single validating choke point: they check the
// range and permissions, pad unaligned requests (read-modify-write with
// overlapping requests serialised), bounce buffers whose memory is not
// aligned as the driver needs, split requests at the driver's max transfer,
// emulate FUA and write-zeroes where the driver cannot, and track in-flight
// requests so drain() can wait for them. Drivers implement the protected do_*
// hooks and may assume clean input: aligned, in range, within max transfer.
//
// What only image formats answer (qemu-img info's format fields, check,
// internal snapshots, persistent bitmaps, VM state) is not here: it is the
// ImageFormat facet (image_format.h), reached through format().
//
// Ownership: a node owns references to its children (shared_ptr); the graph
// owns nodes by name. A node lives on one Loop and is not thread-safe.
// Limits and capabilities are data, filled once at open (see BlockLimits).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "vblk/loop.h"
#include "vblk/named_bitmap.h"
#include "vblk/perm.h"
#include "vblk/result.h"
#include "vblk/status_cache.h"
#include "vblk/sync.h"
#include "vblk/task.h"

namespace vblk {

// Request flags.
enum ReqFlags : uint32_t {
  kReqNone = 0,
  kReqFua = 1u << 0,         // write: durable when it completes
  kReqMayUnmap = 1u << 1,    // write_zeroes: holes are fine
  kReqNoFallback = 1u << 2,  // write_zeroes: fail with ENOTSUP rather than write zero buffers
  kReqCompressed = 1u << 3,  // write: store compressed (whole clusters; ENOTSUP if the driver cannot)
  // write, write_zeroes, copy_range (at its destination): waits for every
  // overlapping request in flight and holds new ones back until done
  // (QEMU's BDRV_REQ_SERIALISING); taken by the request path, never passed
  // to drivers.
  kReqSerialising = 1u << 4,
  // write, write_zeroes: when it completes, the data and every metadata
  // change it made are in the kernel's hands (the file's page cache or the
  // device), so the write outlives this process being killed -- not a power
  // loss, which is kReqFua's. Set by exports whose requests a next daemon
  // takes over (ublk recovery, VDUSE), so that daemon's
  // flush can vouch for what this one answered. Formats that keep metadata in
  // memory write it to their file before completing (no sync unless their
  // crash-safety order needs one); a driver that caches writes in this
  // process (NodeCaps::process_cached_writes) gets kReqFua instead.
  kReqSurviveKill = 1u << 5,
};

// Block status flags (the values QEMU uses, so the mapping is obvious).
enum StatusFlags : uint32_t {
  kStatusData = 0x01,         // reads return data stored here
  kStatusZero = 0x02,         // reads return zeroes
  kStatusOffsetValid = 0x04,  // `map` is the offset in `file`
  kStatusRaw = 0x08,          // driver passes through: ask `file` at `map`
  kStatusAllocated = 0x10,    // allocated at this layer (not from a backing file)
  kStatusEof = 0x20,          // the range reaches the end of the node
  kStatusRecurse = 0x40,      // driver asks: look into `file` at `map` for zeroes
};

class ImageFormat;
class Node;
class NodeRef;

// detect-zeroes (QEMU's BlockdevDetectZeroesOptions): what a write of a
// buffer that is all zeroes becomes at this node.
enum class DetectZeroes {
  Off,    // an ordinary write
  On,     // write-zeroes
  Unmap,  // write-zeroes that may unmap (needs discard=unmap)
};

// How a growing truncate prepares the new area (QEMU's PreallocMode).
enum class Prealloc { Off, Metadata, Falloc, Full };
// "off", "metadata", "falloc", "full"; nullopt for anything else.
std::optional<Prealloc> parse_prealloc(const std::string& s);
const char* prealloc_name(Prealloc p);

struct BlockStatus {
  uint32_t flags = 0;
  uint64_t bytes = 0;    // length of the run with these flags (> 0 unless at EOF)
  uint64_t map = 0;      // host offset in `file` when kStatusOffsetValid
  Node* file = nullptr;  // the node `map` refers to
  int depth = 0;         // for status through a backing chain
};

// Limits, read once per node at open.
struct BlockLimits {
  uint32_t request_alignment = 1;  // offset and length alignment the driver needs
  uint32_t buffer_alignment = 1;   // memory alignment the driver needs (O_DIRECT)
  uint64_t max_transfer = 0;       // 0: no limit
  uint64_t opt_transfer = 0;       // preferred request size, 0: none
  uint64_t max_zeroes = 0;         // max bytes per write_zeroes call, 0: no limit
};

// Capabilities, read once per node at open.
struct NodeCaps {
  bool native_fua = false;         // do_write honours kReqFua itself
  bool zeroes = false;             // do_write_zeroes is implemented
  bool discard = false;            // do_discard is implemented
  bool copy_range = false;         // do_copy_range_to is implemented
  bool serialise_zeroes = false;   // zeroes/discard change metadata: no overlap allowed
  bool supports_backing = false;   // unallocated ranges fall through to "backing"
  bool compressed_writes = false;  // do_write honours kReqCompressed
  // An answered write may live in this process only (librbd's cache):
  // kReqSurviveKill becomes kReqFua here.
  bool process_cached_writes = false;
  // do_block_status answers whole extents that only this node's requests
  // change, plain (map == offset, file == this): block_status() keeps them
  // in the node's StatusCache (status_cache.h). Protocol drivers set it.
  bool cache_status = false;
  // Whether `info` shows dirty-flag at all (QEMU shows it when the driver
  // answers bdrv_get_info; NBD and null-co do not).
  bool reports_dirty_flag = true;
};

// A format found its image corrupt (QEMU's qcow2_signal_corruption, shown by
// QMP as BLOCK_IMAGE_CORRUPTED). fatal: the image was marked corrupt and is
// no longer written.
struct CorruptionEvent {
  std::string msg;
  int64_t offset = -1;  // the refused write's range, or -1 when none
  int64_t size = -1;
  bool fatal = false;
};

struct Child {
  std::string role;  // "file", "backing", ...
  std::shared_ptr<Node> node;
  uint64_t stamp = next_user_stamp();  // when it became a user of node (perm.h)
};

class Node {
 public:
  Node(Loop& loop, std::string driver);
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // ---- identity and graph
  const std::string& driver() const { return driver_; }
  const std::string& node_name() const { return node_name_; }
  void set_node_name(std::string n) { node_name_ = std::move(n); }
  // The user-visible file name (the file node's path for format nodes).
  virtual std::string filename() const;
  const std::vector<Child>& children() const { return children_; }
  Node* child(const std::string& role) const;
  Node* file_child() const { return child("file"); }
  Loop& loop() const { return loop_; }
  // The re-pointable references held to this node by exports and jobs
  // (see node_ref.h); Graph::insert_filter re-points them.
  const std::vector<NodeRef*>& refs() const { return refs_; }

  // ---- properties
  uint64_t length() const { return length_; }
  bool read_only() const { return read_only_; }
  void set_read_only(bool ro) { read_only_ = ro; }
  const BlockLimits& limits() const { return limits_; }
  // The exact size in bytes where it is not a whole number of sectors
  // (length() rounds up to 512 as QEMU does); protocol nodes override it.
  virtual uint64_t exact_length() const { return length_; }
  const NodeCaps& caps() const { return caps_; }
  // Writethrough: every write is followed by a flush (cache=writethrough).
  void set_writethrough(bool on) { writethrough_ = on; }
  // No-flush (cache=unsafe): on a node without children (protocol) flush()
  // does nothing; formats and filters still flush their own state.
  void set_no_flush(bool on) { no_flush_ = on; }
  // Growable nodes (a format's file child) accept I/O past their end.
  void set_growable(bool on) { growable_ = on; }
  bool growable() const { return growable_; }
  // detect-zeroes=on|unmap: write() turns an all-zero buffer into
  // write_zeroes (with kReqMayUnmap for unmap), as QEMU's
  // bdrv_aligned_pwritev does, where the driver implements write-zeroes.
  void set_detect_zeroes(DetectZeroes m) { detect_zeroes_ = m; }
  DetectZeroes detect_zeroes() const { return detect_zeroes_; }

  // ---- permissions and image locks (perm.h)
  // The node's cumulative pair: what its users need, what they share.
  const PermPair& perms() const { return perms_; }
  // The claim of whoever opened this node and uses it directly, not
  // through a parent or a NodeRef (a CLI command: qemu-img's BlockBackend).
  void set_claim(PermPair c) { claim_ = c; }
  // force-share=on (read-only nodes): whatever the users say, the node
  // shares everything with others (QEMU's force_share, qemu-img -U).
  void set_force_share(bool on) { force_share_ = on; }
  bool force_share() const { return force_share_; }
  // Recomputes the pair from the node's users, applies it (a file node
  // takes or drops its OFD locks), then does the same for its children.
  // Users that do not share what another user needs are refused first, in
  // QEMU's words ("Permission conflict on node 'f0': permissions 'write'
  // are both required by ... and unshared by ..."). On a refusal (that, or
  // "Failed to get \"write\" lock") the node and its children keep the
  // pairs and locks they had.
  Status refresh_perms();
  // A job's filter stands between this node and its backing file (QEMU's
  // commit_top during an intermediate commit, which needs nothing of the
  // backing file and shares everything): the backing edge claims nothing.
  void set_backing_filtered(bool on) { backing_filtered_ = on; }
  // What this node needs of its child `c` when its own pair is `self`.
  // The default is a filter's: everything passes through.
  virtual PermPair child_perm(const Child& c, PermPair self) const;
  // ---- corruption reports: the layer that shows them (QMP) subscribes per
  // node; drivers report through report_corruption().
  using CorruptionHandler = std::function<void(const Node&, const CorruptionEvent&)>;
  void set_corruption_handler(CorruptionHandler h) { corruption_handler_ = std::move(h); }

  // ---- I/O (validated, aligned, tracked)
  Task<Status> read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags = kReqNone);
  Task<Status> write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags = kReqNone);
  Task<Status> write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags = kReqNone);
  Task<Status> discard(uint64_t offset, uint64_t bytes);
  Task<Status> flush();
  // Status of [offset, offset+bytes) at this node: one run, starting at offset.
  Task<Result<BlockStatus>> block_status(uint64_t offset, uint64_t bytes);
  // Status through the backing chain (QEMU's bdrv_block_status_above with no
  // base): the first layer that allocates the range answers; depth counts
  // the layers visited.
  Task<Result<BlockStatus>> block_status_above(uint64_t offset, uint64_t bytes);
  // The extents block_status() remembered (caps().cache_status), for tests
  // and statistics; the request path keeps it current.
  const StatusCache& status_cache() const { return status_cache_; }
  // Copies bytes from this node to dst without a bounce through memory, when
  // both sides allow it (copy_file_range). ENOTSUP if not possible: callers
  // fall back to read+write.
  Task<Status> copy_range(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes, uint32_t flags = 0);
  Task<Status> truncate(uint64_t length, bool exact = true, Prealloc prealloc = Prealloc::Off);
  // Waits until no request is in flight on this node.
  Task<void> drain();
  uint64_t in_flight() const { return in_flight_; }

  // A hint from a caller about to write the given ranges (a backup job
  // knows its dirty clusters before copying them): set up the mapping
  // metadata they will need in one step rather than one write at a time.
  // qcow2 allocates their missing L2 tables in one batch (three flushes in
  // all instead of three per table); filters pass it down; others ignore it.
  // Changes no content; an error only means the writes will do it themselves.
  struct WriteRange {
    uint64_t offset;
    uint64_t bytes;
  };
  virtual Task<Status> prepare_writes(std::span<const WriteRange> ranges) {
    (void)ranges;
    co_return Status{};
  }

  // The node copy offload writes to when `this` is a copy_range destination:
  // pass-through layers adjust `offset` and ask their child; file returns
  // itself; everything else nullptr (no offload).
  virtual Node* copy_target(uint64_t& offset) {
    (void)offset;
    return nullptr;
  }

  // Allocated size on disk (qemu-img's "disk size"), -ENOTSUP if unknown.
  virtual Result<uint64_t> allocated_size() const;

  // The node as an image format (image_format.h: info beyond the generic
  // fields, backing file name, check, persistent bitmaps, internal
  // snapshots, VM state), or nullptr when it is none (file, nbd, null, ...).
  // vblk::image:: helpers ask any node and answer for one without it.
  ImageFormat* format() const { return format_; }

  // Closes cleanly: what must reach the disk before the image counts as
  // closed (qcow2: caches, then the dirty bit cleared). The default closes
  // the children. Not calling it is a crash, as far as the image can tell.
  // Runs do_close() once: later calls (a command closing explicitly to
  // report errors, then its image handle closing) succeed without I/O.
  Task<Status> close();

  // Named dirty bitmaps (named_bitmap.h). Every write, write-zeroes,
  // discard and copy-offload write that reaches this node marks its enabled
  // bitmaps, whether or not the driver succeeded (QEMU's
  // bdrv_co_write_req_finish: a failed write may still have changed data).
  BitmapSet& bitmaps() { return bitmaps_; }
  const BitmapSet& bitmaps() const { return bitmaps_; }
  // ---- graph changes while open (blockdev-snapshot, QEMU's bdrv_append)
  // Makes `b` this node's backing child (nullptr: none), replacing the one
  // it had, without touching the image (unlike ImageFormat::set_backing):
  // the driver reads unallocated ranges from it from now on (its format
  // facet hears of it through backing_changed). EINVAL unless
  // caps().supports_backing. Permissions are refreshed (the old backing
  // node loses what this one needed of it).
  Status attach_backing(std::shared_ptr<Node> b);
  // QEMU's reopen read-only (an external snapshot's old top): what must
  // reach the image first is written (qcow2: bitmaps stored, caches
  // flushed, the dirty bit cleared), then the node and its `file` child are
  // read-only and drop their write locks. The format facet's
  // prepare_read_only writes it; a node without one is flushed.
  Task<Status> reopen_read_only();

 protected:
  // Drivers implement these. Input is clean: aligned to request_alignment,
  // within max_transfer, within length (unless growable), buffer memory
  // aligned to buffer_alignment.
  virtual Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) = 0;
  virtual Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags);
  virtual Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags);
  virtual Task<Status> do_discard(uint64_t offset, uint64_t bytes);
  virtual Task<Status> do_flush();
  virtual Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes);
  virtual Task<Status> do_copy_range_to(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes,
                                        uint32_t flags);
  virtual Task<Status> do_truncate(uint64_t length, bool exact);
  virtual Task<Status> do_close();
  // Growing with preallocation other than Off. The default refuses as
  // QEMU does ("Unsupported preallocation mode: metadata").
  virtual Task<Status> do_truncate_prealloc(uint64_t length, bool exact, Prealloc prealloc);

  // The flags a write or write_zeroes goes down with: writethrough adds
  // kReqFua; kReqSurviveKill becomes kReqFua on process_cached_writes.
  uint32_t effective_write_flags(uint32_t flags) const {
    if (writethrough_) flags |= kReqFua;
    if ((flags & kReqSurviveKill) && caps_.process_cached_writes) flags = (flags & ~kReqSurviveKill) | kReqFua;
    return flags;
  }

  void report_corruption(const CorruptionEvent& ev) const {
    if (corruption_handler_) corruption_handler_(*this, ev);
  }
  // For drivers: set during open.
  // The child learns its new parent; its permissions follow at the next
  // refresh_perms() (open_node runs one for every node it opens).
  void add_child(std::string role, std::shared_ptr<Node> n) {
    n->parents_.push_back(this);
    children_.push_back({std::move(role), std::move(n)});
  }
  // Re-points the child of `role` at n (nullptr: drops it); both the old
  // and the new child learn it. Permissions follow at the next refresh.
  void replace_child(const std::string& role, std::shared_ptr<Node> n);
  // Takes or drops what `p` asks of the world (a file: its OFD locks), or
  // fails changing nothing. The default has nothing to take.
  virtual Status apply_perms(PermPair p) {
    (void)p;
    return {};
  }
  void set_length(uint64_t len) { length_ = len; }
  // An image format driver registers its facet (itself) in its constructor.
  void set_format(ImageFormat* f);
  BlockLimits limits_;
  NodeCaps caps_;

 private:
  // A request in flight, living in the requesting coroutine's frame and
  // linked into the node's list: tracking costs no allocation.
  struct Tracked {
    uint64_t begin = 0, end = 0;
    bool serialising = false;
    Tracked* prev = nullptr;
    Tracked* next = nullptr;
    std::vector<std::coroutine_handle<>> waiters;  // empty unless someone waits
  };
  // Tracking, without allocation or suspension in the common case:
  //   Tracked t{...};
  //   if (find_conflict(t)) co_await wait_conflicts(t);
  //   link(t); ... untrack(t);
  // A conflict is an overlapping serialising request (or, if t serialises,
  // any overlapping request).
  Tracked* find_conflict(const Tracked& t) const;
  Task<void> wait_conflicts(Tracked& t);
  void link(Tracked& t);
  void untrack(Tracked& t);

  Task<Status> read_aligned(uint64_t offset, std::span<uint8_t> buf, uint32_t flags);
  Task<Status> write_aligned(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags);
  Task<Status> write_padded(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags);
  Task<Status> zeroes_by_writing(uint64_t offset, uint64_t bytes, uint32_t flags);
  Status check_range(uint64_t offset, uint64_t bytes, bool write) const;
  // [offset, offset + bytes) changes: cached extents there are dropped (a
  // plain write keeps data extents, see status_cache.h).
  void remember_status(uint64_t gen, uint64_t offset, const BlockStatus& s);
  void status_changed(uint64_t offset, uint64_t bytes, bool plain_write) {
    if (caps_.cache_status) status_cache_.invalidate(offset, bytes, plain_write, kStatusData);
  }

  Loop& loop_;
  std::string driver_;
  std::string node_name_;
  std::vector<Child> children_;
  std::vector<Node*> parents_;  // nodes that hold this one as a child (not owned)
  PermPair perms_;
  PermPair claim_;
  bool force_share_ = false;
  bool backing_filtered_ = false;
  uint64_t length_ = 0;
  bool read_only_ = false;
  bool writethrough_ = false;
  bool no_flush_ = false;
  bool growable_ = false;
  DetectZeroes detect_zeroes_ = DetectZeroes::Off;
  bool closed_ = false;  // close() ran
  uint64_t in_flight_ = 0;
  // Serialising requests in the list: while there are none, a plain request
  // conflicts with nothing and the list is not scanned (a copy with zero
  // detection keeps hundreds of small writes in flight: the scan was a
  // quarter of the loop thread in a compressed-qcow2 convert).
  uint64_t serialising_in_flight_ = 0;
  Tracked* tracked_head_ = nullptr;
  friend class NodeRef;
  std::vector<NodeRef*> refs_;
  CoEvent idle_;
  BitmapSet bitmaps_;
  StatusCache status_cache_;
  CorruptionHandler corruption_handler_;
  ImageFormat* format_ = nullptr;  // not owned: the node itself, as a facet
};

}  // namespace vblk
