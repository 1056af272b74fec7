// The backup job and the copy-before-write filter over deterministic fake
// nodes: point in time under concurrent guest writes, pause/resume/cancel,
// set-speed, each error policy, sync modes, argument checking.
#include "vblk/backup.h"

#include <gtest/gtest.h>

#include <random>

#include "../copy/test_disk.h"
#include "vblk/copy_drivers.h"
#include "vblk/open.h"
#include "wait_for.h"

namespace vblk {
namespace {

using vblk::MemNode;
using J = nlohmann::ordered_json;
constexpr uint64_t kCluster = 64 << 10;

struct Env {
  Loop loop;
  JobManager mgr{loop};
  Graph graph;
  std::shared_ptr<MemNode> src, tgt;
  NodeRef device;  // what an export would hold
  std::vector<std::pair<std::string, J>> events;

  explicit Env(uint64_t size = 4 << 20, uint32_t seed = 1) {
    src = vblk::testing::test_disk(loop, size);
    tgt = vblk::testing::test_disk(loop, size);
    src->set_node_name("src");
    tgt->set_node_name("tgt");
    EXPECT_TRUE(graph.add(src).ok());
    EXPECT_TRUE(graph.add(tgt).ok());
    device.reset(src);
    std::mt19937 rng(seed);
    for (auto& b : src->data()) b = static_cast<uint8_t>(rng() | 1);  // never zero: all data
    mgr.set_event_sink([this](const std::string& n, const J& d) { events.push_back({n, d}); });
  }
  BackupArgs args(const std::string& sync = "full") {
    BackupArgs a;
    a.job_id = "job0";
    a.device = "src";
    a.target = "tgt";
    a.sync = sync;
    return a;
  }
  std::shared_ptr<BackupJob> start(const BackupArgs& a) {
    auto r = start_backup(mgr, graph, a);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().what());
    return r.ok() ? *r : nullptr;
  }
  bool wait_for(const std::function<bool()>& cond, int timeout_ms = 20000) {
    return test::wait_for(loop, cond, timeout_ms);
  }
  bool wait_gone(const std::shared_ptr<BackupJob>& j) {
    return wait_for([&] { return j->status() == JobStatus::Null || j->status() == JobStatus::Concluded; });
  }
  int count(const std::string& name) const {
    int n = 0;
    for (auto& e : events) n += e.first == name;
    return n;
  }
  const J* last(const std::string& name) const {
    for (auto it = events.rbegin(); it != events.rend(); ++it)
      if (it->first == name) return &it->second;
    return nullptr;
  }
  // Target data writes per cluster: the engine must copy each cluster once.
  int max_copies_per_cluster() const {
    int worst = 0;
    for (uint64_t c = 0; c < tgt->length(); c += kCluster)
      worst = std::max(worst, tgt->count('w', c, kCluster) + tgt->count('z', c, kCluster));
    return worst;
  }
};

Task<void> write_through(Node& n, uint64_t off, std::vector<uint8_t> data, Status* out) {
  *out = co_await n.write(off, data);
}

TEST(BackupTest, PointInTimeUnderGuestWrites) {
  // ≥ 20 randomised rounds: a slow backup while a writer rewrites random
  // unaligned ranges through the device; once the writer is done the speed
  // limit is lifted. The target must equal the source as it was when the job
  // started.
  int raced = 0;
  for (uint32_t seed = 1; seed <= 24; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Env e(2 << 20, seed);
    e.tgt->options().latency_ns = 50000;
    const std::vector<uint8_t> before = e.src->data();
    std::vector<uint8_t> expect_src = before;
    BackupArgs a = e.args();
    a.speed = 1 << 20;  // 2 s for 2 MiB: the writes land while it runs
    a.max_chunk = kCluster;
    a.max_workers = 1 + seed % 8;
    auto job = e.start(a);
    ASSERT_TRUE(job);
    EXPECT_EQ(e.device.get(), &job->filter());  // the device writes through the filter
    std::mt19937 rng(seed * 7919);
    int done = 0;
    std::vector<Status> results(40);
    auto writer = [&]() -> Task<void> {
      for (int i = 0; i < 40; ++i) {
        uint64_t len = 1 + rng() % (3 * kCluster);
        uint64_t off = rng() % (e.src->length() - len);
        std::vector<uint8_t> d(len);
        for (auto& b : d) b = static_cast<uint8_t>(rng());
        std::copy(d.begin(), d.end(), expect_src.begin() + static_cast<long>(off));
        co_await write_through(*e.device, off, std::move(d), &results[static_cast<size_t>(i)]);
        co_await e.loop.sleep(std::chrono::microseconds(rng() % 3000));
        // Counted after the pause: once done == 40 the writer has returned,
        // so its frame is gone before the round's Env is destroyed.
        ++done;
      }
    };
    spawn_detached(writer());
    ASSERT_TRUE(e.wait_for([&] { return done == 40; }));
    raced += job->status() == JobStatus::Running;
    ASSERT_TRUE(job->set_speed(0).ok() || job->status() != JobStatus::Running);
    ASSERT_TRUE(e.wait_gone(job));
    for (auto& st : results) EXPECT_TRUE(st.ok());
    EXPECT_EQ(e.count("BLOCK_JOB_COMPLETED"), 1);
    EXPECT_FALSE(e.last("BLOCK_JOB_COMPLETED")->contains("error"));
    EXPECT_TRUE(e.tgt->data() == before) << "backup is not the point-in-time image";
    EXPECT_TRUE(e.src->data() == expect_src);
    EXPECT_LE(e.max_copies_per_cluster(), 1);
    EXPECT_EQ(e.device.get(), e.src.get());  // filter removed
    EXPECT_EQ(e.graph.nodes().size(), 2u);
  }
  // The writer really raced the job (it outlasts the writer unless the
  // machine stalls for seconds).
  EXPECT_GE(raced, 12);
}

TEST(BackupTest, EventsAndQueryWhileRunning) {
  Env e;
  BackupArgs a = e.args();
  a.speed = 8 << 20;
  a.filter_node_name = "cbw0";
  auto job = e.start(a);
  ASSERT_TRUE(job);
  EXPECT_NE(e.graph.find("cbw0"), nullptr);
  e.wait_for([&] { return job->progress_current() > 0; });
  J q = e.mgr.query_block_jobs()[0];
  EXPECT_EQ(q["type"], "backup");
  EXPECT_EQ(q["device"], "job0");
  EXPECT_EQ(q["len"], 4 << 20);
  EXPECT_EQ(q["speed"], 8 << 20);
  EXPECT_EQ(q["status"], "running");
  EXPECT_EQ(q["io-status"], "ok");
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_EQ(e.graph.find("cbw0"), nullptr);
  std::vector<std::string> names;
  for (auto& [n, d] : e.events) names.push_back(n == "JOB_STATUS_CHANGE" ? d["status"].get<std::string>() : n);
  EXPECT_EQ(names, (std::vector<std::string>{"created", "running", "waiting", "pending", "BLOCK_JOB_COMPLETED",
                                             "concluded", "null"}));
  EXPECT_EQ(*e.last("BLOCK_JOB_COMPLETED"),
            J::parse(R"({"type":"backup","device":"job0","len":4194304,"offset":4194304,"speed":8388608})"));
  EXPECT_TRUE(e.tgt->data() == e.src->data());
}

TEST(BackupTest, PauseCancelsTheCallAndResumeFinishesExactly) {
  Env e;
  BackupArgs a = e.args();
  a.speed = 8 << 20;
  auto job = e.start(a);
  ASSERT_TRUE(job);
  e.wait_for([&] { return job->progress_current() >= (1 << 20); });
  ASSERT_TRUE(job->user_pause().ok());
  ASSERT_TRUE(e.wait_for([&] { return job->status() == JobStatus::Paused; }));
  EXPECT_TRUE(e.mgr.query_block_jobs()[0]["paused"]);
  // Nothing moves while paused (let running tasks settle first).
  e.wait_for([] { return false; }, 50);
  const size_t ops = e.tgt->ops().size();
  const uint64_t at = job->progress_current();
  e.wait_for([] { return false; }, 150);
  EXPECT_EQ(e.tgt->ops().size(), ops);
  EXPECT_EQ(job->progress_current(), at);
  EXPECT_LT(at, e.src->length());
  ASSERT_TRUE(job->user_resume().ok());
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_TRUE(e.tgt->data() == e.src->data());
  EXPECT_EQ(e.max_copies_per_cluster(), 1);  // no cluster copied twice
  EXPECT_EQ(e.count("BLOCK_JOB_COMPLETED"), 1);
}

TEST(BackupTest, Cancel) {
  Env e;
  BackupArgs a = e.args();
  a.speed = 4 << 20;
  auto job = e.start(a);
  ASSERT_TRUE(job);
  e.wait_for([&] { return job->progress_current() > 0; });
  ASSERT_TRUE(job->user_cancel(true).ok());
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_EQ(e.count("BLOCK_JOB_CANCELLED"), 1);
  EXPECT_EQ(e.count("BLOCK_JOB_COMPLETED"), 0);
  const J& c = *e.last("BLOCK_JOB_CANCELLED");
  EXPECT_LT(c["offset"].get<uint64_t>(), c["len"].get<uint64_t>());
  EXPECT_EQ(e.device.get(), e.src.get());
  EXPECT_TRUE(e.mgr.jobs().empty());
  // Source and target are free again for a new job.
  auto again = e.start(e.args());
  ASSERT_TRUE(again);
  ASSERT_TRUE(e.wait_gone(again));
  EXPECT_TRUE(e.tgt->data() == e.src->data());
}

TEST(BackupTest, SetSpeedTakesEffectAtOnce) {
  Env e;
  BackupArgs a = e.args();
  a.speed = 64 << 10;  // 64 KiB/s: a minute for 4 MiB
  auto job = e.start(a);
  ASSERT_TRUE(job);
  e.wait_for([] { return false; }, 200);
  // At most one chunk of overshoot beyond 64 KiB/s * 0.2 s.
  EXPECT_LE(job->progress_current(), 2 * (1u << 20));
  EXPECT_LT(job->progress_current(), e.src->length());
  const uint64_t t0 = Loop::now_ns();
  ASSERT_TRUE(job->set_speed(0).ok());
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_LT(Loop::now_ns() - t0, 3'000'000'000ull);
  EXPECT_EQ(e.last("BLOCK_JOB_COMPLETED")->at("speed"), 0);
  EXPECT_TRUE(e.tgt->data() == e.src->data());
}

TEST(BackupTest, OnTargetErrorStopPausesAndResumeRetries) {
  Env e;
  e.tgt->faults.push_back({'w', 1 << 20, kCluster, EIO, true});
  BackupArgs a = e.args();
  a.on_target_error = OnError::Stop;
  a.max_workers = 1;
  auto job = e.start(a);
  ASSERT_TRUE(job);
  ASSERT_TRUE(e.wait_for([&] { return job->status() == JobStatus::Paused; }));
  EXPECT_EQ(*e.last("BLOCK_JOB_ERROR"), J::parse(R"({"device":"job0","operation":"write","action":"stop"})"));
  J q = e.mgr.query_block_jobs()[0];
  EXPECT_EQ(q["io-status"], "failed");
  EXPECT_EQ(q["paused"], true);
  EXPECT_TRUE(job->user_paused());
  ASSERT_TRUE(job->user_resume().ok());
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_EQ(e.count("BLOCK_JOB_ERROR"), 1);
  EXPECT_FALSE(e.last("BLOCK_JOB_COMPLETED")->contains("error"));
  EXPECT_TRUE(e.tgt->data() == e.src->data());
}

TEST(BackupTest, OnTargetErrorReportEndsTheJob) {
  Env e;
  e.tgt->faults.push_back({'w', 2 << 20, kCluster, EIO, false});
  BackupArgs a = e.args();
  a.on_target_error = OnError::Report;
  auto job = e.start(a);
  ASSERT_TRUE(job);
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_EQ(*e.last("BLOCK_JOB_ERROR"), J::parse(R"({"device":"job0","operation":"write","action":"report"})"));
  EXPECT_EQ(e.last("BLOCK_JOB_COMPLETED")->at("error"), "Input/output error");
  EXPECT_EQ(e.device.get(), e.src.get());
}

TEST(BackupTest, OnTargetErrorIgnoreRetriesUntilDone) {
  Env e;
  for (uint64_t off : {0ull, 1ull << 20, 3ull << 20}) e.tgt->faults.push_back({'w', off, kCluster, EIO, true});
  BackupArgs a = e.args();
  a.on_target_error = OnError::Ignore;
  auto job = e.start(a);
  ASSERT_TRUE(job);
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_GE(e.count("BLOCK_JOB_ERROR"), 1);
  EXPECT_EQ(e.last("BLOCK_JOB_ERROR")->at("action"), "ignore");
  EXPECT_FALSE(e.last("BLOCK_JOB_COMPLETED")->contains("error"));
  EXPECT_TRUE(e.tgt->data() == e.src->data());
}

TEST(BackupTest, OnSourceErrorAndEnospc) {
  {
    Env e;
    e.src->faults.push_back({'r', 0, kCluster, EIO, true});
    BackupArgs a = e.args();
    a.on_source_error = OnError::Stop;
    auto job = e.start(a);
    ASSERT_TRUE(job);
    ASSERT_TRUE(e.wait_for([&] { return job->status() == JobStatus::Paused; }));
    EXPECT_EQ(e.last("BLOCK_JOB_ERROR")->at("operation"), "read");
    ASSERT_TRUE(job->user_resume().ok());
    ASSERT_TRUE(e.wait_gone(job));
    EXPECT_TRUE(e.tgt->data() == e.src->data());
  }
  {
    Env e;
    e.tgt->faults.push_back({'w', 0, kCluster, ENOSPC, true});
    BackupArgs a = e.args();
    a.on_target_error = OnError::Enospc;
    auto job = e.start(a);
    ASSERT_TRUE(job);
    ASSERT_TRUE(e.wait_for([&] { return job->status() == JobStatus::Paused; }));
    EXPECT_EQ(e.mgr.query_block_jobs()[0]["io-status"], "nospace");
    ASSERT_TRUE(job->user_cancel(true).ok());  // cancel a stopped job
    ASSERT_TRUE(e.wait_gone(job));
    EXPECT_EQ(e.count("BLOCK_JOB_CANCELLED"), 1);
  }
  {
    Env e;
    e.tgt->faults.push_back({'w', 0, kCluster, EIO, true});
    BackupArgs a = e.args();
    a.on_target_error = OnError::Enospc;  // EIO under enospc: report
    auto job = e.start(a);
    ASSERT_TRUE(job);
    ASSERT_TRUE(e.wait_gone(job));
    EXPECT_EQ(e.last("BLOCK_JOB_COMPLETED")->at("error"), "Input/output error");
  }
}

TEST(BackupTest, SyncTopSkipsUnallocated) {
  Env e;
  e.src->extents = {{0, 1 << 20, kStatusData | kStatusAllocated},
                    {1 << 20, 2 << 20, 0},  // unallocated in the top layer
                    {3 << 20, 1 << 20, kStatusData | kStatusAllocated}};
  auto job = e.start(e.args("top"));
  ASSERT_TRUE(job);
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_EQ(e.tgt->count('w', 1 << 20, 2 << 20), 0);
  EXPECT_EQ(e.tgt->count('z', 1 << 20, 2 << 20), 0);
  const J& c = *e.last("BLOCK_JOB_COMPLETED");
  EXPECT_EQ(c["len"], 2 << 20);  // the total shrank by what was skipped
  EXPECT_EQ(c["offset"], 2 << 20);
  EXPECT_TRUE(std::equal(e.tgt->data().begin(), e.tgt->data().begin() + (1 << 20), e.src->data().begin()));
}

TEST(BackupTest, CompressWritesEveryDataChunkCompressed) {
  Env e;
  e.src->extents = {{0, 1 << 20, kStatusData | kStatusAllocated},
                    {1 << 20, 1 << 20, kStatusZero | kStatusAllocated},
                    {2 << 20, 2 << 20, kStatusData | kStatusAllocated}};
  e.tgt->mutable_caps().compressed_writes = true;
  BackupArgs a = e.args();
  a.compress = true;
  a.use_copy_range = true;  // compression wins: offload would store plain data
  e.src->copy_range_errno = 0;
  const std::vector<uint8_t> before = e.src->data();
  auto job = e.start(a);
  ASSERT_TRUE(job);
  // A guest write forces its cluster out first, through the same options.
  Status st;
  e.loop.run(write_through(*e.device, 3 * kCluster + 7, std::vector<uint8_t>(10, 0xcd), &st));
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_EQ(e.src->copy_range_calls, 0);
  int writes = 0;
  for (auto& op : e.tgt->ops()) {
    if (op.op != 'w') continue;
    ++writes;
    EXPECT_TRUE(op.flags & kReqCompressed) << "plain write at " << op.offset;
    EXPECT_EQ(op.offset % kCluster, 0u);
    EXPECT_EQ(op.bytes % kCluster, 0u);
  }
  EXPECT_GT(writes, 0);
  EXPECT_EQ(e.tgt->count('w', 1 << 20, 1 << 20), 0);  // the zero range stays write-zeroes
  EXPECT_GT(e.tgt->count('z', 1 << 20, 1 << 20), 0);
  EXPECT_TRUE(std::equal(e.tgt->data().begin(), e.tgt->data().begin() + (1 << 20), before.begin()));
  EXPECT_TRUE(std::equal(e.tgt->data().begin() + (2 << 20), e.tgt->data().end(), before.begin() + (2 << 20)));
  EXPECT_EQ(e.count("BLOCK_JOB_COMPLETED"), 1);
}

TEST(BackupTest, SyncNoneCopiesOnlyWhatGuestWritesForceOut) {
  Env e;
  const std::vector<uint8_t> before = e.src->data();
  auto job = e.start(e.args("none"));
  ASSERT_TRUE(job);
  e.wait_for([] { return false; }, 20);
  EXPECT_TRUE(e.tgt->ops().empty());
  Status st;
  std::vector<uint8_t> d(100, 0xab);
  e.loop.run(write_through(*e.device, kCluster + 10, d, &st));
  ASSERT_TRUE(st.ok());
  e.loop.run(write_through(*e.device, kCluster + 500, d, &st));  // same cluster: no second copy
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(e.tgt->count('w', 0, e.tgt->length()), 1);
  EXPECT_TRUE(
      std::equal(e.tgt->data().begin() + kCluster, e.tgt->data().begin() + 2 * kCluster, before.begin() + kCluster));
  EXPECT_EQ(e.src->data()[kCluster + 10], 0xab);
  EXPECT_EQ(job->status(), JobStatus::Running);
  ASSERT_TRUE(job->user_cancel(true).ok());
  ASSERT_TRUE(e.wait_gone(job));
  EXPECT_EQ(e.count("BLOCK_JOB_CANCELLED"), 1);
}

TEST(BackupTest, ManualFinalizeKeepsFilterUntilFinalize) {
  Env e;
  BackupArgs a = e.args();
  a.auto_finalize = false;
  a.auto_dismiss = false;
  auto job = e.start(a);
  ASSERT_TRUE(job);
  ASSERT_TRUE(e.wait_for([&] { return job->status() == JobStatus::Pending; }));
  EXPECT_EQ(e.device.get(), &job->filter());
  EXPECT_EQ(e.count("BLOCK_JOB_PENDING"), 1);
  ASSERT_TRUE(job->finalize().ok());
  EXPECT_EQ(job->status(), JobStatus::Concluded);
  EXPECT_EQ(e.device.get(), e.src.get());
  ASSERT_TRUE(job->dismiss().ok());
  EXPECT_TRUE(e.mgr.jobs().empty());
}

TEST(BackupTest, ArgumentErrors) {
  Env e;
  auto err = [&](BackupArgs a) {
    auto r = start_backup(e.mgr, e.graph, a);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.error().what();
  };
  BackupArgs a = e.args();
  a.device = "nope";
  EXPECT_EQ(err(a), "Cannot find device='nope' nor node-name='nope'");
  a = e.args();
  a.target = "src";
  EXPECT_EQ(err(a), "Source and target cannot be the same");
  a = e.args();
  a.max_workers = 0;
  EXPECT_EQ(err(a), "max-workers must be between 1 and 2147483647");
  a = e.args();
  a.max_chunk = -1;
  EXPECT_EQ(err(a), "max-chunk must be zero (which means no limit) or positive");
  a = e.args();
  a.max_chunk = 4096;
  EXPECT_EQ(err(a), "Required max-chunk (4096) is less than backup cluster size (65536)");
  a = e.args("incremental");
  EXPECT_EQ(err(a), "must provide a valid bitmap name for 'incremental' sync mode");
  a = e.args();
  a.bitmap = "b0";
  EXPECT_EQ(err(a), "Bitmap 'b0' could not be found");
  a = e.args();
  a.job_id = "1bad";
  EXPECT_EQ(err(a), "Invalid job ID '1bad'");
  a = e.args();
  a.speed = -1;
  EXPECT_EQ(err(a), "Parameter 'speed' expects a non-negative value");
  auto other = vblk::testing::test_disk(e.loop, 1 << 20);
  other->set_node_name("small");
  ASSERT_TRUE(e.graph.add(other).ok());
  a = e.args();
  a.target = "small";
  EXPECT_EQ(err(a), "Source and target image have different sizes");
  // Nothing was left behind by the failures.
  EXPECT_EQ(e.device.get(), e.src.get());
  EXPECT_TRUE(e.mgr.jobs().empty());
  // A second job on busy nodes, and a duplicate id.
  a = e.args();
  a.speed = 1 << 20;
  auto job = e.start(a);
  ASSERT_TRUE(job);
  EXPECT_EQ(err(e.args()), "Node 'tgt' is busy: block device is in use by block job: backup");
  a = e.args();
  a.compress = true;
  EXPECT_EQ(err(a), "Compression is not supported for this drive ");
  ASSERT_TRUE(job->user_cancel(true).ok());
  ASSERT_TRUE(e.wait_gone(job));
}

TEST(CopyBeforeWriteTest, BreakGuestWriteFailsTheWrite) {
  Env e(1 << 20);
  const std::vector<uint8_t> before = e.src->data();
  CbwOptions o;
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, o);
  e.tgt->faults.push_back({'w', 0, kCluster, EIO, true});
  Status st;
  e.loop.run(write_through(*f, 100, std::vector<uint8_t>(10, 1), &st));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EIO);
  EXPECT_TRUE(e.src->data() == before);                                  // the guest write did not happen
  e.loop.run(write_through(*f, 100, std::vector<uint8_t>(10, 1), &st));  // retried: copies, then writes
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(std::equal(e.tgt->data().begin(), e.tgt->data().begin() + kCluster, before.begin()));
  EXPECT_EQ(e.src->data()[100], 1);
  EXPECT_TRUE(f->snapshot_error().ok());
}

