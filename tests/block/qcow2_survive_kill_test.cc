// kReqSurviveKill on qcow2: a write answered with it has its data and its
// metadata (the L2 entry of a newly allocated cluster, the cluster's
// refcount) in the file before it completes, so a second open of the file
// -- the daemon that takes a device over after a kill -9 -- reads it, with
// no flush and no close in between. Without the flag the metadata may stay
// in the first node's cache (the test shows that it does, so it can fail).
#include <gtest/gtest.h>

#include <cstring>

#include "qcow2_temp_image.h"
#include "vblk/buffer.h"
#include "vblk/open.h"

using namespace vblk;

// Named, not anonymous: the unity build puts several test files in one
// translation unit, and their helpers share names.
namespace qcow2_survive_kill_test {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kCluster = 64 * 1024;

class Qcow2SurviveKill : public ::testing::Test {
 protected:
  void SetUp() override {
    qcow2::Qcow2Node::CreateOptions o;
    o.size = 64 * kMiB;
    ASSERT_NO_FATAL_FAILURE(image_.create(o));
  }
  // What a second, independent open of the image reads at `offset` while
  // the first node is still open (locking off: the first holds the locks).
  std::vector<uint8_t> read_from_second_open(uint64_t offset, size_t len) {
    Loop loop;
    OpenContext ctx{loop};
    ctx.read_only = true;
    auto n = open_node(ctx, Json{{"driver", "qcow2"},
                                 {"file", {{"driver", "file"}, {"filename", image_.path()}, {"locking", "off"}}}});
    EXPECT_TRUE(n.ok()) << (n.ok() ? "" : n.error().what());
    if (!n.ok()) return {};
    AlignedBuffer b(len);
    EXPECT_TRUE(loop.run((*n)->read(offset, b.span())).ok());
    EXPECT_TRUE(loop.run((*n)->close()).ok());
    return {b.data(), b.data() + len};
  }
  static AlignedBuffer pattern(uint8_t seed, size_t len) {
    AlignedBuffer b(len);
    for (size_t i = 0; i < len; ++i) b.data()[i] = static_cast<uint8_t>(seed + i * 7);
    return b;
  }
  vblk::testing::Qcow2TempImage image_;
};

TEST_F(Qcow2SurviveKill, AllocatingWriteIsInTheFileWhenItCompletes) {
  Loop loop;
  auto n = image_.open(loop);
  ASSERT_TRUE(n);
  // Without the flag the new cluster's L2 entry is still only in the cache.
  auto plain = pattern(1, kCluster);
  ASSERT_TRUE(loop.run(n->write(2 * kMiB, plain.span())).ok());
  EXPECT_EQ(read_from_second_open(2 * kMiB, kCluster), std::vector<uint8_t>(kCluster, 0));
  // With it, both writes are there: the table carries the earlier entry too.
  auto kept = pattern(2, kCluster + 4096);
  ASSERT_TRUE(loop.run(n->write(5 * kMiB + 512, kept.span(), kReqSurviveKill)).ok());
  auto got = read_from_second_open(5 * kMiB + 512, kept.size());
  EXPECT_TRUE(got == std::vector<uint8_t>(kept.data(), kept.data() + kept.size()));
  got = read_from_second_open(2 * kMiB, kCluster);
  EXPECT_TRUE(got == std::vector<uint8_t>(plain.data(), plain.data() + kCluster));
  ASSERT_TRUE(loop.run(n->close()).ok());
}

TEST_F(Qcow2SurviveKill, ZeroWriteIsInTheFileWhenItCompletes) {
  Loop loop;
  auto n = image_.open(loop);
  ASSERT_TRUE(n);
  auto data = pattern(3, 2 * kCluster);
  ASSERT_TRUE(loop.run(n->write(8 * kMiB, data.span())).ok());
  ASSERT_TRUE(loop.run(n->flush()).ok());
  auto got = read_from_second_open(8 * kMiB, 2 * kCluster);
  ASSERT_TRUE(got == std::vector<uint8_t>(data.data(), data.data() + data.size()));
  ASSERT_TRUE(loop.run(n->write_zeroes(8 * kMiB, 2 * kCluster, kReqSurviveKill)).ok());
  EXPECT_EQ(read_from_second_open(8 * kMiB, 2 * kCluster), std::vector<uint8_t>(2 * kCluster, 0));
  ASSERT_TRUE(loop.run(n->close()).ok());
}

}  // namespace qcow2_survive_kill_test
