#include "socket_waiters.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace vblk::detail {

namespace {
bool is_out(IoRequest::Op op) {
  return op == IoRequest::Op::Send || op == IoRequest::Op::SendMsg || op == IoRequest::Op::Connect;
}
}  // namespace

SocketWaiters::SocketWaiters(bool nonblocking_accept) : nonblocking_accept_(nonblocking_accept) {
  ep_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep_ < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
}

SocketWaiters::~SocketWaiters() { ::close(ep_); }

IoRequest*& SocketWaiters::slot(Waiters& w, const IoRequest* r) { return is_out(r->op) ? w.out : w.in; }

bool SocketWaiters::park(IoRequest* r) {
  if (try_now(r)) return true;
  ++parked_;
  slot(waiting_[r->fd], r) = r;
  settle(r->fd);
  return false;
}

void SocketWaiters::settle(int fd) {
  auto it = waiting_.find(fd);
  if (it == waiting_.end()) return;
  const Waiters& w = it->second;
  if (!w.in && !w.out) {
    ::epoll_ctl(ep_, EPOLL_CTL_DEL, fd, nullptr);
    waiting_.erase(it);
    return;
  }
  epoll_event ev{};
  ev.events = (w.in ? EPOLLIN : 0u) | (w.out ? EPOLLOUT : 0u) | EPOLLONESHOT;
  ev.data.fd = fd;
  if (::epoll_ctl(ep_, EPOLL_CTL_MOD, fd, &ev) < 0) ::epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev);
}

bool SocketWaiters::try_now(IoRequest* r) const {
  long ret = 0;
  switch (r->op) {
    case IoRequest::Op::Recv: ret = ::recv(r->fd, r->buf, r->len, r->flags | MSG_DONTWAIT); break;
    case IoRequest::Op::Send: ret = ::send(r->fd, r->buf, r->len, r->flags | MSG_DONTWAIT); break;
    case IoRequest::Op::SendMsg:
      ret = ::sendmsg(r->fd, static_cast<const msghdr*>(r->buf), r->flags | MSG_DONTWAIT);
      break;
    case IoRequest::Op::RecvMsg: ret = ::recvmsg(r->fd, static_cast<msghdr*>(r->buf), r->flags | MSG_DONTWAIT); break;
    case IoRequest::Op::ReadStream: ret = ::read(r->fd, r->buf, r->len); break;
    case IoRequest::Op::Accept: {
      // The listener may be a blocking socket: look before accepting.
      pollfd p{r->fd, POLLIN, 0};
      if (::poll(&p, 1, 0) == 0) return false;
      ret = ::accept4(r->fd, nullptr, nullptr, SOCK_CLOEXEC | (nonblocking_accept_ ? SOCK_NONBLOCK : 0));
      // A listener that was shut down (a server stopping wakes its accept
      // so) polls as hung up while accept4 on a non-blocking one keeps
      // answering EAGAIN: end the accept instead of waiting forever (the
      // loop spun here, and `quit` never finished, without io_uring).
      if (ret < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && (p.revents & (POLLHUP | POLLERR))) {
        r->result = -EINVAL;
        return true;
      }
      break;
    }
    case IoRequest::Op::Connect:
      // Non-blocking sockets only (the epoll backend's): start, then wait
      // for writability and read the verdict.
      if (r->flags == 0) {
        ret = ::connect(r->fd, r->addr, r->addrlen);
        if (ret < 0 && (errno == EINPROGRESS || errno == EAGAIN)) {
          r->flags = 1;
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
    default: r->result = -EINVAL; return true;
  }
  if (ret < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
  r->result = ret < 0 ? -errno : ret;
  return true;
}

}  // namespace vblk::detail
