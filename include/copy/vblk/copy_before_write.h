// CopyBeforeWrite: the filter that makes a backup point-in-time (QEMU 7.2's
// copy-before-write driver). It sits above the source; every guest write,
// write_zeroes or discard first copies the old data of the still-dirty
// clusters it touches to the target, through the filter's BlockCopyState
// (ignoring the rate limit, but counted against it), and only then goes to
// the source. Reads, flushes and block status pass through.
//
// The BlockCopyState's bitmap says which clusters the target still lacks; a
// backup job copies the rest in the background through the same state, so a
// cluster is copied once, and a guest write and a background task on the same
// cluster wait for each other (the engine's in-flight tracking).
//
// When a copy fails: on-cbw-error=break-guest-write fails the guest write
// (the snapshot stays valid); break-snapshot lets the guest write through
// and breaks the snapshot (snapshot_error() tells; later writes no longer
// copy). cbw-timeout (seconds, 0 = none) bounds how long a guest write waits
// for its copy: a timeout is an ETIMEDOUT copy failure.
//
// The COW buffer (CbwOptions::buffer.memory_size > 0; x-perf.cow-buffer-size
// of blockdev-backup, x-cow-buffer-size of the filter): a guest write to
// clusters not yet copied claims them in the BlockCopyState (waiting for
// overlapping tasks; concurrent writers to them wait for the claim), reads
// their old data into the CowBuffer (memory, then the spill file) and goes
// on at once. A drain writes the buffer to the target, oldest first, ahead
// of the background copy (held while the buffer has data) and through the
// same rate limit. A drain write that fails keeps its data in the buffer
// and stops the drain with drain_error(), for the job's error policy; the
// data is never read from the source again, since the guest has overwritten
// it there. With buffer and spill full, the guest write copies
// synchronously as without a buffer (sync_copies counts these).
//
// Ownership: the filter owns references to its children (`file` = source,
// `target`), its BlockCopyState and its CowBuffer. Thread-safety: one loop.
#pragma once

#include <coroutine>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "vblk/block_copy.h"
#include "vblk/cow_buffer.h"
#include "vblk/filter_node.h"
#include "vblk/node.h"
#include "vblk/sync.h"

namespace vblk {

enum class OnCbwError { BreakGuestWrite, BreakSnapshot };

struct CbwOptions {
  BlockCopyOptions copy;  // cluster_size 0: max(64 KiB, target's cluster)
  OnCbwError on_error = OnCbwError::BreakGuestWrite;
  uint32_t timeout_s = 0;
};

class CopyBeforeWrite : public FilterNode {
 public:
  CopyBeforeWrite(Loop& loop, std::shared_ptr<Node> file, std::shared_ptr<Node> target, CbwOptions opts);
  ~CopyBeforeWrite() override;

  BlockCopyState& bcs() { return *bcs_; }
  Node& source() const { return filtered(); }
  Node& target() const { return *target_; }
  // The first copy error under break-snapshot (ok while the snapshot holds).
  const Status& snapshot_error() const { return snapshot_error_; }
  // Waits for copies that outlived a timed-out guest write.
  Task<void> quiesce();
  // A backup job that is done: new writes wait at the filter's entry, and
  // this returns once the writes inside are done (quiet() then holds
  // until release_target). QEMU's job ends in a drained section; this is
  // its equivalent, so that the job's end lets go of the target at once.
  Task<void> hold_writes();
  bool quiet() const { return quiet_; }
  // The filter has left the graph: it drops its target (blockdev-del may
  // take it now) if quiet, and lets the held writes go on to the source
  // without copying anything.
  void release_target();
  // Copies the old data under [offset, offset+bytes) if still needed.
  Task<Status> copy_before_write(uint64_t offset, uint64_t bytes);

  // ---- the COW buffer (copy_before_write_buffer.cc)
  // Creates the buffer (before the filter sees writes).
  Status enable_buffer(const CowBufferOptions& opts);
  bool has_buffer() const { return buffer_ != nullptr; }
  CowBufferStats buffer_stats() const;
  bool buffer_empty() const { return !buffer_ || buffer_->empty(); }
  // The first failed drain write since the last clear (ok otherwise); the
  // drain waits until clear_drain_error().
  const Status& drain_error() const { return drain_error_; }
  void clear_drain_error();
  // A paused drain keeps its data and writes nothing (a paused job).
  void set_drain_paused(bool paused);
  // Called when the buffer became empty or the drain failed (the job waits
  // for either).
  void set_drain_listener(std::function<void()> fn) { drain_listener_ = std::move(fn); }
  // Stops the drain, waits for its writes and for guest writes filling the
  // buffer, and frees it; what it held is dropped (a cancelled backup).
  Task<void> stop_buffer();

