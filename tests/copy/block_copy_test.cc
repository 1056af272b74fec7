// The block-copy engine over deterministic fake nodes: chunking by block
// status, worker and memory caps, rate limit, cancel and resume, overlapping
// calls, error reporting and copy offload fallback.
#include "vblk/block_copy.h"

#include <gtest/gtest.h>

#include "test_disk.h"

using namespace vblk;
using vblk::MemNode;
using vblk::testing::Concurrency;
using vblk::testing::fill_pattern;
using vblk::testing::run_until;

namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;

// Only the target's requests of one kind, in order.
std::vector<MemNode::Op> ops_of(const MemNode& n, char op) {
  std::vector<MemNode::Op> out;
  for (auto& o : n.ops())
    if (o.op == op) out.push_back(o);
  return out;
}

BlockCopyOptions opts(uint64_t cluster = 64 * KiB) {
  BlockCopyOptions o;
  o.cluster_size = cluster;
  return o;
}

// Runs fn on the loop after ns (a timer, so the loop wakes for it).
void after(Loop& loop, uint64_t ns, std::function<void()> fn) {
  auto t = [](Loop& l, uint64_t d, std::function<void()> f) -> Task<void> {
    co_await l.sleep(std::chrono::nanoseconds(d));
    f();
  };
  spawn_detached(t(loop, ns, std::move(fn)));
}

struct Fixture {
  Loop loop;
  Concurrency conc;
  MemNode src, dst;
  Fixture(uint64_t size)
      : src(loop, vblk::testing::disk_options(size, &conc)), dst(loop, vblk::testing::disk_options(size, &conc)) {
    fill_pattern(src, 1);
    std::fill(dst.data().begin(), dst.data().end(), 0xAA);
  }
};

}  // namespace

// ---- chunking

