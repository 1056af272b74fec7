// VmstateWriter / VmstateReader (src/block/vmstate.cc) over an in-memory VM
// state area: random piece sizes give back exactly the stream, the disk
// sees aligned buffer-sized writes with at most `workers` in flight,
// positions that jump (backwards, gaps) stay correct, an injected write
// error comes back from flush(); and over a real qcow2 image, the state a
// snapshot carries reads back through that snapshot.
#include "vblk/vmstate.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>

#include "block/drivers/qcow2/qcow2.h"
#include "qcow2_temp_image.h"
#include "vblk/image_format.h"
#include "vblk/mem_node.h"
#include "vblk/open.h"

using namespace vblk;

namespace {

// A MemNode with a VM state area (its data requests are never used); each
// request suspends, so that the writer's workers really overlap.
MemNode::Options vm_disk() {
  MemNode::Options o;
  o.vmstate = true;
  o.record = true;
  return o;
}

// The VM state writes the node was handed, in order.
std::vector<MemNode::Op> vm_writes(const MemNode& n) {
  std::vector<MemNode::Op> out;
  for (const auto& o : n.ops())
    if (o.op == 'v') out.push_back(o);
  return out;
}

std::vector<uint8_t> random_stream(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Writes `s` front to back in pieces of 1 B to max_piece.
Task<Status> write_in_pieces(VmstateWriter& w, const std::vector<uint8_t>& s, size_t max_piece, uint32_t seed) {
  std::mt19937 rng(seed);
  size_t pos = 0;
  while (pos < s.size()) {
    // Mostly tiny pieces, as migration code writes them, some large.
    size_t n = rng() % 4 ? 1 + rng() % 64 : 1 + rng() % max_piece;
    n = std::min(n, s.size() - pos);
    VBLK_CO_TRY(co_await w.write(pos, std::span<const uint8_t>(s.data() + pos, n)));
    pos += n;
  }
  co_return co_await w.flush();
}

}  // namespace

TEST(VmstateWriter, RandomPiecesGiveBackTheStreamInAlignedBufferWrites) {
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    Loop loop;
    MemNode node(loop, vm_disk());
    VmstateOptions o;
    o.workers = 3;
    o.buffer_size = 64 << 10;
    VmstateWriter w(node, o);
    const size_t len = (seed * 977 * 1021) % (3 << 20);
    auto s = random_stream(len, seed);
    ASSERT_TRUE(loop.run(write_in_pieces(w, s, 64 << 10, seed)).ok());
    ASSERT_EQ(node.vmstate_area().size(), s.size());
    EXPECT_TRUE(node.vmstate_area() == s) << "seed " << seed;
    EXPECT_EQ(w.end(), len);
    // Every write is a whole aligned buffer except the last one.
    const auto writes = vm_writes(node);
    for (size_t i = 0; i < writes.size(); ++i) {
      EXPECT_EQ(writes[i].offset % o.buffer_size, 0u);
      if (i + 1 < writes.size()) {
        EXPECT_EQ(writes[i].bytes, o.buffer_size);
      }
    }
    EXPECT_EQ(writes.size(), (len + o.buffer_size - 1) / o.buffer_size);
    EXPECT_LE(node.peak_in_flight(), 3);
    if (len > 8 * o.buffer_size) {
      EXPECT_GE(node.peak_in_flight(), 2) << "writes never overlapped";
    }
    EXPECT_EQ(node.count('V', 0, UINT64_MAX), 0) << "a front-to-back stream needs no read-modify-write";
  }
}

TEST(VmstateWriter, DefaultBufferIsAtLeastFourMiB) {
  Loop loop;
  MemNode node(loop, vm_disk());
  VmstateWriter w(node);
  EXPECT_EQ(w.buffer_size(), 4u << 20);
}

