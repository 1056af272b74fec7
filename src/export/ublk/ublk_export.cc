// The ublk export (include/export/vblk/ublk_export.h): one io_uring for
// every queue's FETCH / COMMIT_AND_FETCH commands, submitted by the loop
// thread (the driver takes the task that fetches first as the queue's
// daemon, and copies write data in by task work on it), its completions
// ringing an eventfd the loop reads.
#include "vblk/ublk_export.h"

#include <fcntl.h>
#include <liburing.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ublk/control.h"
#include "vblk/buffer.h"
#include "vblk/net.h"
#include "vblk/node_ref.h"
#include "vblk/sync.h"

#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57
#endif

namespace vblk::ublk {

namespace {

// The largest request (the kernel splits above it) and so each tag's
// buffer; buffers are touched only as requests use them.
constexpr uint32_t kMaxIoBytes = 512 << 10;
// Discard and write-zeroes requests up to 1 GiB each.
constexpr uint32_t kMaxDiscardSectors = (1u << 30) >> 9;

struct Tag {
  uint16_t q = 0;
  uint16_t tag = 0;
  AlignedBuffer buf{kMaxIoBytes, 4096};
};

class Export final : public UblkExport {
 public:
  Export(Loop& loop, Options o, Control ctrl)
      : loop_(loop), opts_(std::move(o)), node_(opts_.node), ctrl_(std::move(ctrl)), tasks_(loop), started_(loop) {}

  ~Export() override { release(); }

  Status setup() {
    const uint32_t perm = kPermConsistentRead | (opts_.writable ? kPermWrite : 0u);
    VBLK_TRY(node_.set_perms(PermPair{perm, kPermAll & ~kPermResize}));
    dev_bytes_ = node_->length() / 512 * 512;

    VBLK_TRY(claim_device());
    if (!recovering_) VBLK_TRY(add_device());
    VBLK_TRY(open_char_device());
    const size_t desc_bytes = align_up(size_t{opts_.queue_depth} * sizeof(IoDesc), 4096);
    for (uint16_t q = 0; q < opts_.num_queues; ++q) {
      void* m = ::mmap(nullptr, desc_bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, cdev_.get(),
                       static_cast<off_t>(kCmdBufOffset + q * align_up(kMaxCmdBufBytes, 4096)));
      if (m == MAP_FAILED)
        return Error(errno, std::string("Failed to map the ublk queue's descriptors: ") + std::strerror(errno));
      descs_.push_back(static_cast<const IoDesc*>(m));
    }
    desc_bytes_ = desc_bytes;

    // More tags than SQ entries only means fetches go in several submits.
    const unsigned entries = std::min(4096u, std::bit_ceil(unsigned{opts_.num_queues} * opts_.queue_depth));
    io_uring_params rp{};
    // Not IORING_SETUP_DEFER_TASKRUN: with it, one kill in 20 of the soak
    // (bench/ublk_kill_soak.py) left the device with requests in flight
    // and the daemon idle, their task work apparently never run (the
    // reader ran it only when the eventfd rang, and a kernel may keep part
    // of a batch for the next call without ringing again). Task work on
    // the thread's own list runs on any return to user space.
    rp.flags = IORING_SETUP_CQSIZE;
    rp.cq_entries = 2 * entries;
    if (int r = io_uring_queue_init_params(entries, &ring_, &rp); r < 0)
      return Error(-r, std::string("Failed to set up an io_uring for ublk: ") + std::strerror(-r));
    ring_up_ = true;
    efd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!efd_.valid()) return Error(errno, std::string("eventfd: ") + std::strerror(errno));
    if (int r = io_uring_register_eventfd(&ring_, efd_.get()); r < 0)
      return Error(-r, std::string("Failed to set up an io_uring for ublk: ") + std::strerror(-r));

    for (uint16_t q = 0; q < opts_.num_queues; ++q)
      for (uint16_t t = 0; t < opts_.queue_depth; ++t) {
        auto tag = std::make_unique<Tag>();
        tag->q = q;
        tag->tag = t;
        tags_.push_back(std::move(tag));
      }
    // Every tag's fetch, before START_DEV: the driver waits for them all.
    batching_ = true;
    for (auto& t : tags_) queue_cmd(*t, kIoFetchReq, 0);
    batching_ = false;
    if (int r = io_uring_submit(&ring_); r < 0)
      return Error(-r, std::string("ublk FETCH_REQ failed: ") + std::strerror(-r));
    live_ = tags_.size();
    // The loop serves a kernel block device now: memory reclaim must not
    // wait on the I/O this thread is about to do (docs/exports.md).
    (void)::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0);
    tasks_.add();
    spawn_detached(reader());
    tasks_.add();
    spawn_detached(start());
    return {};
  }

