// The vhost-user-blk front end (vhost_user_client.h).
#include "vhost_user_client.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

namespace vhu {

namespace {

std::string errstr(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

template <typename T>
void put(std::vector<uint8_t>& v, T x) {
  size_t o = v.size();
  v.resize(o + sizeof(T));
  std::memcpy(v.data() + o, &x, sizeof(T));
}

template <typename T>
T get(std::span<const uint8_t> s, size_t off) {
  T x{};
  if (off + sizeof(T) <= s.size()) std::memcpy(&x, s.data() + off, sizeof(T));
  return x;
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint16_t load16(const uint16_t* p) {
  return std::atomic_ref<uint16_t>(*const_cast<uint16_t*>(p)).load(std::memory_order_acquire);
}
void store16(uint16_t* p, uint16_t v) { std::atomic_ref<uint16_t>(*p).store(v, std::memory_order_release); }

constexpr uint64_t kRegionGap = 64 << 10;

}  // namespace

// ---------------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------------

const char* request_name(uint32_t r) {
  switch (r) {
    case kGetFeatures: return "GET_FEATURES";
    case kSetFeatures: return "SET_FEATURES";
    case kSetOwner: return "SET_OWNER";
    case kResetOwner: return "RESET_OWNER";
    case kSetMemTable: return "SET_MEM_TABLE";
    case kSetLogBase: return "SET_LOG_BASE";
    case kSetLogFd: return "SET_LOG_FD";
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
    case kResetDevice: return "RESET_DEVICE";
    case kGetMaxMemSlots: return "GET_MAX_MEM_SLOTS";
  }
  return "UNKNOWN";
}

std::vector<std::string> feature_names(uint64_t f) {
  static const std::pair<unsigned, const char*> kNames[] = {
      {kFBlkSizeMax, "BLK_SIZE_MAX"},
      {kFBlkSegMax, "BLK_SEG_MAX"},
      {kFBlkGeometry, "BLK_GEOMETRY"},
      {kFBlkRo, "BLK_RO"},
      {kFBlkBlkSize, "BLK_BLK_SIZE"},
      {kFBlkFlush, "BLK_FLUSH"},
      {kFBlkTopology, "BLK_TOPOLOGY"},
      {kFBlkConfigWce, "BLK_CONFIG_WCE"},
      {kFBlkMq, "BLK_MQ"},
      {kFBlkDiscard, "BLK_DISCARD"},
      {kFBlkWriteZeroes, "BLK_WRITE_ZEROES"},
      {kFBlkLifetime, "BLK_LIFETIME"},
      {kFBlkSecureErase, "BLK_SECURE_ERASE"},
      {kFNotifyOnEmpty, "NOTIFY_ON_EMPTY"},
      {kFLogAll, "LOG_ALL"},
      {kFIndirectDesc, "RING_INDIRECT_DESC"},
      {kFEventIdx, "RING_EVENT_IDX"},
      {kFProtocolFeatures, "PROTOCOL_FEATURES"},
      {kFVersion1, "VERSION_1"},
      {kFAccessPlatform, "ACCESS_PLATFORM"},
      {kFRingPacked, "RING_PACKED"},
      {kFInOrder, "IN_ORDER"},
      {kFOrderPlatform, "ORDER_PLATFORM"},
      {kFSrIov, "SR_IOV"},
      {kFNotificationData, "NOTIFICATION_DATA"},
      {kFRingReset, "RING_RESET"},
  };
  std::vector<std::string> out;
  for (unsigned bit = 0; bit < 64; bit++) {
    if (!(f >> bit & 1)) continue;
    const char* name = nullptr;
    for (auto& [b, n] : kNames)
      if (b == bit) name = n;
    out.push_back(name ? name : "bit" + std::to_string(bit));
  }
  return out;
}

std::vector<std::string> protocol_feature_names(uint64_t f) {
  static const char* kNames[] = {"MQ",
                                 "LOG_SHMFD",
                                 "RARP",
                                 "REPLY_ACK",
                                 "MTU",
                                 "BACKEND_REQ",
                                 "CROSS_ENDIAN",
                                 "CRYPTO_SESSION",
                                 "PAGEFAULT",
                                 "CONFIG",
                                 "BACKEND_SEND_FD",
                                 "HOST_NOTIFIER",
                                 "INFLIGHT_SHMFD",
                                 "RESET_DEVICE",
                                 "INBAND_NOTIFICATIONS",
                                 "CONFIGURE_MEM_SLOTS",
                                 "STATUS"};
  std::vector<std::string> out;
  for (unsigned bit = 0; bit < 64; bit++) {
    if (!(f >> bit & 1)) continue;
    out.push_back(bit < std::size(kNames) ? kNames[bit] : "bit" + std::to_string(bit));
  }
  return out;
}

std::string status_name(int s) {
  switch (s) {
    case kBlkOk: return "OK";
    case kBlkIoErr: return "IOERR";
    case kBlkUnsupp: return "UNSUPP";
  }
  return std::to_string(s);
}

BlkConfig BlkConfig::parse(std::span<const uint8_t> b) {
  BlkConfig c;
  c.capacity = get<uint64_t>(b, 0);
  c.size_max = get<uint32_t>(b, 8);
  c.seg_max = get<uint32_t>(b, 12);
  c.cylinders = get<uint16_t>(b, 16);
  c.heads = get<uint8_t>(b, 18);
  c.sectors = get<uint8_t>(b, 19);
  c.blk_size = get<uint32_t>(b, 20);
  c.physical_block_exp = get<uint8_t>(b, 24);
  c.alignment_offset = get<uint8_t>(b, 25);
  c.min_io_size = get<uint16_t>(b, 26);
  c.opt_io_size = get<uint32_t>(b, 28);
  c.wce = get<uint8_t>(b, 32);
  c.num_queues = get<uint16_t>(b, 34);
  c.max_discard_sectors = get<uint32_t>(b, 36);
  c.max_discard_seg = get<uint32_t>(b, 40);
  c.discard_sector_alignment = get<uint32_t>(b, 44);
  c.max_write_zeroes_sectors = get<uint32_t>(b, 48);
  c.max_write_zeroes_seg = get<uint32_t>(b, 52);
  c.write_zeroes_may_unmap = get<uint8_t>(b, 56);
  return c;
}

// ---------------------------------------------------------------------------
// Fd, Message
// ---------------------------------------------------------------------------

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t Message::u64() const {
  if (payload.size() != 8)
    throw ProtocolError(std::string(request_name(request)) + " reply: payload of " + std::to_string(payload.size()) +
                        " bytes, not a u64");
  return get<uint64_t>(payload, 0);
}

// ---------------------------------------------------------------------------
// Channel
// ---------------------------------------------------------------------------

Channel Channel::connect(const std::string& path, double timeout_s) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.size() >= sizeof(sa.sun_path)) throw ProtocolError("socket path too long: " + path);
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  int64_t end = now_ms() + static_cast<int64_t>(timeout_s * 1000);
  for (;;) {
    Fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s) throw ProtocolError(errstr("socket"));
    if (::connect(s.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) return Channel(std::move(s));
    int e = errno;
    if (now_ms() >= end || (e != ENOENT && e != ECONNREFUSED && e != EAGAIN))
      throw Disconnected("connect " + path + ": " + std::strerror(e));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void Channel::send(uint32_t request, std::span<const uint8_t> payload, std::span<const int> fds, uint32_t flags) {
  std::vector<uint8_t> buf;
  put<uint32_t>(buf, request);
  put<uint32_t>(buf, flags);
  put<uint32_t>(buf, static_cast<uint32_t>(payload.size()));
  buf.insert(buf.end(), payload.begin(), payload.end());
  send_raw(buf, fds);
}

void Channel::send_raw(std::span<const uint8_t> bytes, std::span<const int> fds) {
  size_t done = 0;
  while (done < bytes.size()) {
    iovec iov{const_cast<uint8_t*>(bytes.data()) + done, bytes.size() - done};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 16)];
    if (done == 0 && !fds.empty()) {
      if (fds.size() > 16) throw ProtocolError("too many fds");
      size_t n = fds.size() * sizeof(int);
      std::memset(cbuf, 0, sizeof(cbuf));
      mh.msg_control = cbuf;
      mh.msg_controllen = CMSG_SPACE(n);
      cmsghdr* c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(n);
      std::memcpy(CMSG_DATA(c), fds.data(), n);
    }
    ssize_t r = ::sendmsg(fd_.get(), &mh, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) throw Disconnected(errstr("send"));
      throw ProtocolError(errstr("send"));
    }
    done += static_cast<size_t>(r);
  }
}

