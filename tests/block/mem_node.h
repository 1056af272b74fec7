// MemNode: an in-memory test driver with configurable limits that records
// what the generic layer hands it, so tests can check padding, splitting,
// FUA emulation and zero fallbacks.
#pragma once

#include <cstring>
#include <vector>

#include "vblk/node.h"

namespace vblk::testing {

class MemNode : public Node {
 public:
  struct Req {
    char op;  // 'r' 'w' 'z' 'd' 'f'
    uint64_t offset, bytes;
    uint32_t flags;
  };

  MemNode(Loop& loop, uint64_t size, BlockLimits lim = {}, NodeCaps caps = {}) : Node(loop, "mem"), data_(size) {
    limits_ = lim;
    caps_ = caps;
    set_length(size);
  }

  std::vector<uint8_t>& data() { return data_; }
  std::vector<Req> reqs;
  // Each request suspends once so concurrent requests really interleave.
  bool yield_in_io = true;
  int fail_writes_errno = 0;

 protected:
  Task<void> maybe_yield() {
    if (yield_in_io) co_await loop().yield();
  }
  // max_transfer bounds reads and writes (write-zeroes has max_zeroes).
  void check_clean(uint64_t offset, uint64_t bytes, const void* buf) {
    aligned_ok &= offset % limits_.request_alignment == 0 && bytes % limits_.request_alignment == 0;
    if (buf) aligned_ok &= reinterpret_cast<uintptr_t>(buf) % limits_.buffer_alignment == 0;
    if (limits_.max_transfer && buf) aligned_ok &= bytes <= limits_.max_transfer;
    if (limits_.max_zeroes && !buf) aligned_ok &= bytes <= limits_.max_zeroes;
  }
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override {
    check_clean(offset, buf.size(), buf.data());
    reqs.push_back({'r', offset, buf.size(), flags});
    co_await maybe_yield();
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = offset + i < data_.size() ? data_[offset + i] : 0;
    co_return Status{};
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    check_clean(offset, buf.size(), buf.data());
    reqs.push_back({'w', offset, buf.size(), flags});
    co_await maybe_yield();
    if (fail_writes_errno) co_return Error(fail_writes_errno);
    if (offset + buf.size() > data_.size()) data_.resize(offset + buf.size());
    std::memcpy(data_.data() + offset, buf.data(), buf.size());
    co_return Status{};
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    check_clean(offset, bytes, nullptr);
    reqs.push_back({'z', offset, bytes, flags});
    co_await maybe_yield();
    std::memset(data_.data() + offset, 0, bytes);
    co_return Status{};
  }
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    reqs.push_back({'d', offset, bytes, 0});
    std::memset(data_.data() + offset, 0, bytes);
    co_return Status{};
  }
  Task<Status> do_flush() override {
    reqs.push_back({'f', 0, 0, 0});
    co_return Status{};
  }

 public:
  bool aligned_ok = true;

 private:
  std::vector<uint8_t> data_;
};

}  // namespace vblk::testing
