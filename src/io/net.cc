#include "vblk/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

namespace vblk {

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {

Result<Fd> new_socket(Loop& loop, int domain) {
  int flags = SOCK_STREAM | SOCK_CLOEXEC;
  // The epoll fallback retries on readiness and needs non-blocking sockets;
  // io_uring waits inside the kernel and works best with blocking ones.
  if (!loop.has_io_uring()) flags |= SOCK_NONBLOCK;
  int fd = ::socket(domain, flags, 0);
  if (fd < 0) return Error(errno, std::string("socket: ") + std::strerror(errno));
  return Fd(fd);
}

Result<sockaddr_un> unix_addr(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof a.sun_path) return Error(ENAMETOOLONG, "socket path too long: '" + path + "'");
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return a;
}

Result<sockaddr_storage> tcp_addr(const std::string& host, uint16_t port, socklen_t& len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string svc = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), svc.c_str(), &hints, &res);
  if (rc != 0) return Error(EINVAL, "address resolution failed for " + host + ": " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

// The kernel's maximum (net.core.somaxconn): clients beyond a server's
// connection limit wait here rather than being refused, as with qemu-nbd
// (SOMAXCONN when persistent or unlimited); a burst of connects must not
// be dropped while the accept loop catches up.
constexpr int kListenBacklog = SOMAXCONN;

void tune_tcp(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

Result<Fd> listen_unix(Loop& loop, const std::string& path) {
  auto addr = unix_addr(path);
  VBLK_TRY(addr);
  auto s = new_socket(loop, AF_UNIX);
  VBLK_TRY(s);
  ::unlink(path.c_str());
  if (::bind(s->get(), reinterpret_cast<sockaddr*>(&*addr), sizeof *addr) < 0)
    return Error(errno, "Failed to bind socket to " + path + ": " + std::strerror(errno));
  if (::listen(s->get(), kListenBacklog) < 0) return Error(errno, std::string("listen: ") + std::strerror(errno));
  return std::move(*s);
}

Result<Fd> listen_tcp(Loop& loop, const std::string& host, uint16_t port) {
  socklen_t len = 0;
  auto addr = tcp_addr(host, port, len);
  VBLK_TRY(addr);
  auto s = new_socket(loop, addr->ss_family);
  VBLK_TRY(s);
  int one = 1;
  ::setsockopt(s->get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s->get(), reinterpret_cast<sockaddr*>(&*addr), len) < 0)
    return Error(errno, "Failed to bind socket to " + host + ":" + std::to_string(port) + ": " + std::strerror(errno));
  if (::listen(s->get(), kListenBacklog) < 0) return Error(errno, std::string("listen: ") + std::strerror(errno));
  return std::move(*s);
}

Result<uint16_t> local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) < 0) return Error(errno);
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return Error(EINVAL, "not a TCP socket");
}

Task<Result<Fd>> accept_socket(Loop& loop, int listen_fd) {
  long r = co_await loop.accept(listen_fd);
  if (r < 0) co_return Error(static_cast<int>(-r));
  int fd = static_cast<int>(r);
  if (!loop.has_io_uring()) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0 && ss.ss_family != AF_UNIX) tune_tcp(fd);
  co_return Fd(fd);
}

Task<Result<Fd>> connect_unix(Loop& loop, const std::string& path) {
  auto addr = unix_addr(path);
  if (!addr) co_return addr.take_error();
  auto s = new_socket(loop, AF_UNIX);
  if (!s) co_return s.take_error();
  sockaddr_un a = *addr;
  long r = co_await loop.connect(s->get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  if (r < 0)
    co_return Error(static_cast<int>(-r),
                    "Failed to connect to '" + path + "': " + std::strerror(static_cast<int>(-r)));
  co_return std::move(*s);
}

Task<Result<Fd>> connect_tcp(Loop& loop, const std::string& host, uint16_t port) {
  socklen_t len = 0;
  auto addr = tcp_addr(host, port, len);
  if (!addr) co_return addr.take_error();
  auto s = new_socket(loop, addr->ss_family);
  if (!s) co_return s.take_error();
  sockaddr_storage a = *addr;
  long r = co_await loop.connect(s->get(), reinterpret_cast<sockaddr*>(&a), len);
  if (r < 0)
    co_return Error(static_cast<int>(-r), "Failed to connect to '" + host + ":" + std::to_string(port) +
                                              "': " + std::strerror(static_cast<int>(-r)));
  tune_tcp(s->get());
  co_return std::move(*s);
}

Task<Status> send_all(Loop& loop, int fd, std::span<const uint8_t> buf, int flags) {
  size_t done = 0;
  while (done < buf.size()) {
    long r = co_await loop.send(fd, buf.data() + done, buf.size() - done, flags | MSG_NOSIGNAL);
    if (r < 0) co_return Error(static_cast<int>(-r));
    if (r == 0) co_return Error(EPIPE);
    done += static_cast<size_t>(r);
  }
  co_return Status{};
}

Task<Status> recv_exact(Loop& loop, int fd, std::span<uint8_t> buf) {
  size_t done = 0;
  while (done < buf.size()) {
    long r = co_await loop.recv(fd, buf.data() + done, buf.size() - done, MSG_WAITALL);
    if (r < 0) co_return Error(static_cast<int>(-r));
    if (r == 0) co_return Error(ENODATA, "connection closed by peer");
    done += static_cast<size_t>(r);
  }
  co_return Status{};
}

}  // namespace vblk