void Channel::read_exact(uint8_t* p, size_t n, int timeout_ms, std::vector<Fd>* fds) {
  int64_t end = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  size_t done = 0;
  while (done < n) {
    pollfd pfd{fd_.get(), POLLIN, 0};
    int wait = end < 0 ? -1 : static_cast<int>(std::max<int64_t>(0, end - now_ms()));
    int pr = ::poll(&pfd, 1, wait);
    if (pr < 0) {
      if (errno == EINTR) continue;
      throw ProtocolError(errstr("poll"));
    }
    if (pr == 0) throw Timeout("no reply within " + std::to_string(timeout_ms) + " ms");
    iovec iov{p + done, n - done};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 16)];
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof(cbuf);
    ssize_t r = ::recvmsg(fd_.get(), &mh, MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == ECONNRESET) throw Disconnected(errstr("recv"));
      throw ProtocolError(errstr("recv"));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; i++) {
        int f;
        std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (fds)
          fds->emplace_back(f);
        else
          ::close(f);
      }
    }
    if (r == 0) throw Disconnected("back end closed the connection");
    done += static_cast<size_t>(r);
  }
}

Message Channel::recv(int timeout_ms) {
  Message m;
  uint8_t hdr[kHeaderSize];
  read_exact(hdr, sizeof(hdr), timeout_ms, &m.fds);
  std::span<const uint8_t> h(hdr, sizeof(hdr));
  m.request = get<uint32_t>(h, 0);
  m.flags = get<uint32_t>(h, 4);
  uint32_t size = get<uint32_t>(h, 8);
  if (size > 4096) throw ProtocolError("reply payload of " + std::to_string(size) + " bytes");
  m.payload.resize(size);
  if (size) read_exact(m.payload.data(), size, timeout_ms < 0 ? -1 : std::max(timeout_ms, 1000), &m.fds);
  return m;
}