TEST(BlockCopyTest, ChunksFollowBlockStatus) {
  Fixture f(8 * MiB);
  auto& s = f.src;
  // [0,1M) data, [1M,3M) zero, [3M,4M) unallocated (no backing: read as
  // data in a full copy), [4M,4M+4K) zero then data to 5M, [5M,8M) zero.
  s.extents = {{1 * MiB, 2 * MiB, kStatusZero},
               {3 * MiB, 1 * MiB, 0},
               {4 * MiB, 4 * KiB, kStatusZero},
               {5 * MiB, 3 * MiB, kStatusZero}};
  std::fill(s.data().begin() + 1 * MiB, s.data().begin() + 3 * MiB, 0);
  std::fill(s.data().begin() + 4 * MiB, s.data().begin() + 4 * MiB + 4 * KiB, 0);
  std::fill(s.data().begin() + 5 * MiB, s.data().end(), 0);

  BlockCopyState bcs(f.src, f.dst, opts());
  bcs.bitmap().set_all();
  EXPECT_EQ(bcs.progress_total(), 8 * MiB);
  auto st = f.loop.run(bcs.copy(0, 8 * MiB));
  ASSERT_TRUE(st.ok()) << st.error().what();
  EXPECT_EQ(f.dst.data(), f.src.data());
  EXPECT_EQ(bcs.bitmap().count(), 0u);
  EXPECT_EQ(bcs.progress_done(), 8 * MiB);
  EXPECT_EQ(bcs.progress_total(), 8 * MiB);

  auto writes = ops_of(f.dst, 'w');
  auto zeroes = ops_of(f.dst, 'z');
  std::sort(writes.begin(), writes.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
  std::sort(zeroes.begin(), zeroes.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
  // Data in 1 MiB chunks (the engine's limit); the cluster mixing zero and
  // data at 4M is data; the zero runs are one write_zeroes each, may-unmap.
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(writes[0].offset, 0u);
  EXPECT_EQ(writes[0].bytes, 1 * MiB);
  EXPECT_EQ(writes[1].offset, 3 * MiB);
  EXPECT_EQ(writes[1].bytes, 1 * MiB);
  EXPECT_EQ(writes[2].offset, 4 * MiB);
  EXPECT_EQ(writes[2].bytes, 1 * MiB);
  ASSERT_EQ(zeroes.size(), 2u);
  EXPECT_EQ(zeroes[0].offset, 1 * MiB);
  EXPECT_EQ(zeroes[0].bytes, 2 * MiB);
  EXPECT_EQ(zeroes[1].offset, 5 * MiB);
  EXPECT_EQ(zeroes[1].bytes, 3 * MiB);
  EXPECT_TRUE(zeroes[0].flags & kReqMayUnmap);
  // Nothing was read where the source said zero.
  EXPECT_EQ(f.src.count('r', 1 * MiB, 2 * MiB), 0);
  EXPECT_EQ(f.src.count('r', 5 * MiB, 3 * MiB), 0);
}

TEST(BlockCopyTest, SkipUnallocatedShrinksTheTotal) {
  Fixture f(4 * MiB);
  f.src.extents = {{1 * MiB, 1 * MiB, 0}, {2 * MiB, 64 * KiB, kStatusZero}};
  std::fill(f.src.data().begin() + 2 * MiB, f.src.data().begin() + 2 * MiB + 64 * KiB, 0);
  auto o = opts();
  o.skip_unallocated = true;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
  EXPECT_EQ(f.dst.count('w', 1 * MiB, 1 * MiB) + f.dst.count('z', 1 * MiB, 1 * MiB), 0);
  EXPECT_EQ(f.src.count('r', 1 * MiB, 1 * MiB), 0);
  EXPECT_EQ(bcs.bitmap().count(), 0u);
  EXPECT_EQ(bcs.progress_done(), 3 * MiB);
  EXPECT_EQ(bcs.progress_total(), 3 * MiB);
  // The skipped range kept the target's old bytes; the rest is copied.
  EXPECT_EQ(f.dst.data()[1 * MiB + 5], 0xAA);
  EXPECT_TRUE(std::equal(f.src.data().begin(), f.src.data().begin() + 1 * MiB, f.dst.data().begin()));
  EXPECT_TRUE(std::equal(f.src.data().begin() + 2 * MiB, f.src.data().end(), f.dst.data().begin() + 2 * MiB));
}

TEST(BlockCopyTest, MaxChunkBoundsEveryRequestAndZeroesWithoutUnmapSupport) {
  Fixture f(2 * MiB);
  f.src.extents = {{1 * MiB, 1 * MiB, kStatusZero}};
  std::fill(f.src.data().begin() + 1 * MiB, f.src.data().end(), 0);
  f.dst.mutable_caps().discard = false;  // the target cannot unmap
  auto o = opts();
  o.max_chunk = 256 * KiB + 1000;  // rounded down to whole clusters
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 2 * MiB)).ok());
  EXPECT_EQ(f.dst.data(), f.src.data());
  auto w = ops_of(f.dst, 'w'), z = ops_of(f.dst, 'z');
  EXPECT_EQ(w.size(), 4u);
  EXPECT_EQ(z.size(), 4u);
  for (auto& op : w) EXPECT_EQ(op.bytes, 256 * KiB);
  for (auto& op : z) {
    EXPECT_EQ(op.bytes, 256 * KiB);
    EXPECT_FALSE(op.flags & kReqMayUnmap);
  }
}

TEST(BlockCopyTest, OnlyDirtyClustersAreCopiedAndPartialLastClusterReachesTheEnd) {
  const uint64_t size = 1 * MiB + 1000;
  Fixture f(size);
  BlockCopyState bcs(f.src, f.dst, opts());
  bcs.bitmap().set(128 * KiB, 64 * KiB);
  bcs.bitmap().set(1 * MiB, 1);  // the partial last cluster
  EXPECT_EQ(bcs.progress_total(), 64 * KiB + 1000);
  ASSERT_TRUE(f.loop.run(bcs.copy(0, size)).ok());
  auto w = ops_of(f.dst, 'w');
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(f.dst.count('w', 128 * KiB, 64 * KiB), 1);
  EXPECT_EQ(f.dst.count('w', 1 * MiB, 1000), 1);
  EXPECT_EQ(f.dst.data()[0], 0xAA);  // clean: untouched
  EXPECT_TRUE(std::equal(f.src.data().begin() + 1 * MiB, f.src.data().end(), f.dst.data().begin() + 1 * MiB));
  EXPECT_EQ(bcs.progress_done(), 64 * KiB + 1000);
}

