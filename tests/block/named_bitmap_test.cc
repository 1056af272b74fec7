// Named dirty bitmaps: the registry on a node (vblk/named_bitmap.h), the
// marking done by the generic request path, merge across granularities and
// the digest x-debug-block-dirty-bitmap-sha256 prints.
#include "vblk/named_bitmap.h"

#include <gtest/gtest.h>

#include "bare_disk.h"
#include "vblk/sha256.h"

using namespace vblk;
using vblk::MemNode;
using vblk::testing::bare_disk;

namespace {

NodeCaps all_caps() {
  NodeCaps c;
  c.zeroes = true;
  c.discard = true;
  return c;
}

BlockLimits align512() {
  BlockLimits l;
  l.request_alignment = 512;
  return l;
}

}  // namespace

TEST(NamedBitmapTest, CreateFindRemoveNewestFirst) {
  BitmapSet s;
  ASSERT_TRUE(s.create("a", 1 << 20, 65536).ok());
  ASSERT_TRUE(s.create("b", 1 << 20, 4096).ok());
  ASSERT_EQ(s.list().size(), 2u);
  EXPECT_EQ(s.list()[0]->name, "b");
  EXPECT_EQ(s.list()[1]->name, "a");
  auto dup = s.create("a", 1 << 20, 65536);
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.error().what(), "Bitmap already exists: a");
  auto lng = s.create(std::string(1024, 'x'), 1 << 20, 65536);
  ASSERT_FALSE(lng.ok());
  EXPECT_EQ(lng.error().what(), "Bitmap name too long: " + std::string(1024, 'x'));
  EXPECT_TRUE(s.create(std::string(1023, 'x'), 1 << 20, 65536).ok());
  EXPECT_TRUE(s.remove("a"));
  EXPECT_FALSE(s.remove("a"));
  EXPECT_EQ(s.find("a"), nullptr);
  ASSERT_NE(s.find("b"), nullptr);
  EXPECT_EQ(s.find("b")->bits.granularity(), 4096u);
}

TEST(NamedBitmapTest, ChecksInQemuOrderAndWords) {
  NamedBitmap b("x", 1 << 20, 65536);
  EXPECT_TRUE(check_bitmap(b, kBitmapDefault).ok());
  b.readonly = true;
  EXPECT_TRUE(check_bitmap(b, kBitmapAllowRo).ok());
  EXPECT_EQ(check_bitmap(b, kBitmapDefault).error().what(), "Bitmap 'x' is readonly and cannot be modified");
  b.busy = true;
  EXPECT_EQ(check_bitmap(b, kBitmapDefault).error().what(),
            "Bitmap 'x' is currently in use by another operation and cannot be used");
  b.busy = b.readonly = false;
  b.inconsistent = true;
  EXPECT_EQ(check_bitmap(b, kBitmapAllowRo).error().what(), "Bitmap 'x' is inconsistent and cannot be used");
}

TEST(NamedBitmapTest, WritesZeroesAndDiscardsMarkEnabledBitmaps) {
  Loop loop;
  MemNode n(loop, bare_disk(1 << 20, align512(), all_caps()));
  auto on = n.bitmaps().create("on", n.length(), 65536);
  auto fine = n.bitmaps().create("fine", n.length(), 4096);
  auto off = n.bitmaps().create("off", n.length(), 65536);
  ASSERT_TRUE(on.ok() && fine.ok() && off.ok());
  (*off)->enabled = false;
  std::vector<uint8_t> buf(100, 1);
  ASSERT_TRUE(loop.run(n.write(70000, buf)).ok());  // unaligned: one 64k cluster
  EXPECT_EQ((*on)->bits.dirty_clusters(), 1u);
  EXPECT_TRUE((*on)->bits.get(65536));
  EXPECT_EQ((*fine)->bits.dirty_clusters(), 1u);
  EXPECT_TRUE((*fine)->bits.get(69632));
  ASSERT_TRUE(loop.run(n.write_zeroes(4096 * 40, 8192)).ok());
  EXPECT_TRUE((*fine)->bits.get(4096 * 40));
  EXPECT_TRUE((*fine)->bits.get(4096 * 41));
  EXPECT_EQ((*fine)->bits.dirty_clusters(), 3u);
  // A discard marks the whole request, edges included.
  ASSERT_TRUE(loop.run(n.discard(524288 + 100, 200)).ok());
  EXPECT_TRUE((*on)->bits.get(524288));
  EXPECT_EQ((*off)->bits.dirty_clusters(), 0u);
  // Reads mark nothing.
  uint64_t before = (*on)->bits.dirty_clusters();
  ASSERT_TRUE(loop.run(n.read(900000, buf)).ok());
  EXPECT_EQ((*on)->bits.dirty_clusters(), before);
}

