// The mirror job (QEMU 7.2's block/mirror.c semantics on vblk's block-copy
// engine) and blockdev-mirror's argument checking.
//
// start_mirror inserts a MirrorTop filter above the source (every NodeRef of
// the source — exports, devices — now goes through it) and starts the job:
//   - the engine's dirty bitmap says what the target still lacks: all of it
//     for sync=full, what the source's top layer allocates for sync=top
//     (the target is expected to have the backing chain), nothing for
//     sync=none; guest writes add to it (copy-mode background), or go to
//     the target as well before they complete (write-blocking);
//   - the job copies dirty clusters with one engine call at a time
//     (granularity = the bitmap's cluster, buf-size = the engine's memory
//     cap, speed = its rate limit) until nothing is dirty or in flight,
//     flushes the target and becomes ready (BLOCK_JOB_READY), then keeps
//     copying what guest writes dirty;
//   - block-job-complete (or a soft block-job-cancel once ready) waits until
//     source and target agree with the filter holding new writes; then
//     complete re-points the filter's users (exports) at the target and a
//     soft cancel leaves them on the source, a consistent copy behind. A
//     forced cancel (or any cancel before ready) stops at once.
//   - a failed copy follows on-source-error / on-target-error as backup's
//     does; a failed write-blocking target write follows on-target-error.
// The job's progress is QEMU's: bytes copied (background and write-blocking)
// against those plus what is still dirty or in flight.
//
// Ownership: the job holds source, target (through a NodeRef with QEMU's
// target permissions) and filter; the graph and JobManager outlive it.
// One loop.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vblk/block_copy.h"
#include "vblk/graph.h"
#include "vblk/job.h"
#include "vblk/mirror_top.h"
#include "vblk/node_ref.h"

namespace vblk {

struct MirrorArgs {
  std::optional<std::string> job_id;
  std::string device;  // node name of the source (a root node)
  std::string target;  // node name of the target
  std::optional<std::string> replaces;
  std::string sync;  // full | top | none (incremental, bitmap: refused as QEMU 7.2 does)
  std::optional<int64_t> speed;
  uint64_t granularity = 0;  // 0: the target's default bitmap granularity
  int64_t buf_size = 0;      // 0: 16 MiB
  OnError on_source_error = OnError::Report;
  OnError on_target_error = OnError::Report;
  bool unmap = true;
  std::optional<std::string> filter_node_name;
  bool write_blocking = false;  // copy-mode
  bool auto_finalize = true;
  bool auto_dismiss = true;
  // drive-mirror: the backing file the target takes when the job ends
  // without an error (the source's backing node, or the source for
  // sync=none); its header already names it.
  std::shared_ptr<Node> target_backing;
  // drive-mirror: the job made the target; one it did not switch to is
  // closed when the job ends (QEMU frees it), so its file is free again.
  bool owns_target = false;
};

struct MirrorJobParams;

class MirrorJob : public BlockJob {
 public:
  MirrorJob(JobManager& mgr, const std::string& id, bool auto_finalize, bool auto_dismiss);
  ~MirrorJob() override;
  // An active commit is a mirror into the base (QEMU's commit_active_start).
  // An intermediate commit and block-stream run on it too: they copy once
  // and then relink the chain (no ready, no complete).
  enum class Sync { Full, Top, None, Commit, CommitIntermediate, Stream };
  const char* type() const override {
    if (sync_ == Sync::Stream) return "stream";
    if (sync_ == Sync::Commit || sync_ == Sync::CommitIntermediate) return "commit";
    return "mirror";
  }
  uint64_t progress_current() const override;
  uint64_t progress_total() const override;
  std::shared_ptr<Node> filter_node() const { return filter_; }

 protected:
  Task<Status> run() override;
  void on_pause() override;
  bool on_cancel(bool force) override;
  void on_set_speed(uint64_t speed) override;
  Status on_complete() override;
  Status prepare() override;
  void abort() override;
  void clean() override;
  Task<void> before_exit() override;

