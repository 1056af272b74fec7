#include "vhost_user/backend.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stop_token>
#include <vector>

#include "vhost_user/guest_memory.h"
#include "vhost_user/stall_watch.h"

namespace vblk::vhost {

namespace {

// Ring and vhost-user features every device gets.
constexpr uint64_t kBackendFeatures =
    bit(kFVersion1) | bit(kFRingIndirectDesc) | bit(kFRingEventIdx) | bit(kFProtocolFeatures);
constexpr uint64_t kProtocolFeatures = bit(kPfMq) | bit(kPfReplyAck) | bit(kPfConfig) | bit(kPfInflightShmfd);

struct Msg {
  MsgHeader hdr{};
  alignas(8) uint8_t payload[kMaxPayload];
  std::vector<Fd> fds;

  template <class T>
  const T& as() const {
    return *reinterpret_cast<const T*>(payload);
  }
  uint64_t u64() const {
    uint64_t v;
    std::memcpy(&v, payload, sizeof v);
    return v;
  }
};

Error proto(const std::string& why) { return Error(EPROTO, why); }

const char* request_name(uint32_t r) {
  switch (r) {
    case kGetFeatures: return "GET_FEATURES";
    case kSetFeatures: return "SET_FEATURES";
    case kSetOwner: return "SET_OWNER";
    case kResetOwner: return "RESET_OWNER";
    case kSetMemTable: return "SET_MEM_TABLE";
    case kSetVringNum: return "SET_VRING_NUM";
    case kSetVringAddr: return "SET_VRING_ADDR";
    case kSetVringBase: return "SET_VRING_BASE";
    case kGetVringBase: return "GET_VRING_BASE";
    case kSetVringKick: return "SET_VRING_KICK";
    case kSetVringCall: return "SET_VRING_CALL";
    case kSetVringErr: return "SET_VRING_ERR";
    case kGetProtocolFeatures: return "GET_PROTOCOL_FEATURES";
    case kSetProtocolFeatures: return "SET_PROTOCOL_FEATURES";
    case kGetQueueNum: return "GET_QUEUE_NUM";
    case kSetVringEnable: return "SET_VRING_ENABLE";
    case kGetConfig: return "GET_CONFIG";
    case kSetConfig: return "SET_CONFIG";
    case kGetInflightFd: return "GET_INFLIGHT_FD";
    case kSetInflightFd: return "SET_INFLIGHT_FD";
    default: return "request";
  }
}

}  // namespace

struct Queue {
  explicit Queue(Loop& l) : inflight(l), exited(l) {}
  SplitQueue ring;
  Fd kick;
  Fd call;
  Fd err;
  bool enabled = false;
  bool running = false;    // a run_queue task serves the ring
  bool stopping = false;   // ... and has been asked to end
  WaitGroup inflight;      // requests being served
  CoEvent exited;          // the run_queue task has ended
  QueueActivity activity;  // for the stall watch
};

// The inflight area the front end keeps for us (GET/SET_INFLIGHT_FD).
struct InflightArea {
  InflightArea() = default;
  InflightArea(const InflightArea&) = delete;
  InflightArea& operator=(const InflightArea&) = delete;
  ~InflightArea() { reset(); }
  void reset() {
    if (map) ::munmap(map, map_len);
    map = nullptr;
    map_len = 0;
    queues = queue_size = 0;
  }
  void set(void* p, size_t len, uint64_t off, uint16_t nqueues, uint16_t qsize) {
    reset();
    map = static_cast<uint8_t*>(p);
    map_len = len;
    offset = off;
    queues = nqueues;
    queue_size = qsize;
  }
  InflightQueue* queue(size_t i) const {
    return reinterpret_cast<InflightQueue*>(map + offset + i * inflight_queue_bytes(queue_size));
  }
  uint8_t* map = nullptr;
  size_t map_len = 0;
  uint64_t offset = 0;
  uint16_t queues = 0;
  uint16_t queue_size = 0;
};

struct Session {
  Session(Loop& l, Device& d, Fd s) : loop(l), dev(d), sock(std::move(s)) {}
  Loop& loop;
  Device& dev;
  Fd sock;
  GuestMemory mem;
  InflightArea inflight;
  std::vector<std::unique_ptr<Queue>> queues;
  uint64_t features = 0;
  uint64_t protocol = 0;
  bool features_set = false;
  bool broken = false;
  std::string why;
  std::stop_source end_watch;  // the stall watch's

