// io_uring backend. Requests carry their own IoRequest* as user_data, so a
// completion resumes its coroutine without any lookup. Submission is batched:
// submit() only fills an SQE; wait() submits everything in one syscall.
#include <liburing.h>
#include <poll.h>

#include <cerrno>
#include <cstring>
#include <deque>

#include "io/backend.h"
#include "io/thread_pool.h"

namespace vblk::detail {
namespace {

bool is_socket_op(IoRequest::Op op) {
  using Op = IoRequest::Op;
  return op == Op::Recv || op == Op::Send || op == Op::SendMsg || op == Op::Accept || op == Op::Connect;
}

class UringBackend final : public Backend {
 public:
  UringBackend(Loop& loop, ThreadPool& pool) : loop_(loop), pool_(pool) {}
  ~UringBackend() override {
    if (inited_) io_uring_queue_exit(&ring_);
  }

  bool init(unsigned entries, std::string& why) {
    io_uring_params p{};
#ifdef IORING_SETUP_COOP_TASKRUN
    p.flags |= IORING_SETUP_COOP_TASKRUN;
#endif
    int r = io_uring_queue_init_params(entries, &ring_, &p);
    if (r == -EINVAL) {  // older kernel without the flag
      p = io_uring_params{};
      r = io_uring_queue_init_params(entries, &ring_, &p);
    }
    if (r < 0) {
      why = std::strerror(-r);
      return false;
    }
    inited_ = true;
    cq_capacity_ = p.cq_entries;
    arm_pool_read();
    return true;
  }

  bool is_uring() const override { return true; }
  bool wants_nonblocking_sockets() const override { return false; }

  void submit(IoRequest* r) override {
    // Never let more requests into the kernel than the completion queue
    // holds: an overflowing CQ makes the kernel refuse submissions (-EBUSY).
    // The rest wait in a backlog that completions drain.
    if (in_ring_ >= cq_capacity_) {
      backlog_.push_back(r);
      return;
    }
    prep(r);
  }

  void prep(IoRequest* r) {
    ++in_ring_;
    io_uring_sqe* sqe = get_sqe();
    using Op = IoRequest::Op;
    switch (r->op) {
      case Op::Read:
        io_uring_prep_read(sqe, r->fd, r->buf, static_cast<unsigned>(r->len), r->off);
        break;
      case Op::Write:
        io_uring_prep_write(sqe, r->fd, r->buf, static_cast<unsigned>(r->len), r->off);
        break;
      case Op::Fsync:
        io_uring_prep_fsync(sqe, r->fd, 0);
        break;
      case Op::Fdatasync:
        io_uring_prep_fsync(sqe, r->fd, IORING_FSYNC_DATASYNC);
        break;
      case Op::Fallocate:
        io_uring_prep_fallocate(sqe, r->fd, r->flags, r->off, r->len);
        break;
      case Op::Recv:
        io_uring_prep_recv(sqe, r->fd, r->buf, r->len, r->flags);
        break;
      case Op::Send:
        io_uring_prep_send(sqe, r->fd, r->buf, r->len, r->flags);
        break;
      case Op::SendMsg:
        io_uring_prep_sendmsg(sqe, r->fd, static_cast<const msghdr*>(r->buf), static_cast<unsigned>(r->flags));
        break;
      case Op::Accept:
        io_uring_prep_accept(sqe, r->fd, nullptr, nullptr, SOCK_CLOEXEC);
        break;
      case Op::Connect:
        io_uring_prep_connect(sqe, r->fd, r->addr, r->addrlen);
        break;
      case Op::PollIn:
        io_uring_prep_poll_add(sqe, r->fd, POLLIN);
        break;
      case Op::PollOut:
        io_uring_prep_poll_add(sqe, r->fd, POLLOUT);
        break;
      case Op::Blocking:
        break;  // never routed here
    }
    io_uring_sqe_set_data(sqe, r);
    ++queued_;
  }

