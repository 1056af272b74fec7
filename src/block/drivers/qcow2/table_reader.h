// Reads a table of variable-length records (the snapshot table) from the
// image file a window at a time, so that each record's few small fields do
// not each cost a request: a table of 65,536 entries is hundreds of
// thousands of reads otherwise, on every open and every check.
//
// What a caller sees is what direct reads would give: the window reaches
// past the end of the file only where the file can be read there (a
// growable node: zeros), and a piece the window cannot serve (it crosses the
// end of the file, or filling the window failed) is read directly, so errors
// are reported for exactly the bytes asked for.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "vblk/node.h"
#include "vblk/task.h"

namespace vblk::qcow2 {

class TableReader {
 public:
  explicit TableReader(Node& file) : file_(file) {}

  Task<Status> read(uint64_t offset, std::span<uint8_t> out) {
    if (out.empty()) co_return Status{};
    if (!covers(offset, out.size())) co_await fill(offset, out.size());
    if (covers(offset, out.size())) {
      std::memcpy(out.data(), window_.data() + (offset - base_), out.size());
      co_return Status{};
    }
    co_return co_await file_.read(offset, out);
  }

 private:
  static constexpr uint64_t kWindow = 64 * 1024;

  bool covers(uint64_t offset, uint64_t n) const {
    return offset >= base_ && offset - base_ <= window_.size() && n <= window_.size() - (offset - base_);
  }

  Task<void> fill(uint64_t offset, uint64_t n) {
    window_.clear();
    const uint64_t begin = offset & ~uint64_t{4095};
    uint64_t end = begin + std::max(kWindow, offset + n - begin);
    if (!file_.growable()) end = std::min(end, file_.length());
    if (end <= begin || end - begin < offset + n - begin) co_return;
    std::vector<uint8_t> w(end - begin);
    if (auto st = co_await file_.read(begin, w); !st) co_return;
    window_ = std::move(w);
    base_ = begin;
  }

  Node& file_;
  uint64_t base_ = 0;
  std::vector<uint8_t> window_;
};

}  // namespace vblk::qcow2
