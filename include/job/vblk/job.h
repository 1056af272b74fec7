// Jobs: long-running background operations (backup, later mirror, stream,
// commit) with QEMU's job model, so a QMP client sees the same states, verbs,
// errors and events from vblk as from qemu-storage-daemon.
//
// A Job is a coroutine (run()) plus a state machine. The states and the legal
// transitions between them, and which verb a state accepts, are QEMU's tables
// (job.c: JobSTT and JobVerbTable); an illegal transition is a programming
// error (abort), an illegal verb an Error worded as QEMU words it.
//
// Life of a job: created (paused, pause count 1) → start(): running; run()
// returns → waiting → pending → (auto-finalize, or the finalize verb)
// prepare → commit or abort → clean → concluded → (auto-dismiss, or the
// dismiss verb) null, when the manager drops it. A failed or cancelled job
// goes aborting → abort → clean → concluded instead. There are no
// transactions: each job is a transaction of one.
//
// Pausing counts: every pause (user, error policy, internal) increments the
// pause count; the job stops at its next pause point (pause_point(),
// yield(), sleep()) while the count is non-zero, in state paused (or standby
// when it was ready).
//
// BlockJob adds what block jobs have: a speed, an io-status, the device
// name (the job id in QMP output) and the BLOCK_JOB_* events.
//
// Ownership: the JobManager owns jobs by id; a running job also holds a
// reference to itself until its coroutine has returned. Thread-safety: one
// Loop; everything runs on it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "vblk/loop.h"
#include "vblk/result.h"
#include "vblk/task.h"

namespace vblk {

enum class JobStatus {
  Undefined,
  Created,
  Running,
  Paused,
  Ready,
  Standby,
  Waiting,
  Pending,
  Aborting,
  Concluded,
  Null
};
inline constexpr int kJobStatusCount = 11;
enum class JobVerb { Cancel, Pause, Resume, SetSpeed, Complete, Finalize, Dismiss };
inline constexpr int kJobVerbCount = 7;

// QEMU's id_wellformed (job ids, node names): a letter, then letters,
// digits, '-', '.', '_'.
bool id_wellformed(const std::string& id);

const char* job_status_name(JobStatus s);  // "running", ...
const char* job_verb_name(JobVerb v);      // "set-speed", ...
// QEMU's transition table: may a job go from `from` to `to`?
bool job_transition_allowed(JobStatus from, JobStatus to);
// QEMU's verb table: does a job in state `s` accept verb `v`?
bool job_verb_allowed(JobVerb v, JobStatus s);

// Events go out as (name, data) to whoever listens (QMP adds the timestamp).
using JobEventSink = std::function<void(const std::string& name, const nlohmann::ordered_json& data)>;

class JobManager;
class Job;

// Jobs that complete or fail together (QEMU's JobTxn, a transaction with
// completion-mode grouped): none is finalized before all have finished
// their work; when one fails or is cancelled, the others are cancelled and
// all are aborted. Finalization runs in list order (newest member first,
// as QEMU inserts them).
struct JobGroup {
  std::vector<std::shared_ptr<Job>> jobs;
  bool aborting = false;
};

class Job : public std::enable_shared_from_this<Job> {
 public:
  virtual ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  const std::string& id() const { return id_; }
  JobStatus status() const { return status_; }
  virtual const char* type() const = 0;  // "backup", ...
  bool busy() const { return busy_; }
  bool paused() const { return pause_count_ > 0; }  // what query-block-jobs shows
  int pause_count() const { return pause_count_; }
  bool user_paused() const { return user_paused_; }
  bool auto_finalize() const { return auto_finalize_; }
  bool auto_dismiss() const { return auto_dismiss_; }
  bool started() const { return started_; }
  // cancel was asked for (soft or forced) / the job is really being cancelled.
  bool cancel_requested() const { return cancelled_; }
  bool is_cancelled() const { return force_cancel_; }
  bool is_ready() const { return status_ == JobStatus::Ready || status_ == JobStatus::Standby; }
  bool is_completed() const;
  // The job's result once run() returned: ok, or its error.
  const Status& result() const { return ret_; }
  // The error text QMP shows (empty while the job has no error).
  std::string error_text() const;

  // Progress (query-jobs current-progress / total-progress; block jobs'
  // offset / len).
  virtual uint64_t progress_current() const { return progress_current_; }
  virtual uint64_t progress_total() const { return progress_total_; }

  // ---- verbs (QMP job-* and block-job-*); errors are QEMU's messages.
  Status user_pause();
  Status user_resume();
  Status user_cancel(bool force);
  Status complete();
  Status finalize();
  Status dismiss();

