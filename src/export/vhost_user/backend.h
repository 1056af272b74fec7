// A vhost-user back end (QEMU's docs/interop/vhost-user.rst) serving one
// virtio device to one front end at a time over a unix socket: the message
// protocol, the memory table, the rings and their kick/call eventfds, all
// on the loop. Requests run concurrently (as many as the rings hold), each
// completed into the used ring as soon as the device has served it.
//
// A front end that breaks the protocol or the ring rules (bad sizes,
// addresses outside its memory table, descriptor loops...) loses its
// connection, and only it: the error is reported through on_error, the
// requests in flight finish, the memory is unmapped, and the back end
// accepts the next front end.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "vblk/loop.h"
#include "vblk/net.h"
#include "vblk/sync.h"
#include "vhost_user/device.h"

namespace vblk::vhost {

struct Session;

class Backend {
 public:
  Backend(Loop& loop, Device& dev);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // Serves front ends from `listener`, one at a time, until stop().
  Task<void> serve(Fd listener);
  // Stops accepting and ends the current session (its requests in flight
  // finish first); serve() then returns.
  void stop();
  bool connected() const { return session_ != nullptr; }

  std::function<void(const std::string&)> on_error;
  // A queue stalled with work outstanding, or moving again (stall_watch.h).
  std::function<void(const std::string&)> on_stall;
  // 0: no stall watch.
  std::chrono::steady_clock::duration stall_limit{};

 private:
  Task<void> run_session(Fd sock);

  Loop& loop_;
  Device& dev_;
  int listener_ = -1;
  Session* session_ = nullptr;
  bool stopping_ = false;
};

}  // namespace vblk::vhost
