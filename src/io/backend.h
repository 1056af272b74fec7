// Backend: how a Loop waits for I/O. Two implementations:
//  - UringBackend: io_uring for files and sockets, batched submission.
//  - EpollBackend: the fallback; sockets by readiness (non-blocking retries),
//    file I/O always goes to the thread pool.
// Both watch the thread pool's eventfd so pool completions wake the loop.
#pragma once

#include <memory>
#include <string>

#include "vblk/loop.h"

namespace vblk::detail {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual bool is_uring() const = 0;
  // Queue a request (never Blocking or thread-mode file ops).
  virtual void submit(IoRequest* req) = 0;
  // Submit what is queued and wait up to timeout_ns (-1: forever, 0: poll).
  virtual void wait(int64_t timeout_ns) = 0;
  // Sockets must be non-blocking for this backend.
  virtual bool wants_nonblocking_sockets() const = 0;

 protected:
  static void complete(Loop& l, IoRequest* r) { l.complete(r); }
  static void pool_event(Loop& l);
};

// Returns nullptr and fills why if io_uring cannot be set up.
std::unique_ptr<Backend> make_uring_backend(Loop& loop, ThreadPool& pool, unsigned entries, std::string& why);
std::unique_ptr<Backend> make_epoll_backend(Loop& loop, ThreadPool& pool);

}  // namespace vblk::detail
