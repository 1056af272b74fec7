// Fallback backend when io_uring is unavailable: sockets are non-blocking and
// every socket op waits for readiness in SocketWaiters' epoll set (which is
// also where this backend sleeps); file I/O never reaches here (the loop
// routes it to the thread pool).
#include <sys/epoll.h>

#include "backend.h"
#include "socket_waiters.h"
#include "thread_pool.h"

namespace vblk::detail {
namespace {

class EpollBackend final : public Backend {
 public:
  EpollBackend(Loop& loop, ThreadPool& pool) : loop_(loop), pool_(pool), waiters_(true) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = -1;  // the pool's eventfd
    ::epoll_ctl(waiters_.fd(), EPOLL_CTL_ADD, pool_.event_fd(), &ev);
  }

  bool is_uring() const override { return false; }
  bool wants_nonblocking_sockets() const override { return true; }

  void submit(IoRequest* r) override {
    if (waiters_.park(r)) complete(loop_, r);
  }

  void wait(int64_t timeout_ns) override {
    epoll_event evs[64];
    int ms = timeout_ns < 0 ? -1 : static_cast<int>((timeout_ns + 999999) / 1000000);
    int n = ::epoll_wait(waiters_.fd(), evs, 64, ms);
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.fd == -1) {
        pool_.ack();
        pool_event(loop_);
      }
    }
    if (n > 0) waiters_.dispatch(evs, n, [this](IoRequest* r) { complete(loop_, r); });
  }

 private:
  Loop& loop_;
  ThreadPool& pool_;
  SocketWaiters waiters_;
};

}  // namespace

std::unique_ptr<Backend> make_epoll_backend(Loop& loop, ThreadPool& pool) {
  return std::make_unique<EpollBackend>(loop, pool);
}

}  // namespace vblk::detail
