// MemNode: a protocol node whose medium is memory, with the hooks that
// tests need to break what sits above it: injected faults, latency, a record
// of every request, and power loss.
//
// Power loss is modelled as a disk with a volatile write cache: a write is
// in the cache when it completes and on the medium only once a later flush
// has completed (or at once with FUA). power_cut() returns what the medium
// would hold if power failed now: the state of the last completed flush,
// plus FUA writes, plus — in Reorder mode — any subset of the 512-byte
// sectors of the unflushed writes (each sector whole: a sector write is
// atomic, a multi-sector one may tear). cut_before(n) takes that image just
// before the n-th write-type request (write, write-zeroes, discard, flush,
// truncate) reaches the medium, and from then on every request fails with
// EIO, as for a process whose disk has gone.
//
// It is the one in-memory node of the tests and fuzz targets: it also
// answers block status from a settable extent list, copies ranges into
// another MemNode (or fails with a chosen errno), keeps a VM state area,
// counts requests that break its own limits (the generic layer must pad,
// split and align for it), and measures how many requests overlap.
//
// The VM state area makes it an ImageFormat (image_format.h) of sorts: its
// facet answers supports_vmstate() as Options::vmstate says, the rest as
// the defaults do.
//
// Ownership: plain node; one loop, not thread-safe.
#pragma once

#include <cerrno>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "vblk/image_format.h"
#include "vblk/node.h"

namespace vblk {

class MemNode : public Node, public ImageFormat {
 public:
  static constexpr uint32_t kSector = 512;

  // Requests in flight, shared between nodes that count together.
  struct Concurrency {
    int now = 0, peak = 0;
  };
  struct Options {
    uint64_t size = 0;
    // Writes past the end grow the node like a regular file, up to this;
    // beyond it they fail with ENOSPC (a corrupt table can point anywhere).
    uint64_t max_size = 1ull << 30;
    BlockLimits limits;
    bool yield = true;        // each request suspends once (requests interleave)
    uint64_t latency_ns = 0;  // instead: each request sleeps this long
    bool record = false;      // keep every request in ops()
    // What the node offers the generic layer; unset: zero writes, discard
    // and native FUA. (Tests of FUA emulation or zero fallbacks take less.)
    std::optional<NodeCaps> caps;
    bool vmstate = false;                // a VM state area (supports_vmstate)
    Concurrency* concurrency = nullptr;  // also counted here (not owned)
  };
  struct Op {
    // 'r' read, 'w' write, 'z' write-zeroes, 'd' discard, 'f' flush,
    // 't' truncate, 'c' copy range (on both nodes), 'v' VM state write,
    // 'V' VM state read
    char op;
    uint64_t offset, bytes;
    uint32_t flags;
    uint64_t start_ns = 0, end_ns = 0;  // end_ns: 0 while in flight
  };
  struct Extent {
    uint64_t offset, bytes;
    uint32_t flags;  // kStatusData / kStatusZero / 0 (unallocated)
  };
  struct Fault {
    char op;  // as Op::op
    uint64_t offset, bytes;
    int err;
    bool once;
  };
  enum class CutMode {
    Drop,     // every write not covered by a completed flush (nor FUA) is lost
    Reorder,  // each sector of an unflushed write independently lands or not
  };

  // Nodes on one supply lose power together (a host with several disks):
  // write-type requests are counted across all of them, and at the cut
  // every node's medium is taken at the same instant.
  struct PowerSupply {
    uint64_t submitted = 0;  // write-type requests, all nodes
    uint64_t cut_at = 0;     // cut just before this one (0: never)
    CutMode mode = CutMode::Drop;
    uint64_t seed = 0;
    bool cut = false;
    // Called at the cut instant, once every image is taken: lets a test
    // note the state of the world above the media at that moment.
    std::function<void()> on_cut;
    std::vector<MemNode*> nodes;
  };

  MemNode(Loop& loop, Options o);
  MemNode(Loop& loop, std::vector<uint8_t> contents, Options o);
  MemNode(Loop& loop, std::vector<uint8_t> contents);
  ~MemNode() override;