  // Starts the job: created → running, run() begins.
  void start();
  // Makes the job a member of `g` (before start()).
  void join_group(const std::shared_ptr<JobGroup>& g);
  bool in_group() const { return group_ != nullptr; }
  // Internal pause / resume (error policy stop uses pause()).
  void pause();
  void resume();

  // {"id","type","status","current-progress","total-progress","error"?}
  nlohmann::ordered_json query_job() const;
  // Members a job type adds to its query-jobs / query-block-jobs entries.
  virtual void query_extra(nlohmann::ordered_json& j) const { (void)j; }

 protected:
  Job(JobManager& mgr, std::string id, bool auto_finalize, bool auto_dismiss);

  // The job's body. Returns its result; cancellation is seen through
  // is_cancelled() (a cancelled job's ok result becomes ECANCELED).
  virtual Task<Status> run() = 0;
  // After run(), before the job completes (and, auto-finalized, concludes
  // at once): where a job quiesces what its completion must find quiet.
  virtual Task<void> before_exit() { co_return; }
  // Driver hooks, QEMU's JobDriver callbacks.
  virtual void on_pause() {}        // at a pause point, before stopping
  virtual void on_resume() {}       // at a pause point, after the pause
  virtual void on_user_resume() {}  // a user resume (or cancel of a paused job)
  // Returns whether the cancel is forced (no soft cancel: always).
  virtual bool on_cancel(bool force) {
    (void)force;
    return true;
  }
  // Returns false when the job cannot be completed (no complete callback).
  virtual bool can_complete() const { return false; }
  virtual Status on_complete() { return {}; }
  virtual Status prepare() { return {}; }
  virtual void commit() {}
  virtual void abort() {}
  virtual void clean() {}
  // Finalisation notifications (block jobs send BLOCK_JOB_* here).
  virtual void on_finalize_cancelled() {}
  virtual void on_finalize_completed() {}
  virtual void on_pending() {}
  virtual void on_ready() {}

  // For run(): pause points and yielding. yield() returns when someone
  // enters the job (enter()); sleep() when the time passed or it is entered.
  Task<void> pause_point();
  Task<void> yield();
  Task<void> sleep_ns(uint64_t ns);
  // Wakes the job if it yields (not while it is busy).
  void enter();
  void transition_to_ready();
  void set_progress(uint64_t current, uint64_t total) {
    progress_current_ = current;
    progress_total_ = total;
  }
  // Sets the text of the job's error (default: strerror of the code).
  void set_error_text(std::string s) { err_text_ = std::move(s); }
  // The error policy's stop makes its pause look like a user's.
  void set_user_paused() { user_paused_ = true; }

  void emit(const std::string& name, const nlohmann::ordered_json& data);
  Loop& loop() const;
  JobManager& manager() const { return mgr_; }
  bool should_pause() const { return pause_count_ > 0; }
  bool sleeping() const { return sleeping_; }
  // QEMU's job_apply_verb: ok, or "Job 'x' in state 'y' cannot accept command verb 'z'".
  Status apply_verb(JobVerb v) const;

 private:
  friend class JobManager;
  void transition(JobStatus to);
  Task<void> do_yield(uint64_t ns);  // UINT64_MAX: until entered
  Task<void> co_entry(std::shared_ptr<Job> self);
  void exit_job();
  void update_rc();
  void completed();
  void completed_success();
  void completed_abort();
  void do_finalize();
  // Group completion (QEMU's job_completed_txn_success / _abort).
  void group_success();
  void group_abort();
  void group_finish_abort();
  void finalize_single();
  void conclude();
  void do_dismiss();
  void cancel_async(bool force);
  void cancel(bool force);