TEST(BlockCopyTest, TargetIsZeroSkipsZeroWrites) {
  Fixture f(2 * MiB);
  f.src.extents = {{0, 1 * MiB, kStatusZero}};
  auto o = opts();
  o.target_is_zero = true;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 2 * MiB)).ok());
  EXPECT_EQ(ops_of(f.dst, 'z').size(), 0u);
  EXPECT_EQ(ops_of(f.dst, 'w').size(), 1u);
  EXPECT_EQ(bcs.progress_done(), 2 * MiB);  // zeroes count as copied
}

// ---- parallelism and memory

TEST(BlockCopyTest, WorkerCapBoundsParallelTasks) {
  for (unsigned workers : {1u, 3u, 16u}) {
    Fixture f(4 * MiB);
    f.src.options().latency_ns = f.dst.options().latency_ns = 1'000'000;
    auto o = opts();
    o.max_chunk = 64 * KiB;
    o.max_workers = workers;
    BlockCopyState bcs(f.src, f.dst, o);
    bcs.bitmap().set_all();
    ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
    EXPECT_EQ(f.dst.data(), f.src.data());
    // Each task has one request in flight at a time: the peak equals the cap.
    EXPECT_EQ(f.conc.peak, static_cast<int>(workers)) << workers;
  }
}

TEST(BlockCopyTest, ABusyGuestLeavesTheBackgroundCallOneSmallTask) {
  Fixture f(4 * MiB);
  f.src.options().latency_ns = f.dst.options().latency_ns = 1'000'000;
  auto o = opts();
  o.max_workers = 16;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  // A guest writing all along (a request every 5 ms, as copy-before-write
  // notes them): the background call keeps one task.
  bool copying = true;
  auto guest = [](Loop& l, BlockCopyState& b, bool& on) -> Task<void> {
    while (on) {
      b.note_foreground();
      co_await l.sleep(std::chrono::milliseconds(5));
    }
  };
  auto copy = [&]() -> Task<Status> {
    Status st = co_await bcs.copy(0, 2 * MiB);
    copying = false;
    co_return st;
  };
  spawn_detached(guest(f.loop, bcs, copying));
  ASSERT_TRUE(f.loop.run(copy()).ok());
  EXPECT_EQ(f.conc.peak, 1);
  // One task, of at most 64 KiB (not the 1 MiB data chunk).
  for (auto& w : ops_of(f.dst, 'w')) EXPECT_LE(w.bytes, 64 * KiB);
  EXPECT_EQ(ops_of(f.dst, 'w').size(), 32u);
  // Let the guest coroutine see the end before the loop goes.
  auto pause = [](Loop& l) -> Task<void> { co_await l.sleep(std::chrono::milliseconds(20)); };
  f.loop.run(pause(f.loop));
  // Calls that ignore the limit (copy-before-write) are not held back.
  f.conc.peak = 0;
  bcs.note_foreground();
  ASSERT_TRUE(f.loop.run(bcs.copy(2 * MiB, 2 * MiB, /*ignore_ratelimit=*/true)).ok());
  EXPECT_EQ(f.conc.peak, 2);  // two 1 MiB chunks, at once
  EXPECT_EQ(ops_of(f.dst, 'w').size(), 34u);
  EXPECT_EQ(f.dst.data(), f.src.data());
}

