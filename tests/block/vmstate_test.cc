// VmstateWriter / VmstateReader (src/block/vmstate.cc) over an in-memory VM
// state area: random piece sizes give back exactly the stream, the disk
// sees aligned buffer-sized writes with at most `workers` in flight,
// positions that jump (backwards, gaps) stay correct, an injected write
// error comes back from flush(); and over a real qcow2 image, the state a
// snapshot carries reads back through that snapshot.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>

#include "block/drivers/qcow2/qcow2.h"
#include "block/open.h"
#include "vblk/vmstate.h"
#include "qcow2_temp_image.h"

using namespace vblk;

namespace {

// A node with only a VM state area, in memory; every request suspends so
// that the writer's workers really overlap.
class VmNode : public Node {
 public:
  explicit VmNode(Loop& loop) : Node(loop, "vmmem") {}
  std::vector<uint8_t> area;
  struct Req {
    uint64_t pos, len;
  };
  std::vector<Req> writes;
  int in_flight = 0, max_in_flight = 0;
  int fail_write_no = -1;  // this write (0-based) fails with EIO
  int reads = 0;

  bool supports_vmstate() const override { return true; }
  Task<Status> write_vmstate(uint64_t pos, std::span<const uint8_t> buf) override {
    const int no = static_cast<int>(writes.size());
    writes.push_back({pos, buf.size()});
    max_in_flight = std::max(max_in_flight, ++in_flight);
    co_await loop().yield();
    co_await loop().yield();
    --in_flight;
    if (no == fail_write_no) co_return Error(EIO);
    if (area.size() < pos + buf.size()) area.resize(pos + buf.size());
    std::copy(buf.begin(), buf.end(), area.begin() + static_cast<ptrdiff_t>(pos));
    co_return Status{};
  }
  Task<Status> read_vmstate(uint64_t pos, std::span<uint8_t> buf, const std::string&) override {
    ++reads;
    co_await loop().yield();
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = pos + i < area.size() ? area[pos + i] : 0;
    co_return Status{};
  }

 protected:
  Task<Status> do_read(uint64_t, std::span<uint8_t>, uint32_t) override { co_return Error(EIO); }
};

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
    VmNode node(loop);
    VmstateOptions o;
    o.workers = 3;
    o.buffer_size = 64 << 10;
    VmstateWriter w(node, o);
    const size_t len = (seed * 977 * 1021) % (3 << 20);
    auto s = random_stream(len, seed);
    ASSERT_TRUE(loop.run(write_in_pieces(w, s, 64 << 10, seed)).ok());
    ASSERT_EQ(node.area.size(), s.size());
    EXPECT_TRUE(node.area == s) << "seed " << seed;
    EXPECT_EQ(w.end(), len);
    // Every write is a whole aligned buffer except the last one.
    for (size_t i = 0; i < node.writes.size(); ++i) {
      EXPECT_EQ(node.writes[i].pos % o.buffer_size, 0u);
      if (i + 1 < node.writes.size()) {
        EXPECT_EQ(node.writes[i].len, o.buffer_size);
      }
    }
    EXPECT_EQ(node.writes.size(), (len + o.buffer_size - 1) / o.buffer_size);
    EXPECT_LE(node.max_in_flight, 3);
    if (len > 8 * o.buffer_size) {
      EXPECT_GE(node.max_in_flight, 2) << "writes never overlapped";
    }
    EXPECT_EQ(node.reads, 0) << "a front-to-back stream needs no read-modify-write";
  }
}

TEST(VmstateWriter, DefaultBufferIsAtLeastFourMiB) {
  Loop loop;
  VmNode node(loop);
  VmstateWriter w(node);
  EXPECT_EQ(w.buffer_size(), 4u << 20);
}

TEST(VmstateWriter, PositionsGoingBackwardsOrSkippingAreReadModifyWritten) {
  std::mt19937 rng(42);
  for (int round = 0; round < 20; ++round) {
    Loop loop;
    VmNode node(loop);
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
    node.area.resize(std::max(node.area.size(), model.size()));
    EXPECT_TRUE(node.area == model) << "round " << round;
    EXPECT_EQ(w.end(), model.size());
    EXPECT_LE(node.max_in_flight, 4);
  }
}

TEST(VmstateWriter, WriteErrorIsKeptAndReturnedByFlush) {
  for (int fail_at : {0, 3, 17}) {
    Loop loop;
    VmNode node(loop);
    node.fail_write_no = fail_at;
    VmstateOptions o;
    o.workers = 8;
    o.buffer_size = 4096;
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
  VmNode node(loop);
  node.area = random_stream(1000000, 9);
  VmstateOptions o;
  o.workers = 4;
  o.buffer_size = 8192;
  VmstateReader r(node, "", node.area.size(), o);
  std::vector<uint8_t> got(node.area.size());
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
      if (!std::equal(piece.begin(), piece.end(), node.area.begin() + static_cast<ptrdiff_t>(pos)))
        co_return Error(EBADMSG);
    }
    auto beyond = co_await r.read(got.size() - 10, std::span<uint8_t>(piece.data(), 11));
    if (beyond.ok()) co_return Error(ENOTRECOVERABLE);
    co_await r.close();
    co_return Status{};
  };
  auto st = loop.run(job());
  ASSERT_TRUE(st.ok()) << st.error().what();
  EXPECT_TRUE(got == node.area);
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
    ASSERT_TRUE(loop.run(n->snapshot_create(sn)).ok());
    // The active state is gone: it reads as zeroes.
    std::vector<uint8_t> active(4096, 1);
    ASSERT_TRUE(loop.run(n->read_vmstate(0, active)).ok());
    EXPECT_TRUE(std::all_of(active.begin(), active.end(), [](uint8_t b) { return b == 0; }));
    // The disk did not change.
    std::vector<uint8_t> back(disk.size());
    ASSERT_TRUE(loop.run(n->read(0, back)).ok());
    EXPECT_TRUE(back == disk);
    auto ck = loop.run(n->check(kCheckReport));
    ASSERT_TRUE(ck.ok());
    EXPECT_EQ(ck->corruptions, 0);
    EXPECT_EQ(ck->leaks, 0);
    ASSERT_TRUE(loop.run(n->close()).ok());
  }
  {
    Loop loop;
    auto n = open(loop);
    ASSERT_TRUE(n);
    auto list = n->snapshots();
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
