// MirrorTop: the filter a mirror job puts above its source (QEMU 7.2's
// mirror_top driver). Every user of the source (NBD exports, devices: its
// NodeRefs) goes through it while the job runs, so the job sees each guest
// write:
//   - recording (background copy mode, and any mode until the job has built
//     its first dirty bitmap): the write goes to the source, then its
//     clusters are marked dirty in the job's BlockCopyState and the job is
//     woken to copy them;
//   - write-blocking: the write goes to the source and then, before the
//     guest sees it complete, to the target too (QEMU's
//     do_sync_target_write): clusters it covers whole become clean, dirty
//     clusters it covers only in part stay dirty for the background copy.
//     Overlapping write-blocking writes run one after another, and each
//     first waits for the engine's tasks and claims on its clusters, so
//     source and target see the same order. A failed target write marks
//     the clusters dirty again and goes to the job's error policy; the guest
//     write itself succeeds (as in QEMU).
//   - covering (block-stream, which copies into the source itself): a
//     write waits for the engine's tasks and claims on its clusters, keeps
//     them claimed while it writes, and leaves them clean: a cluster the
//     guest wrote is allocated in the source and needs no copy, and no
//     copy of the old data can land over the guest's.
// To finish, the job holds the filter: new writes wait at its entry and the
// writes inside complete; the job then checks that source and target agree.
// release(dest) lets the held writes go on to dest: the target after
// block-job-complete switched the users over, else the source.
//
// Ownership: the filter owns its child (the source) like any filter; the
// job owns the BlockCopyState and must detach() before destroying it.
// Thread-safety: one loop.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "vblk/block_copy.h"
#include "vblk/filter_node.h"
#include "vblk/sync.h"

namespace vblk {

class MirrorTop : public FilterNode {
 public:
  // `driver`: what query-named-block-nodes shows (QEMU's mirror_top,
  // commit_top or copy-on-read).
  MirrorTop(Loop& loop, std::shared_ptr<Node> source, std::string driver = "mirror_top");
  ~MirrorTop() override;

  Node& source() const { return filtered(); }

  // Connects the job: guest writes dirty `bcs`'s bitmap and call `kick`.
  void attach(BlockCopyState* bcs, std::function<void()> kick);
  // From now on writes also go to the target synchronously.
  // `on_error(err)` reports a failed target write to the job.
  void start_write_blocking(std::function<void(int err)> on_error);
  // Guest writes cover their clusters (see above); set before attach().
  void set_covering(bool on) { covering_ = on; }
  // Covering: the clusters of the writes under way are theirs once they
  // land, so clean. A write that started before the job's first bitmap
  // claimed nothing, and a bitmap built meanwhile may mark its clusters:
  // the engine's copy of the old data would then land after the guest's.
  void clean_under_writes();
  // An active commit's filter (QEMU's is_commit): the layers above the base
  // are claimed without consistent read by the job, so the filter does not
  // pass consistent read down, and it shares write (or the job would block
  // its own writes into the base below).
  void set_commit(bool on) { commit_ = on; }
  PermPair child_perm(const Child& c, PermPair self) const override;
  // Writes stop touching the job's state (before it is destroyed).
  void detach();
  // Bytes write-blocking writes put on the target (progress).
  uint64_t active_bytes_done() const { return active_done_; }
  uint64_t active_bytes_in_flight() const { return active_in_flight_; }

  // Waits until no write is inside the filter.
  Task<void> quiesce() { co_await inside_.wait(); }
  // Lets the requests that were already under way on the source when the
  // filter was put above it finish (an NBD request writes to the node it
  // looked up when it started, so these do not pass here: nothing marks
  // them dirty or sends them to the target). New requests, reads too,
  // wait at the entry meanwhile, so the source runs dry even under load
  // (QEMU drains the source around bdrv_append of its mirror_top).
  Task<void> drain_source();
  // New writes wait at the entry; returns once no write is inside.
  Task<void> hold();
  // Reads too: returns once no request at all is inside (the job's end,
  // so that the filter can let go of its child at once).
  Task<void> hold_all();
  // While held: the filter's child becomes `n` (the mirror's target after
  // the switch), so the old one (the source) has no parent left. Held and
  // later requests go to `n` once released.
  void refilter(std::shared_ptr<Node> n) { set_filtered(std::move(n)); }
  // Lets held (and later) writes go to `dest` (nullptr: the source).
  void release(std::shared_ptr<Node> dest);

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override;
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override;
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override;
  Task<Status> do_flush() override;

 private:
  enum class Method { Copy, Zero, Discard };
  struct ActiveOp {
    uint64_t begin, end;
    std::vector<std::coroutine_handle<>> waiters;
  };
  // The write path shared by the three kinds of write.
  Task<Status> write_common(Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf, uint32_t flags);
  Task<Status> do_method(Node& n, Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf,
                         uint32_t flags);
  // Waits for overlapping write-blocking writes and engine tasks on
  // [begin, end), then registers `op` there.
  Task<void> enter_range(ActiveOp& op);
  void leave_range(ActiveOp& op);
  // covering: the source write with its clusters claimed, then clean.
  Task<Status> write_covering(Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf, uint32_t flags);
  // write-blocking: source, then target, with the bitmap kept exact.
  Task<Status> write_blocking(Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf, uint32_t flags);
  Node& dest() const { return dest_ ? *dest_ : filtered(); }

  BlockCopyState* bcs_ = nullptr;
  std::function<void()> kick_;
  std::function<void(int)> on_error_;
  bool write_blocking_ = false;
  bool covering_ = false;
  bool commit_ = false;
  uint64_t active_done_ = 0, active_in_flight_ = 0;
  std::vector<ActiveOp*> active_;  // write-blocking and covering writes in progress
  // Holding: writes inside the filter, and the gate at its entry.
  bool held_ = false;
  bool hold_reads_ = false;  // drain_source(): reads wait at the entry too
  CoEvent unheld_;
  WaitGroup inside_;
  WaitGroup reads_inside_;      // for hold_all()
  std::shared_ptr<Node> dest_;  // after release(target)
};

}  // namespace vblk