TEST(BlockCopyTest, MemoryBudgetMakesTasksWait) {
  Fixture f(4 * MiB);
  f.src.options().latency_ns = f.dst.options().latency_ns = 1'000'000;
  auto o = opts();
  o.max_chunk = 64 * KiB;
  o.max_workers = 64;
  o.max_memory = 256 * KiB;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
  EXPECT_EQ(f.dst.data(), f.src.data());
  EXPECT_EQ(bcs.memory_peak(), 256 * KiB);  // used up to the cap, never more
  EXPECT_EQ(bcs.memory_in_use(), 0u);
  EXPECT_LE(f.conc.peak, 4);
  EXPECT_GE(f.conc.peak, 2);
}

TEST(BlockCopyTest, ZeroChunksNeedNoMemory) {
  Fixture f(4 * MiB);
  f.src.extents = {{0, 4 * MiB, kStatusZero}};
  auto o = opts();
  o.max_memory = 64 * KiB;
  o.max_chunk = 64 * KiB;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
  EXPECT_EQ(bcs.memory_peak(), 0u);
  EXPECT_EQ(ops_of(f.dst, 'z').size(), 64u);
}

// ---- rate limit

TEST(BlockCopyTest, RateLimitIsNeverExceededByMoreThanOneChunk) {
  Fixture f(2 * MiB);
  auto o = opts();
  o.max_chunk = 256 * KiB;
  o.speed = 4 * MiB;  // per second
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  uint64_t t0 = Loop::now_ns();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 2 * MiB)).ok());
  double elapsed = static_cast<double>(Loop::now_ns() - t0) / 1e9;
  EXPECT_EQ(f.dst.data(), f.src.data());
  // 2 MiB at 4 MiB/s with the first chunk free: at least 1.75 MiB / 4 MiB/s.
  EXPECT_GE(elapsed, 0.43);
  EXPECT_LT(elapsed, 1.5);
  // At every read start, bytes started so far ≤ speed * t + one chunk.
  uint64_t started = 0;
  for (auto& r : ops_of(f.src, 'r')) {
    started += r.bytes;
    double t = static_cast<double>(r.start_ns - t0) / 1e9;
    EXPECT_LE(static_cast<double>(started), 4.0 * MiB * t + 256 * KiB + 1) << "at t=" << t;
  }
}

TEST(BlockCopyTest, SetSpeedAppliesAtOnceToASleepingCall) {
  Fixture f(4 * MiB);
  auto o = opts();
  o.max_chunk = 512 * KiB;
  o.speed = 512 * KiB;  // 4 MiB would take 7 s
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  uint64_t t0 = Loop::now_ns();
  auto call = bcs.copy_async(0, 4 * MiB);
  // The first chunk starts at once; the call then sleeps about 1 s.
  size_t reads_before = 0;
  bool was_finished = true;
  after(f.loop, 150'000'000, [&] {
    reads_before = ops_of(f.src, 'r').size();
    was_finished = call->finished();
    bcs.set_speed(0);
  });
  run_until(f.loop, [&] { return call->finished(); });
  EXPECT_EQ(reads_before, 1u);
  EXPECT_FALSE(was_finished);
  double elapsed = static_cast<double>(Loop::now_ns() - t0) / 1e9;
  EXPECT_TRUE(call->succeeded());
  EXPECT_LT(elapsed, 0.8);  // not the ~1 s sleep, let alone 7 s
  EXPECT_EQ(f.dst.data(), f.src.data());

  // And lowering the speed mid-call slows it at once.
  Fixture g(4 * MiB);
  o.max_workers = 1;
  o.speed = 0;
  BlockCopyState slow(g.src, g.dst, o);
  slow.bitmap().set_all();
  g.src.options().latency_ns = 20'000'000;
  auto c2 = slow.copy_async(0, 4 * MiB);
  run_until(g.loop, [&] { return slow.progress_done() >= 512 * KiB; });
  slow.set_speed(256 * KiB);
  uint64_t t1 = Loop::now_ns();
  bool waited = false;
  after(g.loop, 300'000'000, [&] { waited = true; });
  run_until(g.loop, [&] { return waited; });
  // Within 0.3 s at 256 KiB/s, at most one more chunk may start per call
  // beyond those already in flight at the change.
  uint64_t after = 0;
  for (auto& r : ops_of(g.src, 'r'))
    if (r.start_ns > t1) after += r.bytes;
  EXPECT_LE(after, 512 * KiB);
  EXPECT_FALSE(c2->finished());  // unlimited, it would have finished by now
  c2->cancel();
  run_until(g.loop, [&] { return c2->finished(); });
  EXPECT_TRUE(c2->cancelled());
}

