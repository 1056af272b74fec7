// The generic request path (node.cc) against an in-memory driver: padding,
// bounce buffers, splitting, serialisation, FUA and zero emulation, checks.
#include <gtest/gtest.h>

#include <random>

#include "bare_disk.h"
#include "vblk/buffer.h"

using namespace vblk;
using vblk::MemNode;
using vblk::testing::bare_disk;

namespace {

BlockLimits limits(uint32_t align, uint32_t buf_align = 1, uint64_t max_transfer = 0) {
  BlockLimits l;
  l.request_alignment = align;
  l.buffer_alignment = buf_align;
  l.max_transfer = max_transfer;
  return l;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 31);
  return v;
}

}  // namespace

TEST(NodeTest, UnalignedWriteIsPaddedWithReadModifyWrite) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10, limits(4096, 4096)));
  auto before = pattern(64 << 10, 7);
  n.data() = before;
  auto payload = pattern(5000, 99);
  auto st = loop.run(n.write(1000, payload));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(n.limit_violations(), 0u);
  auto expect = before;
  std::copy(payload.begin(), payload.end(), expect.begin() + 1000);
  EXPECT_EQ(n.data(), expect);
  // Head block and tail block were read (two partial blocks), then one write.
  int reads = 0, writes = 0;
  for (auto& r : n.ops()) (r.op == 'r' ? reads : writes) += r.op == 'r' || r.op == 'w';
  EXPECT_EQ(reads, 2);
  EXPECT_EQ(writes, 1);
}

TEST(NodeTest, UnalignedReadUsesBounceBuffer) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10, limits(512, 4096)));
  n.data() = pattern(64 << 10, 3);
  std::vector<uint8_t> out(777);
  ASSERT_TRUE(loop.run(n.read(12345, out)).ok());
  EXPECT_EQ(n.limit_violations(), 0u);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), n.data().begin() + 12345));
}

TEST(NodeTest, MisalignedMemoryIsBouncedForAlignedRanges) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10, limits(512, 4096)));
  std::vector<uint8_t> raw(4096 + 1);
  std::span<uint8_t> odd(raw.data() + 1, 4096);  // never 4096-aligned
  std::fill(odd.begin(), odd.end(), 0x5a);
  ASSERT_TRUE(loop.run(n.write(8192, odd)).ok());
  EXPECT_EQ(n.limit_violations(), 0u);
  EXPECT_EQ(n.data()[8192], 0x5a);
  EXPECT_EQ(n.data()[8192 + 4095], 0x5a);
}

TEST(NodeTest, LargeRequestsAreSplitAtMaxTransfer) {
  Loop loop;
  MemNode n(loop, bare_disk(1 << 20, limits(512, 1, 64 << 10)));
  auto payload = pattern(300 << 10, 1);
  ASSERT_TRUE(loop.run(n.write(0, payload)).ok());
  EXPECT_EQ(n.limit_violations(), 0u);
  EXPECT_EQ(n.ops().size(), 5u);  // 64K * 4 + 44K
  std::vector<uint8_t> back(300 << 10);
  ASSERT_TRUE(loop.run(n.read(0, back)).ok());
  EXPECT_EQ(back, payload);
}

TEST(NodeTest, ConcurrentUnalignedWritesSharingABlockAreNotLost) {
  Loop loop;
  MemNode n(loop, bare_disk(16 << 10, limits(4096, 1)));
  // 64 writers each own 64 bytes of the same 4 KiB block: without
  // serialisation, read-modify-write would lose most of them.
  auto all = [&]() -> Task<void> {
    WaitGroup wg(loop);
    wg.add(64);
    auto one = [](MemNode& node, uint64_t off, WaitGroup& w) -> Task<void> {
      std::vector<uint8_t> buf(64, static_cast<uint8_t>(off / 64 + 1));
      EXPECT_TRUE((co_await node.write(4096 + off, buf)).ok());
      w.done();
    };
    for (uint64_t i = 0; i < 64; ++i) spawn_detached(one(n, i * 64, wg));
    co_await wg.wait();
  };
  loop.run(all());
  for (uint64_t i = 0; i < 4096; ++i) ASSERT_EQ(n.data()[4096 + i], static_cast<uint8_t>(i / 64 + 1)) << i;
  EXPECT_EQ(n.in_flight(), 0u);
}

