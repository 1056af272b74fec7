// BlockCopyState: the block-copy engine that convert, backup and mirror copy
// through (modelled on QEMU's block/block-copy.c after the "backup
// performance: block_status + async" series).
//
// A state copies from a source node to a target node at the same offsets. Its
// DirtyBitmap (granularity = cluster size) is the single source of truth for
// what is still to copy: a task claims a range by clearing its bits before it
// starts and sets them again if it fails, so after any sequence of calls,
// failures and cancels the bitmap says exactly which clusters the target still
// lacks. Callers may set bits at any time (a guest wrote there).
//
// A copy call over [offset, offset+bytes) walks the dirty clusters of that
// range, asks the source for block status and cuts chunks:
//   - unallocated in the source's top layer, with skip_unallocated (backup
//     sync=top): bits cleared, nothing copied, the progress total shrinks;
//   - zeroes: one target write_zeroes (may-unmap if the target's zeroed holes
//     read back as zeroes), up to 1 GiB (adjacent zero runs are coalesced);
//   - data: read into a buffer and written, or copy_range with copy offload;
// each chunk at least one cluster and at most max_chunk. Up to max_workers
// tasks per call run in parallel; data tasks first take their size from a
// memory budget shared by all calls (a task waits rather than over-allocate).
// A task starts only while the rate limit is not exceeded (overshoot ≤ one
// chunk); calls with ignore_ratelimit start at once but still count.
//
// A call that finds no dirty cluster left in its range waits for every
// in-flight task (of any call) overlapping the range and rescans, so it
// returns only when the range is copied; a task that failed gave its bits
// back and the rescan copies them again.
//
// Cancel is asynchronous: the call stops starting tasks, its running tasks
// finish (or fail and give bits back), then it completes as cancelled. A new
// call over the same range resumes exactly where the bitmap says.
//
// Ownership: the state refers to (does not own) its nodes, which must outlive
// it; it owns its bitmap. A BlockCopyCall is shared between the caller and the
// running coroutine. The state must outlive every call (destroying it with a
// call running is a programming error: it aborts). Thread-safety: one loop.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <utility>
#include <vector>

#include "vblk/buffer.h"
#include "vblk/dirty_bitmap.h"
#include "vblk/node.h"
#include "vblk/result.h"
#include "vblk/slab_pool.h"
#include "vblk/sync.h"
#include "vblk/task.h"

namespace vblk {

class BlockCopyState;
class RateLimit;

struct BlockCopyOptions {
  uint64_t cluster_size = 64 << 10;  // bitmap granularity; power of two
  // Largest chunk of one I/O operation (0: the engine's own, see below).
  uint64_t max_chunk = 0;
  // Parallel tasks per call (QEMU's x-perf.max-workers).
  unsigned max_workers = 64;
  // Bytes of data buffers in flight across all calls.
  uint64_t max_memory = 128ull << 20;
  // Try copy_range (copy_file_range) before read+write; off by default as in
  // QEMU, since an in-kernel copy can be slower than an async read/write
  // pipeline (measured in the reference series: up to 2.6x on HDDs).
  bool use_copy_range = false;
  // Skip what the source's top layer does not allocate (backup sync=top).
  bool skip_unallocated = false;
  // The target already reads as zeroes: zero chunks need no write at all.
  bool target_is_zero = false;
  // Write zeroes with may-unmap where the target reads holes back as zeroes.
  bool unmap_zeroes = true;
  uint64_t speed = 0;  // bytes per second, 0 = unlimited
  // Extra flags for target writes of data (e.g. a compressed-write flag).
  uint32_t write_flags = 0;
  // Zero detection in read data (qemu-img convert -S): aligned runs of this
  // many zero bytes (at least the target's cluster) become write_zeroes, or
  // nothing on a zeroed target, so the target stays sparse. 0 = off.
  uint64_t detect_zeroes = 0;
  // Write zero ranges as allocated data (qemu-img convert -S 0).
  bool allocate_zeroes = false;
};

// The engine's own chunk limits (max_chunk = 0).
inline constexpr uint64_t kBlockCopyDataChunk = 1 << 20;     // read+write
inline constexpr uint64_t kBlockCopyRangeChunk = 16 << 20;   // copy_range, once it has worked
inline constexpr uint64_t kBlockCopyZeroChunk = 1ull << 30;  // write_zeroes / skip

class BlockCopyCall {
 public:
  bool finished() const { return finished_; }
  bool cancelled() const { return cancelled_; }
  // Finished, not cancelled, and without error.
  bool succeeded() const { return finished_ && !cancelled_ && status_.ok(); }
  bool failed() const { return finished_ && !cancelled_ && !status_.ok(); }
  // The first error (valid once failed()), and whether a read caused it.
  const Status& status() const { return status_; }
  bool error_is_read() const { return error_is_read_; }
  // The failed chunk.
  uint64_t error_offset() const { return error_offset_; }
  uint64_t error_bytes() const { return error_bytes_; }

