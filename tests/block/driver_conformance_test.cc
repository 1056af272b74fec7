// One harness over every storage driver configuration: the same reads,
// writes, zeroes, discards and block-status checks against a byte model.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <random>

#include "vblk/buffer.h"
#include "vblk/open.h"

using namespace vblk;

namespace {

struct Config {
  const char* name;
  const char* driver;  // top driver
  bool direct;
  const char* aio;
  uint64_t raw_offset;    // raw driver's offset option
  bool blockdev = false;  // put the file behind a loop device (host_device)
};

// Attaches a loop device to path; "" when not possible (not root, no loop).
std::string attach_loop(const std::string& path) {
  if (geteuid() != 0) return {};
  std::string cmd = "losetup -f --show " + path + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {};
  char buf[256] = {};
  std::string dev = fgets(buf, sizeof buf, p) ? buf : "";
  pclose(p);
  while (!dev.empty() && (dev.back() == '\n' || dev.back() == ' ')) dev.pop_back();
  return dev;
}

class DriverConformance : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    char tmpl[] = "/var/tmp/vblk-conf-XXXXXX";
    int fd = mkstemp(tmpl);
    ASSERT_GE(fd, 0);
    close(fd);
    path_ = tmpl;
    ASSERT_EQ(truncate(path_.c_str(), kSize + GetParam().raw_offset), 0);
    dev_ = path_;
    if (GetParam().blockdev) {
      dev_ = attach_loop(path_);
      if (dev_.empty()) GTEST_SKIP() << "no loop device (needs root and losetup)";
    }
  }
  void TearDown() override {
    if (GetParam().blockdev && !dev_.empty() && dev_ != path_) {
      std::string cmd = "losetup -d " + dev_;
      EXPECT_EQ(system(cmd.c_str()), 0);
    }
    unlink(path_.c_str());
  }

  std::shared_ptr<Node> open(Loop& loop) {
    const Config& c = GetParam();
    Json file = {{"driver", c.blockdev ? "host_device" : "file"}, {"filename", dev_}, {"aio", c.aio}};
    if (c.direct) file["cache"] = {{"direct", true}};
    Json top = file;
    if (std::string(c.driver) == "raw") {
      top = {{"driver", "raw"}, {"file", file}};
      if (c.raw_offset) {
        top["offset"] = c.raw_offset;
        top["size"] = kSize;
      }
    }
    OpenContext ctx{loop};
    auto n = open_node(ctx, top);
    EXPECT_TRUE(n.ok()) << (n.ok() ? "" : n.error().what());
    return n.ok() ? *n : nullptr;
  }

  static constexpr uint64_t kSize = 1 << 20;
  std::string path_;
  std::string dev_;  // what the driver opens: path_ or its loop device
};

std::vector<uint8_t> bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng() | 1);  // never zero
  return v;
}

}  // namespace

TEST_P(DriverConformance, RandomWorkloadMatchesModel) {
  Loop loop;
  auto n = open(loop);
  ASSERT_TRUE(n);
  ASSERT_EQ(n->length(), kSize);
  std::vector<uint8_t> model(kSize, 0);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 300; ++i) {
    uint64_t off = rng() % kSize;
    uint64_t len = 1 + rng() % std::min<uint64_t>(kSize - off, 200000);
    switch (rng() % 4) {
      case 0: {
        auto b = bytes(len, static_cast<uint32_t>(i));
        ASSERT_TRUE(loop.run(n->write(off, b, i % 7 == 0 ? uint32_t{kReqFua} : 0u)).ok()) << i;
        std::copy(b.begin(), b.end(), model.begin() + static_cast<long>(off));
        break;
      }
      case 1:
        ASSERT_TRUE(loop.run(n->write_zeroes(off, len, i % 2 ? uint32_t{kReqMayUnmap} : 0u)).ok()) << i;
        std::fill_n(model.begin() + static_cast<long>(off), len, 0);
        break;
      case 2: {
        std::vector<uint8_t> back(len);
        ASSERT_TRUE(loop.run(n->read(off, back)).ok()) << i;
        ASSERT_TRUE(std::equal(back.begin(), back.end(), model.begin() + static_cast<long>(off))) << "op " << i;
        break;
      }
      case 3: ASSERT_TRUE(loop.run(n->flush()).ok()); break;
    }
  }
  std::vector<uint8_t> all(kSize);
  ASSERT_TRUE(loop.run(n->read(0, all)).ok());
  EXPECT_EQ(all, model);
}