TEST(CopyBeforeWriteTest, BreakSnapshotLetsTheWriteThrough) {
  Env e(1 << 20);
  CbwOptions o;
  o.on_error = OnCbwError::BreakSnapshot;
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, o);
  e.tgt->faults.push_back({'w', 0, kCluster, EIO, true});
  Status st;
  e.loop.run(write_through(*f, 0, std::vector<uint8_t>(10, 7), &st));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(e.src->data()[0], 7);
  ASSERT_FALSE(f->snapshot_error().ok());
  // Later writes no longer copy.
  const size_t ops = e.tgt->ops().size();
  e.loop.run(write_through(*f, 3 * kCluster, std::vector<uint8_t>(10, 7), &st));
  EXPECT_EQ(e.tgt->ops().size(), ops);
}

TEST(CopyBeforeWriteTest, ZeroesAndReadsAndTimeout) {
  Env e(1 << 20);
  const std::vector<uint8_t> before = e.src->data();
  CbwOptions o;
  o.timeout_s = 1;
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, o);
  EXPECT_EQ(f->length(), e.src->length());
  auto zero = [&](uint64_t off, uint64_t n) -> Task<Status> { co_return co_await f->write_zeroes(off, n); };
  ASSERT_TRUE(e.loop.run(zero(2 * kCluster, 2 * kCluster)).ok());
  EXPECT_TRUE(std::equal(e.tgt->data().begin() + 2 * kCluster, e.tgt->data().begin() + 4 * kCluster,
                         before.begin() + 2 * kCluster));
  EXPECT_EQ(e.src->data()[2 * kCluster], 0);
  std::vector<uint8_t> buf(16);
  auto rd = [&]() -> Task<Status> { co_return co_await f->read(2 * kCluster, buf); };
  ASSERT_TRUE(e.loop.run(rd()).ok());
  EXPECT_EQ(buf[0], 0);
  EXPECT_EQ(e.src->count('r', 2 * kCluster, 16), 2);  // the copy, then the pass-through read
  // A copy slower than cbw-timeout fails the guest write with ETIMEDOUT.
  e.tgt->options().latency_ns = 1500'000'000;
  Status st;
  e.loop.run(write_through(*f, 8 * kCluster, std::vector<uint8_t>(4, 1), &st));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, ETIMEDOUT);
  e.loop.run(f->quiesce());
}