  void fail(const std::string& w) {
    if (broken) return;
    broken = true;
    why = w;
    // Wake the message loop so that the session ends.
    ::shutdown(sock.get(), SHUT_RDWR);
  }
};

namespace {

// ---- socket I/O

Task<Result<bool>> read_msg(Session& s, Msg& m) {
  m.fds.clear();
  iovec iov{&m.hdr, sizeof m.hdr};
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * kMaxFds)];
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cbuf;
  mh.msg_controllen = sizeof cbuf;
  long r = co_await s.loop.recvmsg(s.sock.get(), &mh);
  if (r == 0) co_return false;  // the front end hung up
  if (r < 0) co_return Error(static_cast<int>(-r), "vhost-user socket");
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      (void)::fcntl(fd, F_SETFD, FD_CLOEXEC);
      m.fds.emplace_back(fd);
    }
  }
  if (mh.msg_flags & MSG_CTRUNC) co_return proto("too many descriptors with one message");
  if (static_cast<size_t>(r) < sizeof m.hdr) {
    auto rest = std::span(reinterpret_cast<uint8_t*>(&m.hdr) + r, sizeof m.hdr - r);
    if (auto st = co_await recv_exact(s.loop, s.sock.get(), rest); !st) co_return st.error();
  }
  if ((m.hdr.flags & kFlagVersionMask) != kVersion)
    co_return proto("unsupported message version " + std::to_string(m.hdr.flags & kFlagVersionMask));
  if (m.hdr.size > kMaxPayload) co_return proto("message of " + std::to_string(m.hdr.size) + " bytes");
  if (m.hdr.size) {
    if (auto st = co_await recv_exact(s.loop, s.sock.get(), std::span(m.payload, m.hdr.size)); !st)
      co_return st.error();
  }
  co_return true;
}