TEST(NamedBitmapTest, FailedWritesStillMark) {
  // QEMU marks at the end of every write request, failed or not: a failed
  // write may have changed some of the range.
  Loop loop;
  MemNode n(loop, bare_disk(1 << 20, align512(), all_caps()));
  auto b = n.bitmaps().create("b", n.length(), 65536);
  ASSERT_TRUE(b.ok());
  n.faults.push_back({'w', 0, UINT64_MAX, EIO, false});
  std::vector<uint8_t> buf(4096, 1);
  EXPECT_FALSE(loop.run(n.write(0, buf)).ok());
  EXPECT_TRUE((*b)->bits.get(0));
}

TEST(NamedBitmapTest, MergeAcrossGranularities) {
  DirtyBitmap fine(1 << 20, 512), coarse(1 << 20, 65536), same(1 << 20, 512);
  fine.set(1000, 10);  // cluster 512..1023
  fine.set(200000, 1);
  coarse.merge_from(fine);
  EXPECT_EQ(coarse.dirty_clusters(), 2u);
  EXPECT_TRUE(coarse.get(0));
  EXPECT_TRUE(coarse.get(196608));
  DirtyBitmap back(1 << 20, 512);
  back.merge_from(coarse);
  EXPECT_EQ(back.dirty_clusters(), 256u);
  same.set(700000, 1);
  same.merge_from(fine);
  EXPECT_EQ(same.dirty_clusters(), 3u);
  EXPECT_EQ(same.next_dirty(0, 1 << 20), std::optional<uint64_t>(512));
  EXPECT_EQ(same.next_dirty(201000, 1 << 20), std::optional<uint64_t>(700000 / 512 * 512));
}

TEST(NamedBitmapTest, ResizeKeepsBitsBelowTheNewSize) {
  BitmapSet s;
  auto b = s.create("b", 1 << 20, 65536);
  ASSERT_TRUE(b.ok());
  (*b)->bits.set(0, 1);
  (*b)->bits.set(900000, 1);
  s.resize(2 << 20);
  EXPECT_EQ((*b)->bits.size(), 2u << 20);
  EXPECT_EQ((*b)->bits.dirty_clusters(), 2u);
  s.resize(512 << 10);
  EXPECT_EQ((*b)->bits.dirty_clusters(), 1u);
}

TEST(NamedBitmapTest, Sha256MatchesQemu) {
  // FIPS 180-4 test vectors.
  const std::string abc = "abc";
  EXPECT_EQ(sha256_hex({reinterpret_cast<const uint8_t*>(abc.data()), abc.size()}),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(sha256_hex({reinterpret_cast<const uint8_t*>(two.data()), two.size()}),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // What qemu-storage-daemon 7.2 prints for a clean bitmap of one word
  // (4 MiB at 64 KiB).
  DirtyBitmap b(4 << 20, 65536);
  EXPECT_EQ(bitmap_sha256(b), "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc");
}

TEST(NamedBitmapTest, SuccessorRecordsWhileBusyThenAbdicatesOrIsReclaimed) {
  BitmapSet s;
  auto b = s.create("b", 1 << 20, 65536);
  ASSERT_TRUE(b.ok());
  NamedBitmap* bm = *b;
  bm->bits.set(0, 1);
  ASSERT_TRUE(s.create_successor(*bm).ok());
  EXPECT_TRUE(bm->busy);
  EXPECT_TRUE(bm->recording());
  EXPECT_FALSE(s.create_successor(*bm).ok());
  EXPECT_EQ(s.list().size(), 2u);
  EXPECT_EQ(s.find(""), nullptr);  // the successor is anonymous
  s.mark(524288, 1);               // goes to the successor only
  EXPECT_EQ(bm->bits.dirty_clusters(), 1u);
  EXPECT_EQ(bm->successor->bits.dirty_clusters(), 1u);
  bm = &s.reclaim_successor(*bm);  // failure: old bits and new writes
  EXPECT_EQ(s.list().size(), 1u);
  EXPECT_FALSE(bm->busy);
  EXPECT_TRUE(bm->enabled);
  EXPECT_EQ(bm->bits.dirty_clusters(), 2u);
  // Success: only what was written meanwhile, and the bitmap is now the
  // newest of the set (the successor's place, as in QEMU).
  auto other = s.create("other", 1 << 20, 65536);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(s.create_successor(*bm).ok());
  s.mark(917504, 1);
  bm = &s.abdicate_successor(*bm);
  EXPECT_EQ(s.list().size(), 2u);
  EXPECT_EQ(s.list()[0]->name, "b");
  EXPECT_EQ(s.find("b"), bm);
  EXPECT_EQ(bm->bits.dirty_clusters(), 1u);
  EXPECT_TRUE(bm->bits.get(917504));
  EXPECT_FALSE(bm->busy);
  // A disabled bitmap's successor does not record either.
  bm->enabled = false;
  ASSERT_TRUE(s.create_successor(*bm).ok());
  EXPECT_FALSE(bm->recording());
  s.mark(0, 1);
  bm = &s.abdicate_successor(*bm);
  EXPECT_EQ(bm->bits.dirty_clusters(), 0u);
  EXPECT_FALSE(bm->enabled);
}
