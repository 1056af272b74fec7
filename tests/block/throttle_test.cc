// Throttle groups (QEMU's leaky buckets) and the `throttle` filter driver.
#include "vblk/throttle.h"

#include <gtest/gtest.h>

#include <vector>

#include "vblk/open.h"
#include "vblk/sync.h"

using namespace vblk;

namespace {

std::string limits_error(const nlohmann::ordered_json& props) {
  ThrottleLimits l;
  auto st = parse_throttle_limits(props, l);
  return st.ok() ? "" : st.error().message;
}

Task<void> all_done(WaitGroup& wg) { co_await wg.wait(); }

double seconds_since(uint64_t t0) { return static_cast<double>(Loop::now_ns() - t0) / 1e9; }

// n requests of `bytes` each, all at once, through `node`; returns seconds.
double burst(Loop& loop, Node& node, bool write, unsigned n, size_t bytes) {
  std::vector<uint8_t> buf(bytes, 0x5a);
  WaitGroup wg(loop);
  unsigned failed = 0;
  const uint64_t t0 = Loop::now_ns();
  for (unsigned i = 0; i < n; ++i) {
    wg.add();
    spawn_detached(
        [](Node& nd, bool w, std::vector<uint8_t>& b, uint64_t off, WaitGroup& g, unsigned& bad) -> Task<void> {
          Status st;
          if (w)
            st = co_await nd.write(off, b);
          else
            st = co_await nd.read(off, b);
          if (!st.ok()) ++bad;
          g.done();
        }(node, write, buf, uint64_t{i} * bytes % node.length(), wg, failed));
  }
  loop.run(all_done(wg));
  EXPECT_EQ(failed, 0u);
  return seconds_since(t0);
}

std::shared_ptr<Node> open_throttled(Loop& loop, ThrottleGroups& groups, const std::string& group) {
  OpenContext ctx{.loop = loop, .throttle_groups = &groups};
  auto n = open_node(
      ctx, Json{{"driver", "throttle"}, {"throttle-group", group}, {"file", {{"driver", "null-co"}, {"size", "64M"}}}});
  EXPECT_TRUE(n.ok()) << (n.ok() ? "" : n.error().message);
  return n.ok() ? *n : nullptr;
}

}  // namespace

TEST(ThrottleLimits, ValidatesLikeQemu) {
  EXPECT_EQ(limits_error({{"limits", {{"bps-total", 100}, {"bps-read", 5}}}}),
            "bps/iops/max total values and read/write values cannot be used at the same time");
  EXPECT_EQ(limits_error({{"limits", {{"iops-total-max", 100}}}}),
            "bps_max/iops_max require corresponding bps/iops values");
  EXPECT_EQ(limits_error({{"limits", {{"iops-total", -1}}}}),
            "bps/iops/max values must be within [0, 1000000000000000]");
  EXPECT_EQ(limits_error({{"limits", {{"iops-size", 4096}}}}), "iops size requires an iops value to be set");
  EXPECT_EQ(limits_error({{"limits", {{"bps-total-max-length", 2}}}}), "burst length set without burst rate");
  EXPECT_EQ(limits_error({{"limits", {{"bps-total-max-length", 0}}}}), "the burst length cannot be 0");
  EXPECT_EQ(limits_error({{"limits", {{"bps-total", 10}, {"bps-total-max", 5}}}}),
            "bps_max/iops_max cannot be lower than bps/iops");
  EXPECT_EQ(
      limits_error({{"limits", {{"bps-total", 10}, {"bps-total-max", 1000}, {"bps-total-max-length", 1ll << 40}}}}),
      "bps-total-max-length value must be in the range [0, 4294967295]");
  EXPECT_EQ(limits_error({{"x-bps-total", -5}}), "Property values cannot be negative");
  EXPECT_EQ(limits_error({{"limits", {{"foo", 1}}}}), "Parameter 'limits.foo' is unexpected");
  EXPECT_EQ(limits_error({{"limits", {{"bps-write", 1 << 20}}}, {"x-iops-total", 5}}), "");
}

TEST(ThrottleLimits, LegacyAndStructSpellingsFillTheSameBuckets) {
  ThrottleLimits a, b;
  ASSERT_TRUE(parse_throttle_limits({{"x-bps-write", 1000}, {"x-iops-read-max", 50}, {"x-iops-read", 10}}, a).ok());
  ASSERT_TRUE(
      parse_throttle_limits({{"limits", {{"bps-write", 1000}, {"iops-read-max", 50}, {"iops-read", 10}}}}, b).ok());
  for (int i = 0; i < kThrottleBuckets; ++i) {
    EXPECT_EQ(a.buckets[i].avg, b.buckets[i].avg) << i;
    EXPECT_EQ(a.buckets[i].max, b.buckets[i].max) << i;
  }
  EXPECT_EQ(a.buckets[kBpsWrite].avg, 1000u);
  EXPECT_EQ(a.buckets[kOpsRead].max, 50u);
  EXPECT_FALSE(ThrottleLimits{}.enabled());
  EXPECT_TRUE(a.enabled());
}

