#include "thread_pool.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <system_error>

namespace vblk::detail {

ThreadPool::ThreadPool(unsigned max_threads) : max_threads_(max_threads ? max_threads : 1) {
  efd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  ::close(efd_);
}

void ThreadPool::submit(IoRequest* req) {
  {
    std::lock_guard lk(mu_);
    queue_.push_back(req);
    // More queued work than idle workers to take it: start a thread while the
    // cap allows (a woken worker only lowers idle_ once it runs).
    if (queue_.size() > idle_ && threads_.size() < max_threads_) threads_.emplace_back([this] { worker(); });
    // Busy workers take the queue in turn when they finish; only idle ones need a wakeup.
    if (idle_ == 0) return;
  }
  cv_.notify_one();
}

void ThreadPool::post(std::function<void()> fn) {
  {
    std::lock_guard lk(mu_);
    posted_.push_back(std::move(fn));
  }
  signal();
}

void ThreadPool::signal() {
  uint64_t one = 1;
  // The counter cannot overflow in practice; EAGAIN would only mean it is already set.
  [[maybe_unused]] ssize_t n = ::write(efd_, &one, sizeof one);
}

void ThreadPool::ack() {
  uint64_t v;
  [[maybe_unused]] ssize_t n = ::read(efd_, &v, sizeof v);
}

void ThreadPool::take(std::vector<IoRequest*>& done, std::vector<std::function<void()>>& fns) {
  std::lock_guard lk(mu_);
  done.swap(completed_);
  fns.swap(posted_);
}

long ThreadPool::execute(IoRequest* r) {
  long ret = 0;
  switch (r->op) {
    case IoRequest::Op::Read: ret = ::pread(r->fd, r->buf, r->len, static_cast<off_t>(r->off)); break;
    case IoRequest::Op::Write: ret = ::pwrite(r->fd, r->buf, r->len, static_cast<off_t>(r->off)); break;
    case IoRequest::Op::Fsync: ret = ::fsync(r->fd); break;
    case IoRequest::Op::Fdatasync: ret = ::fdatasync(r->fd); break;
    case IoRequest::Op::Fallocate:
      ret = ::fallocate(r->fd, r->flags, static_cast<off_t>(r->off), static_cast<off_t>(r->len));
      break;
    case IoRequest::Op::Blocking: return (*r->fn)();  // returns -errno itself
    default: return -EINVAL;                          // socket operations never go to the pool
  }
  return ret < 0 ? -errno : ret;
}

void ThreadPool::worker() {
  std::unique_lock lk(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lk, [this] { return stopping_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping
    IoRequest* r = queue_.front();
    queue_.pop_front();
    lk.unlock();
    r->result = execute(r);
    lk.lock();
    // Only the first completion of a batch wakes the loop: it acknowledges the
    // eventfd before taking the list, so later pushes are collected with it.
    bool first = completed_.empty();
    completed_.push_back(r);
    lk.unlock();
    if (first) signal();
    lk.lock();
  }
}

}  // namespace vblk::detail
