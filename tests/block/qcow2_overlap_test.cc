// The pieces of qcow2's overlap check (src/block/drivers/qcow2/overlap.cc):
// the option as QEMU parses it, and the sorted indexes compared with a
// brute-force scan of the same structures.
#include <gtest/gtest.h>

#include <random>

#include "block/drivers/qcow2/format.h"
#include "block/drivers/qcow2/overlap.h"

using namespace vblk;
using namespace vblk::qcow2;

namespace {

Result<uint32_t> parse(const std::string& keyval) {
  auto j = parse_keyval(keyval);
  EXPECT_TRUE(j.ok());
  Json o = *j;
  auto r = take_overlap_options(o);
  if (r) {
    EXPECT_TRUE(o.empty()) << o.dump();
  }
  return r;
}

TEST(Qcow2Overlap, Modes) {
  EXPECT_EQ(*parse(""), kOlCached);
  EXPECT_EQ(*parse("overlap-check=none"), 0u);
  EXPECT_EQ(*parse("overlap-check=constant"), kOlConstant);
  EXPECT_EQ(*parse("overlap-check=all"), kOlAll);
  EXPECT_EQ(*parse("overlap-check.template=constant"), kOlConstant);
  EXPECT_EQ(*parse("overlap-check.template=all,overlap-check.inactive-l2=off"), kOlCached);
  EXPECT_EQ(*parse("overlap-check.template=none,overlap-check.main-header=on"), kOlMainHeader);
  EXPECT_EQ(*parse("overlap-check.bitmap-directory=off"), kOlCached & ~kOlBitmapDirectory);
  // QMP spells them typed, as an alternate of a mode or the flags object.
  Json o = {{"overlap-check", {{"template", "cached"}, {"active-l2", false}}}};
  EXPECT_EQ(*take_overlap_options(o), kOlCached & ~kOlActiveL2);
  o = {{"overlap-check", "constant"}};
  EXPECT_EQ(*take_overlap_options(o), kOlConstant);
}

TEST(Qcow2Overlap, Errors) {
  EXPECT_EQ(parse("overlap-check=bar").error().message,
            "Unsupported value 'bar' for qcow2 option 'overlap-check'. Allowed are any of the following: none, "
            "constant, cached, all");
  EXPECT_EQ(parse("overlap-check.active-l1=maybe").error().message,
            "Parameter 'overlap-check.active-l1' expects 'on' or 'off'");
  EXPECT_EQ(parse("overlap-check.nope=on").error().message,
            "Block format 'qcow2' does not support the option 'overlap-check.nope'");
  Json o = {{"overlap-check", "none"}, {"overlap-check.template", "all"}};
  EXPECT_EQ(take_overlap_options(o).error().message,
            "Conflicting values for qcow2 options 'overlap-check' ('none') and 'overlap-check.template' ('all')");
}

TEST(Qcow2Overlap, OffsetTableCountsOffsetChangesOnly) {
  OffsetTable t(kL1OffsetMask);
  t.assign({0, 0x10000 | kOflagCopied});
  const uint64_t g = t.generation();
  t.set(1, 0x10000);  // a flag: the indexes stay valid
  EXPECT_EQ(t.generation(), g);
  t.set(0, 0x20000);
  EXPECT_NE(t.generation(), g);
}

TEST(Qcow2Overlap, ClusterSetMatchesScan) {
  std::mt19937_64 rng(7);
  const uint32_t bits = 16;
  for (int round = 0; round < 50; ++round) {
    std::vector<uint64_t> entries(rng() % 64);
    for (auto& e : entries) e = (rng() % 4 == 0) ? 0 : ((rng() % 200) << bits) | (rng() % 8 == 0 ? 512 : 0);
    ClusterSet s;
    s.rebuild(entries, kL1OffsetMask, bits);
    for (int q = 0; q < 200; ++q) {
      uint64_t first = rng() % 220, last = first + rng() % 4;
      bool want = false;
      for (uint64_t e : entries) {
        const uint64_t off = e & kL1OffsetMask;
        if (off && off < (last + 1) << bits && first << bits < off + (1ull << bits)) want = true;
      }
      EXPECT_EQ(s.hits(first, last), want) << first << ".." << last;
    }
  }
}

TEST(Qcow2Overlap, RangeSetMatchesScan) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::pair<uint64_t, uint64_t>> ranges(rng() % 20);
    RangeSet s;
    for (auto& r : ranges) {
      r = {rng() % 100000, rng() % 30000};
      s.add(r.first, r.second);
    }
    s.sort();
    for (int q = 0; q < 200; ++q) {
      uint64_t a = rng() % 140000, b = a + 1 + rng() % 5000;
      bool want = false;
      for (auto& r : ranges)
        if (r.second && r.first < b && a < r.first + r.second) want = true;
      EXPECT_EQ(s.hits(a, b), want) << a << ".." << b;
    }
  }
}

}  // namespace