  JobManager& mgr_;
  std::shared_ptr<JobGroup> group_;
  std::string id_;
  JobStatus status_ = JobStatus::Undefined;
  bool busy_ = false;
  bool paused_ = true;  // stopped at a pause point (or not started)
  int pause_count_ = 1;
  bool user_paused_ = false;
  bool auto_finalize_;
  bool auto_dismiss_;
  bool started_ = false;
  bool deferred_ = false;  // run() returned; completion is under way
  bool cancelled_ = false;
  bool force_cancel_ = false;
  bool finalizing_ = false;  // the finalize sequence runs (no re-entry)
  Status ret_;
  std::string err_text_;
  uint64_t progress_current_ = 0, progress_total_ = 0;
  // Yielding: the suspended coroutine, or a wakeable sleep.
  std::coroutine_handle<> waiter_;
  bool sleeping_ = false;
  std::stop_source sleep_stop_;
};

// I/O status of a block job (QEMU's BlockDeviceIoStatus).
enum class IoStatus { Ok, Failed, NoSpace };
const char* io_status_name(IoStatus s);

// Error policy (QEMU's BlockdevOnError) and the action it picks.
enum class OnError { Report, Ignore, Enospc, Stop, Auto };
enum class ErrorAction { Report, Ignore, Stop };
// "report" | "ignore" | "enospc" | "stop" | "auto"; false if none.
bool parse_on_error(const std::string& s, OnError& out);

class BlockJob : public Job {
 public:
  uint64_t speed() const { return speed_; }
  IoStatus io_status() const { return io_status_; }
  // The verb set-speed: QEMU's checks, then the job's own set_speed hook.
  Status set_speed(int64_t speed);
  // query-block-jobs entry.
  nlohmann::ordered_json query_block_job() const;
  // The error policy: picks the action, sends BLOCK_JOB_ERROR, and for stop
  // pauses the job (user-visible, resumed by the user) with io-status set.
  ErrorAction error_action(OnError policy, bool is_read, int err);

 protected:
  BlockJob(JobManager& mgr, std::string id, bool auto_finalize, bool auto_dismiss)
      : Job(mgr, std::move(id), auto_finalize, auto_dismiss) {}
  virtual void on_set_speed(uint64_t speed) { (void)speed; }
  void on_user_resume() override;
  void on_finalize_cancelled() override;
  void on_finalize_completed() override;
  void on_pending() override;
  void on_ready() override;
  nlohmann::ordered_json progress_event_data() const;

  uint64_t speed_ = 0;
  IoStatus io_status_ = IoStatus::Ok;
};

class JobManager {
 public:
  explicit JobManager(Loop& loop) : loop_(loop) {}
  ~JobManager();
  JobManager(const JobManager&) = delete;
  JobManager& operator=(const JobManager&) = delete;

  Loop& loop() const { return loop_; }
  void set_event_sink(JobEventSink sink) { sink_ = std::move(sink); }

  // Checks a new job id as QEMU's job_create does: "Invalid job ID 'x'",
  // "Job ID 'x' already in use".
  Status check_new_id(const std::string& id) const;
  // Registers a job (created state); the id must have passed check_new_id.
  void add(std::shared_ptr<Job> job);
  // Makes and registers a job of type J (constructor args after the manager).
  template <class J, class... A>
  Result<std::shared_ptr<J>> create(const std::string& id, A&&... args) {
    if (auto st = check_new_id(id); !st) return st.take_error();
    auto j = std::shared_ptr<J>(new J(*this, id, std::forward<A>(args)...));
    add(j);
    return j;
  }

  // A job whose creation failed after it was registered (QEMU's
  // job_early_fail): created -> null, and gone.
  void early_fail(const std::shared_ptr<Job>& j) { j->do_dismiss(); }

  std::shared_ptr<Job> find(const std::string& id) const;
  // QMP's lookups: "Job not found" / "Block job 'x' not found".
  Result<std::shared_ptr<Job>> find_job(const std::string& id) const;
  Result<std::shared_ptr<BlockJob>> find_block_job(const std::string& id) const;
  // Newest first, as QEMU lists them.
  std::vector<std::shared_ptr<Job>> jobs() const;
  nlohmann::ordered_json query_jobs() const;
  nlohmann::ordered_json query_block_jobs() const;

  // Op blockers: a node a block job uses cannot be used by another one
  // ("Node 'x' is busy: block device is in use by block job: backup").
  Status check_not_busy(const void* node, const std::string& name) const;
  void block(const void* node, const std::string& job_type) { blockers_.push_back({node, job_type}); }
  void unblock(const void* node) {
    std::erase_if(blockers_, [&](const std::pair<const void*, std::string>& b) { return b.first == node; });
  }

  // Cancels every job (force) and runs the loop until all have gone: for
  // shutdown. Jobs still waiting for finalize or dismiss are finished too.
  Task<void> cancel_all();

 private:
  friend class Job;
  void emit(const std::string& name, const nlohmann::ordered_json& data) {
    if (sink_) sink_(name, data);
  }
  void remove(Job* j);

  Loop& loop_;
  JobEventSink sink_;
  std::vector<std::shared_ptr<Job>> jobs_;  // newest first
  std::vector<std::pair<const void*, std::string>> blockers_;
};

}  // namespace vblk
