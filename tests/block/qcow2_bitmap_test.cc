// qcow2 persistent dirty bitmaps (src/block/drivers/qcow2/bitmap.cc): stored
// on close and loaded on open with the same bits and flags, in_use while open
// read-write (a crash leaves them inconsistent), removal rewrites the
// directory, qcow2's own checks for new persistent bitmaps.
#include <gtest/gtest.h>
#include <unistd.h>

#include <random>

#include "block/drivers/qcow2/qcow2.h"
#include "qcow2_temp_image.h"
#include "vblk/image_format.h"
#include "vblk/open.h"

using namespace vblk;

namespace {

class Qcow2Bitmaps : public ::testing::Test {
 protected:
  void SetUp() override {
    qcow2::Qcow2Node::CreateOptions o;
    o.size = kSize;
    ASSERT_NO_FATAL_FAILURE(image_.create(o));
    path_ = image_.path();
  }
  std::shared_ptr<Node> open(Loop& loop, bool ro = false) { return image_.open(loop, ro); }
  static qcow2::Qcow2Node& q(const std::shared_ptr<Node>& n) { return static_cast<qcow2::Qcow2Node&>(*n); }

  static constexpr uint64_t kSize = 64ull << 20;
  vblk::testing::Qcow2TempImage image_;
  std::string path_;
};

}  // namespace

TEST_F(Qcow2Bitmaps, StoredOnCloseLoadedOnOpen) {
  std::string fine_hash, coarse_hash;
  {
    Loop loop;
    auto n = open(loop);
    ASSERT_TRUE(n);
    ASSERT_TRUE(image::can_store_new_bitmap(*n, "fine", 512).ok());
    auto fine = n->bitmaps().create("fine", n->length(), 512);
    auto coarse = n->bitmaps().create("coarse", n->length(), 1 << 20);
    auto temp = n->bitmaps().create("temp", n->length(), 65536);
    ASSERT_TRUE(fine.ok() && coarse.ok() && temp.ok());
    (*fine)->persistent = (*coarse)->persistent = true;
    (*coarse)->enabled = false;
    std::mt19937_64 rng(3);
    for (int i = 0; i < 300; ++i) (*fine)->bits.set(rng() % kSize, 1 + rng() % 100000);
    (*fine)->bits.set(kSize - 1, 1);  // the last bit of the last table entry
    std::vector<uint8_t> buf(4096, 7);
    ASSERT_TRUE(loop.run(n->write(5 << 20, buf)).ok());  // marks fine (enabled), not coarse
    (*coarse)->bits.set(0, 3 << 20);
    fine_hash = bitmap_sha256((*fine)->bits);
    coarse_hash = bitmap_sha256((*coarse)->bits);
    ASSERT_TRUE(loop.run(n->close()).ok());
  }
  Loop loop;
  auto n = open(loop);
  ASSERT_TRUE(n);
  ASSERT_EQ(n->bitmaps().list().size(), 2u);  // temp was not persistent
  NamedBitmap* fine = n->bitmaps().find("fine");
  NamedBitmap* coarse = n->bitmaps().find("coarse");
  ASSERT_TRUE(fine && coarse);
  EXPECT_EQ(bitmap_sha256(fine->bits), fine_hash);
  EXPECT_EQ(bitmap_sha256(coarse->bits), coarse_hash);
  EXPECT_TRUE(fine->enabled && fine->persistent && !fine->inconsistent);
  EXPECT_FALSE(coarse->enabled);
  EXPECT_EQ(fine->bits.granularity(), 512u);
  // Open read-write: in_use on disk.
  for (const auto& e : q(n).stored_bitmaps()) EXPECT_EQ(e.flags & 1, 1u) << e.name;
  // Names on disk answer like existing bitmaps; qcow2's own limits.
  EXPECT_EQ(image::can_store_new_bitmap(*n, "fine", 65536).error().what(), "Bitmap already exists: fine");
  EXPECT_EQ(image::can_store_new_bitmap(*n, "x", 256).error().what(),
            "Can't make bitmap 'x' persistent in '': Granularity is under minimum (512 bytes)");
  EXPECT_EQ(image::can_store_new_bitmap(*n, std::string(1024, 'n'), 65536).error().what(),
            "Can't make bitmap '" + std::string(1024, 'n') +
                "' persistent in '': Name length exceeds maximum (1023 characters)");
  // Removing a stored bitmap rewrites the directory at once.
  ASSERT_TRUE(loop.run(image::remove_persistent_bitmap(*n, "coarse")).ok());
  n->bitmaps().remove("coarse");
  ASSERT_EQ(q(n).stored_bitmaps().size(), 1u);
  auto r = loop.run(image::check(*n, kCheckReport));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->corruptions, 0);
  EXPECT_EQ(r->leaks, 0);
  ASSERT_TRUE(loop.run(n->close()).ok());
}

TEST_F(Qcow2Bitmaps, NotClosedLeavesThemInconsistent) {
  {
    Loop loop;
    auto n = open(loop);
    ASSERT_TRUE(n);
    auto b = n->bitmaps().create("b", n->length(), 65536);
    ASSERT_TRUE(b.ok());
    (*b)->persistent = true;
    ASSERT_TRUE(loop.run(n->close()).ok());
  }
  {
    Loop loop;
    auto n = open(loop);  // sets in_use; never closed: a crash
    ASSERT_TRUE(n);
    ASSERT_TRUE(n->bitmaps().find("b"));
  }
  Loop loop;
  auto ro = open(loop, true);
  ASSERT_TRUE(ro);
  NamedBitmap* b = ro->bitmaps().find("b");
  ASSERT_TRUE(b);
  EXPECT_TRUE(b->inconsistent);
  EXPECT_FALSE(b->enabled);
  EXPECT_TRUE(b->readonly);
  EXPECT_FALSE(check_bitmap(*b, kBitmapAllowRo).ok());
}
