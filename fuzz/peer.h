// The far end of a socketpair for the protocol fuzz targets: sends the fuzz
// input as the peer's whole byte stream, then half-closes, and reads and
// drops whatever the code under test sends back until it closes its end.
// It runs on the target's loop beside the code under test, so that code
// never waits on a full socket buffer, and each input ends with its stream.
#pragma once

#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <span>

#include "vblk/loop.h"
#include "vblk/net.h"
#include "vblk/sync.h"
#include "vblk/task.h"

namespace vblk::fuzz {

// A socketpair the loop's I/O can use (nonblocking only for the epoll
// fallback, as src/io/net.cc makes its sockets).
inline bool loop_socketpair(Loop& loop, Fd& a, Fd& b) {
  int flags = SOCK_STREAM | SOCK_CLOEXEC | (loop.has_io_uring() ? 0 : SOCK_NONBLOCK);
  int sv[2];
  if (::socketpair(AF_UNIX, flags, 0, sv) != 0) return false;
  a = Fd(sv[0]);
  b = Fd(sv[1]);
  return true;
}

class Peer {
 public:
  // Starts sending `input` (which must outlive the peer) on `fd` and
  // draining it; done() completes once the other end has closed.
  Peer(Loop& loop, Fd fd, std::span<const uint8_t> input) : loop_(loop), fd_(std::move(fd)), running_(loop) {
    running_.add();
    spawn_detached(send(this, input));
    running_.add();
    spawn_detached(drain(this));
  }
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  // Waits for both halves; then the peer may be destroyed.
  auto done() { return running_.wait(); }

 private:
  static Task<void> send(Peer* p, std::span<const uint8_t> input) {
    (void)co_await send_all(p->loop_, p->fd_.get(), input);
    ::shutdown(p->fd_.get(), SHUT_WR);
    p->running_.done();
  }
  static Task<void> drain(Peer* p) {
    std::array<uint8_t, 64 * 1024> buf;
    for (;;) {
      long n = co_await p->loop_.recv(p->fd_.get(), buf.data(), buf.size());
      if (n == -EINTR || n == -EAGAIN) continue;
      if (n <= 0) break;
    }
    // The other side is gone: a send still blocked on a full buffer fails.
    ::shutdown(p->fd_.get(), SHUT_RDWR);
    p->running_.done();
  }

  Loop& loop_;
  Fd fd_;
  WaitGroup running_;
};

}  // namespace vblk::fuzz
