// MigrationStreamCheck (src/block/migration_stream.cc): real streams of
// qemu-system-x86_64 (-accel tcg, migrated to a file; skipped where it is
// not installed) pass whole in any piece size, and are refused when cut at
// any of many offsets, with a byte more, or with a byte changed in a
// footer, the vmdesc or a RAM record; a synthetic stream built here is
// refused at every cut; random bytes are refused.
#include "vblk/migration_stream.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

using namespace vblk;

namespace {

using Bytes = std::vector<uint8_t>;

Status check(std::span<const uint8_t> s, size_t piece = SIZE_MAX) {
  MigrationStreamCheck c;
  for (size_t pos = 0; pos < s.size();) {
    const size_t n = std::min(piece, s.size() - pos);
    auto st = c.feed(s.subspan(pos, n));
    if (!st) return st;
    pos += n;
  }
  return c.finish();
}

// A stream of a QEMU with `mem` MiB of RAM, never run (-S) or run for a
// moment; empty when qemu-system-x86_64 is missing.
Bytes qemu_stream(int mem, bool run) {
  char dir[] = "/tmp/vblk-migstream-XXXXXX";
  if (!mkdtemp(dir)) return {};
  const std::string out = std::string(dir) + "/s";
  const std::string cmd = std::string("printf '") + (run ? "cont\\n" : "") + "migrate \"exec:cat > " + out +
                          "\"\\nquit\\n' | qemu-system-x86_64 -nodefaults -display none -accel tcg -m " +
                          std::to_string(mem) + " -S -monitor stdio >/dev/null 2>&1";
  Bytes s;
  if (std::system(cmd.c_str()) == 0) {
    std::ifstream f(out, std::ios::binary);
    s.assign(std::istreambuf_iterator<char>(f), {});
  }
  ::unlink(out.c_str());
  ::rmdir(dir);
  return s;
}

class RealStream : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (::system("command -v qemu-system-x86_64 >/dev/null 2>&1") == 0) {
      streams_.push_back(qemu_stream(32, false));
      streams_.push_back(qemu_stream(48, true));
    }
  }
  void SetUp() override {
    if (streams_.empty() || streams_[0].empty()) GTEST_SKIP() << "qemu-system-x86_64 not installed";
  }
  static std::vector<Bytes> streams_;
};
std::vector<Bytes> RealStream::streams_;

TEST_F(RealStream, WholeStreamsPassInAnyPieceSize) {
  for (const auto& s : streams_) {
    ASSERT_GT(s.size(), 100000u);
    for (size_t piece : {size_t{1}, size_t{7}, size_t{4096}, size_t{65537}, SIZE_MAX})
      EXPECT_TRUE(check(s, piece)) << "piece " << piece << ": " << check(s, piece).error().what();
  }
}

TEST_F(RealStream, EveryCutIsRefused) {
  std::mt19937_64 rng(5);
  for (const auto& s : streams_) {
    std::vector<size_t> cuts;
    for (size_t i = 0; i < 1024; ++i) cuts.push_back(i);                    // the header and configuration
    for (size_t i = s.size() - 3072; i < s.size(); ++i) cuts.push_back(i);  // the end, vmdesc and EOF
    for (int i = 0; i < 1500; ++i) cuts.push_back(rng() % s.size());
    for (size_t cut : cuts) {
      auto st = check(std::span(s).first(cut), 65536);
      ASSERT_FALSE(st) << "a stream cut at " << cut << " of " << s.size() << " passed";
    }
  }
  // A cut's message says it is one.
  const Bytes& s = streams_[0];
  auto st = check(std::span(s).first(s.size() / 2));
  EXPECT_NE(st.error().what().find("it ends early"), std::string::npos) << st.error().what();
}