  const char* type() const override { return "ublk"; }
  const Node* node() const override { return node_.get(); }
  uint32_t dev_id() const override { return dev_id_; }
  // The block device's openers are not visible here; mode safe deletes,
  // as for an NBD export without clients.
  bool in_use() const override { return false; }

  Task<Status> ready() override {
    co_await started_.wait();
    co_return start_status_;
  }

  Task<void> remove() override {
    co_await started_.wait();
    if (start_status_) {
      // The disk goes away once the requests in flight are answered: the
      // loop goes on serving them meanwhile.
      std::function<long()> stop = [this] {
        auto st = ctrl_.stop_dev(dev_id_);
        return st ? 0L : -static_cast<long>(st.error().code);
      };
      (void)co_await loop_.run_blocking(stop);
    }
    // Wake the reader, which sees stopping_; then the commands still
    // registered are cancelled with the ring.
    stopping_ = true;
    (void)::eventfd_write(efd_.get(), 1);
    co_await tasks_.wait();
    close_queues();
    std::function<long()> del = [this] {
      auto st = ctrl_.del_dev(dev_id_);
      return st ? 0L : -static_cast<long>(st.error().code);
    };
    (void)co_await loop_.run_blocking(del);
    added_ = false;
    node_.reset();
  }

 private:
  static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

  // A dev-id given: a device left by a killed daemon is taken back
  // (recovery) or replaced; one another live daemon serves is refused.
  Status claim_device() {
    if (opts_.dev_id < 0) return {};
    const auto id = static_cast<uint32_t>(opts_.dev_id);
    DevInfo old{};
    if (!ctrl_.get_dev_info(id, old)) return {};  // no such device: add it
    const bool alive = old.ublksrv_pid > 0 && old.ublksrv_pid != ::getpid() && ::kill(old.ublksrv_pid, 0) == 0;
    if (alive)
      return Error(EBUSY,
                   "ublk device " + std::to_string(id) + " is served by process " + std::to_string(old.ublksrv_pid));
    if (opts_.recovery && (old.flags & kFlagUserRecovery)) {
      // The driver notices the old daemon's exit on its own time: wait
      // for the queues to be quiesced before taking them over.
      for (int i = 0; i < 500 && old.state == kStateLive; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        if (!ctrl_.get_dev_info(id, old)) break;
      }
      if (old.nr_hw_queues != opts_.num_queues || old.queue_depth != opts_.queue_depth)
        return Error(EINVAL, "ublk device " + std::to_string(id) + " has " + std::to_string(old.nr_hw_queues) +
                                 " queues of depth " + std::to_string(old.queue_depth) + "; recovery needs the same");
      VBLK_TRY(ctrl_.start_user_recovery(id));
      dev_id_ = id;
      added_ = true;
      recovering_ = true;
      return {};
    }
    // A device that waits for recovery holds the requests of its users (a
    // mounted file system's writes): replacing it would drop them.
    if (old.flags & kFlagUserRecovery)
      return Error(EBUSY, "ublk device " + std::to_string(id) +
                              " waits for its daemon to come back; take it back with recovery=on");
    // Stale: its daemon is gone and it will not be recovered.
    (void)ctrl_.stop_dev(id);
    return ctrl_.del_dev(id);
  }

  Status add_device() {
    DevInfo info{};
    info.nr_hw_queues = opts_.num_queues;
    info.queue_depth = opts_.queue_depth;
    info.max_io_buf_bytes = kMaxIoBytes;
    info.dev_id = opts_.dev_id < 0 ? UINT32_MAX : static_cast<uint32_t>(opts_.dev_id);
    info.ublksrv_pid = ::getpid();
    info.flags = kFlagCmdIoctlEncode | (opts_.recovery ? kFlagUserRecovery | kFlagUserRecoveryReissue : 0);
    VBLK_TRY(ctrl_.add_dev(info));
    dev_id_ = info.dev_id;
    added_ = true;

    Params p{};
    p.len = sizeof p;
    p.types = kParamBasic;
    const auto lbs_shift = static_cast<uint8_t>(std::countr_zero(opts_.logical_block_size));
    p.basic.attrs = kAttrVolatileCache | kAttrFua | (opts_.writable ? 0 : kAttrReadOnly);
    p.basic.logical_bs_shift = lbs_shift;
    p.basic.physical_bs_shift = std::max<uint8_t>(lbs_shift, 12);
    p.basic.io_min_shift = lbs_shift;
    p.basic.io_opt_shift = std::max<uint8_t>(lbs_shift, 12);
    p.basic.max_sectors = kMaxIoBytes >> 9;
    p.basic.dev_sectors = dev_bytes_ >> 9;
    if (opts_.writable) {
      p.types |= kParamDiscard;
      p.discard.discard_granularity = opts_.logical_block_size;
      p.discard.max_discard_sectors = kMaxDiscardSectors;
      p.discard.max_write_zeroes_sectors = kMaxDiscardSectors;
      p.discard.max_discard_segments = 1;
    }
    return ctrl_.set_params(dev_id_, p);
  }

