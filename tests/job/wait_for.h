// Test helper: runs a loop until a condition holds or a timeout passes.
#pragma once

#include <chrono>
#include <functional>
#include <stop_token>

#include "vblk/loop.h"
#include "vblk/task.h"

namespace vblk::test {

// Runs `loop` until cond() holds or timeout_ms passed (a wakeable timer
// makes sure the loop looks again at the deadline); returns cond().
inline bool wait_for(Loop& loop, const std::function<bool()>& cond, int timeout_ms = 20000) {
  std::stop_source stop;
  bool fired = false;
  auto timer = [](Loop& l, int ms, std::stop_token t, bool& f) -> Task<void> {
    co_await l.sleep(std::chrono::milliseconds(ms), t);
    f = true;
  };
  spawn_detached(timer(loop, timeout_ms, stop.get_token(), fired));
  loop.run_until([&] { return cond() || fired; });
  stop.request_stop();
  loop.run_until([&] { return fired; });
  return cond();
}

}  // namespace vblk::test