TEST(BlockCopyTest, CallsIgnoringTheLimitStillCountAgainstIt) {
  Fixture f(2 * MiB);
  auto o = opts();
  o.max_chunk = 256 * KiB;
  // Slow enough that "not limited" has a wide margin on a loaded machine:
  // limited, the 1 MiB call would take >= 0.75 s.
  o.speed = 1 * MiB;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  uint64_t t0 = Loop::now_ns();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 1 * MiB, /*ignore_ratelimit=*/true)).ok());
  EXPECT_LT(Loop::now_ns() - t0, 400'000'000u);  // not limited itself
  size_t before = ops_of(f.src, 'r').size();
  ASSERT_TRUE(f.loop.run(bcs.copy(1 * MiB, 256 * KiB)).ok());
  auto reads = ops_of(f.src, 'r');
  ASSERT_EQ(reads.size(), before + 1);
  // The 1 MiB debt at 1 MiB/s delays the limited call by ~1 s.
  EXPECT_GE(reads.back().start_ns - t0, 800'000'000u);
}

// ---- cancel

TEST(BlockCopyTest, CancelLeavesTheBitmapExactAndANewCallResumes) {
  Fixture f(4 * MiB);
  f.src.options().latency_ns = f.dst.options().latency_ns = 2'000'000;
  auto o = opts();
  o.max_chunk = 64 * KiB;
  o.max_workers = 4;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  bool callback_ran = false;
  auto call = bcs.copy_async(0, 4 * MiB, false, [&](BlockCopyCall& c) { callback_ran = c.finished(); });
  run_until(f.loop, [&] { return bcs.progress_done() >= 1 * MiB; });
  call->cancel();
  EXPECT_TRUE(call->cancelled());
  EXPECT_FALSE(call->finished());  // its running tasks finish first
  run_until(f.loop, [&] { return call->finished(); });
  EXPECT_TRUE(callback_ran);
  EXPECT_FALSE(call->succeeded());
  EXPECT_FALSE(call->failed());
  EXPECT_LT(bcs.progress_done(), 4 * MiB);
  EXPECT_EQ(bcs.progress_done() + bcs.bitmap().count(), 4 * MiB);
  // Every cluster is either dirty and untouched, or clean and copied.
  for (uint64_t c = 0; c < 4 * MiB; c += 64 * KiB) {
    int writes = f.dst.count('w', c, 64 * KiB);
    if (bcs.bitmap().get(c)) {
      EXPECT_EQ(writes, 0) << c;
    } else {
      EXPECT_EQ(writes, 1) << c;
      EXPECT_TRUE(std::equal(f.src.data().begin() + c, f.src.data().begin() + c + 64 * KiB, f.dst.data().begin() + c));
    }
  }
  // Resume: each remaining byte copied once, none twice.
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
  EXPECT_EQ(f.dst.data(), f.src.data());
  for (uint64_t c = 0; c < 4 * MiB; c += 64 * KiB) EXPECT_EQ(f.dst.count('w', c, 64 * KiB), 1) << c;
  EXPECT_EQ(bcs.progress_done(), 4 * MiB);
}