TEST(VmstateWriter, PositionsGoingBackwardsOrSkippingAreReadModifyWritten) {
  std::mt19937 rng(42);
  for (int round = 0; round < 20; ++round) {
    Loop loop;
    MemNode node(loop, vm_disk());
    VmstateOptions o;
    o.workers = 4;
    o.buffer_size = 4096;
    VmstateWriter w(node, o);
    std::vector<uint8_t> model;
    auto job = [&]() -> Task<Status> {
      uint64_t pos = 0;
      for (int i = 0; i < 300; ++i) {
        const size_t n = 1 + rng() % 9000;
        if (rng() % 8 == 0) pos = rng() % (model.size() + 5000);  // backwards or a gap
        auto data = random_stream(n, static_cast<uint32_t>(rng()));
        VBLK_CO_TRY(co_await w.write(pos, data));
        if (model.size() < pos + n) model.resize(pos + n);
        std::copy(data.begin(), data.end(), model.begin() + static_cast<ptrdiff_t>(pos));
        pos += n;
        if (rng() % 50 == 0) VBLK_CO_TRY(co_await w.flush());  // flushes in between too
      }
      co_return co_await w.flush();
    };
    ASSERT_TRUE(loop.run(job()).ok());
    node.vmstate_area().resize(std::max(node.vmstate_area().size(), model.size()));
    EXPECT_TRUE(node.vmstate_area() == model) << "round " << round;
    EXPECT_EQ(w.end(), model.size());
    EXPECT_LE(node.peak_in_flight(), 4);
  }
}

TEST(VmstateWriter, WriteErrorIsKeptAndReturnedByFlush) {
  for (int fail_at : {0, 3, 17}) {
    Loop loop;
    MemNode node(loop, vm_disk());
    VmstateOptions o;
    o.workers = 8;
    o.buffer_size = 4096;
    // The fail_at-th buffer write (the stream goes front to back).
    node.faults.push_back({'v', static_cast<uint64_t>(fail_at) * o.buffer_size, 1, EIO, false});
    VmstateWriter w(node, o);
    auto s = random_stream(100 << 10, 5);
    // Writes that do not look at their result, as QEMU's migration code
    // does: the error must still come back from flush().
    auto job = [&]() -> Task<Status> {
      for (size_t pos = 0; pos < s.size(); pos += 100)
        (void)co_await w.write(pos, std::span<const uint8_t>(s.data() + pos, std::min<size_t>(100, s.size() - pos)));
      co_return co_await w.flush();
    };
    auto st = loop.run(job());
    ASSERT_FALSE(st.ok()) << "fail_at " << fail_at;
    EXPECT_EQ(st.error().code, EIO);
    // Once failed, the writer says so at once, and flush() keeps saying it.
    auto again = loop.run(w.write(s.size(), std::span<const uint8_t>(s.data(), 1)));
    EXPECT_FALSE(again.ok());
    EXPECT_FALSE(loop.run(w.flush()).ok());
  }
}

TEST(VmstateReader, ReadsAheadInOrderAndAnyOrder) {
  Loop loop;
  MemNode node(loop, vm_disk());
  node.vmstate_area() = random_stream(1000000, 9);
  VmstateOptions o;
  o.workers = 4;
  o.buffer_size = 8192;
  VmstateReader r(node, "", node.vmstate_area().size(), o);
  std::vector<uint8_t> got(node.vmstate_area().size());
  std::mt19937 rng(3);
  auto job = [&]() -> Task<Status> {
    for (size_t pos = 0; pos < got.size();) {
      size_t n = std::min<size_t>(1 + rng() % 20000, got.size() - pos);
      VBLK_CO_TRY(co_await r.read(pos, std::span<uint8_t>(got.data() + pos, n)));
      pos += n;
    }
    // Out of order too.
    std::vector<uint8_t> piece(5000);
    for (int i = 0; i < 50; ++i) {
      size_t pos = rng() % (got.size() - piece.size());
      VBLK_CO_TRY(co_await r.read(pos, piece));
      if (!std::equal(piece.begin(), piece.end(), node.vmstate_area().begin() + static_cast<ptrdiff_t>(pos)))
        co_return Error(EBADMSG);
    }
    auto beyond = co_await r.read(got.size() - 10, std::span<uint8_t>(piece.data(), 11));
    if (beyond.ok()) co_return Error(ENOTRECOVERABLE);
    co_await r.close();
    co_return Status{};
  };
  auto st = loop.run(job());
  ASSERT_TRUE(st.ok()) << st.error().what();
  EXPECT_TRUE(got == node.vmstate_area());
}

