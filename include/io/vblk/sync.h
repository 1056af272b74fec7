// Coroutine synchronisation for one event loop: CoMutex, CoSemaphore,
// CoQueue<T>, CoEvent and WaitGroup.
//
// None of these block a thread: a waiter suspends and is resumed through
// Loop::post, so wake-ups never recurse into the waker's stack. They are not
// thread-safe: every user must run on the same Loop. Waiters are served FIFO.
#pragma once

#include <coroutine>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>

#include "vblk/loop.h"

namespace vblk {

class CoSemaphore {
 public:
  CoSemaphore(Loop& loop, uint64_t count) : loop_(loop), count_(count) {}

  // co_await acquire(n): waits until n units are free, then takes them.
  auto acquire(uint64_t n = 1) {
    struct A {
      CoSemaphore& s;
      uint64_t n;
      bool await_ready() noexcept {
        if (s.waiters_.empty() && s.count_ >= n) {
          s.count_ -= n;
          return true;
        }
        return false;
      }
      void await_suspend(std::coroutine_handle<> h) { s.waiters_.push_back({h, n}); }
      void await_resume() noexcept {}
    };
    return A{*this, n};
  }
  bool try_acquire(uint64_t n = 1) {
    if (!waiters_.empty() || count_ < n) return false;
    count_ -= n;
    return true;
  }
  void release(uint64_t n = 1) {
    count_ += n;
    // FIFO: a large waiter at the head holds back smaller ones (no starvation).
    while (!waiters_.empty() && count_ >= waiters_.front().n) {
      count_ -= waiters_.front().n;
      loop_.post(waiters_.front().h);
      waiters_.pop_front();
    }
  }
  uint64_t available() const { return count_; }
  size_t waiting() const { return waiters_.size(); }

 private:
  struct Waiter {
    std::coroutine_handle<> h;
    uint64_t n;
  };
  Loop& loop_;
  uint64_t count_;
  std::deque<Waiter> waiters_;
};

class CoMutex {
 public:
  explicit CoMutex(Loop& loop) : sem_(loop, 1) {}
  auto lock() { return sem_.acquire(1); }
  bool try_lock() { return sem_.try_acquire(1); }
  void unlock() { sem_.release(1); }
  bool locked() const { return sem_.available() == 0; }

  // RAII guard: `auto g = co_await m.scoped();`
  class Guard {
   public:
    explicit Guard(CoMutex* m) : m_(m) {}
    Guard(Guard&& o) noexcept : m_(std::exchange(o.m_, nullptr)), held_(o.held_) {}
    Guard& operator=(Guard&&) = delete;
    ~Guard() {
      if (m_ && held_) m_->unlock();
    }
    // Lets the mutex go for a while (around I/O it need not cover); relock()
    // takes it again. The destructor unlocks only what is held.
    void unlock() {
      held_ = false;
      m_->unlock();
    }
    Task<void> relock() {
      co_await m_->lock();
      held_ = true;
    }

   private:
    CoMutex* m_;
    bool held_ = true;
  };
  Task<Guard> scoped() {
    co_await lock();
    co_return Guard(this);
  }

 private:
  CoSemaphore sem_;
};

// A level-triggered event: wait() returns at once while set.
class CoEvent {
 public:
  explicit CoEvent(Loop& loop) : loop_(loop) {}
  auto wait() {
    struct A {
      CoEvent& e;
      bool await_ready() noexcept { return e.set_; }
      void await_suspend(std::coroutine_handle<> h) { e.waiters_.push_back(h); }
      void await_resume() noexcept {}
    };
    return A{*this};
  }
  void set() {
    set_ = true;
    for (auto h : waiters_) loop_.post(h);
    waiters_.clear();
  }
  void reset() { set_ = false; }
  bool is_set() const { return set_; }

 private:
  Loop& loop_;
  bool set_ = false;
  std::deque<std::coroutine_handle<>> waiters_;
};

// Counts outstanding work; wait() returns when the count is zero.
class WaitGroup {
 public:
  explicit WaitGroup(Loop& loop) : zero_(loop) { zero_.set(); }
  void add(uint64_t n = 1) {
    if (n == 0) return;
    count_ += n;
    zero_.reset();
  }
  void done() {
    if (--count_ == 0) zero_.set();
  }
  auto wait() { return zero_.wait(); }
  uint64_t count() const { return count_; }

 private:
  uint64_t count_ = 0;
  CoEvent zero_;
};

// A bounded multi-producer multi-consumer queue (capacity 0 = unbounded).
// pop() yields nullopt once the queue is closed and empty.
template <class T>
class CoQueue {
 public:
  CoQueue(Loop& loop, size_t capacity = 0) : loop_(loop), capacity_(capacity) {}

  Task<bool> push(T v) {
    while (!closed_ && capacity_ && items_.size() >= capacity_) co_await wait_on(space_);
    if (closed_) co_return false;
    items_.push_back(std::move(v));
    wake(items_waiters_);
    co_return true;
  }
  Task<std::optional<T>> pop() {
    while (items_.empty() && !closed_) co_await wait_on(items_waiters_);
    if (items_.empty()) co_return std::nullopt;
    T v = std::move(items_.front());
    items_.pop_front();
    wake(space_);
    co_return std::optional<T>(std::move(v));
  }
  void close() {
    closed_ = true;
    while (!items_waiters_.empty()) wake(items_waiters_);
    while (!space_.empty()) wake(space_);
  }
  size_t size() const { return items_.size(); }
  bool closed() const { return closed_; }

 private:
  auto wait_on(std::deque<std::coroutine_handle<>>& q) {
    struct A {
      std::deque<std::coroutine_handle<>>& q;
      bool await_ready() noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) { q.push_back(h); }
      void await_resume() noexcept {}
    };
    return A{q};
  }
  void wake(std::deque<std::coroutine_handle<>>& q) {
    if (q.empty()) return;
    loop_.post(q.front());
    q.pop_front();
  }

  Loop& loop_;
  size_t capacity_;
  bool closed_ = false;
  std::deque<T> items_;
  std::deque<std::coroutine_handle<>> items_waiters_;
  std::deque<std::coroutine_handle<>> space_;
};

}  // namespace vblk
