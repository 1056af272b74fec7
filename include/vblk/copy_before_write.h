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
// Ownership: the filter owns references to its children (`file` = source,
// `target`) and its BlockCopyState. Thread-safety: one loop.
#pragma once

#include <memory>
#include <vector>

#include "vblk/block_copy.h"
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
  // Copies the old data under [offset, offset+bytes) if still needed.
  Task<Status> copy_before_write(uint64_t offset, uint64_t bytes);

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

 private:
  Node* target_;
  OnCbwError on_error_;
  uint64_t timeout_ns_;
  Status snapshot_error_;
  std::unique_ptr<BlockCopyState> bcs_;
  WaitGroup orphans_;  // timed-out copy calls still running
};

// The block-copy cluster size QEMU picks for a target: the target's
// cluster size, at least 64 KiB.
uint64_t cbw_cluster_size(const Node& target);

}  // namespace vblk
