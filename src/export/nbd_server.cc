#include "vblk/nbd_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstdint>

#include "session.h"

namespace vblk::nbd {

Server::Server(Loop& loop, Options opts)
    : loop_(loop),
      opts_(opts),
      running_(loop),
      slot_free_(loop),
      inflight_budget_(loop, std::max<uint64_t>(opts.max_inflight_bytes, 2 * uint64_t{kMaxBufferSize})) {}

Server::~Server() = default;

Status Server::add_export(Export e) {
  if (exports_.count(e.name)) return Error(EEXIST, "Block export id '" + e.name + "' is already in use");
  // The wire carries sizes as uint64 that clients read as off_t: never
  // advertise one that turns negative (QEMU's nodes end at BDRV_MAX_LENGTH).
  if (e.node && e.node->length() > static_cast<uint64_t>(INT64_MAX)) return Error(EFBIG, "File too large");
  std::string name = e.name;
  // What an NBD export needs (QEMU's blk_exp_add): consistent reads, writes
  // if writable, and then a size nobody changes under the clients — in
  // two steps as QEMU takes them, so a conflict names the same culprit.
  const uint32_t perm = kPermConsistentRead | (e.writable ? kPermWrite : 0u);
  VBLK_TRY(e.node.set_perms(PermPair{perm, kPermAll}));
  VBLK_TRY(e.node.set_perms(PermPair{perm, kPermAll & ~kPermResize}));
  exports_[name] = std::make_shared<const Export>(std::move(e));
  return {};
}

bool Server::remove_export(const std::string& name) { return exports_.erase(name) > 0; }

std::shared_ptr<const Export> Server::find_export(const std::string& name) const {
  auto it = exports_.find(name);
  return it == exports_.end() ? nullptr : it->second;
}

Task<void> Server::serve(Fd listener) {
  running_.add();
  listeners_.push_back(listener.get());
  while (!stopping_) {
    // At the connection limit, later clients wait in the listen backlog (as
    // with qemu-nbd -e) until one of the open connections ends.
    while (opts_.max_connections && conns_.size() >= opts_.max_connections && !stopping_) {
      slot_free_.reset();
      co_await slot_free_.wait();
    }
    if (stopping_) break;
    auto c = co_await accept_socket(loop_, listener.get());
    if (!c) {
      if (stopping_) break;
      int e = c.error().code;
      // A client that gave up before we accepted it, or a transient shortage:
      // keep serving the others.
      if (e == ECONNABORTED || e == EINTR || e == EAGAIN || e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM)
          co_await loop_.sleep(std::chrono::milliseconds(10));
        continue;
      }
      break;
    }
    if (on_connect) on_connect();
    running_.add();
    spawn_detached(run_connection(std::move(*c)));
  }
  std::erase(listeners_, listener.get());
  running_.done();
  co_await running_.wait();
}

// A client that connects and never finishes negotiating must not hold its
// connection (and a slot of max_connections) forever. QEMU 7.2 has no such
// limit; later QEMUs end the handshake after 10 s (qemu-nbd's
// --handshake-limit, default 10), the bound chosen here.
Task<void> Server::handshake_watchdog(int fd, std::stop_token negotiated) {
  bool expired = co_await loop_.sleep(kHandshakeLimit, negotiated);
  // The fd is still this connection's: it closes only after negotiation
  // has ended and requested the stop.
  if (expired && !negotiated.stop_requested()) ::shutdown(fd, SHUT_RDWR);
  running_.done();
}

void Server::stop() {
  if (stopping_) return;
  stopping_ = true;
  // Wakes a pending accept (io_uring and epoll both see the shutdown) and
  // every connection's pending receive; in-flight requests still complete.
  for (int fd : listeners_) ::shutdown(fd, SHUT_RDWR);
  for (auto& [fd, _] : conns_) ::shutdown(fd, SHUT_RDWR);
  slot_free_.set();
}

size_t Server::disconnect_clients(const std::string& name) {
  size_t n = 0;
  for (auto& [fd, s] : conns_) {
    if (s && s->exp && s->exp->name == name) {
      ::shutdown(fd, SHUT_RDWR);
      ++n;
    }
  }
  return n;
}

Task<void> Server::run_connection(Fd fd) {
  {
    Session s{*this, loop_, fd.get()};
    conns_[fd.get()] = &s;
    std::stop_source negotiated;
    running_.add();
    spawn_detached(handshake_watchdog(fd.get(), negotiated.get_token()));
    bool go = co_await negotiate(s);
    negotiated.request_stop();
    if (go) co_await transmit(s);
  }
  conns_.erase(fd.get());
  fd.reset();
  slot_free_.set();
  if (on_disconnect) on_disconnect(conns_.size());
  running_.done();
}

}  // namespace vblk::nbd