  Status open_char_device() {
    const std::string path = "/dev/ublkc" + std::to_string(dev_id_);
    // devtmpfs makes the node right after ADD_DEV; give it a moment.
    for (int i = 0; i < 200; ++i) {
      cdev_ = Fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
      if (cdev_.valid() || errno != ENOENT) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!cdev_.valid()) return Error(errno, "Failed to open " + path + ": " + std::strerror(errno));
    return {};
  }

  // START_DEV adds the disk, whose partition scan reads through the queues
  // this loop serves: it runs on the thread pool (as END_USER_RECOVERY,
  // which waits for every queue's fetches too).
  Task<void> start() {
    std::function<long()> fn = [this] {
      auto st = recovering_ ? ctrl_.end_user_recovery(dev_id_, ::getpid()) : ctrl_.start_dev(dev_id_, ::getpid());
      if (!st) start_error_ = st.error();
      return st ? 0L : -1L;
    };
    long r = co_await loop_.run_blocking(fn);
    if (r < 0) start_status_ = start_error_;
    started_.set();
    tasks_.done();
  }

  // One command per tag is ever outstanding, and the SQ holds them all.
  void queue_cmd(Tag& t, uint32_t op, int32_t result) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {
      (void)io_uring_submit(&ring_);
      if (!(sqe = io_uring_get_sqe(&ring_))) return;
    }
    std::memset(sqe, 0, sizeof *sqe);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = cdev_.get();
    sqe->cmd_op = op;
    IoCmd c{};
    c.q_id = t.q;
    c.tag = t.tag;
    c.result = result;
    c.addr = reinterpret_cast<uint64_t>(t.buf.data());
    std::memcpy(sqe->cmd, &c, sizeof c);
    io_uring_sqe_set_data(sqe, &t);
    if (batching_ || flush_pending_) return;
    flush_pending_ = true;
    tasks_.add();
    spawn_detached(flush_later());
  }

  // A reply after node I/O: submitted once the loop has run what else is
  // ready, with the replies those make.
  Task<void> flush_later() {
    co_await loop_.yield();
    flush_pending_ = false;
    if (ring_up_ && io_uring_sq_ready(&ring_)) (void)io_uring_submit(&ring_);
    tasks_.done();
  }

  Task<void> reader() {
    uint64_t v;
    std::vector<std::pair<Tag*, int>> got;
    while (live_ && !stopping_) {
      long n = co_await loop_.read_stream(efd_.get(), &v, sizeof v);
      if (n == -EINTR || n == -EAGAIN) continue;
      if (n < 0 || stopping_) break;
      got.clear();
      unsigned head, seen = 0;
      io_uring_cqe* cqe;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        got.emplace_back(static_cast<Tag*>(io_uring_cqe_get_data(cqe)), cqe->res);
        ++seen;
      }
      io_uring_cq_advance(&ring_, seen);
      batching_ = true;
      for (auto [t, res] : got) {
        if (res != 0) {  // UBLK_IO_RES_ABORT: the device is going; anything else: refused
          --live_;
          continue;
        }
        tasks_.add();
        spawn_detached(serve(*t));
      }
      batching_ = false;
      if (io_uring_sq_ready(&ring_)) (void)io_uring_submit(&ring_);
    }
    tasks_.done();
  }

  // One request: its descriptor is read once from the shared mapping and
  // checked before use; the answer is bytes done or -errno.
  Task<void> serve(Tag& t) {
    IoDesc d;
    std::memcpy(&d, const_cast<const IoDesc*>(&descs_[t.q][t.tag]), sizeof d);
    const uint8_t op = d.op_flags & 0xff;
    const uint64_t off = d.start_sector << 9, len = uint64_t{d.nr_sectors} << 9;
    int32_t res = 0;
    const bool in_range = d.start_sector < (uint64_t{1} << 54) && off + len <= dev_bytes_;
    Status st;
    switch (op) {
      case kOpRead:
      case kOpWrite:
        if (!in_range || len > kMaxIoBytes) {
          res = -EIO;
        } else if (op == kOpRead) {
          st = co_await node_->read(off, t.buf.span().subspan(0, len));
        } else if (!opts_.writable) {
          res = -EROFS;
        } else {
          st = co_await node_->write(off, t.buf.span().subspan(0, len), write_flags(d.op_flags));
        }
        if (res == 0) res = st ? static_cast<int32_t>(len) : -st.error().code;
        break;
      case kOpFlush:
        st = co_await node_->flush();
        res = st ? 0 : -st.error().code;
        break;
      case kOpDiscard:
      case kOpWriteZeroes:
        if (!in_range) {
          res = -EIO;
        } else if (!opts_.writable) {
          res = -EROFS;
        } else {
          if (op == kOpDiscard)
            st = co_await node_->discard(off, len);
          else
            st = co_await node_->write_zeroes(off, len, write_flags(d.op_flags) | zero_flags(d.op_flags));
          res = st ? 0 : -st.error().code;
        }
        break;
      default: res = -EOPNOTSUPP; break;
    }
    if (ring_up_) queue_cmd(t, kIoCommitAndFetchReq, res);
    tasks_.done();
  }

  // With recovery, a write is in the kernel's hands before it is answered
  // (kReqSurviveKill: qcow2 writes its metadata to the file): a daemon
  // killed after answering writes whose qcow2 metadata it still held in
  // memory would lose them, and the file system's next flush, answered by
  // the daemon that took over, would wrongly vouch for them
  // (bench/results/ublk_kills_s23.txt: fsynced files read back as zeroes).
  // The page cache outlives the daemon; that flush makes it durable.
  uint32_t write_flags(uint32_t op_flags) const {
    return ((op_flags & kIoFlagFua) ? uint32_t{kReqFua} : 0u) | (opts_.recovery ? uint32_t{kReqSurviveKill} : 0u);
  }

  static uint32_t zero_flags(uint32_t op_flags) { return (op_flags & kIoFlagNoUnmap) ? 0u : uint32_t{kReqMayUnmap}; }

  void close_queues() {
    if (ring_up_) {
      ring_up_ = false;
      io_uring_queue_exit(&ring_);  // cancels the fetches still registered
    }
    efd_.reset();
    for (const IoDesc* m : descs_) ::munmap(const_cast<IoDesc*>(m), desc_bytes_);
    descs_.clear();
    cdev_.reset();
  }

  // A failed create: what setup made is undone (the device deleted),
  // except a device being recovered, left waiting for the next attempt.
  void release() {
    close_queues();
    if (added_ && !recovering_) {
      (void)ctrl_.stop_dev(dev_id_);
      (void)ctrl_.del_dev(dev_id_);
      added_ = false;
    }
  }

  Loop& loop_;
  Options opts_;
  NodeRef node_;
  Control ctrl_;
  WaitGroup tasks_;  // the reader, START_DEV, requests being served, pending submits
  CoEvent started_;  // START_DEV returned (start_status_ says how)
  Status start_status_;
  Error start_error_{EIO};
  uint32_t dev_id_ = UINT32_MAX;
  bool added_ = false;
  bool recovering_ = false;  // taking over a device a killed daemon served
  uint64_t dev_bytes_ = 0;
  Fd cdev_;
  std::vector<const IoDesc*> descs_;
  size_t desc_bytes_ = 0;
  io_uring ring_{};
  bool ring_up_ = false;
  Fd efd_;
  bool batching_ = false;
  bool flush_pending_ = false;
  bool stopping_ = false;
  size_t live_ = 0;  // tags whose fetch has not been aborted
  std::vector<std::unique_ptr<Tag>> tags_;
};

}  // namespace

