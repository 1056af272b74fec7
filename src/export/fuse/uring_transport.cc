#include "fuse/uring_transport.h"

#include <linux/fuse.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace vblk::fuse {

namespace {

constexpr uint32_t kUringCmdRegister = 1;
constexpr uint32_t kUringCmdCommitAndFetch = 2;

struct UringCmdReq {  // in the SQE128's command area
  uint64_t flags;
  uint64_t commit_id;
  uint16_t qid;
  uint8_t padding[6];
};
static_assert(sizeof(UringCmdReq) == 24);

// The kernel's num_possible_cpus(): one queue each must be registered.
unsigned possible_cpus() {
  unsigned hi = 0;
  if (FILE* f = std::fopen("/sys/devices/system/cpu/possible", "re")) {
    char line[256];
    if (std::fgets(line, sizeof line, f)) {
      // "0-3" or "0,2-5": the highest number + 1
      char* save = nullptr;
      for (char* t = ::strtok_r(line, ",\n", &save); t; t = ::strtok_r(nullptr, ",\n", &save)) {
        const char* dash = std::strchr(t, '-');
        hi = std::max(hi, static_cast<unsigned>(std::strtoul(dash ? dash + 1 : t, nullptr, 10)) + 1);
      }
    }
    std::fclose(f);
  }
  return hi ? hi : static_cast<unsigned>(::sysconf(_SC_NPROCESSORS_CONF));
}

}  // namespace

Status uring_transport_available() {
  // The parameter exists from 6.14 on (with CONFIG_FUSE_IO_URING) and is
  // off by default: FUSE_INIT does not offer the transport then.
  const char* param = "/sys/module/fuse/parameters/enable_uring";
  FILE* f = std::fopen(param, "re");
  if (!f) return Error(EOPNOTSUPP, "FUSE-over-io_uring is not supported by this kernel (no fuse.enable_uring)");
  char c = 0;
  const bool on = std::fread(&c, 1, 1, f) == 1 && c == 'Y';
  std::fclose(f);
  if (!on) return Error(EOPNOTSUPP, std::string("FUSE-over-io_uring is disabled in the kernel (") + param + " is N)");
  return {};
}

Status UringTransport::setup(unsigned entries) {
  const unsigned nq = possible_cpus();
  const unsigned per_queue = std::max(1u, entries / nq);
  const unsigned n = nq * per_queue;
  io_uring_params p{};
  p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQSIZE;
  p.cq_entries = 2 * n;
  if (int r = io_uring_queue_init_params(n, &ring_, &p); r < 0)
    return Error(-r, std::string("Failed to set up an io_uring for FUSE: ") + std::strerror(-r));
  efd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  const int r = efd_.valid() ? io_uring_register_eventfd(&ring_, efd_.get()) : -errno;
  if (r < 0) {
    io_uring_queue_exit(&ring_);
    efd_.reset();
    return Error(-r, std::string("Failed to set up an io_uring for FUSE: ") + std::strerror(-r));
  }
  for (unsigned q = 0; q < nq; ++q)
    for (unsigned i = 0; i < per_queue; ++i) {
      auto e = std::make_unique<RingEnt>();
      e->qid = static_cast<uint16_t>(q);
      e->iov[0] = {&e->hdr, sizeof e->hdr};
      e->iov[1] = {e->buf.data() + kDataOffset, kMaxWrite};
      ents_.push_back(std::move(e));
    }
  ready_ = true;
  return {};
}

void UringTransport::close() {
  if (!ready_) return;
  ready_ = false;
  io_uring_queue_exit(&ring_);
  efd_.reset();
}

void UringTransport::start(int fuse_fd, Serve serve, WaitGroup& tasks) {
  fuse_fd_ = fuse_fd;
  tasks_ = &tasks;
  batching_ = true;
  for (auto& e : ents_) queue_cmd(*e, kUringCmdRegister, 0);
  live_ents_ = ents_.size();
  batching_ = false;
  (void)io_uring_submit(&ring_);
  tasks.add();
  spawn_detached(reader(std::move(serve)));
}

// One command per entry is ever outstanding, and the SQ holds them all.
void UringTransport::queue_cmd(RingEnt& e, uint32_t op, uint64_t commit_id) {
  if (!ready_) return;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) {
    (void)io_uring_submit(&ring_);
    if (!(sqe = io_uring_get_sqe(&ring_))) return;
  }
  std::memset(sqe, 0, 2 * sizeof *sqe);
  sqe->opcode = IORING_OP_URING_CMD;
  sqe->fd = fuse_fd_;
  sqe->cmd_op = op;
  sqe->addr = reinterpret_cast<uint64_t>(e.iov);
  sqe->len = 2;
  UringCmdReq c{};
  c.commit_id = commit_id;
  c.qid = e.qid;
  std::memcpy(sqe->cmd, &c, sizeof c);
  io_uring_sqe_set_data(sqe, &e);
  if (batching_ || flush_pending_) return;
  // A reply after node I/O: submitted once the loop has run what else is
  // ready, with the replies those make.
  flush_pending_ = true;
  tasks_->add();
  spawn_detached(flush_later());
}

Task<void> UringTransport::flush_later() {
  co_await loop_.yield();
  flush_pending_ = false;
  if (ready_ && io_uring_sq_ready(&ring_)) (void)io_uring_submit(&ring_);
  tasks_->done();
}

void UringTransport::commit(RingEnt& e, uint64_t unique, int error, const void* p, size_t len, const void* p2,
                            size_t len2) {
  uint8_t* pay = e.buf.data() + kDataOffset;
  size_t n = 0;
  if (!error) {
    if (len && p != pay) std::memmove(pay, p, len);
    n = len;
    if (len2) std::memcpy(pay + n, p2, len2);
    n += len2;
  }
  fuse_out_header h{};
  h.unique = unique;
  h.error = error ? -std::abs(error) : 0;
  h.len = static_cast<uint32_t>(sizeof h + n);
  std::memcpy(e.hdr.in_out, &h, sizeof h);
  const uint64_t id = e.hdr.ent.commit_id;
  e.hdr.ent.payload_sz = static_cast<uint32_t>(n);
  e.replied = true;
  queue_cmd(e, kUringCmdCommitAndFetch, id);
}

// Waits on the eventfd, serves what completed; ends when every entry's
// command has failed.
Task<void> UringTransport::reader(Serve serve) {
  uint64_t v;
  std::vector<std::pair<RingEnt*, int>> got;
  while (live_ents_ && ready_) {
    long n = co_await loop_.read_stream(efd_.get(), &v, sizeof v);
    if (n == -EINTR) continue;
    if (n < 0 && n != -EAGAIN) break;
    // A few rounds: the submit's return runs the kernel's task work,
    // which often has the next requests ready.
    for (int round = 0; round < 4 && live_ents_ && ready_; ++round) {
      got.clear();
      unsigned head, seen = 0;
      io_uring_cqe* cqe;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        got.emplace_back(static_cast<RingEnt*>(io_uring_cqe_get_data(cqe)), cqe->res);
        ++seen;
      }
      io_uring_cq_advance(&ring_, seen);
      if (got.empty()) break;
      // Replies made while serving these go out in one submit.
      batching_ = true;
      for (auto [e, res] : got) {
        if (res < 0) {
          --live_ents_;
          continue;
        }
        serve(*e);
      }
      batching_ = false;
      if (io_uring_sq_ready(&ring_)) (void)io_uring_submit(&ring_);
    }
  }
  tasks_->done();
}

}  // namespace vblk::fuse
