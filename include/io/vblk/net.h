// Sockets for the event loop: listening and connecting on unix and TCP
// addresses, and exact-length send/receive helpers as coroutines.
//
// Ownership: Fd closes its descriptor on destruction. Thread-safety: one loop.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "vblk/loop.h"
#include "vblk/result.h"
#include "vblk/task.h"

namespace vblk {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset();

 private:
  int fd_ = -1;
};

// Listening sockets (bound and listening; loopback by default for TCP).
Result<Fd> listen_unix(Loop& loop, const std::string& path);
Result<Fd> listen_tcp(Loop& loop, const std::string& host, uint16_t port);
// Port a TCP socket is bound to (for port 0 listeners in tests).
Result<uint16_t> local_port(int fd);

Task<Result<Fd>> accept_socket(Loop& loop, int listen_fd);
Task<Result<Fd>> connect_unix(Loop& loop, const std::string& path);
Task<Result<Fd>> connect_tcp(Loop& loop, const std::string& host, uint16_t port);

// Sends all of buf; fails with EPIPE/ECONNRESET etc. if the peer goes away.
// `flags` are send(2)'s (MSG_MORE to keep a header with the payload after it).
Task<Status> send_all(Loop& loop, int fd, std::span<const uint8_t> buf, int flags = MSG_NOSIGNAL);
// Receives exactly buf.size() bytes; ECONNRESET-style error or ENODATA on EOF.
Task<Status> recv_exact(Loop& loop, int fd, std::span<uint8_t> buf);

}  // namespace vblk