TEST(CopyBeforeWriteTest, OpensFromBlockdevOptions) {
  register_copy_drivers();
  Env e(1 << 20);
  OpenContext ctx{e.loop, &e.graph};
  auto r = open_node(ctx, Json::parse(R"({"driver":"copy-before-write","node-name":"f","file":"src",
                                          "target":"tgt","on-cbw-error":"break-snapshot","cbw-timeout":5})"));
  ASSERT_TRUE(r.ok()) << r.error().what();
  EXPECT_EQ((*r)->driver(), "copy-before-write");
  EXPECT_NE(e.graph.find("f"), nullptr);
  auto bad = open_node(ctx, Json::parse(R"({"driver":"copy-before-write","file":"src","target":"tgt",
                                            "on-cbw-error":"explode"})"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().what(), "Parameter 'on-cbw-error' does not accept value 'explode'");
  auto nobitmap = open_node(ctx, Json::parse(R"({"driver":"copy-before-write","file":"src","target":"tgt",
                                                 "bitmap":{"node":"src","name":"b"}})"));
  ASSERT_FALSE(nobitmap.ok());
  EXPECT_EQ(nobitmap.error().what(), "Dirty bitmap 'b' not found");
  auto notarget = open_node(ctx, Json::parse(R"({"driver":"copy-before-write","file":"src"})"));
  ASSERT_FALSE(notarget.ok());
  EXPECT_EQ(notarget.error().what(), "A block device must be specified for \"target\"");
}

