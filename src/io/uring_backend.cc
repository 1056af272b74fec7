// io_uring backend. Requests carry their own IoRequest* as user_data, so a
// completion resumes its coroutine without any lookup. Submission is batched:
// submit() only fills an SQE; wait() submits everything in one syscall.
//
// The ring never holds more requests than its completion queue (an
// overflowing CQ makes the kernel refuse submissions), and that capacity is
// split in two budgets so that no number of idle peers can stop the rest:
//  - bounded requests (file I/O, connect, the loop's own wake-ups) finish on
//    their own; beyond their half they wait in a backlog that their
//    completions drain, so the backlog always moves;
//  - peer waits (recv, send, accept and readiness polls on sockets) may
//    wait forever for a client; the first of them (most of the CQ, see
//    init) wait in the ring (the fast path: one SQE per op), the rest are
//    parked in an epoll set (SocketWaiters) that one poll request in the
//    ring watches (a slower path: a few more syscalls per wait).
#include <liburing.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "backend.h"
#include "socket_waiters.h"
#include "thread_pool.h"

namespace vblk::detail {
namespace {

bool is_socket_op(IoRequest::Op op) {
  using Op = IoRequest::Op;
  return op == Op::Recv || op == Op::Send || op == Op::SendMsg || op == Op::RecvMsg || op == Op::ReadStream ||
         op == Op::Accept || op == Op::Connect;
}

// Ops that wait for a peer, possibly forever.
bool waits_on_peer(IoRequest::Op op) {
  using Op = IoRequest::Op;
  return op == Op::Recv || op == Op::Send || op == Op::SendMsg || op == Op::RecvMsg || op == Op::ReadStream ||
         op == Op::Accept || op == Op::PollIn || op == Op::PollOut;
}

class UringBackend final : public Backend {
 public:
  UringBackend(Loop& loop, ThreadPool& pool) : loop_(loop), pool_(pool), waiters_(false) {}
  ~UringBackend() override {
    if (inited_) io_uring_queue_exit(&ring_);
  }

  bool init(unsigned entries, std::string& why) {
    // Bounded requests keep the default CQ of twice the SQ; peer waits get
    // room for kPeerWaitsPerEntry times the SQ on top (16 Ki waits for the
    // default 512 entries: a CQE is 16 bytes, the kernel's cost per waiting
    // op is the same in the ring or in epoll), so the usual thousands of
    // connections all wait in the ring and only beyond that are parked.
    io_uring_params p{};
    p.flags |= IORING_SETUP_CQSIZE;
    p.cq_entries = std::min<unsigned>(2 * entries + kPeerWaitsPerEntry * entries, kMaxCqEntries);
#ifdef IORING_SETUP_COOP_TASKRUN
    p.flags |= IORING_SETUP_COOP_TASKRUN;
#endif
    int r = io_uring_queue_init_params(entries, &ring_, &p);
    if (r == -EINVAL) {  // an older kernel without a flag: the default CQ, split in halves
      p = io_uring_params{};
      r = io_uring_queue_init_params(entries, &ring_, &p);
    }
    if (r < 0) {
      why = std::strerror(-r);
      return false;
    }
    inited_ = true;
    bounded_cap_ = std::min(2 * entries, p.cq_entries / 2);
    peer_cap_ = p.cq_entries - bounded_cap_;
    arm_pool_read();
    arm_waiters_poll();
    return true;
  }

  bool is_uring() const override { return true; }
  bool wants_nonblocking_sockets() const override { return false; }

  void submit(IoRequest* r) override {
    if (waits_on_peer(r->op)) {
      if (peer_waits_ < peer_cap_) {
        ++peer_waits_;
        prep(r);
      } else {
        // Parked ops wait for readiness themselves.
        if (r->op == IoRequest::Op::PollIn || r->op == IoRequest::Op::PollOut) restore_op(r);
        if (waiters_.park(r)) complete(loop_, r);
      }
      return;
    }
    if (bounded_ >= bounded_cap_) {
      backlog_.push_back(r);
      return;
    }
    ++bounded_;
    prep(r);
  }