TEST(ThrottleGroups, DuplicatesAndInUse) {
  Loop loop;
  ThrottleGroups groups(loop);
  ASSERT_TRUE(groups.add("tg0", {}).ok());
  auto dup = groups.add("tg0", {});
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.error().message, "attempt to add duplicate property 'tg0' to object (type 'container')");
  {
    auto node = open_throttled(loop, groups, "tg0");
    ASSERT_TRUE(node);
    auto busy = groups.remove("tg0");
    ASSERT_FALSE(busy.ok());
    EXPECT_EQ(busy.error().message, "object 'tg0' is in use, can not be deleted");
  }
  EXPECT_TRUE(groups.remove("tg0").ok());
  auto gone = groups.remove("tg0");
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.error().message, "object 'tg0' not found");

  OpenContext ctx{.loop = loop, .throttle_groups = &groups};
  auto missing =
      open_node(ctx, Json{{"driver", "throttle"}, {"throttle-group", "nope"}, {"file", {{"driver", "null-co"}}}});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().message, "Throttle group 'nope' does not exist");
  auto unnamed = open_node(ctx, Json{{"driver", "throttle"}, {"file", {{"driver", "null-co"}}}});
  ASSERT_FALSE(unnamed.ok());
  EXPECT_EQ(unnamed.error().message, "Parameter 'throttle-group' is missing");
}

// 4 MiB written at 4 MiB/s: the bucket lets avg/10 through at once, the rest
// drains at the rate: the last of 16 requests of 256 KiB goes after
// (3.75 - 0.4) / 4 s = 0.84 s; reads are not limited by a write limit.
TEST(ThrottleNode, BytesPerSecondHoldsWritesToTheRate) {
  Loop loop;
  ThrottleGroups groups(loop);
  ThrottleLimits l;
  l.buckets[kBpsWrite].avg = 4 << 20;
  ASSERT_TRUE(groups.add("tg", l).ok());
  auto node = open_throttled(loop, groups, "tg");
  ASSERT_TRUE(node);
  const double w = burst(loop, *node, true, 16, 256 << 10);
  EXPECT_GE(w, 0.8);
  EXPECT_LT(w, 5.0);
  const double r = burst(loop, *node, false, 16, 256 << 10);
  EXPECT_LT(r, 0.5);
}

// Two nodes in one group share its limit: 40 operations at 100 IOPS total,
// half through each node: 10 pass at once, the last after (39 - 10) / 100 s.
TEST(ThrottleNode, GroupMembersShareTheLimit) {
  Loop loop;
  ThrottleGroups groups(loop);
  ThrottleLimits l;
  l.buckets[kOpsTotal].avg = 100;
  ASSERT_TRUE(groups.add("tg", l).ok());
  auto a = open_throttled(loop, groups, "tg");
  auto b = open_throttled(loop, groups, "tg");
  ASSERT_TRUE(a && b);
  const uint64_t t0 = Loop::now_ns();
  std::vector<uint8_t> buf(4096);
  WaitGroup wg(loop);
  for (int i = 0; i < 40; ++i) {
    wg.add();
    spawn_detached([](Node& n, std::vector<uint8_t>& bf, WaitGroup& g) -> Task<void> {
      (void)co_await n.read(0, bf);
      g.done();
    }(i % 2 ? *a : *b, buf, wg));
  }
  loop.run(all_done(wg));
  const double s = seconds_since(t0);
  EXPECT_GE(s, 0.25);
  EXPECT_LT(s, 3.0);
}

// iops-size: a 64 KiB request counts as 16 operations of 4 KiB.
TEST(ThrottleNode, IopsSizeCountsLargeRequestsAsMany) {
  Loop loop;
  ThrottleGroups groups(loop);
  ThrottleLimits l;
  l.buckets[kOpsTotal].avg = 160;
  l.iops_size = 4096;
  ASSERT_TRUE(groups.add("tg", l).ok());
  auto node = open_throttled(loop, groups, "tg");
  ASSERT_TRUE(node);
  // 10 x 16 = 160 operations: the last request goes after (144 - 16) / 160 s.
  const double s = burst(loop, *node, false, 10, 64 << 10);
  EXPECT_GE(s, 0.75);
  EXPECT_LT(s, 5.0);
}