bool Channel::closed(int timeout_ms) {
  int64_t end = now_ms() + timeout_ms;
  for (;;) {
    pollfd pfd{fd_.get(), POLLIN | POLLRDHUP, 0};
    int pr = ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, end - now_ms())));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return false;
    uint8_t buf[4096];
    ssize_t r = ::recv(fd_.get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (r == 0) return true;
    if (r < 0 && errno != EAGAIN && errno != EINTR) return true;
  }
}

// ---------------------------------------------------------------------------
// GuestMemory
// ---------------------------------------------------------------------------

GuestMemory::GuestMemory(uint64_t bytes, int nregions) {
  if (nregions < 1 || nregions > static_cast<int>(kMaxRegions)) throw ProtocolError("mem regions: 1 to 8");
  uint64_t per = align_up(std::max<uint64_t>(bytes / nregions, 1 << 20), 1 << 16);
  fd_ = Fd(::memfd_create("vblk-vhost-guest", MFD_CLOEXEC));
  if (!fd_) throw ProtocolError(errstr("memfd_create"));
  uint64_t off = 0, gpa = 1ull << 30;
  for (int i = 0; i < nregions; i++) {
    off += kRegionGap * (i + 1);
    Region r;
    r.gpa = gpa;
    r.size = per;
    r.mmap_offset = off;
    regions_.push_back(r);
    off += per;
    gpa += align_up(per, 1ull << 30) + kRegionGap * (i + 1);
  }
  map_len_ = off;
  if (::ftruncate(fd_.get(), static_cast<off_t>(map_len_)) != 0) throw ProtocolError(errstr("ftruncate"));
  void* m = ::mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (m == MAP_FAILED) throw ProtocolError(errstr("mmap"));
  map_ = static_cast<uint8_t*>(m);
  free_.resize(regions_.size());
  for (size_t i = 0; i < regions_.size(); i++) {
    regions_[i].host = map_ + regions_[i].mmap_offset;
    regions_[i].user_addr = reinterpret_cast<uint64_t>(regions_[i].host);
    free_[i][0] = regions_[i].size;
  }
}

GuestMemory::~GuestMemory() {
  if (map_) ::munmap(map_, map_len_);
}

std::vector<uint8_t> GuestMemory::mem_table() const {
  std::vector<uint8_t> p;
  put<uint32_t>(p, static_cast<uint32_t>(regions_.size()));
  put<uint32_t>(p, 0);
  for (const Region& r : regions_) {
    put<uint64_t>(p, r.gpa);
    put<uint64_t>(p, r.size);
    put<uint64_t>(p, r.user_addr);
    put<uint64_t>(p, r.mmap_offset);
  }
  return p;
}

uint8_t* GuestMemory::host(uint64_t gpa, uint64_t len) const {
  for (const Region& r : regions_)
    if (gpa >= r.gpa && gpa - r.gpa <= r.size && len <= r.size - (gpa - r.gpa)) return r.host + (gpa - r.gpa);
  return nullptr;
}

uint64_t GuestMemory::unmapped_gpa() const {
  const Region& r = regions_.back();
  return r.gpa + r.size + (1 << 20);
}

GuestMemory::Block GuestMemory::alloc(uint64_t len, uint64_t align, int region) {
  if (len == 0) len = 1;
  int n = static_cast<int>(regions_.size());
  for (int k = 0; k < n; k++) {
    int ri = region >= 0 ? region % n : (next_region_ + k) % n;
    auto& fl = free_[ri];
    for (auto it = fl.begin(); it != fl.end(); ++it) {
      uint64_t start = align_up(it->first, align);
      uint64_t end = it->first + it->second;
      if (start + len > end) continue;
      uint64_t fo = it->first;
      fl.erase(it);
      if (start > fo) fl[fo] = start - fo;
      if (start + len < end) fl[start + len] = end - (start + len);
      if (region < 0) next_region_ = (ri + 1) % n;
      const Region& r = regions_[ri];
      return Block{r.host + start, r.gpa + start, len, ri};
    }
    if (region >= 0) break;
  }
  throw std::bad_alloc();
}