  std::string filename() const override { return filtered().filename(); }
  // The target is written by the filter alone and must keep its size; the
  // source, once the filter has users that write, is read consistently
  // and written by nobody else (QEMU's cbw_child_perm).
  PermPair child_perm(const Child& c, PermPair self) const override;

 protected:
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override;
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_truncate(uint64_t length, bool exact) override;
  Task<Status> do_close() override;

 private:
  // copy_before_write past the hold_writes gate.
  Task<Status> copy_old_data(uint64_t offset, uint64_t bytes);
  // The buffered copy-before-write of [begin, end): nullopt when buffer and
  // spill are full (the caller copies synchronously).
  Task<std::optional<Status>> buffered_copy(uint64_t begin, uint64_t end);
  void kick_drain();
  Task<void> drain_loop();
  Task<void> drain_one(uint64_t offset);
  void notify_drain_listener();

  Node* target_;
  OnCbwError on_error_;
  uint64_t timeout_ns_;
  Status snapshot_error_;
  std::unique_ptr<BlockCopyState> bcs_;
  WaitGroup orphans_;  // timed-out copy calls still running
  // hold_writes / release_target: the gate at the writes' entry.
  bool held_ = false, quiet_ = false, detached_ = false;
  CoEvent unheld_;
  WaitGroup inside_;  // writes past the gate

  std::unique_ptr<CowBuffer> buffer_;
  uint64_t sync_copies_ = 0;    // copies made synchronously because the buffer was full
  CowBufferStats final_stats_;  // the buffer's counters when stop_buffer freed it
  Status drain_error_;
  bool drain_paused_ = false;
  bool drain_running_ = false;  // drain_loop exists
  bool buffer_stopping_ = false;
  unsigned drain_writes_ = 0;  // drain writes in flight
  CoEvent drain_wake_;
  WaitGroup buffer_users_;  // drain loop, drain writes, buffered copies
  std::function<void()> drain_listener_;

 public:
  // ---- Fleecing: the snapshot API (QEMU 7.2's bdrv_co_preadv_snapshot,
  // bdrv_co_snapshot_block_status, bdrv_co_pdiscard_snapshot), which the
  // snapshot-access driver exposes. In copy_before_write_snapshot.cc.
  //
  // The snapshot is the source as it was when the filter was created,
  // limited to access_bitmap(): the clusters that were then to be copied
  // (all, or those of the `bitmap` option). A snapshot cluster reads from
  // the target once a copy-before-write has put it there (done_bitmap()),
  // else from the source, registered as a frozen read meanwhile: a guest
  // write that has copied its old data waits for the frozen reads over its
  // clusters before it changes the source. Outside the access bitmap, or
  // once break-snapshot broke the snapshot, requests fail with EACCES.
  //
  // The point in time: the access bitmap starts as the block-copy bitmap
  // is now (the constructor calls it; call again after changing that bitmap
  // before any write, as the `bitmap` option does).
  void snapshot_begin();
  Task<Status> snapshot_read(uint64_t offset, std::span<uint8_t> buf);
  // The status of the child that [offset, ...) is read from (one run).
  Task<Result<BlockStatus>> snapshot_block_status(uint64_t offset, uint64_t bytes);
  // Drops the whole clusters of the range from the snapshot: no longer
  // readable, no longer copied before writes, discarded on the target.
  Task<Status> snapshot_discard(uint64_t offset, uint64_t bytes);
  const DirtyBitmap& access_bitmap() const { return *access_; }
  const DirtyBitmap& done_bitmap() const { return *done_; }

 private:
  struct FrozenRead;
  // Where a run of the snapshot is read from: old data still in the COW
  // buffer first (it is not on the target yet, whatever done says), then
  // the target where done, else the source.
  enum class SnapshotFrom { Buffer, Target, Source };
  struct SnapshotSpan {
    SnapshotFrom from;
    uint64_t bytes;
  };
  // The run of the snapshot at offset (at most bytes) and where it is, with
  // a read of the source registered in `fr`; nullopt if not readable.
  std::optional<SnapshotSpan> snapshot_lock(uint64_t offset, uint64_t bytes, FrozenRead& fr);
  void snapshot_unlock(FrozenRead& fr);
  // After the copy-before-write of [begin, end): marks it done if copied,
  // then waits for the frozen reads over it.
  Task<void> snapshot_release(uint64_t begin, uint64_t end, bool copied);

  std::optional<DirtyBitmap> access_;  // set by snapshot_begin()
  std::optional<DirtyBitmap> done_;
  std::vector<FrozenRead*> frozen_reads_;  // in the readers' frames
};

// The block-copy cluster size QEMU picks for a target: the target's
// cluster size, at least 64 KiB.
uint64_t cbw_cluster_size(const Node& target);

}  // namespace vblk