TEST_F(RealStream, ChangedOrLongerStreamsAreRefused) {
  const Bytes& s = streams_[0];
  Bytes more = s;
  more.push_back(0);
  auto st = check(more);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().what().find("data after the end"), std::string::npos) << st.error().what();
  // The last footer before EOF (0x7e, be32 id, 0x00 EOF, 0x06 VMDESC).
  size_t eof = 0;
  for (size_t i = s.size() - 1; i > 6; --i)
    if (s[i - 6] == 0x7e && s[i - 1] == 0x00 && s[i] == 0x06) {
      eof = i - 1;
      break;
    }
  ASSERT_GT(eof, 0u);
  for (size_t at : {eof - 5, eof - 1, eof, eof + 1, eof + 3, eof + 6, s.size() - 1}) {
    Bytes bad = s;
    bad[at] ^= 0x5a;
    EXPECT_FALSE(check(bad)) << "byte " << at << " changed";
  }
  // Device sections listed otherwise than the vmdesc says: the JSON's first
  // device renamed (same length).
  Bytes renamed = s;
  const std::string key = "\"name\": \"timer\"";
  auto it = std::search(renamed.begin() + static_cast<std::ptrdiff_t>(eof), renamed.end(), key.begin(), key.end());
  ASSERT_NE(it, renamed.end());
  it[10] = 'T';
  st = check(renamed);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().what().find("vmdescription"), std::string::npos) << st.error().what();
  // The first RAM record's flags after its block list: a PAGE of an
  // unknown block.
  Bytes badram = s;
  badram[8] = 0x01;  // configuration -> START
  EXPECT_FALSE(check(badram));
}

TEST(MigrationStream, RandomBytesAreRefused) {
  std::mt19937_64 rng(9);
  for (int i = 0; i < 200; ++i) {
    Bytes b(1 + rng() % 100000);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (i % 2) {  // with the right header, too
      const uint8_t h[] = {'Q', 'E', 'V', 'M', 0, 0, 0, 3};
      std::copy(h, h + std::min(b.size(), sizeof h), b.begin());
    }
    EXPECT_FALSE(check(b, 1 + rng() % 70000)) << i;
  }
  EXPECT_FALSE(check(Bytes{}));
  EXPECT_TRUE(MigrationStreamCheck::has_magic(Bytes{'Q', 'E', 'V', 'M'}));
  EXPECT_FALSE(MigrationStreamCheck::has_magic(Bytes{'Q', 'E', 'V'}));
}

// A small stream as QEMU 7.2 lays it out: configuration, a RAM section
// (START with one block, a PART with pages, END), a device section, EOF
// and the vmdesc.
Bytes synthetic() {
  Bytes s;
  auto u8 = [&](uint8_t v) { s.push_back(v); };
  auto be32 = [&](uint32_t v) {
    for (int i = 3; i >= 0; --i) u8(static_cast<uint8_t>(v >> (8 * i)));
  };
  auto be64 = [&](uint64_t v) {
    be32(static_cast<uint32_t>(v >> 32));
    be32(static_cast<uint32_t>(v));
  };
  auto bytes = [&](const std::string& t) { s.insert(s.end(), t.begin(), t.end()); };
  auto header = [&](uint8_t type, uint32_t id, const std::string& name) {
    u8(type);
    be32(id);
    u8(static_cast<uint8_t>(name.size()));
    bytes(name);
    be32(0);
    be32(4);
  };
  auto footer = [&](uint32_t id) {
    u8(0x7e);
    be32(id);
  };
  be32(0x5145564d);
  be32(3);
  u8(0x07);
  be32(3);
  bytes("toy");
  header(0x01, 2, "ram");
  be64(8192 | 0x04);
  u8(6);
  bytes("pc.ram");
  be64(8192);
  be64(0x10);
  footer(2);
  u8(0x02);
  be32(2);
  be64(0 | 0x08);
  u8(6);
  bytes("pc.ram");
  s.insert(s.end(), 4096, 0x7e);  // page data that looks like footers
  be64(4096 | 0x02 | 0x20);
  u8(0);
  be64(0x10);
  footer(2);
  u8(0x03);
  be32(2);
  be64(0x10);
  footer(2);
  header(0x04, 3, "dev");
  bytes(std::string("\x7e\x00\x00\x00\x03\x09", 6));  // a footer followed by nothing plausible
  footer(3);
  u8(0x00);
  const std::string js = R"({"page_size": 4096, "devices": [{"name": "dev", "instance_id": 0}]})";
  u8(0x06);
  be32(static_cast<uint32_t>(js.size()));
  bytes(js);
  return s;
}

TEST(MigrationStream, SyntheticStreamPassesAndEveryCutFails) {
  const Bytes s = synthetic();
  for (size_t piece : {size_t{1}, size_t{3}, SIZE_MAX}) {
    auto st = check(s, piece);
    EXPECT_TRUE(st) << st.error().what();
  }
  for (size_t cut = 0; cut < s.size(); ++cut) EXPECT_FALSE(check(std::span(s).first(cut))) << "cut at " << cut;
}

}  // namespace