void GuestMemory::free(const Block& b) {
  if (!b.host || b.region < 0) return;
  auto& fl = free_[b.region];
  uint64_t off = b.gpa - regions_[b.region].gpa, len = b.len;
  auto next = fl.lower_bound(off);
  if (next != fl.end() && off + len == next->first) {
    len += next->second;
    next = fl.erase(next);
  }
  if (next != fl.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  fl[off] = len;
}

// ---------------------------------------------------------------------------
// Virtqueue
// ---------------------------------------------------------------------------

Virtqueue::Virtqueue(GuestMemory& mem, uint16_t index, uint16_t size, bool event_idx, bool indirect)
    : mem_(mem), index_(index), size_(size), event_idx_(event_idx), indirect_(indirect) {
  int n = static_cast<int>(mem.regions().size());
  desc_block_ = mem.alloc(16ull * size, 4096, index % n);
  avail_block_ = mem.alloc(6 + 2ull * size, 64, (index + 1) % n);
  used_block_ = mem.alloc(6 + 8ull * size, 4096, (index + 2) % n);
  std::memset(desc_block_.host, 0, desc_block_.len);
  std::memset(avail_block_.host, 0, avail_block_.len);
  std::memset(used_block_.host, 0, used_block_.len);
  desc_ = reinterpret_cast<VringDesc*>(desc_block_.host);
  avail_ = reinterpret_cast<uint16_t*>(avail_block_.host);
  used_ = used_block_.host;
  next_free_.resize(size);
  for (uint16_t i = 0; i < size; i++) next_free_[i] = static_cast<uint16_t>(i + 1);
  free_count_ = size;
  heads_.resize(size);
  indirect_tables_.resize(size);
  kick_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  call_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!kick_ || !call_) throw ProtocolError(errstr("eventfd"));
}

Virtqueue::~Virtqueue() {
  for (auto& t : indirect_tables_) mem_.free(t);
  mem_.free(desc_block_);
  mem_.free(avail_block_);
  mem_.free(used_block_);
}

uint64_t Virtqueue::desc_user() const { return mem_.user_addr(desc_block_.host); }
uint64_t Virtqueue::avail_user() const { return mem_.user_addr(avail_block_.host); }
uint64_t Virtqueue::used_user() const { return mem_.user_addr(used_block_.host); }

uint16_t Virtqueue::alloc_desc() {
  if (free_count_ == 0) throw ProtocolError("no free descriptor");
  uint16_t d = free_head_;
  free_head_ = next_free_[d];
  free_count_--;
  return d;
}

bool Virtqueue::add(std::span<const Seg> segs, uint64_t token) {
  size_t n = segs.size();
  if (n == 0) return false;
  bool ind = indirect_ && n > 1;
  size_t need = ind ? 1 : n;
  if (free_count_ < need) return false;
  uint16_t head = free_head_;
  if (ind) {
    GuestMemory::Block& t = indirect_tables_[head];
    if (t.len < n * sizeof(VringDesc)) {
      mem_.free(t);
      t = mem_.alloc(std::max<uint64_t>(n, 8) * sizeof(VringDesc), 16);
    }
    auto* td = reinterpret_cast<VringDesc*>(t.host);
    for (size_t i = 0; i < n; i++) {
      td[i].addr = segs[i].gpa;
      td[i].len = segs[i].len;
      td[i].flags = static_cast<uint16_t>((segs[i].device_writes ? kDescWrite : 0) | (i + 1 < n ? kDescNext : 0));
      td[i].next = static_cast<uint16_t>(i + 1 < n ? i + 1 : 0);
    }
    desc_[head] = VringDesc{t.gpa, static_cast<uint32_t>(n * sizeof(VringDesc)), kDescIndirect, 0};
    free_head_ = next_free_[head];
  } else {
    uint16_t d = head;
    for (size_t i = 0; i < n; i++) {
      desc_[d].addr = segs[i].gpa;
      desc_[d].len = segs[i].len;
      desc_[d].flags = static_cast<uint16_t>((segs[i].device_writes ? kDescWrite : 0) | (i + 1 < n ? kDescNext : 0));
      desc_[d].next = i + 1 < n ? next_free_[d] : 0;
      d = next_free_[d];
    }
    free_head_ = d;
  }
  free_count_ -= need;
  heads_[head] = HeadState{token, static_cast<uint16_t>(need), true, seq_++};
  in_flight_++;
  avail_[2 + shadow_avail_ % size_] = head;
  shadow_avail_++;
  return true;
}

bool Virtqueue::publish(bool may_kick) {
  uint16_t old_idx = published_avail_, new_idx = shadow_avail_;
  if (old_idx == new_idx) {
    // Published silently before: the kick it did not get.
    if (!may_kick || !owe_kick_) return false;
    owe_kick_ = false;
    kick();
    return true;
  }
  store16(&avail_[1], new_idx);
  published_avail_ = new_idx;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  bool need;
  if (event_idx_) {
    uint16_t ev = load16(reinterpret_cast<uint16_t*>(used_ + 4 + 8ull * size_));
    need = static_cast<uint16_t>(new_idx - ev - 1) < static_cast<uint16_t>(new_idx - old_idx);
  } else {
    need = !(load16(reinterpret_cast<uint16_t*>(used_)) & kUsedNoNotify);
  }
  if (!may_kick) {
    owe_kick_ = owe_kick_ || need;
    return false;
  }
  if (need || owe_kick_) kick();
  owe_kick_ = false;
  return need;
}

void Virtqueue::kick() {
  uint64_t one = 1;
  if (::write(kick_.get(), &one, sizeof(one)) != sizeof(one)) throw ProtocolError(errstr("kick"));
  kicks_++;
}

void Virtqueue::drain_call() {
  uint64_t v;
  if (::read(call_.get(), &v, sizeof(v)) == sizeof(v)) calls_++;
}

