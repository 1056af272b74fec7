// The copy-before-write filter's snapshot API (fleecing) over deterministic
// fake nodes: a frozen read of the source holds a guest write back, done
// clusters read from the target, the access bitmap and snapshot discard,
// and a broken snapshot.
#include <gtest/gtest.h>

#include <random>

#include "../copy/test_disk.h"
#include "vblk/copy_before_write.h"

namespace vblk {
// Named, not anonymous: the unity build puts several test files in one
// translation unit, and their helpers share names.
namespace cbw_snapshot_test {

using vblk::MemNode;
constexpr uint64_t kCluster = 64 << 10;

struct Env {
  Loop loop;
  std::shared_ptr<MemNode> src, tgt;
  explicit Env(uint64_t size = 1 << 20) {
    src = vblk::testing::test_disk(loop, size);
    tgt = vblk::testing::test_disk(loop, size);
    std::mt19937 rng(3);
    for (auto& b : src->data()) b = static_cast<uint8_t>(rng() | 1);
  }
};

Task<void> snap_read(CopyBeforeWrite& f, uint64_t off, std::vector<uint8_t>& buf, Status& st, bool& done) {
  st = co_await f.snapshot_read(off, buf);
  done = true;
}

Task<void> delayed_snap_read(Loop& loop, uint64_t ns, CopyBeforeWrite& f, uint64_t off, std::vector<uint8_t>& buf,
                             Status& st, bool& done) {
  co_await loop.sleep(std::chrono::nanoseconds(ns));
  co_await snap_read(f, off, buf, st, done);
}

Task<void> guest_write(Node& n, uint64_t off, std::vector<uint8_t> data, Status& st, bool& done) {
  st = co_await n.write(off, data);
  done = true;
}

TEST(CbwSnapshotTest, FrozenReadHoldsTheGuestWriteBack) {
  Env e;
  const std::vector<uint8_t> before = e.src->data();
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, CbwOptions{});
  e.src->options().latency_ns = 50'000'000;
  std::vector<uint8_t> buf(kCluster);
  Status rst, wst;
  bool rdone = false, wdone = false;
  // The guest write's copy reads the source first; the snapshot read starts
  // during that copy, so it reads the source (not yet done) and the guest
  // must wait for it after the copy.
  spawn_detached(guest_write(*f, 100, std::vector<uint8_t>(4000, 0), wst, wdone));
  spawn_detached(delayed_snap_read(e.loop, 20'000'000, *f, 0, buf, rst, rdone));
  ASSERT_TRUE(e.loop.run_until([&] { return rdone && wdone; }));
  ASSERT_TRUE(rst.ok());
  ASSERT_TRUE(wst.ok());
  EXPECT_TRUE(std::equal(buf.begin(), buf.end(), before.begin()));
  // The guest's write of the source started only after the frozen read ended.
  uint64_t read_end = 0, write_start = 0;
  for (auto& o : e.src->ops()) {
    if (o.op == 'r') read_end = std::max(read_end, o.end_ns);
    if (o.op == 'w') write_start = o.start_ns;
  }
  EXPECT_EQ(e.src->count('r', 0, kCluster), 2);  // the copy's, the snapshot's
  EXPECT_GE(write_start, read_end);
  EXPECT_TRUE(f->done_bitmap().get(0));
  // Now the cluster comes from the target, still the old data.
  const int tgt_reads = e.tgt->count('r', 0, kCluster);
  rdone = false;
  e.loop.run(snap_read(*f, 0, buf, rst, rdone));
  ASSERT_TRUE(rst.ok());
  EXPECT_EQ(e.tgt->count('r', 0, kCluster), tgt_reads + 1);
  EXPECT_TRUE(std::equal(buf.begin(), buf.end(), before.begin()));
  // A read across done and not-done clusters is split between the two.
  std::vector<uint8_t> two(2 * kCluster);
  e.loop.run(snap_read(*f, 0, two, rst, rdone));
  ASSERT_TRUE(rst.ok());
  EXPECT_TRUE(std::equal(two.begin(), two.end(), before.begin()));
}

TEST(CbwSnapshotTest, DiscardLeavesTheSnapshotAndTheCopy) {
  Env e;
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, CbwOptions{});
  auto discard = [&](uint64_t off, uint64_t n) -> Task<Status> { co_return co_await f->snapshot_discard(off, n); };
  // Only whole clusters leave.
  ASSERT_TRUE(e.loop.run(discard(kCluster + 1, kCluster)).ok());
  EXPECT_TRUE(f->access_bitmap().get(kCluster));
  ASSERT_TRUE(e.loop.run(discard(kCluster, kCluster)).ok());
  EXPECT_FALSE(f->access_bitmap().get(kCluster));
  std::vector<uint8_t> buf(16);
  Status st;
  bool done = false;
  e.loop.run(snap_read(*f, kCluster + 8, buf, st, done));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EACCES);
  // A read that merely touches the discarded cluster fails too.
  std::vector<uint8_t> wide(kCluster + 1);
  e.loop.run(snap_read(*f, 0, wide, st, done));
  EXPECT_EQ(st.error().code, EACCES);
  // No copy-before-write for it any more.
  e.loop.run(guest_write(*f, kCluster, std::vector<uint8_t>(10, 5), st, done));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(e.tgt->count('w', kCluster, kCluster), 0);
  auto bs = [&](uint64_t off) -> Task<Result<BlockStatus>> {
    co_return co_await f->snapshot_block_status(off, kCluster);
  };
  EXPECT_FALSE(e.loop.run(bs(kCluster)).ok());
  EXPECT_TRUE(e.loop.run(bs(0)).ok());
}

TEST(CbwSnapshotTest, BrokenSnapshotFailsWithEacces) {
  Env e;
  CbwOptions o;
  o.on_error = OnCbwError::BreakSnapshot;
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, o);
  e.tgt->faults.push_back({'w', 0, kCluster, EIO, true});
  Status st;
  bool done = false;
  e.loop.run(guest_write(*f, 0, std::vector<uint8_t>(10, 7), st, done));
  ASSERT_TRUE(st.ok());
  std::vector<uint8_t> buf(16);
  e.loop.run(snap_read(*f, 5 * kCluster, buf, st, done));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EACCES);
  EXPECT_FALSE(f->done_bitmap().get(0));
}

TEST(CbwSnapshotTest, BitmapLimitsTheSnapshot) {
  Env e;
  CbwOptions o;
  auto f = std::make_shared<CopyBeforeWrite>(e.loop, e.src, e.tgt, o);
  // As the `bitmap` option does: only cluster 2 is to be copied.
  f->bcs().bitmap().reset_all();
  f->bcs().bitmap().set(2 * kCluster, kCluster);
  f->snapshot_begin();
  std::vector<uint8_t> buf(kCluster);
  Status st;
  bool done = false;
  e.loop.run(snap_read(*f, 2 * kCluster, buf, st, done));
  EXPECT_TRUE(st.ok());
  e.loop.run(snap_read(*f, 3 * kCluster, buf, st, done));
  EXPECT_EQ(st.error().code, EACCES);
}

}  // namespace cbw_snapshot_test
}  // namespace vblk
