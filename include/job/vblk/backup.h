// The backup job (QEMU 7.2's block/backup.c semantics on vblk's block-copy
// engine) and blockdev-backup's argument checking.
//
// start_backup inserts a copy-before-write filter above the source (every
// NodeRef to the source — exports, devices — now writes through it), then
// runs one asynchronous block-copy call over the whole disk through the
// filter's BlockCopyState: the filter copies old data before guest writes,
// the job copies the rest, and the shared bitmap makes each cluster go once.
//   - sync=full copies everything; sync=top skips what the source's top
//     layer does not allocate; sync=none copies only what guest writes
//     force out (fleecing) and runs until cancelled.
//   - pause cancels the copy call, resume starts a new one (the bitmap makes
//     it exact); set-speed changes the engine's rate limit at once.
//   - a failed call follows on-source-error (read) / on-target-error (write):
//     report ends the job with the error, ignore retries, stop pauses the
//     job (io-status failed/nospace, BLOCK_JOB_ERROR) until resumed;
//     enospc/auto stop on ENOSPC and report otherwise.
//   - with a COW buffer, the job completes only once the background call
//     is done and the buffer empty; a failed drain write follows
//     on-target-error like a failed copy (stop pauses the job with the data
//     kept, resume writes it); pause stops the drain, cancel drops the
//     buffer. query-jobs / query-block-jobs add "x-cow-buffer".
//   - with a named bitmap of the source (QEMU's sync=bitmap / incremental,
//     bitmap-mode on-success / never / always): sync=bitmap copies only the
//     clusters the bitmap has dirty; the bitmap is frozen (busy) for the
//     job while a successor records new writes; when the job ends the
//     successor replaces it (success, or `always`) or is merged back
//     (failure, cancel, or `never`), and a failed `always` job adds back
//     what it did not copy.
// When the job ends (completed, failed or cancelled) the filter is removed
// and the NodeRefs point at the source again.
//
// Ownership: the job holds the source, target and filter; the graph and the
// JobManager must outlive it. One loop.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "vblk/copy_before_write.h"
#include "vblk/graph.h"
#include "vblk/job.h"
#include "vblk/named_bitmap.h"

namespace vblk {

struct BackupArgs {
  std::optional<std::string> job_id;
  std::string device;  // node name of the source
  std::string target;  // node name of the target
  std::string sync;    // full | top | none | bitmap | incremental
  std::optional<int64_t> speed;
  std::optional<std::string> bitmap;
  std::optional<std::string> bitmap_mode;
  bool compress = false;
  OnError on_source_error = OnError::Report;
  OnError on_target_error = OnError::Report;
  bool auto_finalize = true;
  bool auto_dismiss = true;
  // false: the job is left in state created (a transaction starts it at
  // commit, or cancels it at abort).
  bool start = true;
  std::optional<std::string> filter_node_name;
  // x-perf
  bool use_copy_range = false;
  int64_t max_workers = 64;
  int64_t max_chunk = 0;
  // vblk: the engine's memory cap for this job (0: the engine's default).
  uint64_t max_memory = 0;
  // vblk: the COW buffer (x-perf cow-buffer-size, cow-spill-dir,
  // cow-spill-size, cow-spill-direct; see include/copy/vblk/cow_buffer.h).
  int64_t cow_buffer_size = 0;
  std::optional<std::string> cow_spill_dir;
  int64_t cow_spill_size = 0;
  bool cow_spill_direct = true;  // x-perf cow-spill-direct
  // vblk's CLI: zero runs of this many bytes (aligned) in the data read
  // become write-zeroes on the target (BlockCopyOptions::detect_zeroes);
  // 0: off, as QMP's blockdev-backup, where the target node's own
  // detect-zeroes option decides.
  uint64_t detect_zeroes = 0;
};

class BackupJob : public BlockJob {
 public:
  BackupJob(JobManager& mgr, const std::string& id, bool auto_finalize, bool auto_dismiss);
  ~BackupJob() override;
  const char* type() const override { return "backup"; }
  uint64_t progress_current() const override;
  uint64_t progress_total() const override;
  CopyBeforeWrite& filter() { return *cbw_; }
  void query_extra(nlohmann::ordered_json& j) const override;
  std::shared_ptr<Node> filter_node() const { return cbw_; }

 protected:
  Task<Status> run() override;
  void on_pause() override;
  void on_resume() override;
  bool on_cancel(bool force) override;
  void on_set_speed(uint64_t speed) override;
  void commit() override;
  void abort() override;
  void clean() override;
  Task<void> before_exit() override;

 private:
  friend Result<std::shared_ptr<BackupJob>> start_backup(JobManager& mgr, Graph& graph, const BackupArgs& args);
  Task<void> prepare_target(BlockCopyState& bcs);
  Task<Status> copy_loop();
  // Waits until the COW buffer is empty (ok) or a drain write failed and
  // the error policy says to report it.
  Task<Status> drain_loop();
  // A failed drain write under on-target-error: the status that ends the
  // job, or nullopt to go on (after a stop's pause, or at once for ignore).
  Task<std::optional<Status>> on_drain_error();
  // QEMU's backup_cleanup_sync_bitmap.
  void cleanup_sync_bitmap(bool ok);

  Graph* graph_ = nullptr;
  std::shared_ptr<Node> source_, target_;
  std::shared_ptr<CopyBeforeWrite> cbw_;
  enum class Sync { Full, Top, None, Bitmap } sync_ = Sync::Full;
  NamedBitmap* sync_bitmap_ = nullptr;  // on source_; busy while the job has it
  std::string bitmap_mode_;             // on-success | never | always
  OnError on_source_error_ = OnError::Report, on_target_error_ = OnError::Report;
  std::shared_ptr<BlockCopyCall> call_;  // the background call, if any
  bool cleaned_ = false;
  bool cow_buffer_ = false;
};

// The x-cow-buffer member of query-jobs / query-block-jobs (and of
// query-named-block-nodes for a copy-before-write filter with a buffer).
nlohmann::ordered_json cow_buffer_json(const CowBufferStats& s);

// Checks the arguments as QEMU's blockdev-backup does (same messages, same
// order), inserts the filter, creates and starts the job.
Result<std::shared_ptr<BackupJob>> start_backup(JobManager& mgr, Graph& graph, const BackupArgs& args);

}  // namespace vblk