uint16_t Virtqueue::used_idx() const { return load16(reinterpret_cast<const uint16_t*>(used_ + 2)); }
uint16_t Virtqueue::avail_idx() const { return load16(&avail_[1]); }
std::pair<uint32_t, uint32_t> Virtqueue::used_elem(uint16_t idx) const {
  const uint8_t* e = used_ + 4 + 8ull * (idx % size_);
  uint32_t id, len;
  std::memcpy(&id, e, 4);
  std::memcpy(&len, e + 4, 4);
  return {id, len};
}

bool Virtqueue::pending() const { return used_idx() != last_used_; }

void Virtqueue::free_chain(uint16_t head) {
  HeadState& h = heads_[head];
  uint16_t last = head;
  for (uint16_t i = 1; i < h.ndesc; i++) last = next_free_[last];
  next_free_[last] = free_head_;
  free_head_ = head;
  free_count_ += h.ndesc;
  h.busy = false;
  in_flight_--;
}

bool Virtqueue::pop_used(uint64_t& token, uint32_t& len, uint16_t* head_out) {
  if (used_idx() == last_used_) return false;
  const uint8_t* e = used_ + 4 + 8ull * (last_used_ % size_);
  uint32_t id, l;
  std::memcpy(&id, e, 4);
  std::memcpy(&l, e + 4, 4);
  if (id >= size_ || !heads_[id].busy)
    throw ProtocolError("queue " + std::to_string(index_) + ": used element " + std::to_string(last_used_) +
                        " names descriptor " + std::to_string(id) + ", not in flight");
  last_used_++;
  token = heads_[id].token;
  len = l;
  if (head_out) *head_out = static_cast<uint16_t>(id);
  free_chain(static_cast<uint16_t>(id));
  return true;
}

bool Virtqueue::arm() {
  if (event_idx_)
    store16(&avail_[2 + size_], last_used_);
  else
    store16(&avail_[0], 0);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return pending();
}

void Virtqueue::note_consumed() {
  if (event_idx_) store16(&avail_[2 + size_], last_used_);
}

void Virtqueue::push_avail(uint16_t head) {
  avail_[2 + shadow_avail_ % size_] = head;
  shadow_avail_++;
}

void Virtqueue::set_avail_idx(uint16_t idx) {
  shadow_avail_ = idx;
  published_avail_ = idx;
  store16(&avail_[1], idx);
}

size_t Virtqueue::requeue_outstanding() {
  std::vector<std::pair<uint64_t, uint16_t>> busy;
  for (uint16_t i = 0; i < size_; i++)
    if (heads_[i].busy) busy.push_back({heads_[i].seq, i});
  std::sort(busy.begin(), busy.end());
  for (auto& [seq, head] : busy) push_avail(head);
  return busy.size();
}

std::vector<uint64_t> Virtqueue::outstanding() const {
  std::vector<uint64_t> out;
  for (const HeadState& h : heads_)
    if (h.busy) out.push_back(h.token);
  return out;
}

// ---------------------------------------------------------------------------
// Device
// ---------------------------------------------------------------------------

Device::Device(Options opts) : opts_(opts) {}
Device::~Device() = default;

void Device::log(const char* dir, uint32_t request, size_t size, uint32_t flags) {
  if (opts_.verbose)
    std::fprintf(stderr, "vhost-user %s %s (%u) flags=0x%x size=%zu\n", dir, request_name(request), request, flags,
                 size);
}

Message Device::recv_reply(uint32_t request) {
  Message m = chan_->recv(opts_.reply_timeout_ms);
  log("<-", m.request, m.payload.size(), m.flags);
  if (m.request != request)
    throw ProtocolError(std::string("reply to ") + request_name(request) + " has request code " +
                        std::to_string(m.request));
  if (!(m.flags & kReplyFlag) || (m.flags & 3) != kVersion)
    throw ProtocolError(std::string("reply to ") + request_name(request) + " has flags " + std::to_string(m.flags));
  return m;
}

Message Device::call(uint32_t request, std::span<const uint8_t> payload, std::span<const int> fds) {
  log("->", request, payload.size(), kVersion);
  chan_->send(request, payload, fds);
  return recv_reply(request);
}

uint64_t Device::send_acked(uint32_t request, std::span<const uint8_t> payload, std::span<const int> fds) {
  bool ack = has_protocol(kPfReplyAck);
  uint32_t flags = kVersion | (ack ? kNeedReplyFlag : 0);
  log("->", request, payload.size(), flags);
  chan_->send(request, payload, fds, flags);
  if (!ack) return 0;
  return recv_reply(request).u64();
}

uint64_t Device::get_u64(uint32_t request) { return call(request).u64(); }

void Device::set_u64(uint32_t request, uint64_t v, std::span<const int> fds) {
  std::vector<uint8_t> p;
  put<uint64_t>(p, v);
  if (uint64_t a = send_acked(request, p, fds))
    throw ProtocolError(std::string(request_name(request)) + " refused (ack " + std::to_string(a) + ")");
}

void Device::set_state(uint32_t request, uint32_t index, uint32_t num) {
  std::vector<uint8_t> p;
  put<uint32_t>(p, index);
  put<uint32_t>(p, num);
  if (uint64_t a = send_acked(request, p))
    throw ProtocolError(std::string(request_name(request)) + " refused (ack " + std::to_string(a) + ")");
}

