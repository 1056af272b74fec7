// Reads a fuzz input as a sequence of choices (libFuzzer's
// FuzzedDataProvider in miniature, which the gcc builds do not have):
// each call takes bytes from the front; an exhausted input answers 0, so
// every input decodes to something and short inputs to short programs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace vblk::fuzz {

class Choices {
 public:
  explicit Choices(std::span<const uint8_t> d) : d_(d) {}
  bool empty() const { return pos_ >= d_.size(); }
  uint8_t byte() { return pos_ < d_.size() ? d_[pos_++] : 0; }
  // 0 .. n-1 (n > 0).
  size_t pick(size_t n) {
    size_t v = byte();
    if (n > 256) v = (v << 8) | byte();
    return v % n;
  }
  bool flag() { return byte() & 1; }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | byte();
    return v;
  }
  // Up to `max` raw bytes, length first.
  std::string bytes(size_t max) {
    // The length byte first: pick() moves pos_, so it must not share an
    // expression with what is left (argument order is unspecified).
    const size_t want = pick(max + 1);
    size_t n = std::min<size_t>(want, d_.size() - std::min(pos_, d_.size()));
    std::string s(reinterpret_cast<const char*>(d_.data()) + pos_, n);
    pos_ += n;
    return s;
  }

 private:
  std::span<const uint8_t> d_;
  size_t pos_ = 0;
};

}  // namespace vblk::fuzz