Task<Status> send_reply(Session& s, uint32_t request, const void* payload, uint32_t size, int fd = -1) {
  MsgHeader h{request, kVersion | kFlagReply, size};
  iovec iov[2] = {{&h, sizeof h}, {const_cast<void*>(payload), size}};
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = size ? 2 : 1;
  if (fd >= 0) {
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  long r = co_await s.loop.sendmsg(s.sock.get(), &mh);
  if (r < 0) co_return Error(static_cast<int>(-r), "vhost-user socket");
  const size_t total = sizeof h + size;
  if (static_cast<size_t>(r) == total) co_return Status{};
  // A reply is a few hundred bytes at most: the rest of a short send goes
  // out plainly (the descriptor went with the first byte).
  std::vector<uint8_t> all(total);
  std::memcpy(all.data(), &h, sizeof h);
  if (size) std::memcpy(all.data() + sizeof h, payload, size);
  co_return co_await send_all(s.loop, s.sock.get(), std::span<const uint8_t>(all).subspan(static_cast<size_t>(r)));
}

// A coroutine, so that `v` lives in its frame while send_reply reads it.
Task<Status> reply_u64(Session& s, uint32_t request, uint64_t v) {
  co_return co_await send_reply(s, request, &v, sizeof v);
}

// ---- rings

void signal(int fd) {
  if (fd < 0) return;
  uint64_t one = 1;
  (void)!::write(fd, &one, sizeof one);
}

Task<void> serve_request(Session& s, Queue& q, std::unique_ptr<Chain> c) {
  auto r = co_await s.dev.handle(*c);
  if (!r) {
    s.fail(r.error().what());
  } else {
    // Even on a session that is ending: the rings stay mapped until every
    // request is done, and the front end may look at them again.
    q.ring.push(c->head, *r);
    q.activity.completed++;
    if (q.ring.need_notify()) {
      signal(q.call.get());
      q.activity.signalled++;
    }
  }
  q.inflight.done();
}

Task<void> run_queue(Session& s, Queue& q, size_t index) {
  while (!q.stopping && !s.broken) {
    // Everything available now, with kicks off; then kicks on and one more
    // look, since the driver may have added a request in between.
    for (;;) {
      q.ring.set_notify(false);
      // One chain is kept for the pop that finds the ring empty; a popped
      // one goes with its request.
      std::unique_ptr<Chain> c;
      for (;;) {
        if (!c) c = std::make_unique<Chain>();
        auto got = q.ring.pop(s.mem, *c);
        if (!got) {
          s.fail("queue " + std::to_string(index) + ": " + got.error().what());
          goto out;
        }
        if (!*got) break;
        q.inflight.add();
        q.activity.popped++;
        spawn_detached(serve_request(s, q, std::move(c)));
        if (q.stopping || s.broken) goto out;
      }
      q.ring.set_notify(true);
      if (q.ring.empty()) break;
    }
    uint64_t v;
    long n = co_await s.loop.read_stream(q.kick.get(), &v, sizeof v);
    if (n < 0 && n != -EAGAIN && n != -EINTR) {
      s.fail("queue " + std::to_string(index) + ": kick: " + std::strerror(static_cast<int>(-n)));
      break;
    }
  }
out:
  q.exited.set();
}

Status start_queue(Session& s, size_t index) {
  Queue& q = *s.queues[index];
  if (q.running || !q.kick.valid() || !s.features_set) return {};
  InflightQueue* area = nullptr;
  if (s.inflight.map) {
    if (index >= s.inflight.queues || q.ring.num > s.inflight.queue_size)
      return proto("queue " + std::to_string(index) + " does not fit the inflight area");
    area = s.inflight.queue(index);
  }
  VBLK_TRY(q.ring.start(s.mem, s.features & bit(kFRingEventIdx), s.features & bit(kFRingIndirectDesc), area));
  q.running = true;
  q.stopping = false;
  q.exited.reset();
  q.activity = {};
  spawn_detached(run_queue(s, q, index));
  return {};
}

// Ends the queue's task and waits for its requests.
Task<void> stop_queue(Session& s, Queue& q) {
  if (q.running) {
    q.stopping = true;
    signal(q.kick.get());  // wake it from its wait for a kick
    co_await q.exited.wait();
    q.running = false;
    q.stopping = false;
  }
  co_await q.inflight.wait();
  q.ring.stop();
  (void)s;
}

// Samples every running queue a few times per limit (stall_watch.h).
Task<void> watch_stalls(Session& s, std::chrono::steady_clock::duration limit,
                        const std::function<void(const std::string&)>& report, CoEvent& done) {
  std::vector<StallWatch> watch;
  auto period = std::clamp<std::chrono::steady_clock::duration>(limit / 4, std::chrono::milliseconds(250),
                                                                std::chrono::seconds(15));
  auto stop = s.end_watch.get_token();
  while (!stop.stop_requested()) {
    co_await s.loop.sleep(period, stop);
    if (stop.stop_requested()) break;
    auto now = std::chrono::steady_clock::now();
    watch.resize(s.queues.size(), StallWatch(limit));
    for (size_t i = 0; i < s.queues.size(); ++i) {
      Queue& q = *s.queues[i];
      if (!q.running || !q.ring.started()) {
        watch[i].reset();
        continue;
      }
      QueueActivity a = q.activity;
      a.in_flight = q.inflight.count();
      if (auto line = watch[i].check(now, a, q.ring.state()); line && report)
        report("queue " + std::to_string(i) + " " + *line);
    }
  }
  done.set();
}

Task<void> stop_all(Session& s) {
  for (auto& q : s.queues) co_await stop_queue(s, *q);
}

Result<Queue*> queue_of(Session& s, uint64_t index) {
  if (index >= s.queues.size()) return proto("queue index " + std::to_string(index) + " out of range");
  return s.queues[index].get();
}

Status need_size(const Msg& m, uint32_t size) {
  if (m.hdr.size < size)
    return proto(std::string(request_name(m.hdr.request)) + " with " + std::to_string(m.hdr.size) + " bytes");
  return {};
}

// ---- messages

// Serves one message; `replied` is set when it sent its own reply (no
// REPLY_ACK then).
Task<Status> handle(Session& s, Msg& m, bool& replied) {
  replied = false;
  const uint32_t req = m.hdr.request;
  switch (req) {
    case kGetFeatures: replied = true; co_return co_await reply_u64(s, req, kBackendFeatures | s.dev.features());
    case kSetFeatures: {
      VBLK_CO_TRY(need_size(m, 8));
      uint64_t f = m.u64();
      if (f & ~(kBackendFeatures | s.dev.features())) co_return proto("features not offered were acknowledged");
      s.features = f;
      s.features_set = true;
      // Rings that were already kicked start now.
      for (size_t i = 0; i < s.queues.size(); ++i) VBLK_CO_TRY(start_queue(s, i));
      co_return Status{};
    }
    case kGetProtocolFeatures: replied = true; co_return co_await reply_u64(s, req, kProtocolFeatures);
    case kSetProtocolFeatures:
      VBLK_CO_TRY(need_size(m, 8));
      if (m.u64() & ~kProtocolFeatures) co_return proto("protocol features not offered were acknowledged");
      s.protocol = m.u64();
      co_return Status{};
    case kGetQueueNum: replied = true; co_return co_await reply_u64(s, req, s.queues.size());
    case kSetOwner:
    case kResetOwner: co_return Status{};
    case kSetMemTable: {
      VBLK_CO_TRY(need_size(m, 8));
      const auto& t = m.as<MemTable>();
      if (t.nregions == 0 || t.nregions > kMaxMemRegions)
        co_return proto("memory table of " + std::to_string(t.nregions) + " regions");
      VBLK_CO_TRY(need_size(m, 8 + t.nregions * sizeof(MemRegion)));
      if (m.fds.size() != t.nregions) co_return proto("memory table without one descriptor per region");
      // Requests hold pointers into the old mapping: let them finish, then
      // remap and translate the rings again.
      std::vector<size_t> were_running;
      for (size_t i = 0; i < s.queues.size(); ++i) {
        if (s.queues[i]->running) were_running.push_back(i);
        co_await stop_queue(s, *s.queues[i]);
      }
      s.mem.clear();
      for (uint32_t i = 0; i < t.nregions; ++i) VBLK_CO_TRY(s.mem.add(t.regions[i], m.fds[i].get()));
      for (size_t i : were_running) VBLK_CO_TRY(start_queue(s, i));
      co_return Status{};
    }
    case kSetVringNum: {
      VBLK_CO_TRY(need_size(m, sizeof(VringState)));
      const auto& st = m.as<VringState>();
      auto q = queue_of(s, st.index);
      VBLK_CO_TRY(q);
      if ((*q)->running) co_return proto("SET_VRING_NUM on a running queue");
      if (st.num == 0 || st.num > kMaxQueueSize || (st.num & (st.num - 1)))
        co_return proto("invalid queue size " + std::to_string(st.num));
      (*q)->ring.num = st.num;
      co_return Status{};
    }
    case kSetVringAddr: {
      VBLK_CO_TRY(need_size(m, sizeof(VringAddr)));
      const auto& a = m.as<VringAddr>();
      auto q = queue_of(s, a.index);
      VBLK_CO_TRY(q);
      if ((*q)->running) co_return proto("SET_VRING_ADDR on a running queue");
      (*q)->ring.addr = a;
      (*q)->ring.addr_set = true;
      co_return Status{};
    }
    case kSetVringBase: {
      VBLK_CO_TRY(need_size(m, sizeof(VringState)));
      const auto& st = m.as<VringState>();
      auto q = queue_of(s, st.index);
      VBLK_CO_TRY(q);
      if ((*q)->running) co_return proto("SET_VRING_BASE on a running queue");
      if (st.num > 0xffff) co_return proto("vring base " + std::to_string(st.num));
      (*q)->ring.last_avail = static_cast<uint16_t>(st.num);
      co_return Status{};
    }
    case kGetVringBase: {
      VBLK_CO_TRY(need_size(m, sizeof(VringState)));
      VringState st = m.as<VringState>();
      auto q = queue_of(s, st.index);
      VBLK_CO_TRY(q);
      // The front end stops the ring: every request it made is completed
      // before it hears where to resume.
      co_await stop_queue(s, **q);
      (*q)->kick.reset();
      (*q)->call.reset();
      st.num = (*q)->ring.last_avail;
      replied = true;
      co_return co_await send_reply(s, req, &st, sizeof st);
    }
    case kSetVringKick:
    case kSetVringCall:
    case kSetVringErr: {
      VBLK_CO_TRY(need_size(m, 8));
      uint64_t v = m.u64();
      auto q = queue_of(s, v & kVringIndexMask);
      VBLK_CO_TRY(q);
      bool no_fd = v & kVringNoFd;
      if (no_fd != m.fds.empty() || m.fds.size() > 1)
        co_return proto(std::string(request_name(req)) + " with a wrong descriptor count");
      Fd fd = no_fd ? Fd() : std::move(m.fds[0]);
      if (req == kSetVringKick) {
        // Polling mode (no kick descriptor) is not offered.
        if (no_fd) co_return proto("SET_VRING_KICK without a descriptor");
        int fl = ::fcntl(fd.get(), F_GETFL);
        if (fl < 0 || ::fcntl(fd.get(), F_SETFL, fl | O_NONBLOCK) < 0) co_return proto("kick descriptor unusable");
        co_await stop_queue(s, **q);
        (*q)->kick = std::move(fd);
        if (!(s.features & bit(kFProtocolFeatures))) (*q)->enabled = true;
        co_return start_queue(s, v & kVringIndexMask);
      }
      (req == kSetVringCall ? (*q)->call : (*q)->err) = std::move(fd);
      co_return Status{};
    }
    case kSetVringEnable: {
      VBLK_CO_TRY(need_size(m, sizeof(VringState)));
      const auto& st = m.as<VringState>();
      auto q = queue_of(s, st.index);
      VBLK_CO_TRY(q);
      // Recorded; as libvhost-user does, a started ring is served whether
      // or not it was enabled (a block device has nothing to hold back).
      (*q)->enabled = st.num != 0;
      co_return Status{};
    }
    case kGetConfig: {
      VBLK_CO_TRY(need_size(m, kConfigHeader));
      ConfigMsg c = m.as<ConfigMsg>();
      replied = true;
      if (c.size > sizeof c.region || m.hdr.size != kConfigHeader + c.size ||
          !s.dev.get_config(c.offset, std::span(c.region, c.size))) {
        // An empty reply tells the front end the read failed.
        c.size = 0;
      }
      co_return co_await send_reply(s, req, &c, kConfigHeader + c.size);
    }
    case kSetConfig: {
      VBLK_CO_TRY(need_size(m, kConfigHeader));
      const auto& c = m.as<ConfigMsg>();
      if (c.size > sizeof c.region || m.hdr.size != kConfigHeader + c.size) co_return proto("SET_CONFIG size");
      s.dev.set_config(c.offset, std::span(c.region, c.size));
      co_return Status{};
    }
    case kGetInflightFd: {
      VBLK_CO_TRY(need_size(m, sizeof(InflightMsg)));
      InflightMsg in = m.as<InflightMsg>();
      if (in.num_queues == 0 || in.num_queues > s.queues.size() || in.queue_size == 0 || in.queue_size > kMaxQueueSize)
        co_return proto("inflight area for " + std::to_string(in.num_queues) + " queues of " +
                        std::to_string(in.queue_size));
      for (auto& q : s.queues)
        if (q->running) co_return proto("GET_INFLIGHT_FD with a queue running");
      const uint64_t size = in.num_queues * inflight_queue_bytes(in.queue_size);
      Fd fd(::memfd_create("vblk-vhost-inflight", MFD_CLOEXEC | MFD_ALLOW_SEALING));
      if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(size)) < 0)
        co_return Error(errno, std::string("inflight area: ") + std::strerror(errno));
      // Its size is fixed: nobody can shrink it under our mapping.
      (void)::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
      if (p == MAP_FAILED) co_return Error(errno, std::string("inflight area: ") + std::strerror(errno));
      s.inflight.set(p, size, 0, in.num_queues, in.queue_size);
      InflightMsg out{size, 0, in.num_queues, in.queue_size};
      replied = true;
      co_return co_await send_reply(s, req, &out, sizeof out, fd.get());
    }
    case kSetInflightFd: {
      VBLK_CO_TRY(need_size(m, sizeof(InflightMsg)));
      const InflightMsg& in = m.as<InflightMsg>();
      if (m.fds.size() != 1) co_return proto("SET_INFLIGHT_FD without one descriptor");
      for (auto& q : s.queues)
        if (q->running) co_return proto("SET_INFLIGHT_FD with a queue running");
      if (in.num_queues == 0 || in.num_queues > s.queues.size() || in.queue_size == 0 ||
          in.queue_size > kMaxQueueSize || in.mmap_size < in.num_queues * inflight_queue_bytes(in.queue_size) ||
          in.mmap_offset > (1ull << 40) || in.mmap_size > (1ull << 40))
        co_return proto("inflight area of " + std::to_string(in.mmap_size) + " bytes for " +
                        std::to_string(in.num_queues) + " queues of " + std::to_string(in.queue_size));
      // A file shorter than the area would fault on first touch.
      struct stat st {};
      const uint64_t len = in.mmap_offset + in.mmap_size;
      if (::fstat(m.fds[0].get(), &st) < 0 || static_cast<uint64_t>(st.st_size) < len)
        co_return proto("inflight area past the end of its file");
      void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, m.fds[0].get(), 0);
      if (p == MAP_FAILED) co_return Error(errno, std::string("inflight area: ") + std::strerror(errno));
      s.inflight.set(p, len, in.mmap_offset, in.num_queues, in.queue_size);
      co_return Status{};
    }
    default: co_return proto("not supported");
  }
}

}  // namespace

