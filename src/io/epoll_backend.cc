// Fallback backend when io_uring is unavailable: sockets are non-blocking and
// retried on readiness (one reader and one writer per fd at a time, which is
// how vblk uses sockets); file I/O never reaches here (the loop routes it to
// the thread pool).
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <unordered_map>

#include "io/backend.h"
#include "io/thread_pool.h"

namespace vblk::detail {
namespace {

class EpollBackend final : public Backend {
 public:
  EpollBackend(Loop& loop, ThreadPool& pool) : loop_(loop), pool_(pool) {
    ep_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (ep_ < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = -1;  // the pool's eventfd
    ::epoll_ctl(ep_, EPOLL_CTL_ADD, pool_.event_fd(), &ev);
  }
  ~EpollBackend() override { ::close(ep_); }

  bool is_uring() const override { return false; }
  bool wants_nonblocking_sockets() const override { return true; }

  void submit(IoRequest* r) override {
    if (try_now(r)) {
      complete(loop_, r);
      return;
    }
    auto& w = waiting_[r->fd];
    bool out = r->op == IoRequest::Op::Send || r->op == IoRequest::Op::SendMsg || r->op == IoRequest::Op::Connect;
    (out ? w.out : w.in) = r;
    rearm(r->fd, w);
  }

  void wait(int64_t timeout_ns) override {
    epoll_event evs[64];
    int ms = timeout_ns < 0 ? -1 : static_cast<int>((timeout_ns + 999999) / 1000000);
    int n = ::epoll_wait(ep_, evs, 64, ms);
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == -1) {
        pool_.ack();
        pool_event(loop_);
        continue;
      }
      auto it = waiting_.find(fd);
      if (it == waiting_.end()) continue;
      Waiters w = it->second;
      it->second = {};
      // Retry each waiter; the ones still blocked are re-registered.
      for (IoRequest* r : {w.in, w.out}) {
        if (!r) continue;
        if (try_now(r)) {
          complete(loop_, r);
        } else {
          auto& slot = waiting_[fd];
          bool out = r->op == IoRequest::Op::Send || r->op == IoRequest::Op::SendMsg || r->op == IoRequest::Op::Connect;
          (out ? slot.out : slot.in) = r;
        }
      }
      auto& slot = waiting_[fd];
      if (!slot.in && !slot.out) {
        ::epoll_ctl(ep_, EPOLL_CTL_DEL, fd, nullptr);
        waiting_.erase(fd);
      } else {
        rearm(fd, slot);
      }
    }
  }

 private:
  struct Waiters {
    IoRequest* in = nullptr;
    IoRequest* out = nullptr;
    bool registered = false;
  };

  void rearm(int fd, Waiters& w) {
    epoll_event ev{};
    ev.events = (w.in ? EPOLLIN : 0u) | (w.out ? EPOLLOUT : 0u) | EPOLLONESHOT;
    ev.data.fd = fd;
    if (::epoll_ctl(ep_, EPOLL_CTL_MOD, fd, &ev) < 0) ::epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev);
    w.registered = true;
  }

  // Performs the socket call; false if it would block (request stays queued).
  static bool try_now(IoRequest* r) {
    long ret = 0;
    switch (r->op) {
      case IoRequest::Op::Recv:
        ret = ::recv(r->fd, r->buf, r->len, r->flags | MSG_DONTWAIT);
        break;
      case IoRequest::Op::Send:
        ret = ::send(r->fd, r->buf, r->len, r->flags | MSG_DONTWAIT);
        break;
      case IoRequest::Op::SendMsg:
        ret = ::sendmsg(r->fd, static_cast<const msghdr*>(r->buf), r->flags | MSG_DONTWAIT);
        break;
      case IoRequest::Op::Accept:
        ret = ::accept4(r->fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        break;
      case IoRequest::Op::Connect:
        if (r->flags == 0) {
          ret = ::connect(r->fd, r->addr, r->addrlen);
          if (ret < 0 && (errno == EINPROGRESS || errno == EAGAIN)) {
            r->flags = 1;  // connection in progress: wait for writability
            return false;
          }
        } else {
          int err = 0;
          socklen_t len = sizeof err;
          ::getsockopt(r->fd, SOL_SOCKET, SO_ERROR, &err, &len);
          r->result = err ? -err : 0;
          return true;
        }
        break;
      default:
        r->result = -EINVAL;
        return true;
    }
    if (ret < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    r->result = ret < 0 ? -errno : ret;
    return true;
  }

  Loop& loop_;
  ThreadPool& pool_;
  int ep_ = -1;
  std::unordered_map<int, Waiters> waiting_;
};

}  // namespace

std::unique_ptr<Backend> make_epoll_backend(Loop& loop, ThreadPool& pool) {
  return std::make_unique<EpollBackend>(loop, pool);
}

}  // namespace vblk::detail
