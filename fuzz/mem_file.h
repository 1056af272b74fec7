// MemFile: an in-memory protocol node holding a fuzz input as the image file.
//
// Unlike tests/block/mem_node.h (which records requests for the generic-layer
// tests), this one is built for hostile drivers above it: it grows on writes
// past the end like a regular file, bounds that growth (a corrupt table can
// point allocations at exabyte offsets), and answers every range safely.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "vblk/node.h"

namespace vblk::fuzz {

class MemFile : public Node {
 public:
  // Writes that would grow the file past this fail with ENOSPC.
  static constexpr uint64_t kMaxSize = 64ull << 20;

  MemFile(Loop& loop, const uint8_t* data, size_t size) : Node(loop, "mem"), data_(data, data + size) {
    caps_.zeroes = true;
    caps_.discard = true;
    set_length(size);
  }
  std::vector<uint8_t>& data() { return data_; }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t) override {
    std::fill(buf.begin(), buf.end(), 0);
    if (offset < data_.size()) {
      uint64_t n = std::min<uint64_t>(buf.size(), data_.size() - offset);
      std::memcpy(buf.data(), data_.data() + offset, n);
    }
    co_return Status{};
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t) override {
    if (!grow(offset, buf.size())) co_return Error(ENOSPC);
    std::memcpy(data_.data() + offset, buf.data(), buf.size());
    co_return Status{};
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t) override {
    if (!grow(offset, bytes)) co_return Error(ENOSPC);
    std::memset(data_.data() + offset, 0, bytes);
    co_return Status{};
  }
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    if (offset < data_.size()) {
      uint64_t n = std::min<uint64_t>(bytes, data_.size() - offset);
      std::memset(data_.data() + offset, 0, n);
    }
    co_return Status{};
  }
  Task<Status> do_flush() override { co_return Status{}; }
  Task<Status> do_truncate(uint64_t length, bool) override {
    if (length > kMaxSize) co_return Error(ENOSPC);
    data_.resize(length);
    set_length(length);
    co_return Status{};
  }

 private:
  bool grow(uint64_t offset, uint64_t bytes) {
    if (offset > kMaxSize || bytes > kMaxSize - offset) return false;
    if (offset + bytes > data_.size()) {
      data_.resize(offset + bytes);
      set_length(offset + bytes);
    }
    return true;
  }
  std::vector<uint8_t> data_;
};

}  // namespace vblk::fuzz
