// Loop: the event loop every vblk node, job and connection runs on.
//
// One Loop per thread. I/O is submitted through io_uring (liburing) in batches:
// an awaited operation only fills a submission entry; the loop submits all of
// them at once when it next waits, and resumes each coroutine straight from
// its completion (io_uring user_data points at the waiting request, no lookup).
// When io_uring cannot be set up (old kernel, seccomp, VBLK_NO_IO_URING=1) the
// loop falls back, with a one-line notice, to a thread pool for file I/O and
// epoll for sockets; the same awaitables work in both modes.
//
// Ownership: the Loop owns its ring, its thread pool and its timers. Awaitables
// live in the awaiting coroutine's frame. Thread-safety: everything except
// post_threadsafe() must be called on the loop's own thread.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <coroutine>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stop_token>

#include "vblk/result.h"
#include "vblk/task.h"

namespace vblk {

// How a file node performs its I/O.
enum class AioMode : uint8_t { IoUring, Threads };

class Loop;

namespace detail {
struct IoRequest {
  enum class Op : uint8_t {
    Read,
    Write,
    Fsync,
    Fdatasync,
    Fallocate,
    Recv,
    Send,
    SendMsg,
    RecvMsg,
    ReadStream,
    Accept,
    Connect,
    Blocking,
    PollIn,
    PollOut
  };
  Op op = Op::Read;
  AioMode mode = AioMode::IoUring;
  int fd = -1;
  void* buf = nullptr;
  size_t len = 0;
  uint64_t off = 0;
  int flags = 0;
  const sockaddr* addr = nullptr;
  socklen_t addrlen = 0;
  std::function<long()>* fn = nullptr;
  long result = 0;
  std::coroutine_handle<> waiter;
  Loop* loop = nullptr;
};
class Backend;
class ThreadPool;
}  // namespace detail

// co_await yields the syscall-style result: >= 0 on success, -errno on failure.
class [[nodiscard]] IoAwaitable {
 public:
  IoAwaitable(Loop& loop, detail::IoRequest req) : req_(req) { req_.loop = &loop; }
  bool await_ready() noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) noexcept;
  long await_resume() noexcept { return req_.result; }

 private:
  detail::IoRequest req_;
};

// co_await yields true if the full time elapsed, false if cancelled.
class [[nodiscard]] SleepAwaitable {
 public:
  SleepAwaitable(Loop& loop, uint64_t deadline_ns, std::stop_token st)
      : loop_(&loop), deadline_(deadline_ns), token_(std::move(st)) {}
  // Not movable: on_stop_ (a stop_callback) points back at this object.
  SleepAwaitable(SleepAwaitable&&) = delete;
  ~SleepAwaitable();
  bool await_ready() noexcept;
  void await_suspend(std::coroutine_handle<> h);
  bool await_resume() noexcept;

 private:
  friend class Loop;
  struct OnStop {
    SleepAwaitable* self;
    void operator()() const noexcept;
  };
  Loop* loop_;
  uint64_t deadline_;
  std::stop_token token_;
  std::coroutine_handle<> waiter_;
  std::multimap<uint64_t, SleepAwaitable*>::iterator pos_;
  bool armed_ = false;
  bool cancelled_ = false;
  std::optional<std::stop_callback<OnStop>> on_stop_;
};

class Loop {
 public:
  struct Options {
    bool allow_io_uring = true;  // false: force the thread-pool/epoll fallback
    unsigned ring_entries = 512;
    unsigned max_threads = 64;  // thread pool size cap (like QEMU's pool)
  };

  Loop();
  explicit Loop(Options opts);
  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  bool has_io_uring() const;
  // The mode file nodes get when they ask for io_uring: IoUring if the ring exists.
  AioMode effective(AioMode wanted) const { return has_io_uring() ? wanted : AioMode::Threads; }

  // --- file I/O (single syscall semantics: short transfers are the caller's job)
  IoAwaitable pread(int fd, void* buf, size_t len, uint64_t off, AioMode mode = AioMode::IoUring);
  IoAwaitable pwrite(int fd, const void* buf, size_t len, uint64_t off, AioMode mode = AioMode::IoUring);
  IoAwaitable fsync(int fd, bool datasync, AioMode mode = AioMode::IoUring);
  IoAwaitable fallocate(int fd, int mode, uint64_t off, uint64_t len, AioMode aio = AioMode::IoUring);
  // Runs fn on the thread pool (for blocking calls such as copy_file_range).
  // fn must stay alive until the await completes (keep it in the frame).
  IoAwaitable run_blocking(std::function<long()>& fn);