TEST(GraphFilterTest, InsertAndRemoveRepointsRefs) {
  Env e(1 << 20);
  NodeRef second(e.src);
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, CbwOptions{});
  f->set_node_name("flt");
  ASSERT_TRUE(e.graph.insert_filter(e.src, f).ok());
  EXPECT_EQ(e.device.get(), f.get());
  EXPECT_EQ(second.get(), f.get());
  EXPECT_TRUE(e.src->refs().empty());
  EXPECT_EQ(f->refs().size(), 2u);
  e.graph.remove_filter(f, e.src);
  EXPECT_EQ(e.device.get(), e.src.get());
  EXPECT_EQ(second.get(), e.src.get());
  EXPECT_EQ(e.graph.find("flt"), nullptr);
  // A named parent node cannot be re-pointed: refused.
  auto g = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, CbwOptions{});
  g->set_node_name("g");
  ASSERT_TRUE(e.graph.add(g).ok());
  auto h = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, CbwOptions{});
  auto st = e.graph.insert_filter(e.src, h);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().what(), "Cannot insert a filter above node 'src': it is a child of node 'g'");
}

TEST(BackupTest, SyncBitmapCopiesOnlyDirtyClustersAndAbdicates) {
  Env e(4 << 20);
  auto b = e.src->bitmaps().create("b", e.src->length(), 4096);
  ASSERT_TRUE(b.ok());
  (*b)->bits.set(100, 1);                   // cluster 0
  (*b)->bits.set(3 * kCluster + 5000, 10);  // cluster 3
  BackupArgs a = e.args("incremental");
  a.bitmap = "b";
  auto job = e.start(a);
  ASSERT_TRUE(job);
  NamedBitmap* bm = e.src->bitmaps().find("b");
  EXPECT_TRUE(bm->busy);
  // A guest write during the job goes to the successor.
  Status st;
  spawn_detached(write_through(*e.device.get(), 2 * kCluster, std::vector<uint8_t>(10, 0x5a), &st));
  ASSERT_TRUE(e.wait_gone(job));
  ASSERT_TRUE(st.ok());
  for (uint64_t c = 0; c < e.tgt->length(); c += kCluster) {
    const bool dirty = c == 0 || c == 3 * kCluster;
    EXPECT_EQ(e.tgt->count('w', c, kCluster) > 0, dirty) << c;
  }
  // Success: the bitmap holds the writes made while the job ran.
  bm = e.src->bitmaps().find("b");
  ASSERT_TRUE(bm);
  EXPECT_FALSE(bm->busy);
  EXPECT_EQ(e.src->bitmaps().list().size(), 1u);
  EXPECT_EQ(bm->bits.dirty_clusters(), 1u);
  EXPECT_TRUE(bm->bits.get(2 * kCluster));
}

