// The VDUSE export: the virtio-blk device (vhost_user/virtio_blk.h) served
// to the kernel's own virtio driver through /dev/vduse (Linux 5.15+,
// module vduse). What VduseBlkExport is.
//
// The device's life, as the kernel drives it:
//   create     CREATE_DEV on /dev/vduse/control (features, configuration
//              space, queue count), open /dev/vduse/NAME, VQ_SETUP for
//              each queue's maximum size.
//   attach     the operator's `vdpa dev add`; the driver negotiates and
//              sets the queues up inside the kernel.
//   DRIVER_OK  a SET_STATUS message: the daemon maps the IOVA space
//              (IOTLB_GET_FD per region), reads each queue's rings and
//              starting index (VQ_GET_INFO), gives it a kick eventfd
//              (VQ_SETUP_KICKFD) and serves it; completions interrupt the
//              driver with VQ_INJECT_IRQ.
//   reset      SET_STATUS 0: the queues stop after their requests in
//              flight, and the mappings go.
//   UPDATE_IOTLB  the IOVA mappings changed: the queues pause, the space
//              is mapped again, and they go on where they were.
// Every message is answered; a message the daemon does not know gets
// VDUSE_REQ_RESULT_FAILED.
#include <fcntl.h>
#include <linux/vduse.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "vblk/net.h"
#include "vblk/node_ref.h"
#include "vblk/sync.h"
#include "vblk/vduse_blk.h"
#include "vhost_user/guest_memory.h"
#include "vhost_user/virtio_blk.h"
#include "vhost_user/virtqueue.h"

namespace vblk::vduse {

namespace {

using vhost::bit;

constexpr uint32_t kVirtioIdBlock = 2;
constexpr unsigned kFAccessPlatform = 33;  // VIRTIO_F_ACCESS_PLATFORM: VDUSE requires it
constexpr uint8_t kStatusDriverOk = 4;
// The driver's coherent allocations (one per ring) and the bounce map.
constexpr size_t kMaxIovaRegions = 256;
constexpr uint32_t kQueueAlign = 4096;

Error sys_error(const std::string& what) {
  const int e = errno;
  return Error(e, what + ": " + std::strerror(e));
}

// After the queues' inflight areas in the log file: the writes answered
// and the flushes that covered them (virtio_blk.h's WriteLedger).
struct LedgerWords {
  uint64_t magic;
  uint64_t answered;  // writes answered, ever
  uint64_t flushed;   // of those, covered by a flush that succeeded
  uint64_t pad[5];
};
// "vduse02*": the daemon answered writes only once they outlived it
// (kReqSurviveKill). A log of another magic is an unknown past.
constexpr uint64_t kLedgerMagic = 0x766475736530322aull;

struct Queue {
  explicit Queue(Loop& l) : inflight(l), exited(l) {}
  vhost::SplitQueue ring;
  Fd kick;
  bool running = false;   // a run_queue task serves the ring
  bool stopping = false;  // ... and has been asked to end
  WaitGroup inflight;     // requests being served
  CoEvent exited;         // the run_queue task has ended
};

class Export final : public VduseBlkExport, public vhost::WriteLedger {
 public:
  Export(Loop& loop, Options o)
      : loop_(loop), opts_(std::move(o)), node_(opts_.node), mem_(kMaxIovaRegions), msgs_done_(loop) {
    vhost::VirtioBlkOptions v;
    v.writable = opts_.writable;
    v.writethrough = opts_.writethrough;
    v.logical_block_size = opts_.logical_block_size;
    v.num_queues = opts_.num_queues;
    v.seg_max = opts_.queue_size - 2u;
    v.config_wce = false;
    v.mq_always = false;
    v.serial = opts_.serial;
    v.ledger = this;
    v.survive_kill = true;  // a next daemon takes the device over
    dev_ = vhost::VirtioBlk::create(loop, node_, std::move(v));
    mem_.on_miss = [this](uint64_t addr) { return map_region(addr); };
    for (uint16_t i = 0; i < opts_.num_queues; ++i) queues_.push_back(std::make_unique<Queue>(loop));
  }

  ~Export() override { release(); }

