// The backup job (see include/job/vblk/backup.h): QEMU 7.2's backup_loop on one
// asynchronous block-copy call, with the copy-before-write filter holding
// the point in time.
#include "vblk/backup.h"

#include <climits>

namespace vblk {

namespace {
constexpr unsigned kBufferedBackgroundWorkers = 4;
}  // namespace

BackupJob::BackupJob(JobManager& mgr, const std::string& id, bool auto_finalize, bool auto_dismiss)
    : BlockJob(mgr, id, auto_finalize, auto_dismiss) {}

BackupJob::~BackupJob() = default;

uint64_t BackupJob::progress_current() const { return cbw_ ? cbw_->bcs().progress_done() : 0; }
uint64_t BackupJob::progress_total() const { return cbw_ ? cbw_->bcs().progress_total() : 0; }

Task<Status> BackupJob::run() {
  // Requests that reached the source before the filter did belong to the
  // time before the snapshot: let them finish first.
  co_await source_->drain();
  Status st;
  if (sync_ == Sync::None) {
    // Fleecing: only guest writes copy (through the filter) until cancelled
    // (start_backup refuses a COW buffer here).
    while (!is_cancelled()) co_await yield();
  } else {
    BlockCopyState& bcs = cbw_->bcs();
    if (sync_ == Sync::Bitmap) co_await prepare_target(bcs);
    for (;;) {
      st = co_await copy_loop();
      if (!st.ok() || is_cancelled()) break;
      st = co_await drain_loop();
      if (!st.ok() || is_cancelled()) break;
      // Done once nothing is dirty, claimed or buffered. Bits come back
      // when a copy before a guest write failed after the background call
      // had passed: copy them too.
      if (bcs.bitmap().count() == 0 && bcs.in_flight_bytes() == 0 && cbw_->buffer_empty()) break;
    }
    if (st.ok() && !is_cancelled() && !cbw_->snapshot_error().ok()) st = cbw_->snapshot_error();
  }
  // A cancelled or failed job drops what its buffer still holds (a
  // completed one has nothing left in it).
  co_await cbw_->stop_buffer();
  co_return st;
}

// An incremental backup knows every cluster it will write before it
// starts: the target sets up their metadata at once (a fresh qcow2 overlay
// allocates its L2 tables in one batch instead of stalling the copy on
// three syncs per table). Only a hint: a failure here is left for the
// writes themselves to meet and report.
Task<void> BackupJob::prepare_target(BlockCopyState& bcs) {
  std::vector<Node::WriteRange> ranges;
  const DirtyBitmap& bm = bcs.bitmap();
  uint64_t pos = 0, off = 0, n = 0;
  while (pos < bm.size() && bm.next_dirty_area(pos, bm.size(), 0, off, n)) {
    ranges.push_back({off, n});
    pos = off + n;
  }
  if (!ranges.empty()) (void)co_await bcs.target().prepare_writes(ranges);
}

Task<std::optional<Status>> BackupJob::on_drain_error() {
  // A failed write of buffered data is a target write error like any other.
  Status err = cbw_->drain_error();
  ErrorAction act = error_action(on_target_error_, false, err.error().code);
  if (act == ErrorAction::Report) co_return err;
  if (act == ErrorAction::Stop) co_await pause_point();
  cbw_->clear_drain_error();
  co_return std::nullopt;
}

Task<Status> BackupJob::drain_loop() {
  while (!is_cancelled() && !cbw_->buffer_empty()) {
    if (!cbw_->drain_error().ok()) {
      if (auto end = co_await on_drain_error()) co_return *end;
      continue;
    }
    co_await yield();  // the drain wakes the job when it empties or fails
  }
  co_return Status{};
}

Task<Status> BackupJob::copy_loop() {
  BlockCopyState& bcs = cbw_->bcs();
  const uint64_t len = align_up(source_->length(), bcs.options().cluster_size);
  std::weak_ptr<Job> weak = weak_from_this();
  for (;;) {
    if (is_cancelled()) co_return Status{};
    // With a COW buffer, few background tasks: a guest write to a cluster
    // a task has in flight waits for that task's write to the (slow)
    // target, so the less the job has claimed, the less a guest can hit.
    call_ = bcs.copy_async(
        0, len, false,
        [weak](BlockCopyCall&) {
          if (auto j = weak.lock()) static_cast<BackupJob*>(j.get())->enter();
        },
        cow_buffer_ ? kBufferedBackgroundWorkers : 0);
    for (;;) {
      while (!call_->finished() && !is_cancelled() && cbw_->drain_error().ok()) co_await yield();
      if (call_->finished() || is_cancelled()) break;
      // The COW buffer's drain failed while the call runs.
      if (auto end = co_await on_drain_error()) {
        call_->cancel();
        co_await call_->wait();
        call_.reset();
        co_return *end;
      }
    }
    std::shared_ptr<BlockCopyCall> call = call_;
    if (!call->finished()) {
      // Cancelled: stop the call and wait for its running tasks.
      call->cancel();
      co_await call->wait();
      call_.reset();
      co_return Status{};
    }
    call_.reset();
    if (is_cancelled() || call->succeeded()) co_return Status{};
    // Cancelled by a pause: the pause is over, start a new call.
    if (call->cancelled()) continue;
    const bool is_read = call->error_is_read();
    ErrorAction act = error_action(is_read ? on_source_error_ : on_target_error_, is_read, call->status().error().code);
    if (act == ErrorAction::Report) co_return call->status();
    // Stop: pause here, before the next call; ignore: retry at once.
    if (act == ErrorAction::Stop) co_await pause_point();
  }
}

void BackupJob::on_pause() {
  if (call_ && !call_->finished()) call_->cancel();
  // Paused, the job writes nothing; the buffer keeps its data.
  if (cbw_) cbw_->set_drain_paused(true);
}

void BackupJob::on_resume() {
  if (cbw_) cbw_->set_drain_paused(false);
}

void BackupJob::query_extra(nlohmann::ordered_json& j) const {
  if (!cbw_ || !cow_buffer_) return;
  j["x-cow-buffer"] = cow_buffer_json(cbw_->buffer_stats());
}

nlohmann::ordered_json cow_buffer_json(const CowBufferStats& s) {
  nlohmann::ordered_json b;
  b["size"] = s.size;
  b["used"] = s.used;
  b["used-peak"] = s.used_peak;
  b["spill-size"] = s.spill_size;
  b["spilled"] = s.spilled;
  b["spilled-peak"] = s.spilled_peak;
  b["sync-copies"] = s.sync_copies;
  return b;
}

bool BackupJob::on_cancel(bool force) {
  (void)force;
  if (call_ && !call_->finished()) call_->cancel();
  return true;
}

void BackupJob::cleanup_sync_bitmap(bool ok) {
  if (!sync_bitmap_) return;
  NamedBitmap& parent = *sync_bitmap_;
  sync_bitmap_ = nullptr;
  BitmapSet& set = source_->bitmaps();
  const bool sync = (ok || bitmap_mode_ == "always") && bitmap_mode_ != "never";
  // Abdicate: the successor (the writes since the job started) carries the
  // name on; reclaim: nothing lost, old bits and new writes.
  NamedBitmap& bm = sync ? set.abdicate_successor(parent) : set.reclaim_successor(parent);
  // A failed `always` job: what it did not copy is still to be backed up.
  if (!ok && bitmap_mode_ == "always") bm.bits.merge_from(cbw_->bcs().bitmap());
}

void BackupJob::commit() { cleanup_sync_bitmap(true); }
void BackupJob::abort() { cleanup_sync_bitmap(false); }

void BackupJob::on_set_speed(uint64_t speed) {
  if (cbw_) cbw_->bcs().set_speed(speed);
}

namespace {
// Keeps the filter alive until requests that entered it before it left the
// graph are done (they hold no reference of their own).
Task<void> release_filter(std::shared_ptr<CopyBeforeWrite> f) {
  co_await f->drain();
  co_await f->quiesce();
}
}  // namespace

// A job that concludes as soon as it completes (auto-finalize, alone)
// holds the guest writes at the filter and lets those inside end, so that
// clean() can drop the target at once: blockdev-del of the target right
// after BLOCK_JOB_COMPLETED works, as in QEMU, whose job ends drained.
// (Not for a job that waits in pending: guest writes would wait with it.)
Task<void> BackupJob::before_exit() {
  if (cbw_ && auto_finalize() && !in_group()) co_await cbw_->hold_writes();
}

void BackupJob::clean() {
  if (cleaned_ || !cbw_) return;
  cleaned_ = true;
  graph_->remove_filter(cbw_, source_);
  cbw_->release_target();
  manager().unblock(target_.get());
  spawn_detached(release_filter(cbw_));
}

Result<std::shared_ptr<BackupJob>> start_backup(JobManager& mgr, Graph& graph, const BackupArgs& a) {
  auto not_found = [](const std::string& n) {
    return Error(ENOENT, "Cannot find device='" + n + "' nor node-name='" + n + "'");
  };
  auto src = graph.find(a.device);
  if (!src) return not_found(a.device);
  auto tgt = graph.find(a.target);
  if (!tgt) return not_found(a.target);

  // QEMU's do_backup_common: 'incremental' is 'bitmap' with on-success.
  BackupJob::Sync sync;
  std::string sync_name = a.sync;
  std::optional<std::string> mode = a.bitmap_mode;
  if (a.sync == "full") {
    sync = BackupJob::Sync::Full;
  } else if (a.sync == "top") {
    sync = BackupJob::Sync::Top;
  } else if (a.sync == "none") {
    sync = BackupJob::Sync::None;
  } else if (a.sync == "bitmap" || a.sync == "incremental") {
    if (!a.bitmap) return Error(EINVAL, "must provide a valid bitmap name for '" + a.sync + "' sync mode");
    if (a.sync == "incremental") {
      if (mode && *mode != "on-success")
        return Error(EINVAL, "Bitmap sync mode must be 'on-success' when using sync mode 'incremental'");
      mode = "on-success";
      sync_name = "bitmap";
    }
    sync = BackupJob::Sync::Bitmap;
  } else {
    return Error(EINVAL, "Parameter 'sync' does not accept value '" + a.sync + "'");
  }
  NamedBitmap* bm = nullptr;
  if (a.bitmap) {
    bm = src->bitmaps().find(*a.bitmap);
    if (!bm) return Error(ENOENT, "Bitmap '" + *a.bitmap + "' could not be found");
    if (!mode) return Error(EINVAL, "Bitmap sync mode must be given when providing a bitmap");
    VBLK_TRY(check_bitmap(*bm, kBitmapAllowRo));
    if (sync == BackupJob::Sync::None)
      return Error(EINVAL, "sync mode 'none' does not produce meaningful bitmap outputs");
    if (*mode == "never" && sync != BackupJob::Sync::Bitmap)
      return Error(
          EINVAL, "Bitmap sync mode 'never' has no meaningful effect when combined with sync mode '" + sync_name + "'");
  }
  if (!a.bitmap && a.bitmap_mode) return Error(EINVAL, "Cannot specify bitmap sync mode without a bitmap");

  if (src == tgt) return Error(EINVAL, "Source and target cannot be the same");
  // Compressed clusters are written only by drivers that store them (qcow2);
  // the name QEMU prints is the device name, empty for a daemon's nodes.
  if (a.compress && !tgt->caps().compressed_writes)
    return Error(ENOTSUP, "Compression is not supported for this drive ");
  // QEMU blocks the job's filter and its target, not the source (a second
  // backup of the same source is refused by insert_filter below); a mirror
  // blocks its source.
  VBLK_TRY(mgr.check_not_busy(src.get(), src->node_name()));
  VBLK_TRY(mgr.check_not_busy(tgt.get(), tgt->node_name()));
  if (a.max_workers < 1 || a.max_workers > INT_MAX)
    return Error(EINVAL, "max-workers must be between 1 and " + std::to_string(INT_MAX));
  if (a.max_chunk < 0) return Error(EINVAL, "max-chunk must be zero (which means no limit) or positive");
  // backup_job_create: a bitmap the job will write to must be writable.
  if (bm && *mode != "never") VBLK_TRY(check_bitmap(*bm, kBitmapDefault));
  if (src->length() != tgt->length()) return Error(EINVAL, "Source and target image have different sizes");
  const uint64_t cs = cbw_cluster_size(*tgt);
  if (a.max_chunk && static_cast<uint64_t>(a.max_chunk) < cs)
    return Error(EINVAL, "Required max-chunk (" + std::to_string(a.max_chunk) + ") is less than backup cluster size (" +
                             std::to_string(cs) + ")");
  if (tgt->read_only()) return Error(EACCES, "Block node is read-only");
  // QEMU names the job after the device when no id is given; nodes of a
  // storage daemon have no device name, so the id must be given.
  const std::string id = a.job_id.value_or(std::string());
  VBLK_TRY(mgr.check_new_id(id));
  if (a.speed && *a.speed < 0) return Error(EINVAL, "Parameter 'speed' expects a non-negative value");
  if (a.cow_buffer_size < 0) return Error(EINVAL, "cow-buffer-size must be zero (no buffer) or positive");
  if (a.cow_spill_size < 0) return Error(EINVAL, "cow-spill-size must be zero (no spill) or positive");
  if (!a.cow_buffer_size && (a.cow_spill_size || a.cow_spill_dir || !a.cow_spill_direct))
    return Error(EINVAL, "cow-spill-dir, cow-spill-size and cow-spill-direct need cow-buffer-size");
  // With sync=none the target itself is what is read (fleecing), and old
  // data still in the buffer is not on it yet: readers would see the
  // guest's new data. Buffered fleecing reads through snapshot-access.
  if (a.cow_buffer_size && sync == BackupJob::Sync::None)
    return Error(EINVAL,
                 "cow-buffer-size cannot be used with sync mode 'none': the target is read directly; "
                 "use a copy-before-write filter with x-cow-buffer-size read through snapshot-access");
  std::string fname = a.filter_node_name.value_or(std::string());
  if (!fname.empty() && graph.find(fname)) return Error(EEXIST, "Duplicate nodes with node-name='" + fname + "'");
  if (fname.empty()) fname = graph.generate_name();

  CbwOptions o;
  o.copy.cluster_size = cs;
  o.copy.max_workers = static_cast<unsigned>(a.max_workers);
  o.copy.max_chunk = static_cast<uint64_t>(a.max_chunk);
  o.copy.use_copy_range = a.use_copy_range;
  // compress=true: every data chunk (whole target clusters: the backup
  // cluster is a multiple of the target's) is stored compressed, by the job
  // and by the filter's copy-before-write alike. Zero ranges stay
  // write-zeroes, as in QEMU. Copy offload would bypass compression.
  if (a.compress) {
    o.copy.write_flags |= kReqCompressed;
    o.copy.use_copy_range = false;
  }
  o.copy.skip_unallocated = sync == BackupJob::Sync::Top;
  o.copy.detect_zeroes = a.detect_zeroes;
  o.copy.speed = a.speed ? static_cast<uint64_t>(*a.speed) : 0;
  if (a.max_memory) o.copy.max_memory = a.max_memory;
  auto cbw = std::make_shared<CopyBeforeWrite>(src->loop(), src, tgt, o);
  cbw->set_node_name(fname);
  if (a.cow_buffer_size) {
    CowBufferOptions bo;
    bo.memory_size = static_cast<uint64_t>(a.cow_buffer_size);
    bo.spill_dir = a.cow_spill_dir.value_or(std::string());
    bo.spill_size = static_cast<uint64_t>(a.cow_spill_size);
    bo.spill_direct = a.cow_spill_direct;
    VBLK_TRY(cbw->enable_buffer(bo));
  }
  // The point in time, for the bitmap too: from here the successor records
  // new writes, and sync=bitmap copies only what the bitmap has dirty
  // (backup_init_bcs_bitmap; done before any guest write can reach the
  // filter).
  if (bm) {
    VBLK_TRY(src->bitmaps().create_successor(*bm));
    if (sync == BackupJob::Sync::Bitmap) {
      cbw->bcs().bitmap().reset_all();
      cbw->bcs().bitmap().merge_from(bm->bits);
    }
  }
  if (auto st = graph.insert_filter(src, cbw); !st) {
    if (bm) src->bitmaps().reclaim_successor(*bm);
    return st.take_error();
  }

  auto created = mgr.create<BackupJob>(id, a.auto_finalize, a.auto_dismiss);
  if (!created.ok()) {
    graph.remove_filter(cbw, src);
    if (bm) src->bitmaps().reclaim_successor(*bm);
    return created.take_error();
  }
  std::shared_ptr<BackupJob> job = *created;
  job->graph_ = &graph;
  job->source_ = src;
  job->target_ = tgt;
  job->cbw_ = cbw;
  job->sync_ = sync;
  job->sync_bitmap_ = bm;
  job->bitmap_mode_ = mode.value_or(std::string());
  job->on_source_error_ = a.on_source_error;
  job->on_target_error_ = a.on_target_error;
  job->speed_ = o.copy.speed;
  job->cow_buffer_ = a.cow_buffer_size > 0;
  if (job->cow_buffer_) {
    std::weak_ptr<Job> weak = job;
    cbw->set_drain_listener([weak] {
      if (auto j = weak.lock()) static_cast<BackupJob*>(j.get())->enter();
    });
  }
  mgr.block(tgt.get(), job->type());
  if (a.start) job->start();
  return job;
}

}  // namespace vblk