TEST(BackupTest, BitmapArgumentsCheckedInQemuOrder) {
  Env e;
  ASSERT_TRUE(e.src->bitmaps().create("b", e.src->length(), kCluster).ok());
  auto err = [&](const BackupArgs& a) {
    auto r = start_backup(e.mgr, e.graph, a);
    return r.ok() ? std::string("ok") : r.error().what();
  };
  BackupArgs a = e.args("bitmap");
  a.bitmap = "b";
  EXPECT_EQ(err(a), "Bitmap sync mode must be given when providing a bitmap");
  a = e.args("none");
  a.bitmap = "b";
  a.bitmap_mode = "always";
  EXPECT_EQ(err(a), "sync mode 'none' does not produce meaningful bitmap outputs");
  a = e.args("full");
  a.bitmap = "b";
  a.bitmap_mode = "never";
  EXPECT_EQ(err(a), "Bitmap sync mode 'never' has no meaningful effect when combined with sync mode 'full'");
  e.src->bitmaps().find("b")->busy = true;
  a = e.args("incremental");
  a.bitmap = "b";
  EXPECT_EQ(err(a), "Bitmap 'b' is currently in use by another operation and cannot be used");
  EXPECT_TRUE(e.mgr.jobs().empty());
}

}  // namespace
}  // namespace vblk