  // --- sockets (fds must come from make_socket_for_loop semantics: see net.h)
  IoAwaitable recv(int fd, void* buf, size_t len, int flags = 0);
  IoAwaitable send(int fd, const void* buf, size_t len, int flags = MSG_NOSIGNAL);
  // sendmsg(2): many buffers in one call (msg must outlive the await).
  IoAwaitable sendmsg(int fd, const msghdr* msg, int flags = MSG_NOSIGNAL);
  // recvmsg(2), for descriptors passed with SCM_RIGHTS (msg must outlive
  // the await; received descriptors are not close-on-exec: set it).
  IoAwaitable recvmsg(int fd, msghdr* msg, int flags = 0);
  // read(2) on a pollable descriptor that is not a socket (an eventfd, a
  // pipe): waits until it is readable. The descriptor must be O_NONBLOCK.
  IoAwaitable read_stream(int fd, void* buf, size_t len);
  IoAwaitable accept(int fd);
  IoAwaitable connect(int fd, const sockaddr* addr, socklen_t len);

  // --- time
  static uint64_t now_ns();
  SleepAwaitable sleep(std::chrono::nanoseconds d, std::stop_token st = {}) {
    return SleepAwaitable(*this, now_ns() + static_cast<uint64_t>(d.count()), std::move(st));
  }
  SleepAwaitable sleep_until(uint64_t deadline_ns, std::stop_token st = {}) {
    return SleepAwaitable(*this, deadline_ns, std::move(st));
  }

  // --- scheduling
  // Resume h on the next loop iteration (same thread).
  void post(std::coroutine_handle<> h) { ready_.push_back(h); }
  // co_await loop.yield(): let other ready coroutines run first.
  auto yield() {
    struct Y {
      Loop* l;
      bool await_ready() noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) noexcept { l->post(h); }
      void await_resume() noexcept {}
    };
    return Y{this};
  }
  // From any thread: run fn on the loop thread soon.
  void post_threadsafe(std::function<void()> fn);
  // While held, run_until waits for work posted from other threads instead
  // of reporting a stall: for a loop that another thread may still feed (a
  // daemon with nothing to serve yet waits for its signal thread's quit).
  void hold() { ++holds_; }
  void release() { --holds_; }

  // Runs the loop until done() is true. Returns false if nothing could ever
  // make progress again (no ready coroutine, timer or pending I/O).
  bool run_until(const std::function<bool()>& done);
  // Runs the loop once: handles what is ready, waits at most timeout_ns.
  void run_once(int64_t timeout_ns);

  // Starts t on this loop and runs the loop until it finishes; returns its value.
  template <class T>
  T run(Task<T> t);

  // Number of submitted but not completed I/O requests (for drains and tests).
  uint64_t pending_io() const { return pending_; }

 private:
  friend class IoAwaitable;
  friend class SleepAwaitable;
  friend class detail::Backend;
  void submit(detail::IoRequest* req);
  void complete(detail::IoRequest* req);
  void run_ready();
  void fire_timers();
  int64_t wait_timeout(int64_t limit_ns) const;

  Options opts_;
  std::unique_ptr<detail::Backend> backend_;
  std::unique_ptr<detail::ThreadPool> pool_;
  std::deque<std::coroutine_handle<>> ready_;
  std::multimap<uint64_t, SleepAwaitable*> timers_;
  uint64_t pending_ = 0;
  unsigned holds_ = 0;
};

template <class T>
T Loop::run(Task<T> t) {
  std::optional<T> out;
  bool done = false;
  auto wrap = [](Task<T> inner, std::optional<T>& o, bool& d) -> Task<void> {
    o.emplace(co_await std::move(inner));
    d = true;
  };
  spawn_detached(wrap(std::move(t), out, done));
  if (!run_until([&] { return done; })) {
    std::fprintf(stderr, "vblk: internal error: event loop stalled with a task still waiting\n");
    std::abort();
  }
  return std::move(*out);
}

template <>
inline void Loop::run(Task<void> t) {
  bool done = false;
  auto wrap = [](Task<void> inner, bool& d) -> Task<void> {
    co_await std::move(inner);
    d = true;
  };
  spawn_detached(wrap(std::move(t), done));
  if (!run_until([&] { return done; })) {
    std::fprintf(stderr, "vblk: internal error: event loop stalled with a task still waiting\n");
    std::abort();
  }
}

}  // namespace vblk
