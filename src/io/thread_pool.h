// ThreadPool: worker threads that run blocking syscalls for a Loop.
//
// Used for file I/O when aio=threads (or when io_uring is unavailable) and for
// calls io_uring cannot do (copy_file_range, lseek). Workers are started on
// demand up to a cap. A finished request is queued for the loop and the loop's
// eventfd is signalled; the loop resumes the waiter on its own thread.
//
// Thread-safety: submit() and post() from the loop thread or any thread;
// take_completions() from the loop thread. Internally guarded by mu_.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "vblk/loop.h"

namespace vblk::detail {

class ThreadPool {
 public:
  explicit ThreadPool(unsigned max_threads);
  ~ThreadPool();

  // The eventfd the loop watches; readable when completions are waiting.
  int event_fd() const { return efd_; }

  void submit(IoRequest* req);
  void post(std::function<void()> fn);

  // Moves finished requests and posted functions out (loop thread).
  void take(std::vector<IoRequest*>& done, std::vector<std::function<void()>>& fns);
  // Clears the eventfd counter after a wakeup.
  void ack();

  static long execute(IoRequest* req);

 private:
  void worker();
  void signal();

  unsigned max_threads_;
  int efd_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoRequest*> queue_;               // guarded by mu_
  std::vector<IoRequest*> completed_;          // guarded by mu_
  std::vector<std::function<void()>> posted_;  // guarded by mu_
  std::vector<std::thread> threads_;           // guarded by mu_
  unsigned idle_ = 0;                          // guarded by mu_
  bool stopping_ = false;                      // guarded by mu_
};

}  // namespace vblk::detail
