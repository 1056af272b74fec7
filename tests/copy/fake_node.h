// FakeNode: a deterministic in-memory driver for block-copy tests. Block
// status comes from a settable extent list, every request can take a fixed
// latency (a loop timer, so many requests overlap), chosen requests fail, and
// every request is recorded with its start and end time; a Concurrency shared
// between nodes records how many requests were in flight at once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include <functional>

#include "vblk/node.h"

namespace vblk::testing {

struct Concurrency {
  int now = 0, peak = 0;
};

class FakeNode : public Node {
 public:
  struct Extent {
    uint64_t offset, bytes;
    uint32_t flags;  // kStatusData / kStatusZero / 0 (unallocated)
  };
  struct Op {
    char op;  // 'r' read, 'w' write, 'z' write_zeroes, 'c' copy_range (source side)
    uint64_t offset, bytes;
    uint32_t flags;
    uint64_t start_ns, end_ns;
  };
  struct Fault {
    char op;  // 'r', 'w', 'z' or 'c'
    uint64_t offset, bytes;
    int err;
    bool once;
  };

  FakeNode(Loop& loop, uint64_t size, Concurrency* conc = nullptr) : Node(loop, "fake"), data_(size), conc_(conc) {
    caps_.zeroes = true;
    caps_.discard = true;
    set_length(size);
  }

  std::vector<uint8_t>& data() { return data_; }
  NodeCaps& mutable_caps() { return caps_; }

  std::vector<Extent> extents;  // sorted; gaps are data
  uint64_t latency_ns = 0;      // 0: each request still yields once
  std::vector<Fault> faults;
  std::vector<Op> ops;
  int copy_range_errno = ENOTSUP;  // 0: copy_range works (into a FakeNode)
  int copy_range_calls = 0;

  // Requests of kind op that overlap [offset, offset+bytes).
  int count(char op, uint64_t offset, uint64_t bytes) const {
    int n = 0;
    for (auto& o : ops)
      if (o.op == op && o.offset < offset + bytes && offset < o.offset + o.bytes) ++n;
    return n;
  }

 protected:
  Task<Status> io(char op, uint64_t offset, uint64_t bytes, uint32_t flags) {
    size_t idx = ops.size();
    ops.push_back({op, offset, bytes, flags, Loop::now_ns(), 0});
    if (conc_) conc_->peak = std::max(conc_->peak, ++conc_->now);
    if (latency_ns) {
      co_await loop().sleep(std::chrono::nanoseconds(latency_ns));
    } else {
      co_await loop().yield();
    }
    if (conc_) --conc_->now;
    ops[idx].end_ns = Loop::now_ns();
    for (size_t i = 0; i < faults.size(); ++i) {
      Fault f = faults[i];
      if (f.op == op && f.offset < offset + bytes && offset < f.offset + f.bytes) {
        if (f.once) faults.erase(faults.begin() + static_cast<long>(i));
        co_return Error(f.err);
      }
    }
    co_return Status{};
  }

  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override {
    VBLK_CO_TRY(co_await io('r', offset, buf.size(), flags));
    std::memcpy(buf.data(), data_.data() + offset, buf.size());
    co_return Status{};
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    VBLK_CO_TRY(co_await io('w', offset, buf.size(), flags));
    std::memcpy(data_.data() + offset, buf.data(), buf.size());
    co_return Status{};
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    VBLK_CO_TRY(co_await io('z', offset, bytes, flags));
    std::memset(data_.data() + offset, 0, bytes);
    co_return Status{};
  }
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override {
    for (auto& e : extents) {
      if (offset >= e.offset + e.bytes) continue;
      if (offset < e.offset) {  // in a gap before e: data
        co_return BlockStatus{.flags = kStatusData, .bytes = std::min(bytes, e.offset - offset)};
      }
      co_return BlockStatus{.flags = e.flags, .bytes = std::min(bytes, e.offset + e.bytes - offset)};
    }
    co_return BlockStatus{.flags = kStatusData, .bytes = bytes};
  }
  Task<Status> do_copy_range_to(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes,
                                uint32_t flags) override {
    ++copy_range_calls;
    if (copy_range_errno) co_return Error(copy_range_errno);
    VBLK_CO_TRY(co_await io('c', offset, bytes, flags));
    auto& d = dynamic_cast<FakeNode&>(dst);
    std::memcpy(d.data_.data() + dst_offset, data_.data() + offset, bytes);
    d.ops.push_back({'c', dst_offset, bytes, flags, Loop::now_ns(), Loop::now_ns()});
    co_return Status{};
  }

 private:
  std::vector<uint8_t> data_;
  Concurrency* conc_;
};

// A recognisable, position-dependent pattern.
inline void fill_pattern(FakeNode& n, uint8_t seed) {
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
