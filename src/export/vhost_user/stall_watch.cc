#include "vhost_user/stall_watch.h"

namespace vblk::vhost {

namespace {

std::string seconds(StallWatch::Clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(d).count()) + " s";
}

}  // namespace

std::optional<std::string> StallWatch::check(Clock::time_point now, const QueueActivity& a, const RingState& r) {
  // Either side: the driver adding requests or consuming completions
  // (used_event moves with EVENT_IDX), the daemon popping or completing.
  bool moved = !seen_ || a.popped != last_.popped || a.completed != last_.completed || r.avail_idx != last_.avail_idx ||
               r.used_event != last_.used_event;
  seen_ = true;
  static_cast<QueueActivity&>(last_) = a;
  last_.avail_idx = r.avail_idx;
  last_.used_event = r.used_event;
  if (moved) {
    auto still = now - since_;
    since_ = now;
    if (!reported_) return std::nullopt;
    reported_ = false;
    return "moving again after " + seconds(still);
  }
  if (reported_ || now - since_ < limit_) return std::nullopt;

  // Whose move it is. The daemon's first: what it holds, then what it was
  // given and did not take; only then the driver's.
  std::string verdict;
  if (a.in_flight)
    verdict = std::to_string(a.in_flight) + " request(s) popped and not completed (the daemon's side: its node)";
  else if (r.avail_idx != r.last_avail)
    verdict = std::to_string(static_cast<uint16_t>(r.avail_idx - r.last_avail)) +
              " request(s) available and not popped (a kick the daemon did not see, or none was sent)";
  else if (r.event_idx && r.used_event != r.used_idx && a.signalled)
    verdict = "every request completed and signalled; the driver has consumed completions only up to " +
              std::to_string(r.used_event) + " of " + std::to_string(r.used_idx) +
              " (an interrupt lost on the front end's side)";
  if (verdict.empty()) return std::nullopt;  // idle, as far as the daemon can tell
  reported_ = true;
  return "stalled for " + seconds(now - since_) + ": " + verdict + "; " + to_string(r) + "; popped " +
         std::to_string(a.popped) + ", completed " + std::to_string(a.completed) + ", interrupts " +
         std::to_string(a.signalled);
}

}  // namespace vblk::vhost
