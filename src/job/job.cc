// The job state machine (see include/job/vblk/job.h). The sequence of states,
// events and callbacks follows QEMU's job.c step by step, so event order on
// the wire is the same; the mechanics are vblk's: a job's coroutine suspends
// in do_yield() and enter() posts it back to the loop.
#include "vblk/job.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "vblk/trace.h"

namespace vblk {

namespace {

using S = JobStatus;

// QEMU's JobSTT: rows are the current state, columns the next one, in the
// order U C R P Y S W D X E N.
constexpr bool kTransitions[kJobStatusCount][kJobStatusCount] = {
    /* U */ {0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    /* C */ {0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1},
    /* R */ {0, 0, 0, 1, 1, 0, 1, 0, 1, 0, 0},
    /* P */ {0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0},
    /* Y */ {0, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0},
    /* S */ {0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0},
    /* W */ {0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0},
    /* D */ {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0},
    /* X */ {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0},
    /* E */ {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1},
    /* N */ {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
};

// QEMU's JobVerbTable (7.2): which states accept each verb.
constexpr bool kVerbs[kJobVerbCount][kJobStatusCount] = {
    /* cancel    */ {0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0},
    /* pause     */ {0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0},
    /* resume    */ {0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0},
    /* set-speed */ {0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0},
    /* complete  */ {0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0},
    /* finalize  */ {0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0},
    /* dismiss   */ {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
};

constexpr uint64_t kNoTimeout = UINT64_MAX;

}  // namespace

const char* job_status_name(JobStatus s) {
  static const char* const names[] = {"undefined", "created", "running",  "paused",    "ready", "standby",
                                      "waiting",   "pending", "aborting", "concluded", "null"};
  return names[static_cast<int>(s)];
}

const char* job_verb_name(JobVerb v) {
  static const char* const names[] = {"cancel", "pause", "resume", "set-speed", "complete", "finalize", "dismiss"};
  return names[static_cast<int>(v)];
}

bool job_transition_allowed(JobStatus from, JobStatus to) {
  return kTransitions[static_cast<int>(from)][static_cast<int>(to)];
}

bool job_verb_allowed(JobVerb v, JobStatus s) { return kVerbs[static_cast<int>(v)][static_cast<int>(s)]; }

// ---- Job

Job::Job(JobManager& mgr, std::string id, bool auto_finalize, bool auto_dismiss)
    : mgr_(mgr), id_(std::move(id)), auto_finalize_(auto_finalize), auto_dismiss_(auto_dismiss) {
  transition(S::Created);
}

Job::~Job() = default;

Loop& Job::loop() const { return mgr_.loop(); }

void Job::emit(const std::string& name, const nlohmann::ordered_json& data) { mgr_.emit(name, data); }

void Job::transition(JobStatus to) {
  JobStatus from = status_;
  if (!job_transition_allowed(from, to)) {
    std::fprintf(stderr, "vblk: internal error: job '%s' cannot go from %s to %s\n", id_.c_str(), job_status_name(from),
                 job_status_name(to));
    std::abort();
  }
  status_ = to;
  VBLK_TRACE(kJob, "job '{}' {} -> {}", id_, job_status_name(from), job_status_name(to));
  if (from != to) {
    nlohmann::ordered_json d;
    d["id"] = id_;
    d["status"] = job_status_name(to);
    emit("JOB_STATUS_CHANGE", d);
  }
}

Status Job::apply_verb(JobVerb v) const {
  if (job_verb_allowed(v, status_)) return {};
  return Error(EPERM, "Job '" + id_ + "' in state '" + job_status_name(status_) + "' cannot accept command verb '" +
                          job_verb_name(v) + "'");
}

bool Job::is_completed() const {
  switch (status_) {
    case S::Waiting:
    case S::Pending:
    case S::Aborting:
    case S::Concluded:
    case S::Null: return true;
    default: return false;
  }
}

std::string Job::error_text() const {
  if (ret_.ok()) return {};
  if (!err_text_.empty()) return err_text_;
  return std::strerror(ret_.error().code);
}

nlohmann::ordered_json Job::query_job() const {
  nlohmann::ordered_json j;
  j["id"] = id_;
  j["type"] = type();
  j["status"] = job_status_name(status_);
  j["current-progress"] = progress_current();
  j["total-progress"] = progress_total();
  if (!ret_.ok()) j["error"] = error_text();
  query_extra(j);
  return j;
}

// ---- coroutine mechanics

void Job::start() {
  auto self = shared_from_this();
  started_ = true;
  --pause_count_;
  busy_ = true;
  paused_ = false;
  transition(S::Running);
  spawn_detached(co_entry(self));
}

Task<void> Job::co_entry(std::shared_ptr<Job> self) {
  (void)self;  // keeps the job alive until its coroutine is done
  co_await pause_point();
  Status st = co_await run();
  ret_ = st;
  deferred_ = true;
  busy_ = true;
  // QEMU finishes the job from a bottom half, outside the job coroutine.
  co_await loop().yield();
  co_await before_exit();
  exit_job();
}

void Job::enter() {
  if (!started_ || deferred_ || busy_) return;
  busy_ = true;
  if (sleeping_) {
    sleep_stop_.request_stop();
  } else if (waiter_) {
    auto h = waiter_;
    waiter_ = {};
    loop().post(h);
  }
}

Task<void> Job::do_yield(uint64_t ns) {
  busy_ = false;
  if (ns == kNoTimeout) {
    struct Suspend {
      Job* j;
      bool await_ready() noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) noexcept { j->waiter_ = h; }
      void await_resume() noexcept {}
    };
    co_await Suspend{this};
  } else {
    sleep_stop_ = std::stop_source();
    sleeping_ = true;
    co_await loop().sleep(std::chrono::nanoseconds(ns), sleep_stop_.get_token());
    sleeping_ = false;
  }
  busy_ = true;
}

Task<void> Job::pause_point() {
  if (!should_pause() || is_cancelled()) co_return;
  on_pause();
  if (should_pause() && !is_cancelled()) {
    JobStatus was = status_;
    if (was == S::Ready) {
      transition(S::Standby);
    } else {
      transition(S::Paused);
    }
    paused_ = true;
    // Unlike QEMU, a stray enter() does not end the pause: only resume()
    // (the pause count reaching zero) or a cancel does.
    do {
      co_await do_yield(kNoTimeout);
    } while (should_pause() && !is_cancelled());
    paused_ = false;
    transition(was);
  }
  on_resume();
}

Task<void> Job::yield() {
  if (is_cancelled()) co_return;
  if (!should_pause()) co_await do_yield(kNoTimeout);
  co_await pause_point();
}

Task<void> Job::sleep_ns(uint64_t ns) {
  if (is_cancelled()) co_return;
  if (!should_pause()) co_await do_yield(ns);
  co_await pause_point();
}

void Job::pause() {
  ++pause_count_;
  if (!paused_) enter();
}

void Job::resume() {
  if (pause_count_ <= 0) return;
  if (--pause_count_) return;
  // Kick only if no timer is pending: a sleeping job wakes on its own.
  if (!sleeping_) enter();
}

void Job::transition_to_ready() {
  transition(S::Ready);
  on_ready();
}

// ---- verbs

Status Job::user_pause() {
  if (auto st = apply_verb(JobVerb::Pause); !st) return st;
  if (user_paused_) return Error(EPERM, "Job is already paused");
  user_paused_ = true;
  pause();
  return {};
}

Status Job::user_resume() {
  if (!user_paused_ || pause_count_ <= 0) return Error(EPERM, "Can't resume a job that was not paused");
  if (auto st = apply_verb(JobVerb::Resume); !st) return st;
  on_user_resume();
  user_paused_ = false;
  resume();
  return {};
}

Status Job::user_cancel(bool force) {
  if (auto st = apply_verb(JobVerb::Cancel); !st) return st;
  auto self = shared_from_this();
  cancel(force);
  return {};
}

Status Job::complete() {
  if (auto st = apply_verb(JobVerb::Complete); !st) return st;
  if (cancel_requested() || !can_complete())
    return Error(EPERM, "The active block job '" + id_ + "' cannot be completed");
  return on_complete();
}

Status Job::finalize() {
  if (auto st = apply_verb(JobVerb::Finalize); !st) return st;
  auto self = shared_from_this();
  do_finalize();
  return {};
}

Status Job::dismiss() {
  if (auto st = apply_verb(JobVerb::Dismiss); !st) return st;
  auto self = shared_from_this();
  do_dismiss();
  return {};
}

void Job::cancel_async(bool force) {
  force = on_cancel(force);
  if (user_paused_) {
    on_user_resume();
    user_paused_ = false;
    --pause_count_;
  }
  // A soft cancel of a job that already finished its work is ignored.
  if (force || !deferred_) {
    cancelled_ = true;
    force_cancel_ |= force;
  }
}

void Job::cancel(bool force) {
  if (status_ == S::Concluded) {
    do_dismiss();
    return;
  }
  cancel_async(force);
  if (!started_) {
    completed();
  } else if (deferred_) {
    // Its work is done; a forced cancel still aborts it (a pending job
    // waiting for finalize, or one between run() and its completion).
    if (is_cancelled() && !finalizing_) completed_abort();
  } else {
    enter();
  }
}

// ---- completion

void Job::exit_job() {
  auto self = shared_from_this();
  if (finalizing_ || is_completed()) return;  // a cancel finished it already
  // Not quiescent, but completion callbacks may drain nodes (QEMU's comment).
  busy_ = false;
  completed();
}

void Job::update_rc() {
  if (ret_.ok() && is_cancelled()) ret_ = Error(ECANCELED);
  if (!ret_.ok()) transition(S::Aborting);
}

void Job::completed() {
  update_rc();
  if (group_) {
    if (!ret_.ok()) {
      group_abort();
    } else {
      group_success();
    }
    return;
  }
  if (!ret_.ok()) {
    completed_abort();
  } else {
    completed_success();
  }
}

void Job::join_group(const std::shared_ptr<JobGroup>& g) {
  group_ = g;
  g->jobs.insert(g->jobs.begin(), shared_from_this());
}

void Job::group_success() {
  auto g = group_;
  if (g->aborting) {
    group_finish_abort();
    return;
  }
  transition(S::Waiting);
  for (auto& j : g->jobs)
    if (!j->is_completed()) return;
  bool manual = false;
  for (auto& j : g->jobs) {
    j->transition(S::Pending);
    if (!j->auto_finalize_) {
      j->on_pending();
      manual = true;
    }
  }
  if (!manual) do_finalize();
}

void Job::group_abort() {
  auto g = group_;
  if (!g->aborting) {
    g->aborting = true;
    // The others are cancelled by this one's failure.
    for (auto& j : std::vector<std::shared_ptr<Job>>(g->jobs)) {
      if (j.get() == this) continue;
      j->cancelled_ = true;
      j->cancel_async(true);
      if (!j->deferred_ && j->started_) j->enter();
    }
  }
  group_finish_abort();
}

void Job::group_finish_abort() {
  // Once every member has finished its work, all are aborted in list order.
  auto g = group_;
  for (auto& j : g->jobs)
    if (!j->is_completed() && !(j->deferred_ && j.get() == this)) return;
  for (auto& j : std::vector<std::shared_ptr<Job>>(g->jobs))
    if (!j->finalizing_) j->finalize_single();
}

void Job::completed_success() {
  transition(S::Waiting);
  transition(S::Pending);
  if (!auto_finalize_) {
    on_pending();
    return;
  }
  do_finalize();
}

void Job::completed_abort() { finalize_single(); }

void Job::do_finalize() {
  if (group_) {
    // Every member prepares first; one failure aborts them all.
    auto g = group_;
    for (auto& j : std::vector<std::shared_ptr<Job>>(g->jobs)) {
      Status st = j->prepare();
      if (!st.ok()) {
        j->ret_ = st;
        j->update_rc();
        j->group_abort();
        return;
      }
    }
    for (auto& j : std::vector<std::shared_ptr<Job>>(g->jobs)) j->finalize_single();
    return;
  }
  if (ret_.ok()) {
    Status st = prepare();
    if (!st.ok()) ret_ = st;
    update_rc();
  }
  // One job per transaction: a failed prepare aborts just this job.
  finalize_single();
}

void Job::finalize_single() {
  finalizing_ = true;
  if (group_) {
    std::erase_if(group_->jobs, [this](const std::shared_ptr<Job>& j) { return j.get() == this; });
    group_.reset();
  }
  update_rc();
  if (ret_.ok()) {
    commit();
  } else {
    abort();
  }
  clean();
  if (started_) {
    if (is_cancelled()) {
      on_finalize_cancelled();
    } else {
      on_finalize_completed();
    }
  }
  conclude();
}

void Job::conclude() {
  transition(S::Concluded);
  if (auto_dismiss_ || !started_) do_dismiss();
}

void Job::do_dismiss() {
  busy_ = false;
  paused_ = false;
  deferred_ = true;
  transition(S::Null);
  mgr_.remove(this);
}

// ---- BlockJob

const char* io_status_name(IoStatus s) {
  switch (s) {
    case IoStatus::Ok: return "ok";
    case IoStatus::Failed: return "failed";
    case IoStatus::NoSpace: return "nospace";
  }
  return "ok";
}

bool parse_on_error(const std::string& s, OnError& out) {
  if (s == "report") {
    out = OnError::Report;
  } else if (s == "ignore") {
    out = OnError::Ignore;
  } else if (s == "enospc") {
    out = OnError::Enospc;
  } else if (s == "stop") {
    out = OnError::Stop;
  } else if (s == "auto") {
    out = OnError::Auto;
  } else {
    return false;
  }
  return true;
}

Status BlockJob::set_speed(int64_t speed) {
  if (auto st = apply_verb(JobVerb::SetSpeed); !st) return st;
  if (speed < 0) return Error(EINVAL, "Parameter 'speed' expects a non-negative value");
  uint64_t old = speed_;
  speed_ = static_cast<uint64_t>(speed);
  on_set_speed(speed_);
  if (speed_ && speed_ <= old) return {};
  // Kick only a job that sleeps for its rate limit.
  if (sleeping()) enter();
  return {};
}

nlohmann::ordered_json BlockJob::progress_event_data() const {
  nlohmann::ordered_json d;
  d["type"] = type();
  d["device"] = id();
  d["len"] = progress_total();
  d["offset"] = progress_current();
  d["speed"] = speed_;
  return d;
}

nlohmann::ordered_json BlockJob::query_block_job() const {
  // QAPI BlockJobInfo member order.
  nlohmann::ordered_json j;
  j["type"] = type();
  j["device"] = id();
  j["len"] = progress_total();
  j["offset"] = progress_current();
  j["busy"] = busy();
  j["paused"] = paused();
  j["speed"] = speed_;
  j["io-status"] = io_status_name(io_status_);
  j["ready"] = is_ready();
  j["status"] = job_status_name(status());
  j["auto-finalize"] = auto_finalize();
  j["auto-dismiss"] = auto_dismiss();
  if (!result().ok()) j["error"] = error_text();
  query_extra(j);
  return j;
}

ErrorAction BlockJob::error_action(OnError policy, bool is_read, int err) {
  ErrorAction action = ErrorAction::Report;
  switch (policy) {
    case OnError::Enospc:
    case OnError::Auto: action = err == ENOSPC ? ErrorAction::Stop : ErrorAction::Report; break;
    case OnError::Stop: action = ErrorAction::Stop; break;
    case OnError::Report: action = ErrorAction::Report; break;
    case OnError::Ignore: action = ErrorAction::Ignore; break;
  }
  nlohmann::ordered_json d;
  d["device"] = id();
  d["operation"] = is_read ? "read" : "write";
  static const char* const names[] = {"report", "ignore", "stop"};
  d["action"] = names[static_cast<int>(action)];
  emit("BLOCK_JOB_ERROR", d);
  if (action == ErrorAction::Stop) {
    if (!user_paused()) {
      // A user-visible pause: the user resumes it.
      pause();
      set_user_paused();
    }
    if (io_status_ == IoStatus::Ok) io_status_ = err == ENOSPC ? IoStatus::NoSpace : IoStatus::Failed;
  }
  return action;
}

void BlockJob::on_user_resume() { io_status_ = IoStatus::Ok; }

void BlockJob::on_finalize_cancelled() { emit("BLOCK_JOB_CANCELLED", progress_event_data()); }

void BlockJob::on_finalize_completed() {
  nlohmann::ordered_json d = progress_event_data();
  if (!result().ok()) d["error"] = error_text();
  emit("BLOCK_JOB_COMPLETED", d);
}

void BlockJob::on_pending() {
  nlohmann::ordered_json d;
  d["type"] = type();
  d["id"] = id();
  emit("BLOCK_JOB_PENDING", d);
}

void BlockJob::on_ready() { emit("BLOCK_JOB_READY", progress_event_data()); }

// ---- JobManager

bool id_wellformed(const std::string& id) {
  if (id.empty() || !std::isalpha(static_cast<unsigned char>(id[0]))) return false;
  for (char c : id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && !std::strchr("-._", c)) return false;
  return true;
}

JobManager::~JobManager() = default;

Status JobManager::check_new_id(const std::string& id) const {
  if (!id_wellformed(id)) return Error(EINVAL, "Invalid job ID '" + id + "'");
  if (find(id)) return Error(EEXIST, "Job ID '" + id + "' already in use");
  return {};
}

Status JobManager::check_not_busy(const void* node, const std::string& name) const {
  for (auto& [n, type] : blockers_)
    if (n == node) return Error(EBUSY, "Node '" + name + "' is busy: block device is in use by block job: " + type);
  return {};
}

void JobManager::add(std::shared_ptr<Job> job) { jobs_.insert(jobs_.begin(), std::move(job)); }

void JobManager::remove(Job* j) {
  std::erase_if(jobs_, [&](const std::shared_ptr<Job>& p) { return p.get() == j; });
}

std::shared_ptr<Job> JobManager::find(const std::string& id) const {
  for (auto& j : jobs_)
    if (j->id() == id) return j;
  return nullptr;
}

Result<std::shared_ptr<Job>> JobManager::find_job(const std::string& id) const {
  auto j = find(id);
  if (!j) return Error(ENOENT, "Job not found");
  return j;
}

Result<std::shared_ptr<BlockJob>> JobManager::find_block_job(const std::string& id) const {
  auto j = std::dynamic_pointer_cast<BlockJob>(find(id));
  if (!j) return Error(ENODEV, "Block job '" + id + "' not found");
  return j;
}

std::vector<std::shared_ptr<Job>> JobManager::jobs() const { return jobs_; }

nlohmann::ordered_json JobManager::query_jobs() const {
  nlohmann::ordered_json a = nlohmann::ordered_json::array();
  for (auto& j : jobs_) a.push_back(j->query_job());
  return a;
}

nlohmann::ordered_json JobManager::query_block_jobs() const {
  nlohmann::ordered_json a = nlohmann::ordered_json::array();
  for (auto& j : jobs_)
    if (auto b = std::dynamic_pointer_cast<BlockJob>(j)) a.push_back(b->query_block_job());
  return a;
}

Task<void> JobManager::cancel_all() {
  while (!jobs_.empty()) {
    std::shared_ptr<Job> j = jobs_.front();
    if (j->status() == S::Concluded) {
      j->do_dismiss();
    } else if (j->status() == S::Pending) {
      j->do_finalize();
    } else {
      if (!j->is_cancelled()) j->cancel(true);
      co_await loop_.sleep(std::chrono::milliseconds(1));
    }
  }
}

}  // namespace vblk
