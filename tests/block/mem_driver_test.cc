// MemNode (src/block/drivers/mem.cc), the in-memory protocol node of the
// tests and fuzz targets: flushes that overlap (an NBD client may have
// several in flight) each make durable what completed before they were
// issued, and nothing else goes wrong (the second one used to apply
// entries the first had already taken off its list: found by
// fuzz_nbd_server, a heap-use-after-free).
#include <gtest/gtest.h>

#include <vector>

#include "vblk/mem_node.h"
#include "vblk/sync.h"

using namespace vblk;

TEST(MemDriver, OverlappingFlushes) {
  Loop loop;
  MemNode::Options o;
  o.size = 4096;
  auto n = std::make_shared<MemNode>(loop, o);
  std::vector<uint8_t> a(512, 0xaa), b(512, 0xbb);
  loop.run([](MemNode& n, std::vector<uint8_t>& a, std::vector<uint8_t>& b) -> Task<void> {
    Status st = co_await n.write(0, a);
    EXPECT_TRUE(st);
    st = co_await n.write(512, a);
    EXPECT_TRUE(st);
    WaitGroup wg(n.loop());
    auto flush = [](MemNode& n, WaitGroup& wg) -> Task<void> {
      Status st = co_await n.flush();
      EXPECT_TRUE(st);
      wg.done();
    };
    wg.add(2);
    spawn_detached(flush(n, wg));  // covers both writes
    spawn_detached(flush(n, wg));  // covers them too; the first takes them off
    co_await wg.wait();
    st = co_await n.write(1024, b);
    EXPECT_TRUE(st);
    st = co_await n.flush();
    EXPECT_TRUE(st);
  }(*n, a, b));
  const auto durable = n->power_cut(MemNode::CutMode::Drop, 0);
  ASSERT_EQ(durable.size(), 4096u);
  EXPECT_EQ(durable[0], 0xaa);
  EXPECT_EQ(durable[1023], 0xaa);
  EXPECT_EQ(durable[1024], 0xbb);
  EXPECT_EQ(durable[1536], 0);
}