 private:
  friend Result<std::shared_ptr<MirrorJob>> start_mirror_job(JobManager& mgr, Graph& graph,
                                                             const std::shared_ptr<Node>& src,
                                                             const std::shared_ptr<Node>& tgt,
                                                             const MirrorJobParams& p);
  // Marks what the first pass must copy.
  Task<Status> init_bitmap();
  // Copies until nothing is dirty (ok), or the error that ends the job;
  // returns early (ok) when paused or cancelled.
  Task<Status> copy_pass();
  // Flushes the target under on-target-error (ok, or the error that ends
  // the job).
  Task<Status> flush_target();
  // A write-blocking target write failed (from the filter).
  void on_active_error(int err);
  // QEMU's mirror_exit_common: the filter leaves the graph; its users go to
  // the target when the job completes, back to the source otherwise.
  void exit_common(bool switch_to_target);
  // The jobs that end on their own once copied (stream, intermediate commit).
  bool auto_complete() const { return sync_ == Sync::Stream || sync_ == Sync::CommitIntermediate; }
  // Their last step: the new backing link (QEMU's stream_prepare,
  // bdrv_drop_intermediate).
  Task<Status> relink();
  bool can_complete() const override { return !auto_complete(); }

  Graph* graph_ = nullptr;
  std::shared_ptr<Node> source_, target_;
  NodeRef target_ref_;  // the job's use of the target (write, shares only write-unchanged)
  // Commit's and stream's claims on the layers they copy out of or past
  // (QEMU's block_job_add_bdrv "intermediate node"): nobody resizes them,
  // nor writes a layer a stream reads, nor reads the moving layers of an
  // active commit. Released with target_ref_.
  std::vector<NodeRef> chain_claims_;
  std::shared_ptr<MirrorTop> filter_;
  std::unique_ptr<BlockCopyState> bcs_;
  Sync sync_ = Sync::Full;
  bool write_blocking_ = false;
  OnError on_source_error_ = OnError::Report, on_target_error_ = OnError::Report;
  std::shared_ptr<BlockCopyCall> call_;
  bool should_complete_ = false;
  bool exited_ = false, cleaned_ = false;
  bool quiesced_ = false;  // before_exit held every request at the filter
  Status active_error_;    // a write-blocking target write failed under report
  Status ignored_error_;   // a stream's first error under `ignore`: it ends with it
  uint64_t len_ = 0;
  // stream: the new backing (nullptr: none); intermediate commit: the node
  // whose backing becomes the base. The name and format recorded for it.
  std::shared_ptr<Node> new_backing_, overlay_, target_backing_;
  bool owns_target_ = false, switched_ = false;
  std::string backing_str_;
  bool started_copy_ = false;                  // past the size check: progress counts
  bool idle_ = false;                          // ready and waiting for guest writes
  uint64_t final_done_ = 0, final_total_ = 0;  // progress once the engine is gone
};

// What mirror_start_job takes, once the command's own checks are done.
struct MirrorJobParams {
  std::string job_id;
  std::string filter_node_name;
  MirrorJob::Sync sync = MirrorJob::Sync::Full;
  uint64_t granularity = 0;
  int64_t buf_size = 0;
  std::optional<int64_t> speed;
  OnError on_source_error = OnError::Report;
  OnError on_target_error = OnError::Report;
  bool unmap = true;
  bool write_blocking = false;
  bool auto_finalize = true;
  bool auto_dismiss = true;
  // What query-named-block-nodes calls the filter.
  std::string driver = "mirror_top";
  // block_job_create before the filter (commit_start's order).
  bool job_before_filter = false;
  // Stream / intermediate commit: see MirrorJob::new_backing_, overlay_.
  std::shared_ptr<Node> new_backing, overlay;
  std::string backing_str;
  std::shared_ptr<Node> target_backing;  // see MirrorArgs
  bool owns_target = false;              // see MirrorArgs
};

// QEMU's mirror_start_job: its checks (buf-size, into itself, filter node
// name, job id, speed, the target's permissions) in its order, then the
// filter and the job (blockdev-mirror and block-commit's active commit).
Result<std::shared_ptr<MirrorJob>> start_mirror_job(JobManager& mgr, Graph& graph, const std::shared_ptr<Node>& src,
                                                    const std::shared_ptr<Node>& tgt, const MirrorJobParams& p);

// Checks the arguments as QEMU's blockdev-mirror does (same messages, same
// order), inserts the filter, creates and starts the job.
Result<std::shared_ptr<MirrorJob>> start_mirror(JobManager& mgr, Graph& graph, const MirrorArgs& args);

}  // namespace vblk