Result<std::unique_ptr<UblkExport>> UblkExport::create(Loop& loop, Options o) {
  if (!o.node) return Error(EINVAL, "no node to export");
  if (o.writable && o.node->read_only()) return Error(EACCES, "Cannot export read-only node as writable");
  if (o.num_queues < 1 || o.num_queues > 64) return Error(EINVAL, "num-queues must be between 1 and 64");
  if (o.queue_depth < 1 || o.queue_depth > kMaxQueueDepth)
    return Error(EINVAL, "queue-depth must be between 1 and " + std::to_string(kMaxQueueDepth));
  if (o.logical_block_size < 512 || o.logical_block_size > 4096 || (o.logical_block_size & (o.logical_block_size - 1)))
    return Error(EINVAL, "logical-block-size must be 512, 1024, 2048 or 4096");
  if (o.dev_id < -1 || o.dev_id >= (1 << 20)) return Error(EINVAL, "dev-id must be -1 or between 0 and 1048575");
  auto ctrl = Control::open();
  VBLK_TRY(ctrl);
  auto e = std::make_unique<Export>(loop, std::move(o), std::move(*ctrl));
  VBLK_TRY(e->setup());
  return std::unique_ptr<UblkExport>(std::move(e));
}

}  // namespace vblk::ublk
