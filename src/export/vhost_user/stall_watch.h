// Tells a stalled virtqueue from an idle one, and says whose side it
// stalled on. A guest whose I/O hangs on a vhost-user disk may be waiting
// for the daemon (a request popped and never completed, or made available
// and never popped: a kick not seen) or for its own front end (completions
// published and signalled, never consumed: an interrupt lost between the
// call eventfd and the guest — QEMU 7.2 under TCG loses some with
// EVENT_IDX on). Sampled periodically; when a queue with work outstanding
// has not moved for the limit, one report with both sides' ring indices,
// and one more when it moves again.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "vhost_user/virtqueue.h"

namespace vblk::vhost {

// What the back end did on one queue, counted since it started.
struct QueueActivity {
  uint64_t popped = 0;
  uint64_t completed = 0;
  uint64_t signalled = 0;  // call eventfd writes
  uint64_t in_flight = 0;  // popped, not completed (the queue's WaitGroup)
};

class StallWatch {
 public:
  using Clock = std::chrono::steady_clock;
  explicit StallWatch(Clock::duration limit) : limit_(limit) {}

  // A line to log when a stall is found or ends; nothing otherwise.
  std::optional<std::string> check(Clock::time_point now, const QueueActivity& a, const RingState& r);
  // The queue restarted: forget what was seen.
  void reset() { seen_ = false; }

 private:
  Clock::duration limit_;
  bool seen_ = false;
  bool reported_ = false;
  Clock::time_point since_;
  struct Seen : QueueActivity {
    uint16_t avail_idx = 0;
    uint16_t used_event = 0;
  };
  Seen last_{};
};

}  // namespace vblk::vhost
