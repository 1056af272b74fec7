#include "vblk/options.h"

#include <gtest/gtest.h>

using namespace vblk;

TEST(ParseSize, QemuVectors) {
  struct V {
    const char* in;
    uint64_t out;
  };
  for (V v : {V{"0", 0}, V{"1k", 1024}, V{"1K", 1024}, V{"1b", 1}, V{"1m", 1 << 20}, V{"1.5G", 1610612736ull},
              V{"1.", 1}, V{"1.k", 1024}, V{"0.5k", 512}, V{"0.3k", 307}, V{"1.0005k", 1025}, V{"+1024", 1024},
              V{"010", 10}, V{"0x1000", 4096}, V{"0x10k", 16384}, V{"0.00048828125k", 1},
              // A fraction that strtod rounds to 1.0 counts as 0 (qemu-img
              // create says size=1024 and size=1); it used to be converted
              // to uint64 first, undefined behaviour (found by fuzz_options).
              V{"1.99999999999999999999k", 1024}, V{"1.99999999999999999999", 1}}) {
    auto r = parse_size(v.in);
    ASSERT_TRUE(r.ok()) << v.in;
    EXPECT_EQ(*r, v.out) << v.in;
  }
  for (const char* bad :
       {"1.5", "1.5b", "1kB", "1KiB", "1e3", "1.5e3k", ".5G", "1Z", "abc", "", "0x", "-1", "1024 ", "1kk"}) {
    auto r = parse_size(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.error().code, EINVAL) << bad;
    }
  }
  for (const char* big : {"16E", "18446744073709551616", "12345678901234567890123"}) {
    auto r = parse_size(big);
    ASSERT_FALSE(r.ok()) << big;
    EXPECT_EQ(r.error().code, ERANGE) << big;
  }
}

TEST(ParseKeyval, NestsDottedKeysAndHandlesCommas) {
  auto r = parse_keyval("driver=raw,file.filename=a,,b.img,file.cache.direct=on");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)["driver"], "raw");
  EXPECT_EQ((*r)["file"]["filename"], "a,b.img");
  EXPECT_EQ((*r)["file"]["cache"]["direct"], "on");
  auto implied = parse_keyval("a.img,driver=raw", "file");
  ASSERT_TRUE(implied.ok());
  EXPECT_EQ((*implied)["file"], "a.img");
  EXPECT_FALSE(parse_keyval("driver=raw,oops").ok());
  EXPECT_FALSE(parse_keyval("a=1,a.b=2").ok());
}

// QEMU's keyval rules (qemu-storage-daemon --blockdev 'driver=null-co,x..y=1'
// says "Invalid parameter 'x..y'"), and a bound on nesting: a key of 5,000
// dots once nested the options 5,000 levels deep and overflowed the stack of
// whatever walked them (found by the options fuzzer).
TEST(ParseKeyval, KeysFollowQemuRulesAndNestBoundedly) {
  auto msg = [](const std::string& text) {
    auto r = parse_keyval(text);
    return r.ok() ? std::string("ok") : r.error().what();
  };
  EXPECT_EQ(msg("driver=null-co,x..y=1"), "Invalid parameter 'x..y'");
  EXPECT_EQ(msg("driver=null-co,x.1y=1"), "Invalid parameter 'x.1y'");
  EXPECT_EQ(msg("driver=null-co,x.y$=1"), "Invalid parameter 'x.y$'");
  EXPECT_EQ(msg("1x=1"), "Invalid parameter '1x'");
  EXPECT_EQ(msg("file.=1"), "Invalid parameter 'file.'");
  EXPECT_EQ(msg("a.0.b=1"), "ok");  // list indices after the first fragment
  EXPECT_EQ(msg("x-perf.max_chunk=1"), "ok");
  EXPECT_EQ(msg(std::string(128, 'a') + "=1"), "Parameter '" + std::string(128, 'a') + "' is too long");
  EXPECT_EQ(msg("f." + std::string(128, 'a') + "=1"), "Parameter fragment '" + std::string(128, 'a') + "' is too long");
  std::string deep;
  for (int i = 0; i < 1024; ++i) deep += i ? ".a" : "a";
  EXPECT_EQ(msg(deep + "=1"), "ok");
  EXPECT_EQ(msg(deep + ".a=1").find("nests deeper than 1024 levels") != std::string::npos, true);
}

TEST(TakeOptions, AcceptStringsAndTypedValues) {
  Json o = {{"a", "on"}, {"b", false}, {"c", "4k"}, {"d", 512}, {"e", "maybe"}};
  EXPECT_EQ(**take_bool(o, "a"), true);
  EXPECT_EQ(**take_bool(o, "b"), false);
  EXPECT_EQ(**take_size(o, "c"), 4096u);
  EXPECT_EQ(**take_size(o, "d"), 512u);
  EXPECT_FALSE(take_bool(o, "e").ok());
  EXPECT_TRUE(o.empty());  // every getter consumed its key
  EXPECT_FALSE(take_bool(o, "missing")->has_value());
}