  // What reads return now (the cache view). Changing it directly changes
  // the medium too as far as reads go, not what a power cut keeps.
  const std::vector<uint8_t>& data() const { return volatile_; }
  std::vector<uint8_t>& data() { return volatile_; }
  std::vector<uint8_t>& mutable_data() { return volatile_; }
  const std::vector<Op>& ops() const { return ops_; }
  void clear_ops() { ops_.clear(); }
  // Recorded requests of kind op that overlap [offset, offset + bytes).
  int count(char op, uint64_t offset, uint64_t bytes) const;
  std::vector<Fault> faults;
  // Latency, yield and the like may change between requests.
  Options& options() { return opts_; }
  NodeCaps& mutable_caps() { return caps_; }

  // Block status: sorted extents, the gaps between them data. Empty: the
  // generic answer (all data).
  std::vector<Extent> extents;
  // copy_range into another MemNode: fails with this errno unless 0.
  int copy_range_errno = ENOTSUP;
  int copy_range_calls = 0;
  // The VM state area (Options::vmstate).
  std::vector<uint8_t>& vmstate_area() { return vmstate_; }
  // Requests that broke limits(): misaligned offset, length or buffer, or
  // longer than max_transfer / max_zeroes.
  uint64_t limit_violations() const { return limit_violations_; }
  int peak_in_flight() const { return peak_; }

  // Write-type requests submitted so far (the instants cut_before counts).
  uint64_t writes_submitted() const { return submitted_; }
  // The medium after a power failure now.
  std::vector<uint8_t> power_cut(CutMode mode, uint64_t seed) const;
  // Takes power_cut(mode, seed) just before write-type request n (1-based)
  // and fails every request from then on.
  void cut_before(uint64_t n, CutMode mode, uint64_t seed);
  // Puts this node on `supply` (before its first request).
  void join(const std::shared_ptr<PowerSupply>& supply);
  // The image cut_before or the supply's cut took, once it has.
  const std::optional<std::vector<uint8_t>>& cut_image() const { return cut_; }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override;
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_flush() override;
  Task<Status> do_truncate(uint64_t length, bool exact) override;
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_copy_range_to(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes,
                                uint32_t flags) override;

 public:
  bool supports_vmstate() const override { return opts_.vmstate; }
  Task<Status> write_vmstate(uint64_t pos, std::span<const uint8_t> buf) override;
  Task<Status> read_vmstate(uint64_t pos, std::span<uint8_t> buf, const std::string& snapshot_id) override;

 private:
  // A change not yet on the medium: data (empty for zeroes) or a new length.
  struct Pending {
    char op;  // 'w', 'z' or 't'
    uint64_t offset, bytes;
    std::vector<uint8_t> data;
    bool fua;
  };

  // Records, waits, counts the instant, applies faults; EIO once cut.
  Task<Status> enter(char op, uint64_t offset, uint64_t bytes, uint32_t flags);
  void check_limits(uint64_t offset, uint64_t bytes, const void* buf);
  // [offset, offset + bytes) within max_size, without overflow.
  bool fits(uint64_t offset, uint64_t bytes) const;
  bool grow(uint64_t end);
  // Applies p to img, or (sector_mask) only the sectors the generator picks.
  static void apply(std::vector<uint8_t>& img, const Pending& p, std::mt19937_64* pick);
  void remember(Pending p);

  Options opts_;
  std::vector<uint8_t> volatile_;
  std::vector<uint8_t> durable_;
  std::vector<Pending> pending_;
  uint64_t flushed_ = 0;  // changes ever taken off pending_ (made durable)
  std::vector<Op> ops_;
  uint64_t submitted_ = 0;
  uint64_t cut_at_ = 0;
  CutMode cut_mode_ = CutMode::Drop;
  uint64_t cut_seed_ = 0;
  std::optional<std::vector<uint8_t>> cut_;
  std::shared_ptr<PowerSupply> supply_;
  std::vector<uint8_t> vmstate_;
  uint64_t limit_violations_ = 0;
  int in_flight_ = 0, peak_ = 0;
};

}  // namespace vblk
