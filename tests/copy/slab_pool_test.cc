// SlabPool: pieces sized to the request (power-of-two classes), recycled,
// aligned, never overlapping, and the memory mapped bounded by what is in use
// per class.
#include "vblk/slab_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>

using namespace vblk;

// Named, not anonymous: the unity build puts several test files in one
// translation unit, and their helpers share names.
namespace slab_pool_test {
constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;

TEST(SlabPool, SmallRequestsTouchSmallPieces) {
  // 64 workers copying 64 KiB clusters: 4 MiB of slabs, not 64 x 1 MiB.
  SlabPool pool;
  std::vector<std::span<uint8_t>> in_use;
  for (int i = 0; i < 64; ++i) in_use.push_back(pool.take(64 * kKiB));
  EXPECT_EQ(pool.slab_bytes(), 4 * kMiB);
  // Distinct, aligned to their class, and writable end to end without
  // touching a neighbour.
  std::sort(in_use.begin(), in_use.end(), [](auto a, auto b) { return a.data() < b.data(); });
  for (size_t i = 0; i < in_use.size(); ++i) {
    EXPECT_TRUE(is_aligned(in_use[i].data(), 64 * kKiB));
    EXPECT_EQ(in_use[i].size(), 64 * kKiB);
    if (i) {
      EXPECT_GE(in_use[i].data(), in_use[i - 1].data() + 64 * kKiB);
    }
    std::memset(in_use[i].data(), static_cast<int>(i), in_use[i].size());
  }
  for (size_t i = 0; i < in_use.size(); ++i)
    EXPECT_TRUE(
        std::all_of(in_use[i].begin(), in_use[i].end(), [&](uint8_t b) { return b == static_cast<uint8_t>(i); }));
  for (auto p : in_use) pool.give(p);
  // Given back, they are taken again: no new slab.
  for (int i = 0; i < 64; ++i) in_use[i] = pool.take(64 * kKiB);
  EXPECT_EQ(pool.slab_bytes(), 4 * kMiB);
}

TEST(SlabPool, SizeClasses) {
  SlabPool pool;
  // Below the minimum piece: a 64 KiB piece; odd sizes round up to a power
  // of two; the span has the size asked for.
  auto a = pool.take(512);
  EXPECT_EQ(a.size(), 512u);
  EXPECT_TRUE(is_aligned(a.data(), 64 * kKiB));
  auto b = pool.take(96 * kKiB);  // a 128 KiB piece
  EXPECT_TRUE(is_aligned(b.data(), 128 * kKiB));
  auto c = pool.take(1 * kMiB);
  EXPECT_TRUE(is_aligned(c.data(), 1 * kMiB));
  EXPECT_EQ(pool.slab_bytes(), 3 * 2 * kMiB);  // one huge page per class
  // Larger than a huge page: a slab of its own.
  auto d = pool.take(3 * kMiB);
  EXPECT_EQ(d.size(), 3 * kMiB);
  EXPECT_EQ(pool.slab_bytes(), 6 * kMiB + 4 * kMiB);
  std::memset(d.data(), 0xab, d.size());
  // Returned pieces go back to their own class.
  pool.give(b);
  EXPECT_EQ(pool.take(65 * kKiB).data(), b.data());
  pool.give(d);
  EXPECT_EQ(pool.take(4 * kMiB).data(), d.data());
  EXPECT_EQ(pool.slab_bytes(), 10 * kMiB);
  std::set<uint8_t*> distinct{a.data(), b.data(), c.data(), d.data()};
  EXPECT_EQ(distinct.size(), 4u);
}

}  // namespace slab_pool_test