  // Asks the call to stop; it finishes once its running tasks are done.
  void cancel();
  // Wakes the call if it sleeps for the rate limit (set_speed does this).
  void kick();
  // Waits until the call finished.
  Task<void> wait();

  uint64_t offset() const { return offset_; }
  uint64_t bytes() const { return bytes_; }

 private:
  friend class BlockCopyState;
  explicit BlockCopyCall(BlockCopyState& s, uint64_t offset, uint64_t bytes, bool ignore_ratelimit,
                         unsigned max_workers = 0);

  BlockCopyState& s_;
  uint64_t offset_, bytes_;
  bool ignore_ratelimit_;
  bool finished_ = false;
  bool cancelled_ = false;
  bool error_is_read_ = false;
  uint64_t error_offset_ = 0, error_bytes_ = 0;
  Status status_;
  std::function<void(BlockCopyCall&)> on_done_;
  CoSemaphore workers_;  // task slots of this call
  WaitGroup running_;    // this call's tasks in flight
  CoEvent done_;
  std::stop_source sleep_stop_;  // kicks the rate-limit sleep
};

// A run of clusters being copied, by a task of the engine or under a claim
// (defined in src/copy/block_copy.cc).
struct BlockCopyInFlight;

// Clusters taken out of the engine by a copier of its own (the COW buffer,
// see claim() below): the claimed runs, in flight until end_claim.
class BlockCopyClaim {
 public:
  struct Range {
    uint64_t offset, bytes;
  };
  ~BlockCopyClaim();
  const std::vector<Range>& ranges() const { return ranges_; }

 private:
  friend class BlockCopyState;
  BlockCopyClaim() = default;
  std::vector<Range> ranges_;
  std::vector<std::unique_ptr<BlockCopyInFlight>> in_flight_;  // one per range
};

class BlockCopyState {
 public:
  BlockCopyState(Node& source, Node& target, BlockCopyOptions opts);
  ~BlockCopyState();
  BlockCopyState(const BlockCopyState&) = delete;
  BlockCopyState& operator=(const BlockCopyState&) = delete;

  DirtyBitmap& bitmap() { return bitmap_; }
  const BlockCopyOptions& options() const { return opts_; }
  Node& source() { return source_; }
  Node& target() { return target_; }

  // Copies the dirty clusters of [offset, offset+bytes) (widened to whole
  // clusters) and returns once all of them are on the target. error_is_read
  // (if given) tells a failed read from a failed write.
  Task<Status> copy(uint64_t offset, uint64_t bytes, bool ignore_ratelimit = false, bool* error_is_read = nullptr);
  // The same, running on its own; on_done runs when it finishes (from the
  // call's coroutine: it must not destroy the state). max_workers caps this
  // call's tasks below the state's (0: the state's).
  std::shared_ptr<BlockCopyCall> copy_async(uint64_t offset, uint64_t bytes, bool ignore_ratelimit = false,
                                            std::function<void(BlockCopyCall&)> on_done = {}, unsigned max_workers = 0);