std::vector<uint8_t> Device::get_config(uint32_t offset, uint32_t size) {
  std::vector<uint8_t> p;
  put<uint32_t>(p, offset);
  put<uint32_t>(p, size);
  put<uint32_t>(p, 0);
  p.resize(p.size() + size);
  Message m = call(kGetConfig, p);
  if (m.payload.size() != 12 + size)
    throw ProtocolError("GET_CONFIG reply of " + std::to_string(m.payload.size()) + " bytes (asked for " +
                        std::to_string(size) + " bytes of config)");
  return std::vector<uint8_t>(m.payload.begin() + 12, m.payload.end());
}

uint64_t Device::set_config(uint32_t offset, std::span<const uint8_t> bytes, uint32_t flags) {
  std::vector<uint8_t> p;
  put<uint32_t>(p, offset);
  put<uint32_t>(p, static_cast<uint32_t>(bytes.size()));
  put<uint32_t>(p, flags);
  p.insert(p.end(), bytes.begin(), bytes.end());
  return send_acked(kSetConfig, p);
}

void Device::connect(const std::string& path) {
  path_ = path;
  handshake(false);
}

size_t Device::reconnect(double timeout_s) {
  reap(stash_);  // the back end may have used elements nobody reaped yet
  size_t n = in_flight();
  chan_.reset();
  resume_base_.assign(queues_.size(), std::nullopt);
  int saved = opts_.connect_timeout_ms;
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    auto left = std::chrono::duration<double>(end - std::chrono::steady_clock::now()).count();
    opts_.connect_timeout_ms = static_cast<int>(std::max(0.0, left) * 1000);
    try {
      handshake(true);
      break;
    } catch (const Disconnected&) {
      chan_.reset();
      if (std::chrono::steady_clock::now() >= end) {
        opts_.connect_timeout_ms = saved;
        throw;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } catch (...) {
      opts_.connect_timeout_ms = saved;
      throw;
    }
  }
  opts_.connect_timeout_ms = saved;
  return n;
}

void Device::close() { chan_.reset(); }

void Device::handshake(bool again) {
  chan_ = std::make_unique<Channel>(Channel::connect(path_, opts_.connect_timeout_ms / 1000.0));
  uint64_t offered = get_u64(kGetFeatures);
  if (again && (offered & features_acked_) != features_acked_)
    throw ProtocolError("the back end no longer offers the features negotiated before");
  features_offered_ = offered;
  protocol_offered_ = protocol_acked_ = 0;
  if (offered >> kFProtocolFeatures & 1) {
    protocol_offered_ = get_u64(kGetProtocolFeatures);
    uint64_t want = 1ull << kPfMq | 1ull << kPfConfig;
    if (opts_.reply_ack != Toggle::kOff) want |= 1ull << kPfReplyAck;
    // Again: only with the inflight fd of the first connection.
    if (opts_.inflight != Toggle::kOff && (!again || inflight_fd_)) want |= 1ull << kPfInflightShmfd;
    if (opts_.reply_ack == Toggle::kOn && !(protocol_offered_ >> kPfReplyAck & 1))
      throw ProtocolError("the back end does not offer REPLY_ACK");
    if (opts_.inflight == Toggle::kOn && (want >> kPfInflightShmfd & 1) && !(protocol_offered_ >> kPfInflightShmfd & 1))
      throw ProtocolError("the back end does not offer INFLIGHT_SHMFD");
    uint64_t acked = protocol_offered_ & want;
    std::vector<uint8_t> p;
    put<uint64_t>(p, acked);
    log("->", kSetProtocolFeatures, 8, kVersion);
    chan_->send(kSetProtocolFeatures, p);
    protocol_acked_ = acked;
    if (has_protocol(kPfMq)) queue_num_ = get_u64(kGetQueueNum);
  }
  if (uint64_t a = send_acked(kSetOwner, {})) throw ProtocolError("SET_OWNER refused (ack " + std::to_string(a) + ")");
  if (has_protocol(kPfConfig)) {
    config_bytes_ = get_config(0, kBlkConfigSize);
    config_ = BlkConfig::parse(config_bytes_);
  }
  unsigned max_queues = 1;
  if (queue_num_) max_queues = static_cast<unsigned>(queue_num_);
  if (offered >> kFBlkMq & 1 && config_.num_queues) max_queues = std::min<unsigned>(max_queues, config_.num_queues);
  if (!(offered >> kFBlkMq & 1) && !queue_num_) max_queues = 1;
  if (opts_.queues > max_queues)
    throw ProtocolError("asked for " + std::to_string(opts_.queues) + " queues, the back end has " +
                        std::to_string(max_queues));

  uint64_t want = 1ull << kFVersion1 | 1ull << kFProtocolFeatures | 1ull << kFBlkSizeMax | 1ull << kFBlkSegMax |
                  1ull << kFBlkGeometry | 1ull << kFBlkRo | 1ull << kFBlkBlkSize | 1ull << kFBlkFlush |
                  1ull << kFBlkTopology | 1ull << kFBlkConfigWce | 1ull << kFBlkMq | 1ull << kFBlkDiscard |
                  1ull << kFBlkWriteZeroes;
  if (opts_.event_idx != Toggle::kOff) want |= 1ull << kFEventIdx;
  if (opts_.indirect != Toggle::kOff) want |= 1ull << kFIndirectDesc;
  if (opts_.event_idx == Toggle::kOn && !(offered >> kFEventIdx & 1))
    throw ProtocolError("the back end does not offer EVENT_IDX");
  if (opts_.indirect == Toggle::kOn && !(offered >> kFIndirectDesc & 1))
    throw ProtocolError("the back end does not offer INDIRECT_DESC");
  uint64_t acked = again ? features_acked_ : (offered & want);

  if (has_protocol(kPfInflightShmfd)) {
    if (!again) {
      std::vector<uint8_t> p;
      put<uint64_t>(p, 0);
      put<uint64_t>(p, 0);
      put<uint16_t>(p, static_cast<uint16_t>(opts_.queues));
      put<uint16_t>(p, opts_.queue_size);
      p.resize(24);  // the C struct's size, padding included
      Message m = call(kGetInflightFd, p);
      if (m.payload.size() < 16 || m.fds.size() != 1)
        throw ProtocolError("GET_INFLIGHT_FD reply: " + std::to_string(m.payload.size()) + " bytes, " +
                            std::to_string(m.fds.size()) + " fds");
      inflight_size_ = get<uint64_t>(m.payload, 0);
      inflight_offset_ = get<uint64_t>(m.payload, 8);
      inflight_fd_ = std::move(m.fds[0]);
    }
    std::vector<uint8_t> p;
    put<uint64_t>(p, inflight_size_);
    put<uint64_t>(p, inflight_offset_);
    put<uint16_t>(p, static_cast<uint16_t>(opts_.queues));
    put<uint16_t>(p, opts_.queue_size);
    p.resize(24);
    int f = inflight_fd_.get();
    if (uint64_t a = send_acked(kSetInflightFd, p, std::span<const int>(&f, 1)))
      throw ProtocolError("SET_INFLIGHT_FD refused (ack " + std::to_string(a) + ")");
  }

  set_u64(kSetFeatures, acked);
  features_acked_ = acked;

  if (!mem_) mem_ = std::make_unique<GuestMemory>(opts_.mem_bytes, opts_.mem_regions);
  std::vector<int> fds(mem_->regions().size(), mem_->fd());
  if (uint64_t a = send_acked(kSetMemTable, mem_->mem_table(), fds))
    throw ProtocolError("SET_MEM_TABLE refused (ack " + std::to_string(a) + ")");

  if (opts_.start_rings) setup_rings(again);
}

