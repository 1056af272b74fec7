// The mirror job over deterministic fake nodes: a guest write already under
// way on the source when blockdev-mirror puts its filter above it.
#include "vblk/mirror.h"

#include <gtest/gtest.h>

#include <random>

#include "../copy/test_disk.h"
#include "vblk/mem_node.h"
#include "wait_for.h"

namespace vblk {
// Named, not anonymous: the unity build puts several test files in one
// translation unit, and their helpers share names.
namespace mirror_test {

using vblk::MemNode;
constexpr uint64_t kCluster = 64 << 10;

// A test disk whose write at gate_offset waits for `gate` before its data
// lands (a guest write still in the host's queue).
class GatedNode : public MemNode {
 public:
  GatedNode(Loop& loop, uint64_t size) : MemNode(loop, testing::disk_options(size)), gate(loop) {}
  CoEvent gate;
  uint64_t gate_offset = UINT64_MAX;
  bool at_gate = false;

 protected:
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    if (offset == gate_offset) {
      at_gate = true;
      co_await gate.wait();
    }
    co_return co_await MemNode::do_write(offset, buf, flags);
  }
};

struct Env {
  Loop loop;
  JobManager mgr{loop};
  Graph graph;
  std::shared_ptr<GatedNode> src;
  std::shared_ptr<MemNode> tgt;
  NodeRef device;  // what an NBD export holds

  explicit Env(uint64_t size) {
    src = std::make_shared<GatedNode>(loop, size);
    tgt = vblk::testing::test_disk(loop, size);
    src->set_node_name("src");
    tgt->set_node_name("tgt");
    EXPECT_TRUE(graph.add(src).ok());
    EXPECT_TRUE(graph.add(tgt).ok());
    device.reset(src);
    std::mt19937 rng(1);
    for (auto& b : src->data()) b = static_cast<uint8_t>(rng() | 1);  // all data, never zero
  }
  bool wait_for(const std::function<bool()>& cond, int timeout_ms = 20000) {
    return test::wait_for(loop, cond, timeout_ms);
  }
};

Task<void> write_through(Node& n, uint64_t off, std::vector<uint8_t> data, Status* out, bool* done) {
  *out = co_await n.write(off, data);
  *done = true;
}

// An NBD request looks its node up when it starts: one that started before
// blockdev-mirror goes on to the source itself, not through the filter.
// The job must let it land before it copies anything; otherwise the engine
// copies the old data of its cluster, nothing marks the cluster dirty
// again, and the target (after complete, the export's node) lacks the
// acknowledged write.
void run_bypassing_write(bool write_blocking) {
  Env e(1 << 20);
  const uint64_t off = 3 * kCluster + 4096;
  e.src->gate_offset = off;
  Status wst = Error(EINPROGRESS);
  bool wdone = false;
  spawn_detached(write_through(*e.device, off, std::vector<uint8_t>(4096, 0xab), &wst, &wdone));
  ASSERT_TRUE(e.wait_for([&] { return e.src->at_gate; }));

  MirrorArgs a;
  a.job_id = "j";
  a.device = "src";
  a.target = "tgt";
  a.sync = "full";
  a.granularity = kCluster;
  a.write_blocking = write_blocking;
  auto r = start_mirror(e.mgr, e.graph, a);
  ASSERT_TRUE(r.ok()) << r.error().what();
  std::shared_ptr<MirrorJob> job = *r;
  EXPECT_EQ(e.device.get(), job->filter_node().get());

  // A write through the filter meanwhile waits, or lands, but is not lost.
  const uint64_t off2 = 5 * kCluster;
  Status wst2 = Error(EINPROGRESS);
  bool wdone2 = false;
  spawn_detached(write_through(*e.device, off2, std::vector<uint8_t>(4096, 0xcd), &wst2, &wdone2));

  // While the first write is under way the job copies nothing (a timer,
  // not a race: without the wait the 1 MiB copy is done and the job ready
  // long before it fires).
  EXPECT_FALSE(e.wait_for([&] { return job->is_ready(); }, 200));
  EXPECT_EQ(e.tgt->ops().size(), 0u);

  e.src->gate.set();
  ASSERT_TRUE(e.wait_for([&] { return wdone && wdone2 && job->is_ready(); }));
  EXPECT_TRUE(wst.ok());
  EXPECT_TRUE(wst2.ok());
  ASSERT_TRUE(job->complete().ok());
  ASSERT_TRUE(e.wait_for([&] { return job->status() == JobStatus::Null; }));
  EXPECT_EQ(e.device.get(), e.tgt.get());  // the export writes the target now
  EXPECT_EQ(e.tgt->data()[off], 0xab);
  EXPECT_EQ(e.tgt->data()[off2], 0xcd);
  EXPECT_TRUE(e.tgt->data() == e.src->data());
}

TEST(MirrorTest, WriteUnderWayBeforeTheFilterReachesTheTargetWriteBlocking) { run_bypassing_write(true); }

TEST(MirrorTest, WriteUnderWayBeforeTheFilterReachesTheTargetBackground) { run_bypassing_write(false); }

// The target's last flush, once complete has stopped guest writes, fails:
// the job reports it under the target's error policy (QEMU's mirror_flush),
// not go round again for ever, busy, never ending (found by
// vblk_power_loss_jobs cutting the power under a write-blocking mirror).
TEST(MirrorTest, CompleteReportsAFailingTargetFlush) {
  Loop loop;
  JobManager mgr{loop};
  Graph graph;
  auto src = std::make_shared<MemNode>(loop, MemNode::Options{.size = 1 << 20});
  auto tgt = std::make_shared<MemNode>(loop, MemNode::Options{.size = 1 << 20});
  src->set_node_name("src");
  tgt->set_node_name("tgt");
  ASSERT_TRUE(graph.add(src).ok());
  ASSERT_TRUE(graph.add(tgt).ok());
  NodeRef device(src);
  std::fill(src->mutable_data().begin(), src->mutable_data().end(), 0x5a);
  MirrorArgs a;
  a.job_id = "j";
  a.device = "src";
  a.target = "tgt";
  a.sync = "full";
  auto r = start_mirror(mgr, graph, a);
  ASSERT_TRUE(r.ok()) << r.error().what();
  std::shared_ptr<MirrorJob> job = *r;
  ASSERT_TRUE(test::wait_for(loop, [&] { return job->is_ready(); }));
  tgt->faults.push_back({'f', 0, 1, EIO, false});
  ASSERT_TRUE(job->complete().ok());
  ASSERT_TRUE(test::wait_for(
      loop, [&] { return job->status() == JobStatus::Null; }, 5000));
  ASSERT_FALSE(job->result().ok());
  EXPECT_EQ(job->result().error().code, EIO);
  EXPECT_EQ(device.get(), src.get());  // not switched to a target that lost writes
}

}  // namespace mirror_test
}  // namespace vblk