TEST(BlockCopyTest, CancelWakesACallSleepingForTheLimit) {
  Fixture f(4 * MiB);
  auto o = opts();
  o.speed = 64 * KiB;  // the second chunk would wait 16 s
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  auto call = bcs.copy_async(0, 4 * MiB);
  f.loop.run_once(10'000'000);
  uint64_t t0 = Loop::now_ns();
  call->cancel();
  run_until(f.loop, [&] { return call->finished(); });
  EXPECT_LT(Loop::now_ns() - t0, 500'000'000u);
  EXPECT_EQ(bcs.bitmap().count(), 3 * MiB);  // one 1 MiB chunk was copied
}

// ---- overlapping calls

TEST(BlockCopyTest, OverlappingCallWaitsForTheTaskCopyingItsRange) {
  Fixture f(2 * MiB);
  f.src.options().latency_ns = f.dst.options().latency_ns = 5'000'000;
  auto o = opts();
  o.max_workers = 1;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  auto a = bcs.copy_async(0, 2 * MiB);  // claims [0,1M) at once
  size_t writes_when_b_done = 0;
  auto b = bcs.copy_async(256 * KiB, 256 * KiB, false,
                          [&](BlockCopyCall&) { writes_when_b_done = f.dst.count('w', 0, 1 * MiB); });
  EXPECT_FALSE(b->finished());
  run_until(f.loop, [&] { return a->finished() && b->finished(); });
  EXPECT_TRUE(a->succeeded());
  EXPECT_TRUE(b->succeeded());
  EXPECT_EQ(writes_when_b_done, 1u);                     // b finished only after a's write landed
  EXPECT_EQ(f.dst.count('w', 256 * KiB, 256 * KiB), 1);  // and nobody copied it twice
  EXPECT_EQ(f.src.count('r', 256 * KiB, 256 * KiB), 1);
  EXPECT_EQ(f.dst.data(), f.src.data());
}

TEST(BlockCopyTest, OverlappingCallRecopiesWhatAFailedTaskGaveBack) {
  Fixture f(2 * MiB);
  f.src.options().latency_ns = f.dst.options().latency_ns = 5'000'000;
  f.dst.faults = {{'w', 0, 1 * MiB, EIO, true}};
  auto o = opts();
  o.max_workers = 1;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  auto a = bcs.copy_async(0, 2 * MiB);
  auto b = bcs.copy_async(256 * KiB, 256 * KiB);
  run_until(f.loop, [&] { return a->finished() && b->finished(); });
  EXPECT_TRUE(a->failed());
  EXPECT_FALSE(a->error_is_read());
  EXPECT_EQ(a->status().error().code, EIO);
  EXPECT_TRUE(b->succeeded());
  EXPECT_TRUE(
      std::equal(f.src.data().begin() + 256 * KiB, f.src.data().begin() + 512 * KiB, f.dst.data().begin() + 256 * KiB));
  // Exactly b's range was recopied; the rest of the failed chunk is dirty.
  EXPECT_EQ(f.dst.count('w', 256 * KiB, 256 * KiB), 2);
  EXPECT_FALSE(bcs.bitmap().get(256 * KiB));
  EXPECT_TRUE(bcs.bitmap().get(0));
  EXPECT_TRUE(bcs.bitmap().get(512 * KiB));
}

// ---- errors

TEST(BlockCopyTest, ReadAndWriteErrorsAreReportedWithTheirSide) {
  for (char side : {'r', 'w'}) {
    Fixture f(4 * MiB);
    MemNode& bad = side == 'r' ? f.src : f.dst;
    bad.faults = {{side, 2 * MiB + 4096, 1, EIO, false}};
    BlockCopyState bcs(f.src, f.dst, opts());
    bcs.bitmap().set_all();
    bool is_read = side != 'r';
    Status st = f.loop.run(bcs.copy(0, 4 * MiB, false, &is_read));
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.error().code, EIO);
    EXPECT_EQ(is_read, side == 'r');
    // The failed 1 MiB chunk is dirty again; the others are done.
    EXPECT_TRUE(bcs.bitmap().get(2 * MiB));
    EXPECT_FALSE(bcs.bitmap().get(0));
    EXPECT_EQ(bcs.progress_done() + bcs.bitmap().count(), 4 * MiB);
    // A retry without the fault finishes the job.
    bad.faults.clear();
    ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
    EXPECT_EQ(f.dst.data(), f.src.data());
  }
}

