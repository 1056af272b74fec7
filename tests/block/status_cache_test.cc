// The per-node block-status cache (status_cache.h) on real files: the file
// driver answers whole extents, the node keeps them, and every request that
// changes the file drops what it touches, so the next block status sees the
// change. Each invalidation test fails if the invalidation is missing: the
// cached extent would still be answered.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "vblk/buffer.h"
#include "vblk/open.h"

using namespace vblk;

namespace {

constexpr uint64_t kMiB = 1 << 20;

class StatusCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = temp_file(4 * kMiB);
    // Data at [1 MiB, 2 MiB), holes elsewhere.
    write_file(path_, kMiB, kMiB, 0xab);
  }
  void TearDown() override {
    for (auto& p : cleanup_) unlink(p.c_str());
  }

  std::string temp_file(uint64_t size) {
    char tmpl[] = "/var/tmp/vblk-bsc-XXXXXX";
    int fd = mkstemp(tmpl);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    close(fd);
    cleanup_.push_back(tmpl);
    return tmpl;
  }
  static void write_file(const std::string& p, uint64_t off, uint64_t len, uint8_t v) {
    int fd = ::open(p.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    std::vector<uint8_t> b(len, v);
    ASSERT_EQ(pwrite(fd, b.data(), len, static_cast<off_t>(off)), static_cast<ssize_t>(len));
    close(fd);
  }

  // A file node (or raw over it) whose users share no write: holes are cached.
  std::shared_ptr<Node> open(Loop& loop, const std::string& p, bool raw = false, bool share_write = false) {
    Json file = {{"driver", "file"}, {"filename", p}};
    Json top = raw ? Json{{"driver", "raw"}, {"file", file}} : file;
    OpenContext ctx{loop};
    auto n = open_node(ctx, top);
    EXPECT_TRUE(n.ok()) << (n.ok() ? "" : n.error().what());
    if (!n.ok()) return nullptr;
    (*n)->set_claim(
        PermPair{kPermConsistentRead | kPermWrite, share_write ? kPermAll : kPermAll & ~(kPermWrite | kPermResize)});
    EXPECT_TRUE((*n)->refresh_perms().ok());
    return *n;
  }

  static BlockStatus status(Loop& loop, Node& n, uint64_t off, uint64_t bytes) {
    auto r = loop.run(n.block_status(off, bytes));
    EXPECT_TRUE(r.ok());
    return r.ok() ? *r : BlockStatus{};
  }
  static bool is_data(const BlockStatus& s) { return (s.flags & kStatusData) && !(s.flags & kStatusZero); }
  static bool is_hole(const BlockStatus& s) { return (s.flags & kStatusZero) && !(s.flags & kStatusData); }

  std::string path_;
  std::vector<std::string> cleanup_;
};

TEST_F(StatusCacheTest, WholeExtentAnsweredOnceThenFromTheCache) {
  Loop loop;
  auto n = open(loop, path_);
  ASSERT_TRUE(n);
  // A 64 KiB question gets a 64 KiB answer, but the node keeps the extent.
  auto s = status(loop, *n, 0, 64 << 10);
  EXPECT_TRUE(is_hole(s));
  EXPECT_EQ(s.bytes, 64u << 10);
  EXPECT_EQ(n->status_cache().fills(), 1u);
  for (uint64_t off = 64 << 10; off < kMiB; off += 64 << 10) {
    s = status(loop, *n, off, 64 << 10);
    EXPECT_TRUE(is_hole(s));
    EXPECT_EQ(s.bytes, 64u << 10);
  }
  // Asked without a limit, the rest of the hole comes back in one run.
  s = status(loop, *n, 4096, 4 * kMiB);
  EXPECT_EQ(s.bytes, kMiB - 4096);
  s = status(loop, *n, kMiB, 4096);
  EXPECT_TRUE(is_data(s));
  EXPECT_EQ(s.map, kMiB);
  for (uint64_t off = kMiB; off < 2 * kMiB; off += 4096) EXPECT_TRUE(is_data(status(loop, *n, off, 4096)));
  s = status(loop, *n, kMiB + 4096, 4 * kMiB);
  EXPECT_EQ(s.bytes, kMiB - 4096);
  EXPECT_EQ(s.map, kMiB + 4096);
  // One driver answer per extent.
  EXPECT_EQ(n->status_cache().fills(), 2u);
}

TEST_F(StatusCacheTest, WriteIntoCachedHoleIsSeen) {
  Loop loop;
  auto n = open(loop, path_);
  ASSERT_TRUE(n);
  ASSERT_TRUE(is_hole(status(loop, *n, 0, 4096)));
  AlignedBuffer b(4096, 4096);
  std::memset(b.data(), 0x11, 4096);
  ASSERT_TRUE(loop.run(n->write(256 << 10, b.span())).ok());
  EXPECT_TRUE(is_data(status(loop, *n, 256 << 10, 4096)));
  // The hole before it is a hole again, and shorter.
  auto s = status(loop, *n, 0, 4 * kMiB);
  EXPECT_TRUE(is_hole(s));
  EXPECT_EQ(s.bytes, 256u << 10);
}

