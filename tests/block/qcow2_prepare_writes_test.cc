// qcow2 prepare_writes (src/block/drivers/qcow2/cluster.cc): the L2 tables
// the announced ranges need are allocated in one batch and linked from the
// L1 table on disk; nothing else changes; writes then land in them and the
// image checks clean; a read-only node ignores the hint.
#include <gtest/gtest.h>

#include <array>
#include <cstring>

#include "block/drivers/qcow2/qcow2.h"
#include "qcow2_temp_image.h"
#include "vblk/image_format.h"
#include "vblk/open.h"

using namespace vblk;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kCluster = 64 * 1024;
constexpr uint64_t kPerTable = 512 * kMiB;  // 8192 entries of 64 KiB clusters
constexpr uint64_t kSize = 4 * kPerTable;   // four L1 entries

class Qcow2PrepareWrites : public ::testing::Test {
 protected:
  void SetUp() override {
    qcow2::Qcow2Node::CreateOptions o;
    o.size = kSize;
    ASSERT_NO_FATAL_FAILURE(image_.create(o));
  }
  // The active L1 table's four entries as stored in the file.
  std::array<uint64_t, 4> l1_on_disk(Loop& loop, const std::shared_ptr<Node>& n) {
    auto& q = static_cast<qcow2::Qcow2Node&>(*n);
    Node* file = n->file_child();
    AlignedBuffer b(512, 512);
    EXPECT_TRUE(loop.run(file->read(q.header().l1_table_offset, b.span())).ok());
    std::array<uint64_t, 4> e{};
    for (int i = 0; i < 4; ++i) {
      uint64_t v = 0;
      for (int k = 0; k < 8; ++k) v = (v << 8) | b.data()[i * 8 + k];
      e[i] = v;
    }
    return e;
  }
  vblk::testing::Qcow2TempImage image_;
};

}  // namespace

TEST_F(Qcow2PrepareWrites, AllocatesOnlyTheTablesOfTheRanges) {
  Loop loop;
  auto n = image_.open(loop);
  ASSERT_TRUE(n);
  EXPECT_EQ(l1_on_disk(loop, n), (std::array<uint64_t, 4>{0, 0, 0, 0}));
  const std::array<Node::WriteRange, 3> ranges{
      {{0, kCluster}, {3 * kPerTable + 5 * kCluster, 2 * kCluster}, {3 * kPerTable + 99 * kCluster, kCluster}}};
  ASSERT_TRUE(loop.run(n->prepare_writes(ranges)).ok());
  auto e = l1_on_disk(loop, n);
  const uint64_t copied = 1ull << 63;
  EXPECT_EQ(e[0] & copied, copied);
  EXPECT_EQ(e[1], 0u);
  EXPECT_EQ(e[2], 0u);
  EXPECT_EQ(e[3] & copied, copied);
  EXPECT_NE(e[0], e[3]);
  // The tables exist and are empty: nothing reads as allocated yet.
  for (uint64_t pos = 0; pos < kSize;) {
    auto st = loop.run(n->block_status(pos, kSize - pos));
    ASSERT_TRUE(st.ok());
    ASSERT_GT(st->bytes, 0u);
    EXPECT_FALSE(st->flags & kStatusData) << pos;
    pos += st->bytes;
  }

  // Announcing the same ranges again changes nothing (and the check below
  // finds no leaked table).
  ASSERT_TRUE(loop.run(n->prepare_writes(ranges)).ok());
  EXPECT_EQ(l1_on_disk(loop, n), e);

  // Writes land in the prepared tables (and in an unprepared one), read
  // back, and the image checks clean with no leaks.
  AlignedBuffer w(kCluster, 4096);
  for (uint64_t off : {uint64_t{0}, 3 * kPerTable + 5 * kCluster, kPerTable + 7 * kCluster}) {
    std::memset(w.data(), static_cast<int>(off / kCluster % 251 + 1), kCluster);
    ASSERT_TRUE(loop.run(n->write(off, w.span())).ok());
  }
  EXPECT_EQ(l1_on_disk(loop, n)[0], e[0]);
  EXPECT_EQ(l1_on_disk(loop, n)[3], e[3]);
  AlignedBuffer r(kCluster, 4096);
  for (uint64_t off : {uint64_t{0}, 3 * kPerTable + 5 * kCluster, kPerTable + 7 * kCluster}) {
    ASSERT_TRUE(loop.run(n->read(off, r.span())).ok());
    EXPECT_EQ(r.data()[0], static_cast<uint8_t>(off / kCluster % 251 + 1));
    EXPECT_EQ(r.data()[kCluster - 1], static_cast<uint8_t>(off / kCluster % 251 + 1));
  }
  ASSERT_TRUE(loop.run(n->flush()).ok());
  auto c = loop.run(image::check(*n, 0));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->corruptions, 0);
  EXPECT_EQ(c->leaks, 0);
  EXPECT_EQ(c->check_errors, 0);
  ASSERT_TRUE(loop.run(n->close()).ok());
}

TEST_F(Qcow2PrepareWrites, ReadOnlyNodeIgnoresTheHint) {
  Loop loop;
  auto n = image_.open(loop, true);
  ASSERT_TRUE(n);
  const std::array<Node::WriteRange, 1> ranges{{{kPerTable, kCluster}}};
  EXPECT_TRUE(loop.run(n->prepare_writes(ranges)).ok());
  EXPECT_EQ(l1_on_disk(loop, n), (std::array<uint64_t, 4>{0, 0, 0, 0}));
  ASSERT_TRUE(loop.run(n->close()).ok());
}