TEST(NodeTest, RandomMixedWorkloadMatchesAModel) {
  Loop loop;
  const uint64_t size = 256 << 10;
  MemNode n(loop, bare_disk(size, limits(512, 512, 32 << 10), NodeCaps{.zeroes = true, .discard = true}));
  std::vector<uint8_t> model(size, 0);
  std::mt19937_64 rng(42);
  for (int i = 0; i < 500; ++i) {
    uint64_t off = rng() % size;
    uint64_t len = 1 + rng() % std::min<uint64_t>(size - off, 70000);
    int op = static_cast<int>(rng() % 3);
    if (op == 0) {
      auto buf = pattern(len, static_cast<uint8_t>(i));
      ASSERT_TRUE(loop.run(n.write(off, buf)).ok());
      std::copy(buf.begin(), buf.end(), model.begin() + static_cast<long>(off));
    } else if (op == 1) {
      ASSERT_TRUE(loop.run(n.write_zeroes(off, len, i % 2 ? uint32_t{kReqMayUnmap} : 0u)).ok());
      std::fill_n(model.begin() + static_cast<long>(off), len, 0);
    } else {
      std::vector<uint8_t> back(len);
      ASSERT_TRUE(loop.run(n.read(off, back)).ok());
      ASSERT_TRUE(std::equal(back.begin(), back.end(), model.begin() + static_cast<long>(off))) << i;
    }
  }
  EXPECT_EQ(n.limit_violations(), 0u);
  EXPECT_EQ(n.data(), model);
}

TEST(NodeTest, FuaIsEmulatedWithAFlushAndWritethroughAddsIt) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10));
  std::vector<uint8_t> b(512, 1);
  ASSERT_TRUE(loop.run(n.write(0, b, kReqFua)).ok());
  ASSERT_EQ(n.ops().size(), 2u);
  EXPECT_EQ(n.ops()[0].op, 'w');
  EXPECT_EQ(n.ops()[0].flags & kReqFua, 0u);  // the driver said it cannot do FUA
  EXPECT_EQ(n.ops()[1].op, 'f');
  n.clear_ops();
  n.set_writethrough(true);
  ASSERT_TRUE(loop.run(n.write(512, b)).ok());
  ASSERT_EQ(n.ops().size(), 2u);
  EXPECT_EQ(n.ops()[1].op, 'f');
}

TEST(NodeTest, WriteZeroesFallsBackToWritingUnlessNoFallback) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10));  // caps.zeroes = false
  n.data() = pattern(64 << 10, 9);
  EXPECT_EQ(loop.run(n.write_zeroes(4096, 8192, kReqNoFallback)).error().code, ENOTSUP);
  EXPECT_NE(n.data()[4096], 0);
  ASSERT_TRUE(loop.run(n.write_zeroes(4096, 8192)).ok());
  EXPECT_TRUE(std::all_of(n.data().begin() + 4096, n.data().begin() + 12288, [](uint8_t c) { return c == 0; }));
  EXPECT_NE(n.data()[4095], 0);
  EXPECT_NE(n.data()[12288], 0);
}

TEST(NodeTest, UnalignedWriteZeroesPadsEdgesAndZeroesTheMiddle) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10, limits(4096), NodeCaps{.zeroes = true}));
  n.data() = pattern(64 << 10, 5);
  ASSERT_TRUE(loop.run(n.write_zeroes(100, 20000, kReqMayUnmap)).ok());
  EXPECT_EQ(n.limit_violations(), 0u);
  for (uint64_t i = 0; i < (64 << 10); ++i) {
    bool in = i >= 100 && i < 20100;
    if (in) {
      ASSERT_EQ(n.data()[i], 0) << i;
    }
  }
  EXPECT_NE(n.data()[99], 0);
  EXPECT_NE(n.data()[20100], 0);
  bool used_zero_op = false;
  for (auto& r : n.ops()) used_zero_op |= r.op == 'z' && (r.flags & kReqMayUnmap);
  EXPECT_TRUE(used_zero_op);
}