TEST_F(StatusCacheTest, UnalignedWriteAndWriteThroughRawAreSeen) {
  Loop loop;
  auto n = open(loop, path_, /*raw=*/true);
  ASSERT_TRUE(n);
  Node* file = n->file_child();
  ASSERT_TRUE(is_hole(status(loop, *n, 2 * kMiB, 4096)));
  EXPECT_GE(file->status_cache().fills(), 1u);
  std::vector<uint8_t> b(100, 0x22);
  ASSERT_TRUE(loop.run(n->write(3 * kMiB + 10, b)).ok());
  EXPECT_TRUE(is_data(status(loop, *n, 3 * kMiB, 512)));
}

TEST_F(StatusCacheTest, WriteInsideCachedDataKeepsTheExtent) {
  Loop loop;
  auto n = open(loop, path_);
  ASSERT_TRUE(n);
  ASSERT_TRUE(is_data(status(loop, *n, kMiB, 4096)));
  const uint64_t fills = n->status_cache().fills();
  AlignedBuffer b(4096, 4096);
  std::memset(b.data(), 0x33, 4096);
  ASSERT_TRUE(loop.run(n->write(kMiB + 8192, b.span())).ok());
  auto s = status(loop, *n, kMiB, 4 * kMiB);
  EXPECT_TRUE(is_data(s));
  EXPECT_EQ(s.bytes, kMiB);
  EXPECT_EQ(n->status_cache().fills(), fills);  // no new driver answer
}

TEST_F(StatusCacheTest, DiscardAndWriteZeroesIntoCachedDataAreSeen) {
  Loop loop;
  auto n = open(loop, path_);
  ASSERT_TRUE(n);
  ASSERT_TRUE(is_data(status(loop, *n, kMiB, 4096)));
  ASSERT_TRUE(loop.run(n->discard(kMiB + (64 << 10), 64 << 10)).ok());
  auto s = status(loop, *n, kMiB + (64 << 10), 4096);
  EXPECT_TRUE(is_hole(s));
  ASSERT_TRUE(is_data(status(loop, *n, kMiB + (256 << 10), 4096)));
  ASSERT_TRUE(loop.run(n->write_zeroes(kMiB + (256 << 10), 64 << 10, kReqMayUnmap)).ok());
  EXPECT_TRUE(is_hole(status(loop, *n, kMiB + (256 << 10), 4096)));
  // What is left of the data extent is asked again, not taken from before.
  s = status(loop, *n, kMiB, 4 * kMiB);
  EXPECT_TRUE(is_data(s));
  EXPECT_EQ(s.bytes, 64u << 10);
}

TEST_F(StatusCacheTest, TruncateDropsTheCache) {
  Loop loop;
  auto n = open(loop, path_);
  ASSERT_TRUE(n);
  ASSERT_TRUE(is_data(status(loop, *n, kMiB, 4096)));
  // Shrink into the data, grow again: the regrown part is a hole.
  ASSERT_TRUE(loop.run(n->truncate(kMiB + (512 << 10))).ok());
  ASSERT_TRUE(loop.run(n->truncate(4 * kMiB)).ok());
  EXPECT_TRUE(is_hole(status(loop, *n, kMiB + (768 << 10), 4096)));
  EXPECT_EQ(status(loop, *n, kMiB, 4 * kMiB).bytes, 512u << 10);
}

TEST_F(StatusCacheTest, CopyRangeIntoCachedHoleIsSeen) {
  Loop loop;
  auto src = open(loop, path_);
  std::string dpath = temp_file(4 * kMiB);
  auto dst = open(loop, dpath, /*raw=*/true);
  ASSERT_TRUE(src && dst);
  // The raw node passes status through to its file, which caches the hole.
  ASSERT_TRUE(is_hole(status(loop, *dst, kMiB, 4096)));
  ASSERT_GE(dst->file_child()->status_cache().fills(), 1u);
  ASSERT_TRUE(loop.run(src->copy_range(kMiB, *dst, kMiB, 64 << 10)).ok());
  EXPECT_TRUE(is_data(status(loop, *dst, kMiB, 4096)));
}

TEST_F(StatusCacheTest, HolesAreNotCachedWhileOthersMayWrite) {
  Loop loop;
  auto n = open(loop, path_, false, /*share_write=*/true);
  ASSERT_TRUE(n);
  ASSERT_TRUE(is_hole(status(loop, *n, 0, 4096)));
  EXPECT_EQ(n->status_cache().fills(), 0u);
  ASSERT_TRUE(is_data(status(loop, *n, kMiB, 4096)));
  EXPECT_EQ(n->status_cache().fills(), 1u);
  // Another writer fills the hole: seen at once.
  write_file(path_, 0, 4096, 0x44);
  EXPECT_TRUE(is_data(status(loop, *n, 0, 4096)));
}

}  // namespace