  Status setup() {
    const uint32_t perm = kPermConsistentRead | (opts_.writable ? kPermWrite : 0u);
    VBLK_TRY(node_.set_perms(PermPair{perm, kPermAll & ~kPermResize}));

    ctrl_ = Fd(::open("/dev/vduse/control", O_RDWR | O_CLOEXEC));
    if (!ctrl_.valid()) return sys_error("Failed to open /dev/vduse/control (module vduse)");
    uint64_t version = 0;
    if (::ioctl(ctrl_.get(), VDUSE_SET_API_VERSION, &version) < 0)
      return sys_error("Failed to set the VDUSE API version");
    VBLK_TRY(create_device());
    if (!dev_fd_.valid()) VBLK_TRY(open_device());
    VBLK_TRY(open_log());
    if (!takeover_) {
      for (uint16_t i = 0; i < opts_.num_queues; ++i) {
        vduse_vq_config c{};
        c.index = i;
        c.max_size = opts_.queue_size;
        if (::ioctl(dev_fd_.get(), VDUSE_VQ_SETUP, &c) < 0) return sys_error("VDUSE_VQ_SETUP");
      }
    }
    stop_efd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!stop_efd_.valid()) return sys_error("eventfd");
    // A device taken over is ours from here: destroyed at removal once
    // detached. A failed takeover leaves it, and its log, as they were.
    created_ = true;
    spawn_detached(messages());
    return {};
  }

  const char* type() const override { return "vduse-blk"; }
  const Node* node() const override { return node_.get(); }
  // The kernel's driver is the client, bound or not: mode safe deletes,
  // as for a ublk export.
  bool in_use() const override { return false; }

  Task<void> remove() override {
    stopping_ = true;
    uint64_t one = 1;
    (void)!::write(stop_efd_.get(), &one, sizeof one);
    co_await msgs_done_.wait();
    co_await stop_queues();
    mem_.clear();
    release();
    node_.reset();
  }

 private:
  Status create_device() {
    const vhost::BlkConfig cfg = dev_->config();
    std::vector<uint8_t> buf(sizeof(vduse_dev_config) + sizeof cfg);
    auto* c = reinterpret_cast<vduse_dev_config*>(buf.data());
    std::memcpy(c->name, opts_.name.data(), opts_.name.size());
    c->vendor_id = 0;
    c->device_id = kVirtioIdBlock;
    c->features = dev_->features() | bit(vhost::kFVersion1) | bit(kFAccessPlatform) | bit(vhost::kFRingEventIdx) |
                  bit(vhost::kFRingIndirectDesc);
    c->vq_num = opts_.num_queues;
    c->vq_align = kQueueAlign;
    c->config_size = sizeof cfg;
    std::memcpy(c->config, &cfg, sizeof cfg);
    if (::ioctl(ctrl_.get(), VDUSE_CREATE_DEV, c) == 0) {
      created_ = true;
      return {};
    }
    if (errno != EEXIST) return sys_error("Failed to create VDUSE device '" + opts_.name + "'");
    // Left by a daemon that is gone: destroyed if nothing holds it (no
    // driver attached, no process serving it), then made anew.
    char name[VDUSE_NAME_MAX] = {};
    std::memcpy(name, opts_.name.data(), opts_.name.size());
    if (::ioctl(ctrl_.get(), VDUSE_DESTROY_DEV, name) < 0) {
      if (errno != EBUSY) return sys_error("Failed to replace VDUSE device '" + opts_.name + "'");
      // Attached to the vDPA bus: a driver holds it. If no process serves
      // it (its daemon was killed), this one takes it over.
      const std::string path = "/dev/vduse/" + opts_.name;
      dev_fd_ = Fd(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK));
      if (!dev_fd_.valid() && errno == EBUSY)
        return Error(EBUSY, "VDUSE device '" + opts_.name + "' is served by another process");
      if (!dev_fd_.valid()) return sys_error("Failed to open " + path);
      takeover_ = true;  // ours once setup() succeeds (created_ then)
      return {};
    }
    if (::ioctl(ctrl_.get(), VDUSE_CREATE_DEV, c) < 0)
      return sys_error("Failed to create VDUSE device '" + opts_.name + "'");
    created_ = true;
    return {};
  }

