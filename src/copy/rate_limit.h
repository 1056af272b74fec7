// RateLimit: the block-copy speed limit as a byte debt that drains at
// `speed` bytes per second.
//
// The rule (from QEMU's block-copy rate limiting): a new chunk may start only
// while the debt is zero, and starting it adds its whole size at once. So the
// bytes started by any instant t never exceed speed * t plus one chunk, however
// many workers run in parallel. Idle time earns no credit (the debt never goes
// below zero), so there are no bursts after a pause. Copies that ignore the
// limit (copy-before-write) still add their bytes: the background copy then
// waits for them.
//
// Not thread-safe: one loop owns it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace vblk {

class RateLimit {
 public:
  // 0 = unlimited. The debt accrued so far keeps its byte value and drains
  // at the new speed from now on.
  void set_speed(uint64_t bytes_per_sec, uint64_t now_ns) {
    drain(now_ns);
    speed_ = bytes_per_sec;
    if (!speed_) debt_ = 0;
  }
  uint64_t speed() const { return speed_; }

  // Nanoseconds to wait before a new chunk may start (0: start now).
  uint64_t delay_ns(uint64_t now_ns) {
    if (!speed_) return 0;
    drain(now_ns);
    if (debt_ <= 0) return 0;
    long double ns = debt_ * 1e9L / static_cast<long double>(speed_);
    return std::max<uint64_t>(1, static_cast<uint64_t>(ns));
  }
  // Accounts bytes that started now.
  void account(uint64_t bytes, uint64_t now_ns) {
    if (!speed_) return;
    drain(now_ns);
    debt_ += static_cast<long double>(bytes);
  }

 private:
  void drain(uint64_t now_ns) {
    if (speed_ && now_ns > last_ns_) {
      debt_ -= static_cast<long double>(now_ns - last_ns_) * static_cast<long double>(speed_) / 1e9L;
      if (debt_ < 0) debt_ = 0;
    }
    last_ns_ = std::max(last_ns_, now_ns);
  }
  uint64_t speed_ = 0;
  long double debt_ = 0;  // bytes started but not yet "paid" for
  uint64_t last_ns_ = 0;
};

}  // namespace vblk
