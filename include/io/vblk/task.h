// Task<T>: a lazily started C++20 coroutine that produces a T.
//
// A Task starts when it is awaited. If it finishes without suspending, the
// awaiter simply continues (no resume, no stack growth); if it suspended, it
// resumes its awaiter by symmetric transfer when it finishes. Chains of tasks
// (a qcow2 read awaiting an L2 load awaiting a file read) cost no scheduling. Exceptions are kept in
// the promise and rethrown to the awaiter: nothing is swallowed. Expected
// failures travel as Result values, not exceptions.
//
// Ownership: the Task object owns the coroutine frame; moving it moves
// ownership. spawn_detached() hands a Task<void> to a self-destroying wrapper.
// Thread-safety: a Task belongs to the event loop thread that runs it.
#pragma once

#include <coroutine>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <utility>

#include "vblk/frame_pool.h"

namespace vblk {

template <class T = void>
class Task;

namespace detail {

struct TaskPromiseBase {
  std::coroutine_handle<> continuation = std::noop_coroutine();
  std::exception_ptr exception;
  // True while the awaiter is still inside its await_suspend, running this
  // task's first steps. A task that finishes then hands control back by
  // returning, not by resuming the awaiter: a loop of synchronous awaits
  // needs no tail call to keep the stack flat (sanitizer builds have none).
  bool starting = false;
  bool finished_inline = false;

  std::suspend_always initial_suspend() noexcept { return {}; }

  // Frames come from a per-thread pool: see frame_pool.h.
  static void* operator new(std::size_t n) { return frame_alloc(n); }
  static void operator delete(void* p, std::size_t n) noexcept { frame_free(p, n); }

  struct FinalAwaiter {
    bool await_ready() noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      auto& p = h.promise();
      if (p.starting) {
        p.finished_inline = true;
        return std::noop_coroutine();
      }
      return p.continuation;
    }
    void await_resume() noexcept {}
  };
  FinalAwaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { exception = std::current_exception(); }
};

template <class T>
struct TaskPromise : TaskPromiseBase {
  std::optional<T> value;
  Task<T> get_return_object() noexcept;
  template <class U>
  void return_value(U&& v) {
    value.emplace(std::forward<U>(v));
  }
  T take() {
    if (exception) std::rethrow_exception(exception);
    return std::move(*value);
  }
};

template <>
struct TaskPromise<void> : TaskPromiseBase {
  Task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void take() {
    if (exception) std::rethrow_exception(exception);
  }
};

}  // namespace detail

template <class T>
class [[nodiscard]] Task {
 public:
  using promise_type = detail::TaskPromise<T>;
  using Handle = std::coroutine_handle<promise_type>;

  Task() = default;
  explicit Task(Handle h) : h_(h) {}
  Task(Task&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  Task& operator=(Task&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() { reset(); }

  bool valid() const { return bool(h_); }

  auto operator co_await() && noexcept {
    struct Awaiter {
      Handle h;
      bool await_ready() noexcept { return false; }
      bool await_suspend(std::coroutine_handle<> awaiting) noexcept {
        auto& p = h.promise();
        p.continuation = awaiting;
        p.starting = true;
        h.resume();
        p.starting = false;
        return !p.finished_inline;  // finished already: do not suspend at all
      }
      T await_resume() { return h.promise().take(); }
    };
    return Awaiter{h_};
  }

 private:
  void reset() {
    if (h_) h_.destroy();
    h_ = {};
  }
  Handle h_;
};

namespace detail {
template <class T>
Task<T> TaskPromise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<TaskPromise<T>>::from_promise(*this));
}
inline Task<void> TaskPromise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<TaskPromise<void>>::from_promise(*this));
}

// A fire-and-forget coroutine: starts at once, frees itself when done. An
// exception escaping a detached task is a programming error: terminate loudly.
struct DetachedTask {
  struct promise_type {
    DetachedTask get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept {
      try {
        throw;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "vblk: uncaught exception in detached task: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "vblk: uncaught exception in detached task\n");
      }
      std::abort();
    }
  };
};

inline DetachedTask run_detached(Task<void> t) { co_await std::move(t); }
}  // namespace detail

// Starts `t` now (it runs until its first suspension) and lets it finish on its
// own; its frame is freed when it completes.
inline void spawn_detached(Task<void> t) { detail::run_detached(std::move(t)); }

}  // namespace vblk