  Status open_device() {
    const std::string path = "/dev/vduse/" + opts_.name;
    // devtmpfs makes the node right after CREATE_DEV; give it a moment.
    for (int i = 0; i < 200; ++i) {
      dev_fd_ = Fd(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NONBLOCK));
      if (dev_fd_.valid() || errno != ENOENT) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!dev_fd_.valid()) return sys_error("Failed to open " + path);
    return {};
  }

  // The log a daemon that takes the device over reads: each queue's
  // requests popped and not completed (vhost-user's inflight format), and
  // the write ledger. $TMPDIR/vduse-blk-NAME (as QEMU's vduse-blk), made
  // anew for a new device, kept by a killed daemon for the next one.
  Status open_log() {
    const char* dir = std::getenv("TMPDIR");
    log_path_ = std::string(dir && *dir ? dir : "/tmp") + "/vduse-blk-" + opts_.name;
    queue_bytes_ = vhost::inflight_queue_bytes(opts_.queue_size);
    log_bytes_ = queue_bytes_ * opts_.num_queues + sizeof(LedgerWords);
    Fd fd;
    bool fresh = !takeover_;
    bool known = true;  // the log says what the previous daemon left unflushed
    if (takeover_) {
      fd = Fd(::open(log_path_.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
      struct stat st {};
      if (!fd.valid() && errno != ENOENT) return sys_error("Failed to open " + log_path_);
      if (!fd.valid()) {
        report("no log at " + log_path_ + ": requests the previous daemon took are not answered");
        fresh = true;
        known = false;
      } else if (::fstat(fd.get(), &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
        // Anyone may write a file into /tmp: only our own is trusted.
        return Error(EPERM, "VDUSE device '" + opts_.name + "': " + log_path_ + " is not a file of this user");
      } else if (static_cast<uint64_t>(st.st_size) != log_bytes_) {
        return Error(EINVAL, "VDUSE device '" + opts_.name + "': " + log_path_ +
                                 " does not fit these queues (num-queues and queue-size must be the previous ones)");
      }
    }
    if (fresh) {
      // A new file, never one already there (whoever made it); its blocks
      // reserved now, so a full file system fails here and not as a
      // SIGBUS on a store into the mapping later.
      if (::unlink(log_path_.c_str()) < 0 && errno != ENOENT) return sys_error("Failed to replace " + log_path_);
      fd = Fd(::open(log_path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
      if (!fd.valid()) return sys_error("Failed to make " + log_path_);
      if (int e = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(log_bytes_)); e != 0) {
        ::unlink(log_path_.c_str());
        return Error(e, "Failed to make " + log_path_ + ": " + std::strerror(e));
      }
    }
    void* m = ::mmap(nullptr, log_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (m == MAP_FAILED) return sys_error("Failed to map " + log_path_);
    log_ = static_cast<uint8_t*>(m);
    LedgerWords& w = ledger();
    if (!fresh && w.magic != kLedgerMagic) known = false;
    if (fresh || w.magic != kLedgerMagic) {
      w = LedgerWords{};
      w.magic = kLedgerMagic;
    }
    // The killed daemon answered each write once it was in the kernel's
    // hands (its data and its qcow2 metadata in the file's page cache), so
    // our flush makes the unflushed ones durable too. Without a log (or
    // with one we cannot read) what it did is unknown: the next flush says
    // so instead of vouching.
    log_known_ = known;
    unvouched_ = takeover_ && !known;
    if (takeover_)
      report("taking over the device of a daemon that is gone (" + std::to_string(w.answered) + " writes answered, " +
             std::to_string(w.answered - w.flushed) + " of them to be made durable by the next flush)");
    if (unvouched_) report("what the previous daemon left unflushed is unknown; the next flush fails");
    return {};
  }

  LedgerWords& ledger() { return *reinterpret_cast<LedgerWords*>(log_ + queue_bytes_ * opts_.num_queues); }
  vhost::InflightQueue* log_queue(uint32_t i) {
    return reinterpret_cast<vhost::InflightQueue*>(log_ + queue_bytes_ * i);
  }

  // ---- WriteLedger
  void answered() override { ++ledger().answered; }
  uint64_t flush_begins() override { return ledger().answered; }
  void flushed(uint64_t covered) override {
    if (covered > ledger().flushed) ledger().flushed = covered;
  }
  bool flush_can_vouch() override {
    if (!unvouched_) return true;
    // Once: the driver has been told; what it writes from now on is ours.
    unvouched_ = false;
    ledger().flushed = ledger().answered;
    return false;
  }

  // The control messages, one at a time, each answered before the next.
  // The wait for one runs on the thread pool, where remove() ends it
  // through the stop eventfd.
  Task<void> messages() {
    std::function<long()> wait = [this] {
      pollfd p[2] = {{dev_fd_.get(), POLLIN, 0}, {stop_efd_.get(), POLLIN, 0}};
      int r = ::poll(p, 2, -1);
      if (r < 0) return -static_cast<long>(errno);
      return (p[1].revents & POLLIN) ? 1L : 0L;
    };
    if (takeover_) {
      // The driver set the device up with the previous daemon: serve the
      // queues it made ready, requests in flight first, and interrupt
      // once in case completions were published but never signalled.
      const bool started = co_await start_queues();
      if (!started) report("taking over the queues failed");
      for (uint32_t i = 0; i < queues_.size(); ++i)
        if (queues_[i]->running) interrupt(i);
      log_known_ = true;  // from here on the log is this daemon's
    }
    while (!stopping_) {
      long r = co_await loop_.run_blocking(wait);
      if (stopping_ || r == 1) break;
      if (r < 0 && r != -EINTR) {
        report("poll: " + std::string(std::strerror(static_cast<int>(-r))));
        break;
      }
      vduse_dev_request req{};
      ssize_t n = ::read(dev_fd_.get(), &req, sizeof req);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n != static_cast<ssize_t>(sizeof req)) {
        report(n < 0 ? std::string("read: ") + std::strerror(errno) : "short message");
        break;
      }
      vduse_dev_response resp{};
      resp.request_id = req.request_id;
      resp.result = VDUSE_REQ_RESULT_OK;
      switch (req.type) {
        case VDUSE_GET_VQ_STATE:
          if (req.vq_state.index >= queues_.size()) {
            resp.result = VDUSE_REQ_RESULT_FAILED;
            break;
          }
          resp.vq_state.index = req.vq_state.index;
          resp.vq_state.split.avail_index = queues_[req.vq_state.index]->ring.last_avail;
          break;
        case VDUSE_SET_STATUS:
          if (req.s.status & kStatusDriverOk) {
            const bool started = co_await start_queues();
            if (!started) resp.result = VDUSE_REQ_RESULT_FAILED;
          } else if (req.s.status == 0) {
            co_await stop_queues();
            mem_.clear();
            for (auto& q : queues_) q->ring = vhost::SplitQueue{};
            // A reset device starts over: no request in flight to replay.
            for (uint16_t i = 0; i < queues_.size(); ++i) std::memset(log_queue(i), 0, queue_bytes_);
          }
          break;
        case VDUSE_UPDATE_IOTLB: {
          // The rings may lie in what changed: pause, map again, go on.
          bool were_running = false;
          for (auto& q : queues_) were_running |= q->running;
          co_await stop_queues();
          mem_.clear();
          if (were_running) {
            const bool resumed = co_await resume_queues();
            if (!resumed) resp.result = VDUSE_REQ_RESULT_FAILED;
          }
          break;
        }
        default: resp.result = VDUSE_REQ_RESULT_FAILED; break;
      }
      if (::write(dev_fd_.get(), &resp, sizeof resp) != static_cast<ssize_t>(sizeof resp))
        report(std::string("reply: ") + std::strerror(errno));
    }
    msgs_done_.set();
  }

  void report(const std::string& why) {
    std::fprintf(stderr, "vblk: vduse-blk %s: %s\n", opts_.name.c_str(), why.c_str());
  }

  // The region holding `addr`, mapped as its driver starts to use it (the
  // bounce area appears with the first request after DRIVER_OK, and no
  // message says so).
  bool map_region(uint64_t addr) {
    vduse_iotlb_entry e{};
    e.start = addr;
    e.last = addr;
    int fd = ::ioctl(dev_fd_.get(), VDUSE_IOTLB_GET_FD, &e);
    if (fd < 0) return false;
    Fd f(fd);
    if (e.last < e.start || addr < e.start || addr > e.last) return false;
    auto st = mem_.add(vhost::MemRegion{e.start, e.last - e.start + 1, e.start, e.offset}, f.get());
    if (!st) report("IOVA region at " + std::to_string(e.start) + ": " + st.error().what());
    return st.ok();
  }

  // Every region of the device's IOVA space, in address order.
  Status map_iova() {
    mem_.clear();
    uint64_t cursor = 0;
    for (size_t i = 0; i < kMaxIovaRegions; ++i) {
      vduse_iotlb_entry e{};
      e.start = cursor;
      e.last = UINT64_MAX;
      int fd = ::ioctl(dev_fd_.get(), VDUSE_IOTLB_GET_FD, &e);
      if (fd < 0) {
        if (errno == EINVAL) return {};  // no region from cursor on
        return sys_error("VDUSE_IOTLB_GET_FD");
      }
      Fd f(fd);
      if (e.last < e.start || e.start < cursor) return Error(EPROTO, "VDUSE gave an IOVA region out of order");
      vhost::MemRegion r{e.start, e.last - e.start + 1, e.start, e.offset};
      VBLK_TRY(mem_.add(r, f.get()));
      if (e.last == UINT64_MAX) return {};
      cursor = e.last + 1;
    }
    return Error(ENOSPC, "more than " + std::to_string(kMaxIovaRegions) + " IOVA regions");
  }

  // DRIVER_OK: the negotiated features, the mappings, and each queue the
  // driver made ready.
  Task<bool> start_queues() {
    if (::ioctl(dev_fd_.get(), VDUSE_DEV_GET_FEATURES, &features_) < 0) {
      report(sys_error("VDUSE_DEV_GET_FEATURES").what());
      co_return false;
    }
    if (auto st = map_iova(); !st) {
      report(st.error().what());
      co_return false;
    }
    for (uint16_t i = 0; i < queues_.size(); ++i) {
      Queue& q = *queues_[i];
      if (q.running) continue;
      vduse_vq_info info{};
      info.index = i;
      if (::ioctl(dev_fd_.get(), VDUSE_VQ_GET_INFO, &info) < 0) {
        report(sys_error("VDUSE_VQ_GET_INFO").what());
        co_return false;
      }
      if (!info.ready) continue;
      q.ring = vhost::SplitQueue{};
      q.ring.num = info.num;
      q.ring.addr.desc_user_addr = info.desc_addr;
      q.ring.addr.avail_user_addr = info.driver_addr;
      q.ring.addr.used_user_addr = info.device_addr;
      q.ring.addr_set = true;
      q.ring.last_avail = info.split.avail_index;
      if (!q.kick.valid()) {
        q.kick = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
        vduse_vq_eventfd k{};
        k.index = i;
        k.fd = q.kick.get();
        if (!q.kick.valid() || ::ioctl(dev_fd_.get(), VDUSE_VQ_SETUP_KICKFD, &k) < 0) {
          report(sys_error("VDUSE_VQ_SETUP_KICKFD").what());
          q.kick.reset();
          co_return false;
        }
      }
      if (!start(q, i)) co_return false;
    }
    co_return true;
  }

  // After an IOTLB update: the same rings, mapped again, from where they
  // stopped.
  Task<bool> resume_queues() {
    if (auto st = map_iova(); !st) {
      report(st.error().what());
      co_return false;
    }
    bool ok = true;
    for (uint16_t i = 0; i < queues_.size(); ++i)
      if (queues_[i]->ring.addr_set && queues_[i]->kick.valid()) ok &= start(*queues_[i], i);
    co_return ok;
  }

  bool start(Queue& q, uint16_t index) {
    if (auto st = q.ring.start(mem_, features_ & bit(vhost::kFRingEventIdx), features_ & bit(vhost::kFRingIndirectDesc),
                               log_queue(index));
        !st) {
      report("queue " + std::to_string(index) + ": " + st.error().what());
      return false;
    }
    // Taken over without a log: what the killed daemon had popped is
    // unknown, and the kernel's starting index is the device's first one.
    // Start after what was completed, never replaying old entries of the
    // available ring (the requests in flight are lost then).
    if (takeover_ && !log_known_) q.ring.last_avail = q.ring.used_idx();
    q.running = true;
    q.stopping = false;
    q.exited.reset();
    spawn_detached(run_queue(q, index));
    return true;
  }

  // Ends every queue's task and waits for its requests; the kick
  // eventfds stay registered for the next start.
  Task<void> stop_queues() {
    for (auto& qp : queues_) {
      Queue& q = *qp;
      if (q.running) {
        q.stopping = true;
        uint64_t one = 1;
        (void)!::write(q.kick.get(), &one, sizeof one);
        co_await q.exited.wait();
        q.running = false;
        q.stopping = false;
      }
      co_await q.inflight.wait();
      q.ring.stop();
    }
  }

  void interrupt(uint32_t index) {
    if (::ioctl(dev_fd_.get(), VDUSE_VQ_INJECT_IRQ, &index) < 0 && !irq_error_reported_) {
      irq_error_reported_ = true;
      report(sys_error("VDUSE_VQ_INJECT_IRQ").what());
    }
  }

  Task<void> serve_request(Queue& q, uint32_t index, std::unique_ptr<vhost::Chain> c) {
    auto r = co_await dev_->handle(*c);
    if (!r) {
      report("queue " + std::to_string(index) + ": " + r.error().what());
    } else {
      q.ring.push(c->head, *r);
      if (q.ring.need_notify()) interrupt(index);
    }
    q.inflight.done();
  }

  // As the vhost-user back end's: everything available with kicks off,
  // then kicks on and one more look, then wait for a kick.
  Task<void> run_queue(Queue& q, uint32_t index) {
    while (!q.stopping) {
      bool broken = false;
      for (;;) {
        q.ring.set_notify(false);
        std::unique_ptr<vhost::Chain> c;
        for (;;) {
          if (!c) c = std::make_unique<vhost::Chain>();
          auto got = q.ring.pop(mem_, *c);
          if (!got) {
            // A driver in the kernel that breaks the ring rules: the
            // queue stops rather than touch memory it was not given.
            report("queue " + std::to_string(index) + ": " + got.error().what());
            broken = true;
            break;
          }
          if (!*got) break;
          q.inflight.add();
          spawn_detached(serve_request(q, index, std::move(c)));
          if (q.stopping) break;
        }
        if (broken || q.stopping) break;
        q.ring.set_notify(true);
        if (q.ring.empty()) break;
      }
      if (broken || q.stopping) break;
      uint64_t v;
      long n = co_await loop_.read_stream(q.kick.get(), &v, sizeof v);
      if (n < 0 && n != -EAGAIN && n != -EINTR) {
        report("queue " + std::to_string(index) + ": kick: " + std::strerror(static_cast<int>(-n)));
        break;
      }
    }
    q.exited.set();
  }

  // What setup made is undone: the kick descriptors, the device's file,
  // and the device itself (refused, and left, while a driver holds it:
  // `vdpa dev del NAME` first, as with qemu-storage-daemon).
  void release() {
    for (auto& q : queues_) q->kick.reset();
    dev_fd_.reset();
    if (created_ && ctrl_.valid()) {
      char name[VDUSE_NAME_MAX] = {};
      std::memcpy(name, opts_.name.data(), opts_.name.size());
      if (::ioctl(ctrl_.get(), VDUSE_DESTROY_DEV, name) == 0) {
        if (!log_path_.empty()) ::unlink(log_path_.c_str());
      } else if (errno == EBUSY) {
        // Its log stays too: the next daemon for the name takes it over.
        report("the device stays: it is still attached (vdpa dev del " + opts_.name + ")");
      }
      created_ = false;
    }
    ctrl_.reset();
    if (log_) ::munmap(log_, log_bytes_);
    log_ = nullptr;
  }

  Loop& loop_;
  Options opts_;
  NodeRef node_;
  std::unique_ptr<vhost::VirtioBlk> dev_;
  vhost::GuestMemory mem_;
  std::vector<std::unique_ptr<Queue>> queues_;
  Fd ctrl_;
  Fd dev_fd_;
  Fd stop_efd_;
  bool created_ = false;
  bool takeover_ = false;   // a device a killed daemon served
  bool unvouched_ = false;  // its unflushed writes: the next flush fails
  bool log_known_ = true;   // a takeover found the killed daemon's log
  std::string log_path_;
  uint8_t* log_ = nullptr;
  size_t log_bytes_ = 0;
  size_t queue_bytes_ = 0;
  bool stopping_ = false;
  bool irq_error_reported_ = false;
  uint64_t features_ = 0;
  CoEvent msgs_done_;  // the message task has ended
};

}  // namespace

Result<std::unique_ptr<VduseBlkExport>> VduseBlkExport::create(Loop& loop, Options o) {
  if (!o.node) return Error(EINVAL, "no node to export");
  if (o.writable && o.node->read_only()) return Error(EACCES, "Cannot export read-only node as writable");
  if (o.name.empty() || o.name.size() >= VDUSE_NAME_MAX || o.name.find('/') != std::string::npos ||
      o.name.find("..") != std::string::npos)
    return Error(EINVAL, "Invalid VDUSE device name '" + o.name + "'");
  if (o.num_queues < 1 || o.num_queues > 64) return Error(EINVAL, "num-queues must be between 1 and 64");
  if (o.queue_size <= 2 || o.queue_size > 1024 || (o.queue_size & (o.queue_size - 1)))
    return Error(EINVAL, "queue-size is invalid");
  if (o.logical_block_size < 512 || o.logical_block_size > 4096 || (o.logical_block_size & (o.logical_block_size - 1)))
    return Error(EINVAL, "logical-block-size must be 512, 1024, 2048 or 4096");
  auto e = std::make_unique<Export>(loop, std::move(o));
  VBLK_TRY(e->setup());
  return std::unique_ptr<VduseBlkExport>(std::move(e));
}

}  // namespace vblk::vduse