TEST(NodeTest, OutOfRangeAndReadOnlyAreRefused) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10));
  std::vector<uint8_t> b(512);
  EXPECT_EQ(loop.run(n.read(64 << 10, b)).error().code, EIO);
  EXPECT_EQ(loop.run(n.write((64 << 10) - 100, b)).error().code, EIO);
  EXPECT_EQ(loop.run(n.write_zeroes(UINT64_MAX - 10, 100)).error().code, EIO);
  n.set_read_only(true);
  EXPECT_EQ(loop.run(n.write(0, b)).error().code, EPERM);
  EXPECT_EQ(loop.run(n.write_zeroes(0, 512)).error().code, EPERM);
  EXPECT_EQ(loop.run(n.discard(0, 512)).error().code, EPERM);
  EXPECT_TRUE(n.ops().empty());  // nothing reached the driver
}

TEST(NodeTest, GrowableNodesAcceptWritesPastTheEnd) {
  Loop loop;
  MemNode n(loop, bare_disk(4096));
  n.set_growable(true);
  std::vector<uint8_t> b(512, 7);
  ASSERT_TRUE(loop.run(n.write(8192, b)).ok());
  EXPECT_EQ(n.length(), 8192u + 512);
}

TEST(NodeTest, WriteErrorsReachTheCaller) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10, limits(4096)));
  n.faults.push_back({'w', 0, UINT64_MAX, ENOSPC, false});
  std::vector<uint8_t> b(100, 1);
  auto st = loop.run(n.write(10, b));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, ENOSPC);
  EXPECT_EQ(n.in_flight(), 0u);
}

TEST(NodeTest, DrainWaitsForInFlightRequests) {
  Loop loop;
  MemNode n(loop, bare_disk(64 << 10));
  int done = 0;
  auto t = [&]() -> Task<void> {
    auto w = [](MemNode& node, int& d) -> Task<void> {
      std::vector<uint8_t> b(512, 1);
      EXPECT_TRUE((co_await node.write(0, b)).ok());
      ++d;
    };
    for (int i = 0; i < 10; ++i) spawn_detached(w(n, done));
    EXPECT_GT(n.in_flight(), 0u);
    co_await n.drain();
    EXPECT_EQ(done, 10);
  };
  loop.run(t());
  EXPECT_EQ(done, 10);
}

TEST(NodeTest, BlockStatusIsClampedAndMarksEof) {
  Loop loop;
  MemNode n(loop, bare_disk(10000));
  auto s = loop.run(n.block_status(4000, 1 << 20));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->bytes, 6000u);
  EXPECT_TRUE(s->flags & kStatusData);
  EXPECT_TRUE(s->flags & kStatusAllocated);
  EXPECT_TRUE(s->flags & kStatusEof);
  EXPECT_EQ(s->map, 4000u);
  auto past = loop.run(n.block_status(10000, 10));
  ASSERT_TRUE(past.ok());
  EXPECT_EQ(past->bytes, 0u);
  EXPECT_EQ(past->flags, static_cast<uint32_t>(kStatusEof));
}

// Compressed writes reach only drivers that store compressed data, unpadded.
TEST(NodeTest, CompressedWritesNeedDriverSupportAndAlignment) {
  Loop loop;
  std::vector<uint8_t> buf(4096, 7);
  {
    MemNode n(loop, bare_disk(1 << 20, BlockLimits{512, 512}));
    auto st = loop.run(n.write(0, buf, kReqCompressed));
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.error().code, ENOTSUP);
    EXPECT_TRUE(n.ops().empty());
  }
  {
    NodeCaps caps;
    caps.compressed_writes = true;
    MemNode n(loop, bare_disk(1 << 20, BlockLimits{512, 512}, caps));
    auto st = loop.run(n.write(100, buf, kReqCompressed));
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.error().code, EINVAL);  // no read-modify-write of a compressed unit
    EXPECT_TRUE(n.ops().empty());
    ASSERT_TRUE(loop.run(n.write(4096, buf, kReqCompressed)).ok());
    ASSERT_EQ(n.ops().size(), 1u);
    EXPECT_EQ(n.ops()[0].flags & kReqCompressed, kReqCompressed);
    EXPECT_EQ(n.data()[4096], 7);
  }
}