TEST(BlockCopyTest, AsyncCallReportsFailure) {
  Fixture f(1 * MiB);
  f.src.faults = {{'r', 0, 1, ENOSPC, false}};
  BlockCopyState bcs(f.src, f.dst, opts());
  bcs.bitmap().set_all();
  auto call = bcs.copy_async(0, 1 * MiB);
  f.loop.run(call->wait());
  EXPECT_TRUE(call->finished());
  EXPECT_TRUE(call->failed());
  EXPECT_TRUE(call->error_is_read());
  EXPECT_EQ(call->status().error().code, ENOSPC);
}

// ---- copy offload

TEST(BlockCopyTest, CopyOffloadIsOffByDefault) {
  Fixture f(2 * MiB);
  f.src.mutable_caps().copy_range = true;
  f.src.copy_range_errno = 0;
  BlockCopyState bcs(f.src, f.dst, opts());
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 2 * MiB)).ok());
  EXPECT_EQ(f.src.copy_range_calls, 0);
  EXPECT_EQ(f.dst.data(), f.src.data());
}

TEST(BlockCopyTest, CopyOffloadUsedWhenAllowed) {
  Fixture f(20 * MiB);
  f.src.mutable_caps().copy_range = true;
  f.src.copy_range_errno = 0;
  auto o = opts();
  o.use_copy_range = true;
  o.max_workers = 1;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 20 * MiB)).ok());
  EXPECT_EQ(f.dst.data(), f.src.data());
  EXPECT_EQ(ops_of(f.src, 'r').size(), 0u);
  auto c = ops_of(f.dst, 'c');
  // 1 MiB until a request has worked, then 16 MiB chunks (QEMU's order).
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].bytes, 1 * MiB);
  EXPECT_EQ(c[1].bytes, 16 * MiB);
  EXPECT_EQ(c[2].bytes, 3 * MiB);
  EXPECT_TRUE(bcs.copy_range_active());
  EXPECT_EQ(bcs.memory_peak(), 0u);
}

TEST(BlockCopyTest, CopyOffloadRefusedFallsBackToReadWrite) {
  Fixture f(4 * MiB);
  f.src.mutable_caps().copy_range = true;
  f.src.copy_range_errno = ENOTSUP;
  auto o = opts();
  o.use_copy_range = true;
  o.max_workers = 1;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
  EXPECT_EQ(f.dst.data(), f.src.data());
  EXPECT_EQ(f.src.copy_range_calls, 1);  // refused once, then not tried again
  EXPECT_FALSE(bcs.copy_range_active());
  // The refused request itself was copied by read+write, in 1 MiB pieces.
  for (auto& w : ops_of(f.dst, 'w')) EXPECT_LE(w.bytes, 1 * MiB);
  EXPECT_EQ(bcs.progress_done(), 4 * MiB);
  EXPECT_LE(bcs.memory_peak(), 16 * MiB);
}

// ---- zero detection (qemu-img convert -S) and full allocation (-S 0)

