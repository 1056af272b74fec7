// The job state machine against QEMU's tables, verbs, messages and event
// order (job.c / blockjob.c in QEMU 7.2).
#include "vblk/job.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>

namespace vblk {
namespace {

using S = JobStatus;
using V = JobVerb;
using J = nlohmann::ordered_json;

// A block job whose body the test steers: it runs `steps` pause points
// (one yield each, woken by the test through kick()), optionally becomes
// ready and waits for complete, then returns `result`.
class StepJob : public BlockJob {
 public:
  StepJob(JobManager& m, const std::string& id, bool af = true, bool ad = true) : BlockJob(m, id, af, ad) {}
  const char* type() const override { return "backup"; }

  int steps = 3;
  int done = 0;
  bool want_ready = false;
  bool completed_verb = false;
  Status outcome;
  std::vector<std::string> calls;
  void kick() { enter(); }
  using BlockJob::apply_verb;
  ErrorAction fail(OnError p, bool read, int err) { return error_action(p, read, err); }

 protected:
  Task<Status> run() override {
    set_progress(0, static_cast<uint64_t>(steps));
    while (done < steps && !is_cancelled()) {
      co_await yield();
      if (is_cancelled()) break;
      ++done;
      set_progress(static_cast<uint64_t>(done), static_cast<uint64_t>(steps));
    }
    if (want_ready && !is_cancelled()) {
      transition_to_ready();
      while (!completed_verb && !cancel_requested()) co_await yield();
    }
    co_return outcome;
  }
  bool can_complete() const override { return want_ready; }
  Status on_complete() override {
    completed_verb = true;
    enter();
    return {};
  }
  void on_pause() override { calls.push_back("pause"); }
  Status prepare() override {
    calls.push_back("prepare");
    return {};
  }
  void commit() override { calls.push_back("commit"); }
  void abort() override { calls.push_back("abort"); }
  void clean() override { calls.push_back("clean"); }
};

struct JobTest : ::testing::Test {
  Loop loop;
  JobManager mgr{loop};
  std::vector<std::pair<std::string, J>> events;
  void SetUp() override {
    mgr.set_event_sink([this](const std::string& n, const J& d) { events.push_back({n, d}); });
  }
  // Jobs a test leaves running end here, so no coroutine outlives the loop.
  void TearDown() override { loop.run(mgr.cancel_all()); }
  // The event names, with JOB_STATUS_CHANGE shown as its status.
  std::vector<std::string> trace() const {
    std::vector<std::string> out;
    for (auto& [n, d] : events) out.push_back(n == "JOB_STATUS_CHANGE" ? d["status"].get<std::string>() : n);
    return out;
  }
  void spin(int n = 20) {
    for (int i = 0; i < n; ++i) loop.run_once(0);
  }
  std::shared_ptr<StepJob> make(const std::string& id, bool af = true, bool ad = true) {
    auto r = mgr.create<StepJob>(id, af, ad);
    EXPECT_TRUE(r.ok());
    return *r;
  }
  // Wakes the job until it has finished `n` steps.
  void step(StepJob& j, int n) {
    for (int i = 0; i < n; ++i) {
      j.kick();
      spin(3);
    }
  }
};

TEST(JobTables, TransitionsAreQemus) {
  // Every allowed (from, to) pair of QEMU's JobSTT; everything else refused.
  std::set<std::pair<S, S>> allowed = {
      {S::Undefined, S::Created}, {S::Created, S::Running},   {S::Created, S::Aborting},   {S::Created, S::Null},
      {S::Running, S::Paused},    {S::Running, S::Ready},     {S::Running, S::Waiting},    {S::Running, S::Aborting},
      {S::Paused, S::Running},    {S::Ready, S::Standby},     {S::Ready, S::Waiting},      {S::Ready, S::Aborting},
      {S::Standby, S::Ready},     {S::Waiting, S::Pending},   {S::Waiting, S::Aborting},   {S::Pending, S::Aborting},
      {S::Pending, S::Concluded}, {S::Aborting, S::Aborting}, {S::Aborting, S::Concluded}, {S::Concluded, S::Null},
  };
  int n = 0;
  for (int a = 0; a < kJobStatusCount; ++a)
    for (int b = 0; b < kJobStatusCount; ++b) {
      bool want = allowed.count({S(a), S(b)}) > 0;
      EXPECT_EQ(job_transition_allowed(S(a), S(b)), want) << job_status_name(S(a)) << "->" << job_status_name(S(b));
      n += want;
    }
  EXPECT_EQ(n, 20);
}

TEST(JobTables, VerbsAreQemus) {
  std::set<std::pair<V, S>> allowed;
  for (S s : {S::Created, S::Running, S::Paused, S::Ready, S::Standby, S::Waiting, S::Pending})
    allowed.insert({V::Cancel, s});
  for (V v : {V::Pause, V::Resume, V::SetSpeed})
    for (S s : {S::Created, S::Running, S::Paused, S::Ready, S::Standby}) allowed.insert({v, s});
  allowed.insert({V::Complete, S::Ready});
  allowed.insert({V::Complete, S::Standby});
  allowed.insert({V::Finalize, S::Pending});
  allowed.insert({V::Dismiss, S::Concluded});
  for (int v = 0; v < kJobVerbCount; ++v)
    for (int s = 0; s < kJobStatusCount; ++s)
      EXPECT_EQ(job_verb_allowed(V(v), S(s)), allowed.count({V(v), S(s)}) > 0)
          << job_verb_name(V(v)) << " in " << job_status_name(S(s));
}

TEST(JobTables, Names) {
  EXPECT_STREQ(job_status_name(S::Undefined), "undefined");
  EXPECT_STREQ(job_status_name(S::Standby), "standby");
  EXPECT_STREQ(job_status_name(S::Null), "null");
  EXPECT_STREQ(job_verb_name(V::SetSpeed), "set-speed");
  EXPECT_STREQ(job_verb_name(V::Dismiss), "dismiss");
  OnError e;
  EXPECT_TRUE(parse_on_error("enospc", e));
  EXPECT_EQ(e, OnError::Enospc);
  EXPECT_FALSE(parse_on_error("explode", e));
}

TEST_F(JobTest, AutoFinalizeAndDismissEventOrder) {
  auto j = make("j0");
  EXPECT_EQ(j->status(), S::Created);
  EXPECT_TRUE(j->paused());
  j->start();
  EXPECT_EQ(j->status(), S::Running);
  spin();
  EXPECT_FALSE(j->busy());  // yielding
  EXPECT_FALSE(j->paused());
  step(*j, 3);
  spin();
  EXPECT_EQ(trace(), (std::vector<std::string>{"created", "running", "waiting", "pending", "BLOCK_JOB_COMPLETED",
                                               "concluded", "null"}));
  EXPECT_EQ(j->calls, (std::vector<std::string>{"prepare", "commit", "clean"}));
  EXPECT_EQ(mgr.find("j0"), nullptr);
  J& done = events[4].second;
  EXPECT_EQ(done, J::parse(R"({"type":"backup","device":"j0","len":3,"offset":3,"speed":0})"));
  EXPECT_EQ(events[0].second, J::parse(R"({"id":"j0","status":"created"})"));
}

TEST_F(JobTest, ManualFinalizeAndDismiss) {
  auto j = make("j1", false, false);
  j->steps = 1;
  j->start();
  spin();
  step(*j, 1);
  spin();
  EXPECT_EQ(j->status(), S::Pending);
  EXPECT_EQ(trace().back(), "BLOCK_JOB_PENDING");
  EXPECT_EQ(events.back().second, J::parse(R"({"type":"backup","id":"j1"})"));
  EXPECT_TRUE(j->calls.empty());  // nothing prepared before finalize
  auto st = j->dismiss();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().what(), "Job 'j1' in state 'pending' cannot accept command verb 'dismiss'");
  EXPECT_EQ(j->user_pause().error().what(), "Job 'j1' in state 'pending' cannot accept command verb 'pause'");
  EXPECT_EQ(j->set_speed(1).error().what(), "Job 'j1' in state 'pending' cannot accept command verb 'set-speed'");
  ASSERT_TRUE(j->finalize().ok());
  EXPECT_EQ(j->status(), S::Concluded);
  EXPECT_EQ(j->calls, (std::vector<std::string>{"prepare", "commit", "clean"}));
  EXPECT_EQ(j->finalize().error().what(), "Job 'j1' in state 'concluded' cannot accept command verb 'finalize'");
  EXPECT_EQ(j->user_cancel(true).error().what(), "Job 'j1' in state 'concluded' cannot accept command verb 'cancel'");
  EXPECT_EQ(mgr.query_block_jobs()[0]["status"], "concluded");
  ASSERT_TRUE(j->dismiss().ok());
  EXPECT_EQ(j->status(), S::Null);
  EXPECT_TRUE(mgr.jobs().empty());
  EXPECT_EQ(trace(), (std::vector<std::string>{"created", "running", "waiting", "pending", "BLOCK_JOB_PENDING",
                                               "BLOCK_JOB_COMPLETED", "concluded", "null"}));
}

TEST_F(JobTest, PauseResumeAndPauseCounting) {
  auto j = make("j2");
  j->steps = 5;
  j->start();
  spin();
  ASSERT_TRUE(j->user_pause().ok());
  EXPECT_EQ(j->user_pause().error().what(), "Job is already paused");
  spin();
  EXPECT_EQ(j->status(), S::Paused);
  EXPECT_TRUE(j->paused());
  EXPECT_EQ(j->calls, std::vector<std::string>{"pause"});
  int before = j->done;
  step(*j, 3);  // kicks do not move a paused job
  EXPECT_EQ(j->done, before);
  j->pause();  // an internal pause on top
  EXPECT_EQ(j->pause_count(), 2);
  ASSERT_TRUE(j->user_resume().ok());
  EXPECT_EQ(j->user_resume().error().what(), "Can't resume a job that was not paused");
  spin();
  EXPECT_EQ(j->status(), S::Paused);  // still held by the internal pause
  j->resume();
  spin();
  EXPECT_EQ(j->status(), S::Running);
  step(*j, 5);
  spin();
  EXPECT_EQ(j->status(), S::Null);
  EXPECT_EQ(trace(), (std::vector<std::string>{"created", "running", "paused", "running", "waiting", "pending",
                                               "BLOCK_JOB_COMPLETED", "concluded", "null"}));
}

TEST_F(JobTest, PauseBeforeStart) {
  auto j = make("j3");
  ASSERT_TRUE(j->user_pause().ok());
  j->start();
  spin();
  EXPECT_EQ(j->status(), S::Paused);  // the first pause point is before run()
  EXPECT_EQ(j->done, 0);
  ASSERT_TRUE(j->user_resume().ok());
  spin();
  EXPECT_EQ(j->status(), S::Running);
}

TEST_F(JobTest, CancelRunningJob) {
  auto j = make("j4");
  j->steps = 100;
  j->start();
  spin();
  step(*j, 2);
  ASSERT_TRUE(j->user_cancel(false).ok());  // no soft cancel: behaves as forced
  EXPECT_TRUE(j->is_cancelled());
  spin();
  EXPECT_EQ(trace(),
            (std::vector<std::string>{"created", "running", "aborting", "BLOCK_JOB_CANCELLED", "concluded", "null"}));
  EXPECT_EQ(j->calls, (std::vector<std::string>{"abort", "clean"}));
  EXPECT_EQ(events[3].second, J::parse(R"({"type":"backup","device":"j4","len":100,"offset":2,"speed":0})"));
  EXPECT_EQ(j->result().error().code, ECANCELED);
}

TEST_F(JobTest, CancelPausedJobUnpausesIt) {
  auto j = make("j5", true, false);
  j->steps = 100;
  j->start();
  spin();
  ASSERT_TRUE(j->user_pause().ok());
  spin();
  EXPECT_EQ(j->status(), S::Paused);
  ASSERT_TRUE(j->user_cancel(true).ok());
  EXPECT_FALSE(j->user_paused());
  spin();
  EXPECT_EQ(j->status(), S::Concluded);
  EXPECT_EQ(j->query_job()["error"], "Operation canceled");
  EXPECT_EQ(mgr.query_block_jobs()[0]["error"], "Operation canceled");
  ASSERT_TRUE(j->dismiss().ok());
}

TEST_F(JobTest, CancelCreatedJobSendsNoBlockEvents) {
  auto j = make("j6");
  ASSERT_TRUE(j->user_cancel(true).ok());
  EXPECT_EQ(trace(), (std::vector<std::string>{"created", "aborting", "concluded", "null"}));
}

TEST_F(JobTest, CancelPendingJob) {
  auto j = make("j7", false, false);
  j->steps = 0;
  j->start();
  spin();
  EXPECT_EQ(j->status(), S::Pending);
  ASSERT_TRUE(j->user_cancel(true).ok());
  EXPECT_EQ(j->status(), S::Concluded);
  EXPECT_EQ(j->calls, (std::vector<std::string>{"abort", "clean"}));
  EXPECT_EQ(trace().back(), "concluded");
}

TEST_F(JobTest, FailedJobReportsItsError) {
  auto j = make("j8");
  j->steps = 1;
  j->outcome = Error(EIO);
  j->start();
  spin();
  step(*j, 1);
  spin();
  EXPECT_EQ(trace(),
            (std::vector<std::string>{"created", "running", "aborting", "BLOCK_JOB_COMPLETED", "concluded", "null"}));
  EXPECT_EQ(events[3].second["error"], "Input/output error");
  EXPECT_EQ(j->calls, (std::vector<std::string>{"abort", "clean"}));
}

TEST_F(JobTest, ReadyStandbyComplete) {
  auto j = make("j9");
  j->steps = 1;
  j->want_ready = true;
  j->start();
  spin();
  EXPECT_EQ(j->complete().error().what(), "Job 'j9' in state 'running' cannot accept command verb 'complete'");
  step(*j, 1);
  spin();
  EXPECT_EQ(j->status(), S::Ready);
  EXPECT_TRUE(j->query_block_job()["ready"]);
  ASSERT_TRUE(j->user_pause().ok());
  spin();
  EXPECT_EQ(j->status(), S::Standby);
  ASSERT_TRUE(j->user_resume().ok());
  spin();
  EXPECT_EQ(j->status(), S::Ready);
  ASSERT_TRUE(j->complete().ok());
  spin();
  EXPECT_EQ(trace(), (std::vector<std::string>{"created", "running", "ready", "BLOCK_JOB_READY", "standby", "ready",
                                               "waiting", "pending", "BLOCK_JOB_COMPLETED", "concluded", "null"}));
}

TEST_F(JobTest, CompleteWithoutCompleteCallback) {
  // A job with no complete callback, made ready by hand, still refuses.
  auto j = make("j10");
  j->steps = 1;
  j->start();
  spin();
  EXPECT_EQ(j->complete().error().what(), "Job 'j10' in state 'running' cannot accept command verb 'complete'");
}

TEST_F(JobTest, ErrorPolicyStopPausesWithIoStatus) {
  auto j = make("j11");
  j->steps = 2;
  j->start();
  spin();
  EXPECT_EQ(j->fail(OnError::Stop, false, EIO), ErrorAction::Stop);
  EXPECT_EQ(events.back().first, "BLOCK_JOB_ERROR");
  EXPECT_EQ(events.back().second, J::parse(R"({"device":"j11","operation":"write","action":"stop"})"));
  spin();
  EXPECT_EQ(j->status(), S::Paused);
  EXPECT_TRUE(j->user_paused());
  J q = mgr.query_block_jobs()[0];
  EXPECT_EQ(q["io-status"], "failed");
  EXPECT_EQ(q["paused"], true);
  ASSERT_TRUE(j->user_resume().ok());
  EXPECT_EQ(j->io_status(), IoStatus::Ok);
  EXPECT_EQ(j->fail(OnError::Enospc, true, ENOSPC), ErrorAction::Stop);
  EXPECT_EQ(j->io_status(), IoStatus::NoSpace);
  EXPECT_EQ(events.back().second["operation"], "read");
  ASSERT_TRUE(j->user_resume().ok());
  EXPECT_EQ(j->fail(OnError::Enospc, true, EIO), ErrorAction::Report);
  EXPECT_EQ(j->fail(OnError::Ignore, true, EIO), ErrorAction::Ignore);
  EXPECT_EQ(events.back().second["action"], "ignore");
  EXPECT_EQ(j->fail(OnError::Report, true, EIO), ErrorAction::Report);
  EXPECT_EQ(j->io_status(), IoStatus::Ok);
}

TEST_F(JobTest, SetSpeed) {
  auto j = make("j12");
  ASSERT_TRUE(j->set_speed(1 << 20).ok());
  EXPECT_EQ(j->speed(), 1u << 20);
  EXPECT_EQ(j->set_speed(-1).error().what(), "Parameter 'speed' expects a non-negative value");
  EXPECT_EQ(j->query_block_job()["speed"], 1 << 20);
}

// Every verb in every state a job can be observed in: refused verbs give
// QEMU's message; accepted ones do not (they may fail for other reasons).
TEST_F(JobTest, EveryVerbInEveryObservableState) {
  auto call = [](StepJob& j, V v) -> Status {
    switch (v) {
      case V::Cancel: return j.apply_verb(v);  // checked only: cancelling would end the job
      case V::Pause: return j.apply_verb(v);
      case V::Resume: return j.apply_verb(v);
      case V::SetSpeed: return j.set_speed(0);
      case V::Complete: return j.apply_verb(v);
      case V::Finalize: return j.apply_verb(v);
      case V::Dismiss: return j.apply_verb(v);
    }
    return {};
  };
  auto check_all = [&](StepJob& j, S want) {
    ASSERT_EQ(j.status(), want);
    for (int v = 0; v < kJobVerbCount; ++v) {
      Status st = call(j, V(v));
      std::string refused = std::string("Job '") + j.id() + "' in state '" + job_status_name(want) +
                            "' cannot accept command verb '" + job_verb_name(V(v)) + "'";
      if (job_verb_allowed(V(v), want)) {
        EXPECT_TRUE(st.ok() || st.error().what() != refused) << job_verb_name(V(v));
      } else {
        ASSERT_FALSE(st.ok()) << job_verb_name(V(v)) << " in " << job_status_name(want);
        EXPECT_EQ(st.error().what(), refused);
      }
    }
  };
  auto j = make("v", false, false);
  j->steps = 1;
  j->want_ready = true;
  check_all(*j, S::Created);
  j->start();
  spin();
  check_all(*j, S::Running);
  ASSERT_TRUE(j->user_pause().ok());
  spin();
  check_all(*j, S::Paused);
  ASSERT_TRUE(j->user_resume().ok());
  spin();
  step(*j, 1);
  spin();
  check_all(*j, S::Ready);
  ASSERT_TRUE(j->user_pause().ok());
  spin();
  check_all(*j, S::Standby);
  ASSERT_TRUE(j->user_resume().ok());
  spin();
  ASSERT_TRUE(j->complete().ok());
  spin();
  check_all(*j, S::Pending);
  ASSERT_TRUE(j->finalize().ok());
  check_all(*j, S::Concluded);
  ASSERT_TRUE(j->dismiss().ok());
  EXPECT_EQ(j->status(), S::Null);
}

TEST_F(JobTest, ManagerIdsAndLookups) {
  auto a = make("a");
  auto b = make("b");
  auto dup = mgr.create<StepJob>("a");
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.error().what(), "Job ID 'a' already in use");
  for (const char* bad : {"", "1x", "a b", "#x"}) {
    auto r = mgr.create<StepJob>(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().what(), std::string("Invalid job ID '") + bad + "'");
  }
  EXPECT_TRUE(mgr.create<StepJob>("x-1.y_z").ok());
  EXPECT_EQ(mgr.find_job("nope").error().what(), "Job not found");
  EXPECT_EQ(mgr.find_block_job("nope").error().what(), "Block job 'nope' not found");
  J q = mgr.query_jobs();
  ASSERT_EQ(q.size(), 3u);
  EXPECT_EQ(q[0]["id"], "x-1.y_z");  // newest first
  EXPECT_EQ(q[2], J::parse(R"({"id":"a","type":"backup","status":"created","current-progress":0,
                               "total-progress":0})"));
  J bq = mgr.query_block_jobs()[2];
  EXPECT_EQ(bq, J::parse(R"({"type":"backup","device":"a","len":0,"offset":0,"busy":false,"paused":true,
      "speed":0,"io-status":"ok","ready":false,"status":"created","auto-finalize":true,"auto-dismiss":true})"));
  loop.run(mgr.cancel_all());
  EXPECT_TRUE(mgr.jobs().empty());
}

TEST_F(JobTest, CancelAllFinishesRunningAndWaitingJobs) {
  auto a = make("a", false, false);
  a->steps = 0;
  a->start();
  auto b = make("b");
  b->steps = 1000;
  b->start();
  spin();
  EXPECT_EQ(a->status(), S::Pending);
  loop.run(mgr.cancel_all());
  EXPECT_TRUE(mgr.jobs().empty());
  EXPECT_EQ(b->status(), S::Null);
}

}  // namespace
}  // namespace vblk
