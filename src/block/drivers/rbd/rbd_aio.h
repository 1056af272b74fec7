// One librbd asynchronous request awaited by a coroutine.
//
//   long r = co_await RbdAio(loop, [&](rbd_completion_t c) {
//     return rbd_lib().rbd_aio_read(image, off, len, buf, c);
//   });
//
// await_suspend creates the completion and starts the request; librbd calls
// the completion callback on one of its own threads, which only takes the
// return value and posts the resumption to the loop (Loop::post_threadsafe:
// the loop's eventfd wakes it). The coroutine therefore always resumes on its
// loop thread, and the loop thread never waits for the cluster. While the
// request is out the loop is held (Loop::hold), so run_until does not take a
// quiet loop for a stalled one.
//
// The awaitable lives in the coroutine frame, which stays put until resumed;
// the callback touches nothing but the loop and this object.
#pragma once

#include <rbd/librbd.h>

#include <coroutine>

#include "drivers/rbd/rbd_lib.h"
#include "vblk/loop.h"

namespace vblk::rbd {

template <class Start>
class [[nodiscard]] RbdAio {
 public:
  RbdAio(Loop& loop, Start start) : loop_(loop), start_(std::move(start)) {}

  bool await_ready() noexcept { return false; }

  bool await_suspend(std::coroutine_handle<> h) noexcept {
    waiter_ = h;
    rbd_completion_t c = nullptr;
    int r = rbd_lib().rbd_aio_create_completion(this, &RbdAio::on_complete, &c);
    if (r < 0) {
      result_ = r;
      return false;
    }
    loop_.hold();
    r = start_(c);
    if (r < 0) {
      // Refused before it started: no callback will come.
      rbd_lib().rbd_aio_release(c);
      loop_.release();
      result_ = r;
      return false;
    }
    return true;
  }

  // librbd's result: >= 0 (bytes read for reads) or -errno.
  long await_resume() noexcept { return result_; }

 private:
  // On a librbd thread.
  static void on_complete(rbd_completion_t c, void* arg) {
    auto* self = static_cast<RbdAio*>(arg);
    long r = static_cast<long>(rbd_lib().rbd_aio_get_return_value(c));
    rbd_lib().rbd_aio_release(c);
    self->loop_.post_threadsafe([self, r] {
      self->result_ = r;
      self->loop_.release();
      self->loop_.post(self->waiter_);
    });
  }

  Loop& loop_;
  Start start_;
  std::coroutine_handle<> waiter_;
  long result_ = 0;
};

}  // namespace vblk::rbd