TEST_P(DriverConformance, DiscardAndZeroesShowAsHolesInBlockStatus) {
  Loop loop;
  auto n = open(loop);
  ASSERT_TRUE(n);
  auto b = bytes(256 << 10, 1);
  ASSERT_TRUE(loop.run(n->write(0, b)).ok());
  auto s = loop.run(n->block_status(0, kSize));
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->flags & kStatusData);
  EXPECT_TRUE(s->flags & kStatusAllocated);
  EXPECT_GE(s->bytes, 4096u);
  // Punch 64 KiB in the middle: reads as zeroes, and the status says zero.
  ASSERT_TRUE(loop.run(n->write_zeroes(64 << 10, 64 << 10, kReqMayUnmap)).ok());
  std::vector<uint8_t> back(64 << 10);
  ASSERT_TRUE(loop.run(n->read(64 << 10, back)).ok());
  EXPECT_TRUE(buffer_is_zero(back));
  auto hole = loop.run(n->block_status(64 << 10, 64 << 10));
  ASSERT_TRUE(hole.ok());
  if (GetParam().blockdev) {
    EXPECT_TRUE(hole->flags & kStatusData);  // a device cannot tell holes
  } else {
    EXPECT_TRUE(hole->flags & kStatusZero) << hole->flags;
    EXPECT_EQ(hole->bytes, 64u << 10);
  }
  ASSERT_TRUE(loop.run(n->discard(128 << 10, 64 << 10)).ok());
  ASSERT_TRUE(loop.run(n->read(128 << 10, back)).ok());
  EXPECT_TRUE(buffer_is_zero(back));
  // Data around the holes is intact.
  std::vector<uint8_t> head(64 << 10);
  ASSERT_TRUE(loop.run(n->read(0, head)).ok());
  EXPECT_TRUE(std::equal(head.begin(), head.end(), b.begin()));
}

TEST_P(DriverConformance, CopyRangeOffloadsOrSaysNotSupported) {
  Loop loop;
  auto n = open(loop);
  ASSERT_TRUE(n);
  auto b = bytes(128 << 10, 3);
  ASSERT_TRUE(loop.run(n->write(0, b)).ok());
  auto st = loop.run(n->copy_range(0, *n, 512 << 10, 128 << 10));
  if (!st.ok()) {
    EXPECT_EQ(st.error().code, ENOTSUP);
    return;
  }
  std::vector<uint8_t> back(128 << 10);
  ASSERT_TRUE(loop.run(n->read(512 << 10, back)).ok());
  EXPECT_EQ(back, b);
}

TEST_P(DriverConformance, ReadOnlyOpenRefusesWrites) {
  Loop loop;
  const Config& c = GetParam();
  Json file = {{"driver", c.blockdev ? "host_device" : "file"}, {"filename", dev_}, {"read-only", true}};
  if (c.direct) file["cache"] = {{"direct", true}};
  OpenContext ctx{loop};
  auto n = open_node(ctx, file);
  ASSERT_TRUE(n.ok());
  std::vector<uint8_t> b(4096, 1);
  auto st = loop.run((*n)->write(0, b));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EPERM);
}

INSTANTIATE_TEST_SUITE_P(Drivers, DriverConformance,
                         ::testing::Values(Config{"file_buffered_uring", "file", false, "io_uring", 0},
                                           Config{"file_direct_uring", "file", true, "io_uring", 0},
                                           Config{"file_direct_threads", "file", true, "threads", 0},
                                           Config{"raw_buffered_threads", "raw", false, "threads", 0},
                                           Config{"raw_direct_offset", "raw", true, "io_uring", 65536},
                                           Config{"host_device_direct", "file", true, "io_uring", 0, true},
                                           Config{"raw_host_device_threads", "raw", false, "threads", 0, true}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(NullDriver, ReadZeroesAndStatus) {
  Loop loop;
  OpenContext ctx{loop};
  auto n = open_node(ctx, Json{{"driver", "null-co"}, {"size", "1M"}, {"read-zeroes", "on"}});
  ASSERT_TRUE(n.ok());
  EXPECT_EQ((*n)->length(), 1u << 20);
  std::vector<uint8_t> b(4096, 0xff);
  ASSERT_TRUE(loop.run((*n)->write(0, b)).ok());
  ASSERT_TRUE(loop.run((*n)->read(0, b)).ok());
  EXPECT_TRUE(buffer_is_zero(b));
  auto s = loop.run((*n)->block_status(0, 1 << 20));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->flags & (kStatusZero | kStatusData), static_cast<uint32_t>(kStatusZero));
}

TEST(OpenNode, ReportsUnknownOptionsAndDriversLikeQemu) {
  Loop loop;
  OpenContext ctx{loop};
  auto a = open_node(ctx, Json{{"driver", "raw"}, {"foo", "1"}, {"file", {{"driver", "null-co"}}}});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.error().what(), "Block format 'raw' does not support the option 'foo'");
  auto b = open_node(ctx, Json{{"driver", "null-co"}, {"bar", "1"}});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.error().what(), "Block protocol 'null-co' doesn't support the option 'bar'");
  auto c = open_node(ctx, Json{{"driver", "nope"}});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().what(), "Unknown driver 'nope'");
  auto d = open_node(ctx, Json{{"driver", "file"}, {"filename", "/nonexistent/x"}});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error().code, ENOENT);
  auto e = open_node(ctx, Json{{"driver", "raw"}});
  ASSERT_FALSE(e.ok());
}