void Device::setup_rings(bool again) {
  for (unsigned q = 0; q < opts_.queues; q++) {
    if (!again) {
      queues_.push_back(std::make_unique<Virtqueue>(*mem_, static_cast<uint16_t>(q), opts_.queue_size, has(kFEventIdx),
                                                    has(kFIndirectDesc)));
      Slots s;
      s.block = mem_->alloc(32ull * opts_.queue_size, 64);
      for (int i = opts_.queue_size - 1; i >= 0; i--) s.free.push_back(static_cast<uint16_t>(i));
      s.token.resize(opts_.queue_size);
      slots_.push_back(std::move(s));
    }
    Virtqueue& vq = *queues_[q];
    set_state(kSetVringNum, q, opts_.vring_num >= 0 ? static_cast<uint32_t>(opts_.vring_num) : vq.size());
    // After a reconnection with INFLIGHT_SHMFD the back end starts at the
    // used index and adds the requests its inflight area still holds (what
    // QEMU does after a back end crash); without it the outstanding chains
    // go on the avail ring again after the old avail index.
    uint32_t base = 0;
    if (again && has_protocol(kPfInflightShmfd)) {
      base = vq.used_idx();
    } else if (again && q < resume_base_.size() && resume_base_[q]) {
      base = *resume_base_[q];
    } else if (again) {
      base = vq.avail_idx();
      vq.requeue_outstanding();
      if (q < resume_base_.size()) resume_base_[q] = base;
    }
    set_state(kSetVringBase, q, base);
    std::vector<uint8_t> a;
    put<uint32_t>(a, q);
    put<uint32_t>(a, 0);
    put<uint64_t>(a, vq.desc_user());
    put<uint64_t>(a, vq.used_user());
    put<uint64_t>(a, vq.avail_user());
    put<uint64_t>(a, 0);
    if (uint64_t r = send_acked(kSetVringAddr, a)) throw ProtocolError("SET_VRING_ADDR refused: " + std::to_string(r));
    int kf = vq.kick_fd(), cf = vq.call_fd();
    set_u64(kSetVringKick, q, std::span<const int>(&kf, 1));
    set_u64(kSetVringCall, q, std::span<const int>(&cf, 1));
  }
  if (has(kFProtocolFeatures))
    for (unsigned q = 0; q < opts_.queues; q++) set_state(kSetVringEnable, q, 1);
  if (again)
    for (auto& vq : queues_) {
      vq->publish();
      vq->kick();
    }
}