TEST(BlockCopyTest, ZeroDetectionKeepsTheTargetSparse) {
  for (bool zeroed : {false, true}) {
    Fixture f(1 * MiB);
    // Data status everywhere, but [128K,256K) and [260K,264K) read as zero.
    std::fill(f.src.data().begin() + 128 * KiB, f.src.data().begin() + 256 * KiB, 0);
    std::fill(f.src.data().begin() + 260 * KiB, f.src.data().begin() + 264 * KiB, 0);
    if (zeroed) std::fill(f.dst.data().begin(), f.dst.data().end(), 0);
    auto o = opts();
    o.detect_zeroes = 4 * KiB;
    o.target_is_zero = zeroed;
    BlockCopyState bcs(f.src, f.dst, o);
    bcs.bitmap().set_all();
    ASSERT_TRUE(f.loop.run(bcs.copy(0, 1 * MiB)).ok());
    EXPECT_EQ(f.dst.data(), f.src.data());
    EXPECT_EQ(f.dst.count('w', 128 * KiB, 128 * KiB), 0);
    EXPECT_EQ(f.dst.count('w', 260 * KiB, 4 * KiB), 0);
    EXPECT_EQ(f.dst.count('z', 128 * KiB, 128 * KiB), zeroed ? 0 : 1);
    EXPECT_EQ(f.dst.count('z', 260 * KiB, 4 * KiB), zeroed ? 0 : 1);
    EXPECT_EQ(f.dst.count('w', 256 * KiB, 4 * KiB), 1);
    EXPECT_EQ(bcs.progress_done(), 1 * MiB);
  }
}

TEST(BlockCopyTest, AllocateZeroesWritesZeroRangesAsData) {
  Fixture f(1 * MiB);
  f.src.extents = {{0, 1 * MiB, kStatusZero}};
  std::fill(f.src.data().begin(), f.src.data().end(), 0);
  auto o = opts();
  o.allocate_zeroes = true;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 1 * MiB)).ok());
  EXPECT_EQ(f.dst.data(), f.src.data());
  EXPECT_EQ(ops_of(f.dst, 'z').size(), 0u);
  EXPECT_EQ(ops_of(f.dst, 'w').size(), 1u);
}

TEST(BlockCopyTest, ErrorOffsetNamesTheFailedChunk) {
  Fixture f(4 * MiB);
  f.dst.faults = {{'w', 3 * MiB + 10, 1, EIO, false}};
  BlockCopyState bcs(f.src, f.dst, opts());
  bcs.bitmap().set_all();
  auto call = bcs.copy_async(0, 4 * MiB);
  f.loop.run(call->wait());
  ASSERT_TRUE(call->failed());
  EXPECT_EQ(call->error_offset(), 3 * MiB);
}

TEST(BlockCopyTest, UnalignedCallRangeCopiesWholeClusters) {
  Fixture f(1 * MiB);
  BlockCopyState bcs(f.src, f.dst, opts());
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(10 * KiB, 90 * KiB)).ok());  // touches clusters 0 and 1
  EXPECT_FALSE(bcs.bitmap().get(0));
  EXPECT_FALSE(bcs.bitmap().get(64 * KiB));
  EXPECT_TRUE(bcs.bitmap().get(128 * KiB));
  EXPECT_TRUE(std::equal(f.src.data().begin(), f.src.data().begin() + 128 * KiB, f.dst.data().begin()));
  EXPECT_EQ(f.dst.data()[128 * KiB], 0xAA);
  EXPECT_EQ(bcs.progress_done(), 128 * KiB);
}

TEST(BlockCopyTest, ZeroBuffersOfATargetWithoutWriteZeroesCountAsMemory) {
  Fixture f(4 * MiB);
  f.src.extents = {{0, 4 * MiB, kStatusZero}};
  std::fill(f.src.data().begin(), f.src.data().end(), 0);
  f.dst.mutable_caps().zeroes = false;  // the node layer writes zero buffers
  f.dst.options().latency_ns = 1'000'000;
  auto o = opts();
  o.max_chunk = 256 * KiB;
  o.max_memory = 512 * KiB;
  BlockCopyState bcs(f.src, f.dst, o);
  bcs.bitmap().set_all();
  ASSERT_TRUE(f.loop.run(bcs.copy(0, 4 * MiB)).ok());
  EXPECT_EQ(f.dst.data(), f.src.data());
  EXPECT_EQ(bcs.memory_peak(), 512 * KiB);
  EXPECT_LE(f.conc.peak, 2);  // two 256 KiB zero tasks fit in the budget
}