  // ---- copies made outside the engine (the COW buffer)
  //
  // A copier that saves old data its own way takes the dirty clusters of a
  // range away from the engine: claim() clears their bits and puts them in
  // flight, so engine tasks and other claimers touching them wait, until
  // end_claim. With keep, the clusters stay clean: the claimer owns their
  // old data and they count as remaining work (pending) until it reports
  // them copied with add_done; without keep their bits come back.
  //
  // Returns once no task or claim overlaps the range.
  Task<void> wait_idle(uint64_t offset, uint64_t bytes);
  // Dirty bytes in the range (whole clusters, clamped to the length).
  uint64_t dirty_bytes(uint64_t offset, uint64_t bytes) const;
  // Synchronous: nothing can change the bitmap between dirty_bytes and this.
  std::unique_ptr<BlockCopyClaim> claim(uint64_t offset, uint64_t bytes);
  void end_claim(std::unique_ptr<BlockCopyClaim> c, bool keep);
  void add_done(uint64_t bytes);
  // Kept clusters that turned out to need no copy (sync=top: not allocated
  // in the source's top layer) leave the pending work.
  void drop_pending(uint64_t bytes) { pending_bytes_ -= std::min(pending_bytes_, bytes); }
  // While held, calls that respect the rate limit start no new tasks: the
  // claimer writes its data to the target first.
  void hold_background(bool on);
  // A guest request reached the source (copy-before-write notes each one).
  // For the next 100 ms, calls that honour the rate limit (the job's
  // background copy) keep one task in flight instead of max_workers, with
  // data chunks of at most 64 KiB (or a cluster), so the guest's requests
  // do not queue behind dozens of 1 MiB chunks; calls that ignore it
  // (copy-before-write itself) are not held back.
  void note_foreground() { foreground_ns_ = Loop::now_ns(); }
  // Bytes of tasks and claims in flight.
  uint64_t in_flight_bytes() const { return in_flight_bytes_; }

  // Changes the speed now and kicks every call sleeping for the limit.
  void set_speed(uint64_t bytes_per_sec);
  void set_skip_unallocated(bool on) { opts_.skip_unallocated = on; }

  // Progress: bytes copied, and done + still to copy (dirty + in flight).
  // The total shrinks when skipped ranges are found, grows if bits are set.
  uint64_t progress_done() const { return done_bytes_; }
  uint64_t progress_total() const { return done_bytes_ + bitmap_.count() + in_flight_bytes_ + pending_bytes_; }
  // The rate limit, for a claimer that writes to the target: it waits
  // rate_delay_ns() before a write and accounts its bytes, as a task does.
  uint64_t rate_delay_ns() const;
  void rate_account(uint64_t bytes);
  // Bytes of buffers held now and at most so far (tests, bench).
  uint64_t memory_in_use() const { return opts_.max_memory - memory_.available(); }
  uint64_t memory_peak() const { return memory_peak_; }
  // Whether copy offload is still tried (it turns off after a refusal).
  bool copy_range_active() const { return use_copy_range_; }

 private:
  using InFlight = BlockCopyInFlight;
  struct Chunk;
  Task<void> run_call(std::shared_ptr<BlockCopyCall> call);
  Task<bool> scan(BlockCopyCall& call);  // true if it found dirty clusters
  Task<Chunk> next_chunk(uint64_t pos, uint64_t end);
  Task<void> run_task(BlockCopyCall& call, uint64_t offset, uint64_t bytes, int kind);
  Task<Status> copy_data(uint64_t offset, uint64_t bytes, bool& error_is_read);
  Task<Status> read_write(uint64_t offset, uint64_t bytes, bool& error_is_read);
  Task<Status> write_detecting_zeroes(uint64_t offset, std::span<const uint8_t> buf);
  InFlight* find_in_flight(uint64_t offset, uint64_t end);
  // [offset, offset+bytes) widened to whole clusters, clamped to the length.
  std::pair<uint64_t, uint64_t> cluster_hull(uint64_t offset, uint64_t bytes) const;
  uint64_t data_chunk_limit() const;
  uint64_t zero_chunk_limit() const;

  Node& source_;
  Node& target_;
  BlockCopyOptions opts_;
  DirtyBitmap bitmap_;
  bool use_copy_range_;
  bool copy_range_works_ = false;  // a copy_range request succeeded: large chunks
  uint32_t zero_flags_ = 0;
  std::unique_ptr<RateLimit> rate_;
  CoSemaphore memory_;
  uint64_t memory_peak_ = 0;
  uint64_t done_bytes_ = 0;
  uint64_t in_flight_bytes_ = 0;
  uint64_t pending_bytes_ = 0;  // claimed and kept, not yet copied
  bool held_ = false;
  uint64_t foreground_ns_ = 0;         // last note_foreground(), 0: never
  std::vector<InFlight*> in_flight_;   // tasks of all calls
  std::vector<BlockCopyCall*> calls_;  // running calls (for kicks)
  // Data buffers from huge-page slabs: a 1 MiB O_DIRECT request spans one
  // or two physical segments instead of 256 pages (the virtio queue allows
  // 254), and recycled pieces cost no mmap or freshly zeroed pages per
  // chunk; sized to the chunk, so scattered 64 KiB chunks touch 64 KiB
  // each. Bounded by the memory budget every user holds its bytes of.
  SlabPool buffers_;
};

}  // namespace vblk
