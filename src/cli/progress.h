// qemu-img's progress meter: "    (12.34/100%)\r" on stdout, printed when the
// value moved by more than min_skip percent, and a newline at the end.
#pragma once

#include <cstdio>

namespace vblk::cli {

class Progress {
 public:
  Progress(bool enabled, float min_skip) : enabled_(enabled), min_skip_(min_skip) {}
  // Adds delta percent of max (qemu_progress_print semantics); max 0 sets
  // the meter to delta.
  void print(float delta, int max) {
    if (!enabled_) return;
    current_ = max == 0 ? delta : current_ + (delta / 100) * static_cast<float>(max);
    if (current_ > 100) current_ = 100;
    if (current_ > last_ + min_skip_ || current_ < last_ - min_skip_ || current_ == 100 || current_ == 0) {
      last_ = current_;
      std::printf("    (%3.2f/100%%)\r", static_cast<double>(current_));
      std::fflush(stdout);
    }
  }
  void end() {
    if (!enabled_) return;
    std::printf("\n");
    std::fflush(stdout);
  }
  bool enabled() const { return enabled_; }

 private:
  bool enabled_;
  float min_skip_;
  float current_ = 0;
  float last_ = 0;
};

}  // namespace vblk::cli
