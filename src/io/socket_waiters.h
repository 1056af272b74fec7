// SocketWaiters: socket operations waiting for their peer, parked in an
// epoll set instead of in the kernel's I/O queue.
//
// A socket op may wait forever (an idle client's next request, a client
// that never reads its replies). io_uring keeps such an op in the ring and
// it holds a completion-queue slot all that time; the epoll fallback has no
// slots at all. The uring backend therefore admits only a bounded number of
// peer waits into the ring and parks the rest here, and the epoll backend
// parks every socket op here: a parked op costs one epoll registration,
// nothing the other I/O needs. Ops are tried at once without blocking
// (MSG_DONTWAIT, or a zero-timeout poll before accept), then retried when
// epoll reports the socket ready (EPOLLONESHOT, one reader and one writer
// per fd at a time, which is how vblk uses sockets).
#pragma once

#include <sys/epoll.h>

#include <unordered_map>

#include "vblk/loop.h"

namespace vblk::detail {

class SocketWaiters {
 public:
  // nonblocking_accept: accepted sockets get O_NONBLOCK (the epoll backend
  // needs it; io_uring works best with blocking sockets).
  explicit SocketWaiters(bool nonblocking_accept);
  ~SocketWaiters();
  SocketWaiters(const SocketWaiters&) = delete;
  SocketWaiters& operator=(const SocketWaiters&) = delete;

  // The epoll fd: readable when a parked op may go on.
  int fd() const { return ep_; }
  size_t parked() const { return parked_; }

  // Tries r now; true when it is done (r->result set), false when parked.
  bool park(IoRequest* r);
  // Retries the ops of the sockets in evs (from epoll_wait on fd(); events
  // whose data.fd is negative are the caller's); done ones go to complete.
  template <class F>
  void dispatch(const epoll_event* evs, int n, F&& complete) {
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd < 0) continue;
      auto it = waiting_.find(fd);
      if (it == waiting_.end()) continue;
      Waiters w = it->second;
      it->second = {};
      for (IoRequest* r : {w.in, w.out}) {
        if (!r) continue;
        if (try_now(r)) {
          --parked_;
          complete(r);
        } else {
          slot(waiting_[fd], r) = r;
        }
      }
      settle(fd);
    }
  }

 private:
  struct Waiters {
    IoRequest* in = nullptr;
    IoRequest* out = nullptr;
  };
  static IoRequest*& slot(Waiters& w, const IoRequest* r);
  bool try_now(IoRequest* r) const;
  // Re-registers fd for what its waiters wait for, or forgets it.
  void settle(int fd);

  int ep_ = -1;
  bool nonblocking_accept_;
  size_t parked_ = 0;
  std::unordered_map<int, Waiters> waiting_;
};

}  // namespace vblk::detail
