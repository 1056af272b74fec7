// StatusGroup: Task<Status> pieces of one request run together, the first
// error kept, at most `max_in_flight` at once (0: no bound). The owner
// awaits wait() before the pieces' buffers go away, even after an error.
// Used where one request fans out (qcow2's compressed reads, the copy
// engine's data and zero runs).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "vblk/result.h"
#include "vblk/sync.h"
#include "vblk/task.h"

namespace vblk {

class StatusGroup {
 public:
  explicit StatusGroup(Loop& loop, uint64_t max_in_flight = 0) : pending_(loop) {
    if (max_in_flight) slots_.emplace(loop, max_in_flight);
  }
  StatusGroup(const StatusGroup&) = delete;
  StatusGroup& operator=(const StatusGroup&) = delete;

  // Starts t now, once a slot is free.
  Task<void> spawn(Task<Status> t) {
    if (slots_) co_await slots_->acquire();
    pending_.add();
    spawn_detached(run(this, std::move(t)));
  }
  // Returns when every piece has ended.
  auto wait() { return pending_.wait(); }
  // Ok until a piece fails.
  bool ok() const { return static_cast<bool>(error_); }
  // The first error, or ok (after wait()).
  Status take_status() { return std::move(error_); }

 private:
  static Task<void> run(StatusGroup* g, Task<Status> t) {
    Status st = co_await std::move(t);
    if (!st && g->error_) g->error_ = std::move(st);
    if (g->slots_) g->slots_->release();
    g->pending_.done();
  }

  std::optional<CoSemaphore> slots_;
  WaitGroup pending_;
  Status error_;
};

}  // namespace vblk