  void prep(IoRequest* r) {
    io_uring_sqe* sqe = get_sqe();
    using Op = IoRequest::Op;
    switch (r->op) {
      case Op::Read: io_uring_prep_read(sqe, r->fd, r->buf, static_cast<unsigned>(r->len), r->off); break;
      case Op::Write: io_uring_prep_write(sqe, r->fd, r->buf, static_cast<unsigned>(r->len), r->off); break;
      case Op::Fsync: io_uring_prep_fsync(sqe, r->fd, 0); break;
      case Op::Fdatasync: io_uring_prep_fsync(sqe, r->fd, IORING_FSYNC_DATASYNC); break;
      case Op::Fallocate: io_uring_prep_fallocate(sqe, r->fd, r->flags, r->off, r->len); break;
      case Op::Recv: io_uring_prep_recv(sqe, r->fd, r->buf, r->len, r->flags); break;
      case Op::Send: io_uring_prep_send(sqe, r->fd, r->buf, r->len, r->flags); break;
      case Op::SendMsg:
        io_uring_prep_sendmsg(sqe, r->fd, static_cast<const msghdr*>(r->buf), static_cast<unsigned>(r->flags));
        break;
      case Op::RecvMsg:
        io_uring_prep_recvmsg(sqe, r->fd, static_cast<msghdr*>(r->buf), static_cast<unsigned>(r->flags));
        break;
      // Offset -1: the descriptor's own position (eventfds and pipes have none).
      case Op::ReadStream: io_uring_prep_read(sqe, r->fd, r->buf, static_cast<unsigned>(r->len), ~0ull); break;
      case Op::Accept: io_uring_prep_accept(sqe, r->fd, nullptr, nullptr, SOCK_CLOEXEC); break;
      case Op::Connect: io_uring_prep_connect(sqe, r->fd, r->addr, r->addrlen); break;
      case Op::PollIn: io_uring_prep_poll_add(sqe, r->fd, POLLIN); break;
      case Op::PollOut: io_uring_prep_poll_add(sqe, r->fd, POLLOUT); break;
      case Op::Blocking: break;  // never routed here
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
    ++bounded_;
  }

  // One poll on the parked sockets' epoll fd (a bounded slot: it is
  // re-armed by reap, never left waiting on a peer's whim).
  void arm_waiters_poll() {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_poll_add(sqe, waiters_.fd(), POLLIN);
    io_uring_sqe_set_data(sqe, &waiters_marker_);
    ++queued_;
    ++bounded_;
  }

  void wake_parked() {
    epoll_event evs[256];
    int n = ::epoll_wait(waiters_.fd(), evs, 256, 0);
    if (n > 0) waiters_.dispatch(evs, n, [this](IoRequest* r) { complete(loop_, r); });
  }

  void reap() {
    unsigned head;
    unsigned seen = 0;
    io_uring_cqe* cqe;
    bool pool = false;
    bool parked = false;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      auto* req = static_cast<IoRequest*>(io_uring_cqe_get_data(cqe));
      if (req == &pool_marker_ || req == &waiters_marker_) {
        --bounded_;
        (req == &pool_marker_ ? pool : parked) = true;
        continue;
      }
      // Its budget is free again whatever happens next (a retry below
      // submits anew).
      (waits_on_peer(req->op) ? peer_waits_ : bounded_) -= 1;
      if (req->op == IoRequest::Op::PollIn || req->op == IoRequest::Op::PollOut) {
        // A socket op that said EAGAIN: readiness arrived, retry it.
        restore_op(req);
        submit(req);
        continue;
      }
      if (cqe->res == -EAGAIN && is_socket_op(req->op) && req->op != IoRequest::Op::Connect) {
        bool out = req->op == IoRequest::Op::Send || req->op == IoRequest::Op::SendMsg;
        if (req->op == IoRequest::Op::Send) req->flags |= kWasSend;
        if (req->op == IoRequest::Op::SendMsg) req->flags |= kWasSendMsg;
        if (req->op == IoRequest::Op::Accept) req->flags |= kWasAccept;
        if (req->op == IoRequest::Op::RecvMsg) req->flags |= kWasRecvMsg;
        if (req->op == IoRequest::Op::ReadStream) req->flags |= kWasReadStream;
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
    if (parked) {
      wake_parked();
      arm_waiters_poll();
    }
    while (!backlog_.empty() && bounded_ < bounded_cap_) {
      ++bounded_;
      prep(backlog_.front());
      backlog_.pop_front();
    }
  }

  // A readiness poll back to the socket op that asked for it.
  static void restore_op(IoRequest* req) {
    if (req->flags & kWasSend) {
      req->op = IoRequest::Op::Send;
    } else if (req->flags & kWasSendMsg) {
      req->op = IoRequest::Op::SendMsg;
    } else if (req->flags & kWasAccept) {
      req->op = IoRequest::Op::Accept;
    } else if (req->flags & kWasRecvMsg) {
      req->op = IoRequest::Op::RecvMsg;
    } else if (req->flags & kWasReadStream) {
      req->op = IoRequest::Op::ReadStream;
    } else {
      req->op = IoRequest::Op::Recv;
    }
    req->flags &= ~(kWasSend | kWasSendMsg | kWasAccept | kWasRecvMsg | kWasReadStream);
  }

  static constexpr unsigned kPeerWaitsPerEntry = 32;
  static constexpr unsigned kMaxCqEntries = 65536;  // the kernel's IORING_MAX_CQ_ENTRIES

  // Flag bits kept in IoRequest::flags while a socket op waits for readiness
  // (MSG_* flags never use these high bits: MSG_CMSG_CLOEXEC, bit 30, is
  // never passed to recvmsg here).
  static constexpr int kWasReadStream = 1 << 26;
  static constexpr int kWasRecvMsg = 1 << 27;
  static constexpr int kWasSendMsg = 1 << 28;
  static constexpr int kWasSend = 1 << 29;
  static constexpr int kWasAccept = 1 << 30;

  Loop& loop_;
  ThreadPool& pool_;
  io_uring ring_{};
  bool inited_ = false;
  unsigned queued_ = 0;       // prepared SQEs not yet submitted
  unsigned bounded_ = 0;      // bounded requests in the kernel (SQ or in flight)
  unsigned peer_waits_ = 0;   // peer waits in the kernel
  unsigned bounded_cap_ = 0;  // the two budgets add up to the CQ size
  unsigned peer_cap_ = 0;
  std::deque<IoRequest*> backlog_;  // bounded requests over their budget
  SocketWaiters waiters_;           // peer waits over theirs
  uint64_t pool_counter_ = 0;
  IoRequest pool_marker_;
  IoRequest waiters_marker_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(Loop& loop, ThreadPool& pool, unsigned entries, std::string& why) {
  auto b = std::make_unique<UringBackend>(loop, pool);
  if (!b->init(entries, why)) return nullptr;
  return b;
}

}  // namespace vblk::detail
