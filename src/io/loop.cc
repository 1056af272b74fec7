#include "vblk/loop.h"

#include <fcntl.h>
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend.h"
#include "thread_pool.h"
#include "vblk/trace.h"

namespace vblk {

namespace detail {
void Backend::pool_event(Loop& l) {
  std::vector<IoRequest*> done;
  std::vector<std::function<void()>> fns;
  l.pool_->take(done, fns);
  for (IoRequest* r : done) l.complete(r);
  for (auto& fn : fns) fn();
}
}  // namespace detail

namespace {
bool uring_disabled_by_env() {
  const char* v = std::getenv("VBLK_NO_IO_URING");
  return v && *v && std::string(v) != "0";
}
}  // namespace

Loop::Loop() : Loop(Options{}) {}

Loop::Loop(Options opts) : opts_(opts) {
  pool_ = std::make_unique<detail::ThreadPool>(opts_.max_threads);
  if (opts_.allow_io_uring && !uring_disabled_by_env()) {
    std::string why;
    backend_ = detail::make_uring_backend(*this, *pool_, opts_.ring_entries, why);
    VBLK_TRACE(kIo, "loop backend {}{}", backend_ ? "io_uring" : "thread pool: ", backend_ ? "" : why);
    if (!backend_) {
      static bool told = false;  // one notice per process is enough
      if (!told) {
        std::fprintf(stderr, "vblk: io_uring unavailable (%s); using the thread pool\n", why.c_str());
        told = true;
      }
    }
  }
  if (!backend_) backend_ = detail::make_epoll_backend(*this, *pool_);
}

Loop::~Loop() {
  // Join workers before the backend goes: a worker may still signal the eventfd.
  pool_.reset();
  backend_.reset();
}

bool Loop::has_io_uring() const { return backend_->is_uring(); }

uint64_t Loop::now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

using Op = detail::IoRequest::Op;

IoAwaitable Loop::pread(int fd, void* buf, size_t len, uint64_t off, AioMode mode) {
  return IoAwaitable(*this, {.op = Op::Read, .mode = mode, .fd = fd, .buf = buf, .len = len, .off = off});
}
IoAwaitable Loop::pwrite(int fd, const void* buf, size_t len, uint64_t off, AioMode mode) {
  return IoAwaitable(*this,
                     {.op = Op::Write, .mode = mode, .fd = fd, .buf = const_cast<void*>(buf), .len = len, .off = off});
}
IoAwaitable Loop::fsync(int fd, bool datasync, AioMode mode) {
  return IoAwaitable(*this, {.op = datasync ? Op::Fdatasync : Op::Fsync, .mode = mode, .fd = fd});
}
IoAwaitable Loop::fallocate(int fd, int mode, uint64_t off, uint64_t len, AioMode aio) {
  return IoAwaitable(*this, {.op = Op::Fallocate, .mode = aio, .fd = fd, .len = len, .off = off, .flags = mode});
}
IoAwaitable Loop::run_blocking(std::function<long()>& fn) {
  return IoAwaitable(*this, {.op = Op::Blocking, .mode = AioMode::Threads, .fn = &fn});
}
IoAwaitable Loop::recv(int fd, void* buf, size_t len, int flags) {
  return IoAwaitable(*this, {.op = Op::Recv, .fd = fd, .buf = buf, .len = len, .flags = flags});
}
IoAwaitable Loop::send(int fd, const void* buf, size_t len, int flags) {
  return IoAwaitable(*this, {.op = Op::Send, .fd = fd, .buf = const_cast<void*>(buf), .len = len, .flags = flags});
}
IoAwaitable Loop::sendmsg(int fd, const msghdr* msg, int flags) {
  return IoAwaitable(*this, {.op = Op::SendMsg, .fd = fd, .buf = const_cast<msghdr*>(msg), .flags = flags});
}
IoAwaitable Loop::recvmsg(int fd, msghdr* msg, int flags) {
  return IoAwaitable(*this, {.op = Op::RecvMsg, .fd = fd, .buf = msg, .flags = flags});
}
IoAwaitable Loop::read_stream(int fd, void* buf, size_t len) {
  return IoAwaitable(*this, {.op = Op::ReadStream, .fd = fd, .buf = buf, .len = len});
}
IoAwaitable Loop::accept(int fd) { return IoAwaitable(*this, {.op = Op::Accept, .fd = fd}); }
IoAwaitable Loop::connect(int fd, const sockaddr* addr, socklen_t len) {
  return IoAwaitable(*this, {.op = Op::Connect, .fd = fd, .addr = addr, .addrlen = len});
}

bool IoAwaitable::await_suspend(std::coroutine_handle<> h) noexcept {
  req_.waiter = h;
  req_.loop->submit(&req_);
  return true;
}

void Loop::submit(detail::IoRequest* req) {
  ++pending_;
  bool file_op = req->op == Op::Read || req->op == Op::Write || req->op == Op::Fsync || req->op == Op::Fdatasync ||
                 req->op == Op::Fallocate;
  if (req->op == Op::Blocking || (file_op && (req->mode == AioMode::Threads || !backend_->is_uring()))) {
    pool_->submit(req);
  } else {
    backend_->submit(req);
  }
}

void Loop::complete(detail::IoRequest* req) {
  --pending_;
  ready_.push_back(req->waiter);
}

void Loop::post_threadsafe(std::function<void()> fn) { pool_->post(std::move(fn)); }

void Loop::run_ready() {
  // Only what is ready now: coroutines posted meanwhile wait for the next
  // round, so I/O gets submitted between rounds.
  size_t n = ready_.size();
  while (n-- && !ready_.empty()) {
    auto h = ready_.front();
    ready_.pop_front();
    h.resume();
  }
}

void Loop::fire_timers() {
  if (timers_.empty()) return;
  uint64_t now = now_ns();
  while (!timers_.empty() && timers_.begin()->first <= now) {
    SleepAwaitable* s = timers_.begin()->second;
    timers_.erase(timers_.begin());
    s->armed_ = false;
    ready_.push_back(s->waiter_);
  }
}

void Loop::run_once(int64_t timeout_ns) {
  run_ready();
  fire_timers();
  backend_->wait(wait_timeout(timeout_ns));
}

int64_t Loop::wait_timeout(int64_t limit_ns) const {
  if (!ready_.empty()) return 0;  // still submit the batch, but do not sleep
  if (timers_.empty()) return limit_ns;
  uint64_t now = now_ns();
  uint64_t first = timers_.begin()->first;
  int64_t until = first > now ? static_cast<int64_t>(first - now) : 0;
  return limit_ns < 0 || until < limit_ns ? until : limit_ns;
}

bool Loop::run_until(const std::function<bool()>& done) {
  for (;;) {
    run_ready();
    fire_timers();
    if (done()) return true;
    if (ready_.empty() && timers_.empty() && pending_ == 0 && holds_ == 0) return false;
    backend_->wait(wait_timeout(-1));
  }
}

// ---- SleepAwaitable

SleepAwaitable::~SleepAwaitable() {
  // A coroutine destroyed while sleeping must not leave its timer behind.
  if (armed_) loop_->timers_.erase(pos_);
}

bool SleepAwaitable::await_ready() noexcept {
  if (token_.stop_requested()) {
    cancelled_ = true;
    return true;
  }
  return deadline_ <= Loop::now_ns();
}

void SleepAwaitable::await_suspend(std::coroutine_handle<> h) {
  waiter_ = h;
  pos_ = loop_->timers_.emplace(deadline_, this);
  armed_ = true;
  if (token_.stop_possible()) on_stop_.emplace(token_, OnStop{this});
}

void SleepAwaitable::OnStop::operator()() const noexcept {
  if (!self->armed_) return;
  self->loop_->timers_.erase(self->pos_);
  self->armed_ = false;
  self->cancelled_ = true;
  self->loop_->post(self->waiter_);
}

bool SleepAwaitable::await_resume() noexcept {
  on_stop_.reset();
  return !cancelled_;
}

}  // namespace vblk