Backend::Backend(Loop& loop, Device& dev) : loop_(loop), dev_(dev) {}

Backend::~Backend() = default;

Task<void> Backend::serve(Fd listener) {
  listener_ = listener.get();
  while (!stopping_) {
    auto c = co_await accept_socket(loop_, listener.get());
    if (!c) {
      if (stopping_) break;
      if (c.error().code == ECONNABORTED || c.error().code == EINTR) continue;
      co_await loop_.sleep(std::chrono::milliseconds(100));  // EMFILE and the like
      continue;
    }
    if (stopping_) break;
    co_await run_session(std::move(*c));
  }
  listener_ = -1;
}

void Backend::stop() {
  stopping_ = true;
  if (listener_ >= 0) ::shutdown(listener_, SHUT_RDWR);
  if (session_) session_->fail("");
}

Task<void> Backend::run_session(Fd sock) {
  Session s(loop_, dev_, std::move(sock));
  for (uint16_t i = 0; i < dev_.num_queues(); ++i) s.queues.push_back(std::make_unique<Queue>(loop_));
  session_ = &s;
  CoEvent watch_done(loop_);
  if (stall_limit.count() > 0)
    spawn_detached(watch_stalls(s, stall_limit, on_stall, watch_done));
  else
    watch_done.set();
  auto m = std::make_unique<Msg>();
  while (!s.broken) {
    auto got = co_await read_msg(s, *m);
    if (!got) {
      s.fail(got.error().what());
      break;
    }
    if (!*got) break;
    bool replied = false;
    Status st = co_await handle(s, *m, replied);
    bool ack = (s.protocol & bit(kPfReplyAck)) && (m->hdr.flags & kFlagNeedReply) && !replied;
    const uint64_t failed = st ? 0 : 1;
    if (ack) (void)co_await reply_u64(s, m->hdr.request, failed);
    if (!st) {
      std::string name = request_name(m->hdr.request);
      if (name == "request") name += " " + std::to_string(m->hdr.request);
      s.fail(name + ": " + st.error().what());
    }
  }
  s.end_watch.request_stop();
  co_await watch_done.wait();
  co_await stop_all(s);
  s.mem.clear();
  session_ = nullptr;
  if (!s.why.empty() && on_error) on_error(s.why);
}

}  // namespace vblk::vhost