std::vector<uint32_t> Device::stop() {
  std::vector<uint32_t> bases;
  for (unsigned q = 0; q < queues_.size(); q++) {
    std::vector<uint8_t> p;
    put<uint32_t>(p, q);
    put<uint32_t>(p, 0);
    Message m = call(kGetVringBase, p);
    if (m.payload.size() != 8) throw ProtocolError("GET_VRING_BASE reply of " + std::to_string(m.payload.size()));
    bases.push_back(get<uint32_t>(m.payload, 4));
  }
  return bases;
}

bool Device::submit(unsigned q, const BlkRequest& req, uint64_t token) {
  Slots& s = slots_.at(q);
  if (s.free.empty()) return false;
  uint16_t slot = s.free.back();
  uint8_t* base = s.block.host + 32ull * slot;
  uint64_t gpa = s.block.gpa + 32ull * slot;
  std::memcpy(base, &req.type, 4);
  std::memcpy(base + 4, &req.ioprio, 4);
  std::memcpy(base + 8, &req.sector, 8);
  base[16] = 0xff;  // not a status: shows whether the device wrote one
  std::vector<Seg> segs;
  segs.reserve(req.data.size() + 2);
  segs.push_back(Seg{gpa, req.header_len, false});
  segs.insert(segs.end(), req.data.begin(), req.data.end());
  segs.push_back(Seg{gpa + 16, 1, req.status_writable});
  if (!queues_[q]->add(segs, slot)) return false;
  s.free.pop_back();
  s.token[slot] = token;
  return true;
}

void Device::kick_all() {
  for (auto& vq : queues_) vq->publish();
}

void Device::publish_all_silently() {
  for (auto& vq : queues_) vq->publish(false);
}

size_t Device::reap(std::vector<Completion>& out) {
  size_t n = stash_.size();
  out.insert(out.end(), stash_.begin(), stash_.end());
  stash_.clear();
  for (unsigned q = 0; q < queues_.size(); q++) {
    uint64_t slot;
    uint32_t len;
    bool any = false;
    while (queues_[q]->pop_used(slot, len)) {
      Slots& s = slots_[q];
      out.push_back(Completion{q, s.token[slot], s.block.host[32ull * slot + 16], len});
      s.free.push_back(static_cast<uint16_t>(slot));
      n++;
      any = true;
    }
    if (any) queues_[q]->note_consumed();
  }
  return n;
}

size_t Device::in_flight() const {
  size_t n = stash_.size();
  for (auto& vq : queues_) n += vq->in_flight();
  return n;
}

bool Device::wait(int timeout_ms) {
  int64_t end = now_ms() + timeout_ms;
  for (;;) {
    bool any = !stash_.empty();
    for (auto& vq : queues_) any |= vq->arm();
    if (any) return true;
    std::vector<pollfd> pfds;
    pfds.push_back(pollfd{chan_->fd(), POLLIN | POLLRDHUP, 0});
    for (auto& vq : queues_) pfds.push_back(pollfd{vq->call_fd(), POLLIN, 0});
    int left = static_cast<int>(std::max<int64_t>(0, end - now_ms()));
    int pr = ::poll(pfds.data(), pfds.size(), left);
    if (pr < 0 && errno != EINTR) throw ProtocolError(errstr("poll"));
    if (pr > 0 && pfds[0].revents) {
      if (chan_->closed(0)) throw Disconnected("back end closed the connection");
    }
    for (size_t i = 1; i < pfds.size(); i++)
      if (pfds[i].revents) queues_[i - 1]->drain_call();
    for (auto& vq : queues_)
      if (vq->pending()) return true;
    if (pr == 0 || now_ms() >= end) return false;
  }
}

std::vector<Seg> Device::segs(const GuestMemory::Block& b, bool device_writes) const {
  std::vector<Seg> out;
  uint64_t max = opts_.max_seg ? opts_.max_seg : b.len;
  for (uint64_t off = 0; off < b.len || (b.len == 0 && out.empty()); off += max) {
    out.push_back(Seg{b.gpa + off, static_cast<uint32_t>(std::min(max, b.len - off)), device_writes});
    if (b.len == 0) break;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Patterns
// ---------------------------------------------------------------------------

uint64_t fnv1a64(const uint8_t* p, size_t n, uint64_t h) {
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

void fill_pattern(uint8_t* p, uint64_t offset, size_t len, uint64_t seed) {
  size_t i = 0;
  while (i < len) {
    uint64_t o = offset + i;
    uint64_t w = splitmix64(seed ^ (o / 8));
    size_t k = o % 8;
    if (k == 0 && len - i >= 8) {
      std::memcpy(p + i, &w, 8);
      i += 8;
      continue;
    }
    p[i++] = static_cast<uint8_t>(w >> (8 * k));
  }
}

int64_t check_pattern(const uint8_t* p, uint64_t offset, size_t len, uint64_t seed) {
  uint8_t buf[4096];
  for (size_t i = 0; i < len; i += sizeof(buf)) {
    size_t n = std::min(sizeof(buf), len - i);
    fill_pattern(buf, offset + i, n, seed);
    if (std::memcmp(buf, p + i, n) != 0)
      for (size_t j = 0; j < n; j++)
        if (buf[j] != p[i + j]) return static_cast<int64_t>(offset + i + j);
  }
  return -1;
}

}  // namespace vhu