// ---- over qcow2: the area past the disk, carried by a snapshot

namespace {

class Qcow2Vmstate : public ::testing::TestWithParam<uint32_t> {
 protected:
  void SetUp() override {
    qcow2::Qcow2Node::CreateOptions o;
    o.size = 3 << 20;  // not a whole L2 table's reach for the small clusters
    o.cluster_size = GetParam();
    ASSERT_NO_FATAL_FAILURE(image_.create(o));
    path_ = image_.path();
  }
  std::shared_ptr<Node> open(Loop& loop) { return image_.open(loop); }
  vblk::testing::Qcow2TempImage image_;
  std::string path_;
};

}  // namespace

TEST_P(Qcow2Vmstate, SnapshotCarriesTheStateAndTheActiveTablesDropIt) {
  const uint32_t cs = GetParam();
  auto s = random_stream(5 << 20, cs);
  auto disk = random_stream(3 << 20, 77);
  {
    Loop loop;
    auto n = open(loop);
    ASSERT_TRUE(n);
    auto& q = static_cast<qcow2::Qcow2Node&>(*n);
    const uint32_t l2_bits = __builtin_ctz(cs) - 3;
    const uint64_t reach = uint64_t{cs} << l2_bits;
    EXPECT_EQ(q.vm_state_offset(3 << 20), (((3 << 20) + reach - 1) / reach) * reach);
    ASSERT_TRUE(loop.run(n->write(0, disk)).ok());
    VmstateOptions o;
    o.workers = 8;
    VmstateWriter w(*n, o);
    ASSERT_TRUE(loop.run(write_in_pieces(w, s, 64 << 10, 1)).ok());
    SnapshotInfo sn;
    sn.name = "s1";
    sn.vm_state_size = s.size();
    ASSERT_TRUE(loop.run(image::snapshot_create(*n, sn)).ok());
    // The active state is gone: it reads as zeroes.
    std::vector<uint8_t> active(4096, 1);
    ASSERT_TRUE(loop.run(image::read_vmstate(*n, 0, active)).ok());
    EXPECT_TRUE(std::all_of(active.begin(), active.end(), [](uint8_t b) { return b == 0; }));
    // The disk did not change.
    std::vector<uint8_t> back(disk.size());
    ASSERT_TRUE(loop.run(n->read(0, back)).ok());
    EXPECT_TRUE(back == disk);
    auto ck = loop.run(image::check(*n, kCheckReport));
    ASSERT_TRUE(ck.ok());
    EXPECT_EQ(ck->corruptions, 0);
    EXPECT_EQ(ck->leaks, 0);
    ASSERT_TRUE(loop.run(n->close()).ok());
  }
  {
    Loop loop;
    auto n = open(loop);
    ASSERT_TRUE(n);
    auto list = image::snapshots(*n);
    ASSERT_EQ(list.size(), 1u);
    EXPECT_EQ(list[0].vm_state_size, s.size());
    VmstateReader r(*n, list[0].id, list[0].vm_state_size);
    std::vector<uint8_t> got(s.size());
    auto job = [&]() -> Task<Status> {
      auto st = co_await r.read(0, got);
      co_await r.close();
      co_return st;
    };
    ASSERT_TRUE(loop.run(job()).ok());
    EXPECT_TRUE(got == s);
    ASSERT_TRUE(loop.run(n->close()).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(ClusterSizes, Qcow2Vmstate, ::testing::Values(512u, 65536u, 2u << 20));
