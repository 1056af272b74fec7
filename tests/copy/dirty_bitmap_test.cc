// DirtyBitmap against a plain vector<bool> model, plus the edge cases:
// partial last cluster, word and summary-level boundaries, large sizes.
#include "vblk/dirty_bitmap.h"

#include <gtest/gtest.h>

#include <random>

using namespace vblk;

namespace {

struct Model {
  uint64_t size, gran;
  std::vector<bool> bits;
  Model(uint64_t s, uint64_t g) : size(s), gran(g), bits((s + g - 1) / g) {}
  void apply(uint64_t off, uint64_t bytes, bool v) {
    if (!bytes || off >= size) return;
    uint64_t end = std::min(size, off + bytes);
    for (uint64_t c = off / gran; c <= (end - 1) / gran; ++c) bits[c] = v;
  }
  uint64_t count() const {
    uint64_t n = 0;
    for (uint64_t c = 0; c < bits.size(); ++c)
      if (bits[c]) n += std::min(gran, size - c * gran);
    return n;
  }
  std::optional<uint64_t> next(uint64_t off, uint64_t end, bool v) const {
    end = std::min(end, size);
    for (uint64_t c = off / gran; c * gran < end; ++c)
      if (bits[c] == v) return c * gran;
    return std::nullopt;
  }
};

}  // namespace

TEST(DirtyBitmapTest, EmptyAndFull) {
  DirtyBitmap b(10 << 20, 64 << 10);
  EXPECT_EQ(b.count(), 0u);
  EXPECT_FALSE(b.next_dirty(0, b.size()).has_value());
  b.set_all();
  EXPECT_EQ(b.count(), 10u << 20);
  EXPECT_EQ(*b.next_dirty(0, b.size()), 0u);
  EXPECT_FALSE(b.next_clean(0, b.size()).has_value());
  b.reset_all();
  EXPECT_EQ(b.count(), 0u);
  EXPECT_FALSE(b.next_dirty(0, b.size()).has_value());
}

TEST(DirtyBitmapTest, SetTouchesEveryClusterOfAnUnalignedRange) {
  DirtyBitmap b(1 << 20, 4096);
  b.set(4095, 2);  // touches clusters 0 and 1
  EXPECT_TRUE(b.get(0));
  EXPECT_TRUE(b.get(4096));
  EXPECT_FALSE(b.get(8192));
  EXPECT_EQ(b.count(), 8192u);
  EXPECT_EQ(b.count(4096, 1), 4096u);
}

TEST(DirtyBitmapTest, PartialLastClusterCountsItsRealBytes) {
  DirtyBitmap b(3 * 65536 + 1000, 65536);
  b.set_all();
  EXPECT_EQ(b.count(), 3u * 65536 + 1000);
  b.reset(0, 3 * 65536);
  EXPECT_EQ(b.count(), 1000u);
  EXPECT_EQ(*b.next_dirty(0, b.size()), 3u * 65536);
  uint64_t o = 0, n = 0;
  ASSERT_TRUE(b.next_dirty_area(0, b.size(), 0, o, n));
  EXPECT_EQ(o, 3u * 65536);
  EXPECT_EQ(n, 1000u);  // the area ends at the bitmap size
}

TEST(DirtyBitmapTest, NextDirtyAreaStopsAtCleanClusterAndCap) {
  DirtyBitmap b(1 << 20, 4096);
  b.set(8192, 10 * 4096);
  uint64_t o = 0, n = 0;
  ASSERT_TRUE(b.next_dirty_area(0, b.size(), 0, o, n));
  EXPECT_EQ(o, 8192u);
  EXPECT_EQ(n, 10u * 4096);
  ASSERT_TRUE(b.next_dirty_area(0, b.size(), 3 * 4096 + 100, o, n));
  EXPECT_EQ(n, 3u * 4096);  // cap rounded down to whole clusters
  ASSERT_TRUE(b.next_dirty_area(0, b.size(), 1, o, n));
  EXPECT_EQ(n, 4096u);  // but at least one
  ASSERT_TRUE(b.next_dirty_area(0, 8192 + 2 * 4096, 0, o, n));
  EXPECT_EQ(n, 2u * 4096);  // and never past end
  EXPECT_FALSE(b.next_dirty_area(8192 + 10 * 4096, b.size(), 0, o, n));
}

TEST(DirtyBitmapTest, SparseBitsInAHugeBitmapAreFoundThroughTheSummary) {
  // 16 TiB at 64 KiB: 256 Mi clusters, three summary levels.
  const uint64_t tib = 1ull << 40;
  DirtyBitmap b(16 * tib, 64 << 10);
  b.set(13 * tib + 12345, 1);
  b.set(2 * tib, 64 << 10);
  EXPECT_EQ(b.count(), 2u * (64 << 10));
  EXPECT_EQ(*b.next_dirty(0, b.size()), 2 * tib);
  EXPECT_EQ(*b.next_dirty(2 * tib + (64 << 10), b.size()), 13 * tib);
  EXPECT_FALSE(b.next_dirty(13 * tib + (64 << 10), b.size()).has_value());
  EXPECT_FALSE(b.next_dirty(0, 2 * tib).has_value());  // bounded by end
  b.reset(2 * tib, 64 << 10);
  EXPECT_EQ(*b.next_dirty(0, b.size()), 13 * tib);
  b.reset(13 * tib, 64 << 10);
  EXPECT_FALSE(b.next_dirty(0, b.size()).has_value());
  EXPECT_EQ(b.count(), 0u);
}

TEST(DirtyBitmapTest, RandomOperationsMatchAPlainModel) {
  std::mt19937_64 rng(42);
  for (uint64_t gran : {512ull, 4096ull, 65536ull}) {
    // Enough clusters for two summary levels (> 64*64 clusters).
    const uint64_t size = gran * 64 * 64 * 3 + gran / 2 + 1;
    DirtyBitmap b(size, gran);
    Model m(size, gran);
    for (int i = 0; i < 3000; ++i) {
      uint64_t off = rng() % size;
      uint64_t len = rng() % 4 == 0 ? rng() % (size / 3) : rng() % (gran * 200);
      bool set = rng() % 2;
      if (set) {
        b.set(off, len);
      } else {
        // Reset only whole clusters, as the engine does.
        uint64_t a = off / gran * gran;
        uint64_t e = std::min(size, (off + len) / gran * gran);
        if (e <= a) continue;
        off = a;
        len = e - a;
        b.reset(off, len);
      }
      m.apply(off, len, set);
      ASSERT_EQ(b.count(), m.count()) << "step " << i;
      uint64_t q = rng() % size, qe = q + rng() % (size / 2 + 1);
      ASSERT_EQ(b.next_dirty(q, qe), m.next(q, qe, true)) << "step " << i;
      ASSERT_EQ(b.next_clean(q, qe), m.next(q, qe, false)) << "step " << i;
      ASSERT_EQ(b.get(q), m.bits[q / gran]);
    }
  }
}
