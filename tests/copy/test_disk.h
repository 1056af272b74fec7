// The block-copy, backup and mirror tests' disks: MemNodes
// (include/block/vblk/mem_node.h) that record every request with its start and
// end time, offer zero writes and discard but not native FUA, and have a
// fixed size; plus the helpers those tests share.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "vblk/mem_node.h"

namespace vblk::testing {

using Concurrency = MemNode::Concurrency;

inline MemNode::Options disk_options(uint64_t size, Concurrency* conc = nullptr) {
  MemNode::Options o;
  o.size = size;
  o.max_size = size;
  o.record = true;
  o.caps = NodeCaps{.zeroes = true, .discard = true};
  o.concurrency = conc;
  return o;
}

inline std::shared_ptr<MemNode> test_disk(Loop& loop, uint64_t size, Concurrency* conc = nullptr) {
  return std::make_shared<MemNode>(loop, disk_options(size, conc));
}

// A recognisable, position-dependent pattern.
inline void fill_pattern(MemNode& n, uint8_t seed) {
  auto& d = n.data();
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<uint8_t>(seed + i * 7 + i / 4096);
}

// Runs the loop until pred() holds (with a safety timeout).
inline void run_until(Loop& loop, const std::function<bool()>& pred) {
  uint64_t deadline = Loop::now_ns() + 20'000'000'000ull;
  ASSERT_TRUE(loop.run_until([&] { return pred() || Loop::now_ns() > deadline; }));
  ASSERT_TRUE(pred()) << "timed out";
}

}  // namespace vblk::testing