  void wait(int64_t timeout_ns) override {
    io_uring_cqe* cqe = nullptr;
    int r;
    if (timeout_ns == 0) {
      r = queued_ ? io_uring_submit(&ring_) : 0;
    } else if (timeout_ns < 0) {
      r = io_uring_submit_and_wait(&ring_, 1);
    } else {
      __kernel_timespec ts{};
      ts.tv_sec = timeout_ns / 1000000000;
      ts.tv_nsec = timeout_ns % 1000000000;
      r = io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr);
    }
    (void)r;  // -ETIME / -EINTR simply mean "nothing yet"
    queued_ = 0;
    reap();
  }

 private:
  io_uring_sqe* get_sqe() {
    io_uring_sqe* sqe;
    while ((sqe = io_uring_get_sqe(&ring_)) == nullptr) {
      io_uring_submit(&ring_);  // ring full: flush the batch and retry
      queued_ = 0;
    }
    return sqe;
  }

  void arm_pool_read() {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_read(sqe, pool_.event_fd(), &pool_counter_, sizeof pool_counter_, 0);
    io_uring_sqe_set_data(sqe, &pool_marker_);
    ++queued_;
    ++in_ring_;
  }

  void reap() {
    unsigned head;
    unsigned seen = 0;
    io_uring_cqe* cqe;
    bool pool = false;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      --in_ring_;
      auto* req = static_cast<IoRequest*>(io_uring_cqe_get_data(cqe));
      if (req == &pool_marker_) {
        pool = true;
        continue;
      }
      if (req->op == IoRequest::Op::PollIn || req->op == IoRequest::Op::PollOut) {
        // A socket op that said EAGAIN: readiness arrived, retry it.
        if (req->flags & kWasSend) {
          req->op = IoRequest::Op::Send;
        } else if (req->flags & kWasSendMsg) {
          req->op = IoRequest::Op::SendMsg;
        } else if (req->flags & kWasAccept) {
          req->op = IoRequest::Op::Accept;
        } else {
          req->op = IoRequest::Op::Recv;
        }
        req->flags &= ~(kWasSend | kWasSendMsg | kWasAccept);
        submit(req);
        continue;
      }
      if (cqe->res == -EAGAIN && is_socket_op(req->op) && req->op != IoRequest::Op::Connect) {
        bool out = req->op == IoRequest::Op::Send || req->op == IoRequest::Op::SendMsg;
        if (req->op == IoRequest::Op::Send) req->flags |= kWasSend;
        if (req->op == IoRequest::Op::SendMsg) req->flags |= kWasSendMsg;
        if (req->op == IoRequest::Op::Accept) req->flags |= kWasAccept;
        req->op = out ? IoRequest::Op::PollOut : IoRequest::Op::PollIn;
        submit(req);
        continue;
      }
      req->result = cqe->res;
      complete(loop_, req);
    }
    io_uring_cq_advance(&ring_, seen);
    if (pool) {
      pool_event(loop_);
      arm_pool_read();
    }
    while (!backlog_.empty() && in_ring_ < cq_capacity_) {
      prep(backlog_.front());
      backlog_.pop_front();
    }
  }

  // Flag bits kept in IoRequest::flags while a socket op waits for readiness
  // (MSG_* flags never use these high bits).
  static constexpr int kWasSendMsg = 1 << 28;
  static constexpr int kWasSend = 1 << 29;
  static constexpr int kWasAccept = 1 << 30;

  Loop& loop_;
  ThreadPool& pool_;
  io_uring ring_{};
  bool inited_ = false;
  unsigned queued_ = 0;     // prepared SQEs not yet submitted
  unsigned in_ring_ = 0;    // requests in the kernel (SQ or in flight)
  unsigned cq_capacity_ = 0;
  std::deque<IoRequest*> backlog_;
  uint64_t pool_counter_ = 0;
  IoRequest pool_marker_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(Loop& loop, ThreadPool& pool, unsigned entries, std::string& why) {
  auto b = std::make_unique<UringBackend>(loop, pool);
  if (!b->init(entries, why)) return nullptr;
  return b;
}

}  // namespace vblk::detail
