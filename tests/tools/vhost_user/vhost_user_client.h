// A vhost-user-blk front end for tests and benchmarks: what QEMU (or
// libblkio) does on the host side of a vhost-user block device, written from
// QEMU's docs/interop/vhost-user.rst and the virtio 1.1 split-ring and block
// device sections. It plays the "guest": guest memory is one memfd mapped
// here and handed to the back end in SET_MEM_TABLE (one or more regions at
// non-zero fd offsets and with guest addresses unlike the user addresses, so
// the back end's translation is exercised), the virtqueues live in that
// memory, kicks and calls are eventfds.
//
// The pieces, bottom up:
//   Channel      the unix socket: framed messages with fds (SCM_RIGHTS)
//   GuestMemory  the memfd, its regions and a first-fit allocator in them
//   Virtqueue    one split ring: descriptor table, avail and used rings,
//                free descriptors, direct or indirect chains, EVENT_IDX or
//                flag-based notification suppression, raw access for
//                hostile tests
//   Device       a session with a back end: negotiation, config space,
//                inflight shmem, memory table, rings; virtio-blk requests
//                (submit / reap / wait) and reconnection after the back end
//                went away (the inflight fd is passed back)
//
// Ownership: a Device owns its GuestMemory, Virtqueues and Channel; the fds
// it holds are closed by their owners' destructors. Nothing here is
// thread-safe: one thread drives a Device.
//
// Errors: the control path throws (ProtocolError for a back end breaking
// the protocol or refusing a message, Disconnected when the socket is gone);
// the data path returns values (submit() false when the ring is full, a
// virtio status byte per request).
//
// It does not include vblk headers and links only libc and the C++ library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace vhu {

// ---------------------------------------------------------------------------
// Protocol numbers
// ---------------------------------------------------------------------------

// Front-end message types (vhost-user.rst "Front-end message types").
enum Request : uint32_t {
  kGetFeatures = 1,
  kSetFeatures = 2,
  kSetOwner = 3,
  kResetOwner = 4,
  kSetMemTable = 5,
  kSetLogBase = 6,
  kSetLogFd = 7,
  kSetVringNum = 8,
  kSetVringAddr = 9,
  kSetVringBase = 10,
  kGetVringBase = 11,
  kSetVringKick = 12,
  kSetVringCall = 13,
  kSetVringErr = 14,
  kGetProtocolFeatures = 15,
  kSetProtocolFeatures = 16,
  kGetQueueNum = 17,
  kSetVringEnable = 18,
  kGetConfig = 24,
  kSetConfig = 25,
  kGetInflightFd = 31,
  kSetInflightFd = 32,
  kResetDevice = 34,
  kGetMaxMemSlots = 36,
};
const char* request_name(uint32_t request);

// Header flags: version 1 in the low two bits, reply, need_reply.
constexpr uint32_t kVersion = 0x1;
constexpr uint32_t kReplyFlag = 1u << 2;
constexpr uint32_t kNeedReplyFlag = 1u << 3;
constexpr size_t kHeaderSize = 12;
constexpr size_t kMaxRegions = 8;  // SET_MEM_TABLE's fixed array
constexpr uint64_t kVringNoFd = 1ull << 8;

// Protocol feature bits (GET/SET_PROTOCOL_FEATURES).
enum ProtocolFeature : unsigned {
  kPfMq = 0,
  kPfLogShmfd = 1,
  kPfRarp = 2,
  kPfReplyAck = 3,
  kPfMtu = 4,
  kPfBackendReq = 5,
  kPfCrossEndian = 6,
  kPfCryptoSession = 7,
  kPfPagefault = 8,
  kPfConfig = 9,
  kPfBackendSendFd = 10,
  kPfHostNotifier = 11,
  kPfInflightShmfd = 12,
  kPfResetDevice = 13,
  kPfInbandNotifications = 14,
  kPfConfigureMemSlots = 15,
  kPfStatus = 16,
};

// Virtio feature bits: device-independent ones and virtio-blk's.
enum Feature : unsigned {
  kFBlkSizeMax = 1,
  kFBlkSegMax = 2,
  kFBlkGeometry = 4,
  kFBlkRo = 5,
  kFBlkBlkSize = 6,
  kFBlkFlush = 9,
  kFBlkTopology = 10,
  kFBlkConfigWce = 11,
  kFBlkMq = 12,
  kFBlkDiscard = 13,
  kFBlkWriteZeroes = 14,
  kFBlkLifetime = 15,
  kFBlkSecureErase = 16,
  kFNotifyOnEmpty = 24,
  kFLogAll = 26,
  kFIndirectDesc = 28,
  kFEventIdx = 29,
  kFProtocolFeatures = 30,  // VHOST_USER_F_PROTOCOL_FEATURES
  kFVersion1 = 32,
  kFAccessPlatform = 33,
  kFRingPacked = 34,
  kFInOrder = 35,
  kFOrderPlatform = 36,
  kFSrIov = 37,
  kFNotificationData = 38,
  kFRingReset = 40,
};
std::vector<std::string> feature_names(uint64_t features);
std::vector<std::string> protocol_feature_names(uint64_t features);

// virtio-blk request types and status bytes.
enum BlkType : uint32_t {
  kBlkIn = 0,
  kBlkOut = 1,
  kBlkFlush = 4,
  kBlkGetId = 8,
  kBlkGetLifetime = 10,
  kBlkDiscard = 11,
  kBlkWriteZeroes = 13,
  kBlkSecureErase = 14,
};
enum BlkStatus : uint8_t { kBlkOk = 0, kBlkIoErr = 1, kBlkUnsupp = 2 };
std::string status_name(int status);  // "OK", "IOERR", "UNSUPP", else the number
constexpr uint32_t kBlkIdBytes = 20;
constexpr uint32_t kBlkDiscardUnmap = 1;  // flags of a discard/write-zeroes range

// struct virtio_blk_config up to write_zeroes_may_unmap (60 bytes; later
// fields - secure erase, zoned - are not asked for).
constexpr uint32_t kBlkConfigSize = 60;
constexpr uint32_t kBlkConfigWceOffset = 32;
struct BlkConfig {
  uint64_t capacity = 0;  // in 512-byte sectors
  uint32_t size_max = 0, seg_max = 0;
  uint16_t cylinders = 0;
  uint8_t heads = 0, sectors = 0;
  uint32_t blk_size = 0;
  uint8_t physical_block_exp = 0, alignment_offset = 0;
  uint16_t min_io_size = 0;
  uint32_t opt_io_size = 0;
  uint8_t wce = 0;
  uint16_t num_queues = 0;
  uint32_t max_discard_sectors = 0, max_discard_seg = 0, discard_sector_alignment = 0;
  uint32_t max_write_zeroes_sectors = 0, max_write_zeroes_seg = 0;
  uint8_t write_zeroes_may_unmap = 0;
  static BlkConfig parse(std::span<const uint8_t> bytes);  // little-endian, short input zero-filled
};

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The back end closed the socket (or it broke). A Device can reconnect().
struct Disconnected : ProtocolError {
  using ProtocolError::ProtocolError;
};
// No reply within the time allowed.
struct Timeout : ProtocolError {
  using ProtocolError::ProtocolError;
};

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// ---------------------------------------------------------------------------
// Channel: the vhost-user socket
// ---------------------------------------------------------------------------

struct Message {
  uint32_t request = 0;
  uint32_t flags = 0;
  std::vector<uint8_t> payload;
  std::vector<Fd> fds;
  uint64_t u64() const;  // payload as a u64 (ProtocolError if it is not 8 bytes)
};

class Channel {
 public:
  // Connects to a listening back end, retrying until timeout_s has passed
  // (the socket may not exist yet, or the back end may still be busy with
  // its previous client). Throws Disconnected on giving up.
  static Channel connect(const std::string& path, double timeout_s);

  // Sends one message; fds go in the ancillary data of its first byte.
  void send(uint32_t request, std::span<const uint8_t> payload, std::span<const int> fds = {},
            uint32_t flags = kVersion);
  // Sends a message with an arbitrary header (hostile tests: a wrong size,
  // a wrong version).
  void send_raw(std::span<const uint8_t> bytes, std::span<const int> fds = {});
  // Receives one message; Timeout after timeout_ms (< 0: wait forever).
  Message recv(int timeout_ms);
  // Whether the peer has closed the connection, waiting up to timeout_ms.
  // Unexpected messages from the back end are read and dropped.
  bool closed(int timeout_ms);
  int fd() const { return fd_.get(); }

 private:
  explicit Channel(Fd fd) : fd_(std::move(fd)) {}
  void read_exact(uint8_t* p, size_t n, int timeout_ms, std::vector<Fd>* fds);
  Fd fd_;
};

// ---------------------------------------------------------------------------
// GuestMemory
// ---------------------------------------------------------------------------

class GuestMemory {
 public:
  struct Region {
    uint64_t gpa = 0;          // guest physical address of the first byte
    uint64_t size = 0;         // bytes
    uint64_t user_addr = 0;    // this process's address of the first byte
    uint64_t mmap_offset = 0;  // offset of the first byte in the memfd
    uint8_t* host = nullptr;   // == user_addr
  };
  // A piece of guest memory handed out by alloc().
  struct Block {
    uint8_t* host = nullptr;
    uint64_t gpa = 0;
    uint64_t len = 0;
    int region = -1;
  };

  // `bytes` of guest memory split into `nregions` equal regions of one
  // memfd. Region i starts at fd offset (i+1) * 64 KiB past the end of region
  // i-1 and at guest address (i+1) GiB + i * 64 KiB, so neither the fd
  // offsets nor the guest addresses are contiguous or zero.
  GuestMemory(uint64_t bytes, int nregions);
  ~GuestMemory();
  GuestMemory(const GuestMemory&) = delete;
  GuestMemory& operator=(const GuestMemory&) = delete;

  const std::vector<Region>& regions() const { return regions_; }
  int fd() const { return fd_.get(); }
  // The SET_MEM_TABLE payload (nregions, padding, regions).
  std::vector<uint8_t> mem_table() const;

  // Host pointer for [gpa, gpa+len) when it lies inside one region, else nullptr.
  uint8_t* host(uint64_t gpa, uint64_t len) const;
  // The user address of a host pointer inside guest memory.
  uint64_t user_addr(const void* p) const { return reinterpret_cast<uint64_t>(p); }
  // A guest address inside no region (between region 0 and 1, or past the end).
  uint64_t unmapped_gpa() const;

  // First fit in `region` (-1: the next region round-robin). Throws
  // std::bad_alloc when nothing fits.
  Block alloc(uint64_t len, uint64_t align = 64, int region = -1);
  void free(const Block& b);

 private:
  Fd fd_;
  std::vector<Region> regions_;
  std::vector<std::map<uint64_t, uint64_t>> free_;  // per region: offset -> length
  int next_region_ = 0;
  uint8_t* map_ = nullptr;
  uint64_t map_len_ = 0;
};

// ---------------------------------------------------------------------------
// Virtqueue: one split ring
// ---------------------------------------------------------------------------

struct VringDesc {
  uint64_t addr;
  uint32_t len;
  uint16_t flags;
  uint16_t next;
};
constexpr uint16_t kDescNext = 1, kDescWrite = 2, kDescIndirect = 4;
constexpr uint16_t kAvailNoInterrupt = 1, kUsedNoNotify = 1;

// One buffer of a chain: guest address, length, whether the device writes it.
struct Seg {
  uint64_t gpa;
  uint32_t len;
  bool device_writes;
};

class Virtqueue {
 public:
  // Allocates the ring in `mem`: the descriptor table, the avail ring and
  // the used ring in (up to) three different regions.
  Virtqueue(GuestMemory& mem, uint16_t index, uint16_t size, bool event_idx, bool indirect);
  ~Virtqueue();

  uint16_t index() const { return index_; }
  uint16_t size() const { return size_; }
  uint64_t desc_user() const;
  uint64_t avail_user() const;
  uint64_t used_user() const;
  int kick_fd() const { return kick_.get(); }
  int call_fd() const { return call_.get(); }

  // Adds a chain (device-readable segments must come first). Indirect when
  // the queue was made so and the chain has more than one segment. Returns
  // false when there are not enough free descriptors. Not visible to the
  // device before publish().
  bool add(std::span<const Seg> segs, uint64_t token);
  // Makes the added chains visible (avail idx) and kicks if the device
  // wants a notification (EVENT_IDX avail_event or the used ring's
  // NO_NOTIFY flag). Returns whether it kicked. With `may_kick` false it
  // never kicks (a driver that forgot to: the stall tests).
  bool publish(bool may_kick = true);
  // One used element if there is one: its token and written length.
  bool pop_used(uint64_t& token, uint32_t& len, uint16_t* head = nullptr);
  // Asks for a call on the next used element (used_event or the avail
  // flag); returns true if used elements are already pending.
  // After reaping, as Linux's virtqueue_enable_cb: with EVENT_IDX, tells
  // the device (used_event) how far completions have been consumed.
  void note_consumed();
  bool arm();
  bool pending() const;
  size_t in_flight() const { return in_flight_; }
  size_t free_descs() const { return free_count_; }
  uint64_t kicks() const { return kicks_; }
  uint64_t calls_seen() const { return calls_; }
  void drain_call();  // reads the call eventfd

  // Raw access for hostile tests and reconnection.
  VringDesc* desc_table() { return desc_; }
  uint16_t alloc_desc();           // a free descriptor (throws when none)
  void push_avail(uint16_t head);  // adds head at avail idx without bookkeeping
  void set_avail_idx(uint16_t idx);
  uint16_t avail_idx() const;
  uint16_t used_idx() const;  // as the device wrote it
  uint16_t last_used() const { return last_used_; }
  // Used element number idx (mod size) as the device wrote it: {id, len}.
  std::pair<uint32_t, uint32_t> used_elem(uint16_t idx) const;
  void kick();
  // The tokens of the chains the device has not returned yet.
  std::vector<uint64_t> outstanding() const;
  // After the back end went away without an inflight area: puts every
  // outstanding chain on the avail ring again, in submission order (made
  // visible by publish()). Returns how many.
  size_t requeue_outstanding();

 private:
  void free_chain(uint16_t head);
  GuestMemory& mem_;
  uint16_t index_, size_;
  bool event_idx_, indirect_;
  GuestMemory::Block desc_block_, avail_block_, used_block_;
  VringDesc* desc_ = nullptr;
  uint16_t* avail_ = nullptr;  // flags, idx, ring[size], used_event
  uint8_t* used_ = nullptr;    // flags, idx, {id,len}[size], avail_event
  std::vector<uint16_t> next_free_;
  uint16_t free_head_ = 0;
  size_t free_count_ = 0;
  uint16_t shadow_avail_ = 0;     // avail idx including unpublished chains
  uint16_t published_avail_ = 0;  // avail idx the device has seen
  uint16_t last_used_ = 0;
  size_t in_flight_ = 0;
  struct HeadState {
    uint64_t token = 0;
    uint16_t ndesc = 0;  // ring descriptors the chain holds
    bool busy = false;
    uint64_t seq = 0;  // submission order
  };
  std::vector<HeadState> heads_;
  std::vector<GuestMemory::Block> indirect_tables_;  // per head, made on first use
  Fd kick_, call_;
  uint64_t kicks_ = 0, calls_ = 0;
  uint64_t seq_ = 0;
  bool owe_kick_ = false;  // published without the kick the device wanted
};

// ---------------------------------------------------------------------------
// Device: a vhost-user-blk session
// ---------------------------------------------------------------------------

enum class Toggle { kOff, kOn, kAuto };  // kAuto: on when the back end offers it

struct Options {
  unsigned queues = 1;
  uint16_t queue_size = 128;
  Toggle event_idx = Toggle::kAuto;
  Toggle indirect = Toggle::kAuto;
  Toggle reply_ack = Toggle::kAuto;
  Toggle inflight = Toggle::kAuto;  // GET/SET_INFLIGHT_FD
  int mem_regions = 2;
  uint64_t mem_bytes = 64ull << 20;
  int connect_timeout_ms = 5000;
  int reply_timeout_ms = 10000;
  // Largest data segment per descriptor (0: no limit): longer buffers are
  // split, and consecutive pieces come from different regions.
  uint32_t max_seg = 0;
  bool start_rings = true;  // false: stop after SET_MEM_TABLE
  int64_t vring_num = -1;   // >= 0: SET_VRING_NUM says this instead of queue_size (hostile)
  bool verbose = false;     // every message on stderr
};

struct Completion {
  unsigned queue = 0;
  uint64_t token = 0;
  int status = -1;  // the status byte the device wrote
  uint32_t used_len = 0;
};

// A virtio-blk request: the header's type and sector, the data segments
// (device-readable for OUT/DISCARD/WRITE_ZEROES, device-writable for
// IN/GET_ID), and optionally a status area other than one byte.
struct BlkRequest {
  uint32_t type = kBlkIn;
  uint64_t sector = 0;
  uint32_t ioprio = 0;
  std::vector<Seg> data;
  uint32_t header_len = 16;  // < 16: a truncated header (hostile)
  bool status_writable = true;
};

class Device {
 public:
  explicit Device(Options opts);
  ~Device();

  // Connects and negotiates, sets up memory and (unless !start_rings) the
  // rings. Throws ProtocolError / Disconnected.
  void connect(const std::string& path);
  // After a Disconnected: connects again to the same path (retrying up to
  // timeout_s) and renegotiates the same features. With INFLIGHT_SHMFD it
  // passes the kept inflight fd back (SET_INFLIGHT_FD) and restarts the
  // rings at the used index: the back end resubmits what its inflight area
  // holds. Without it, the requests still outstanding are put on the avail
  // rings again and the rings restart at the old avail index. Returns how
  // many requests were in flight; their completions come through reap().
  // A connection dropped during the handshake is retried too: a back end
  // killed with a client queued on its listener resets that connection.
  size_t reconnect(double timeout_s);
  // GET_VRING_BASE on every ring (stops them); the avail indices the back
  // end reports.
  std::vector<uint32_t> stop();
  void close();

  // Negotiation results.
  uint64_t features_offered() const { return features_offered_; }
  uint64_t features_acked() const { return features_acked_; }
  uint64_t protocol_offered() const { return protocol_offered_; }
  uint64_t protocol_acked() const { return protocol_acked_; }
  uint64_t queue_num() const { return queue_num_; }  // GET_QUEUE_NUM, 0 without MQ
  bool has(unsigned feature) const { return features_acked_ >> feature & 1; }
  bool has_protocol(unsigned pf) const { return protocol_acked_ >> pf & 1; }
  const BlkConfig& config() const { return config_; }
  std::vector<uint8_t> config_bytes() const { return config_bytes_; }
  uint64_t inflight_mmap_size() const { return inflight_size_; }
  int inflight_fd() const { return inflight_fd_.get(); }

  // GET_CONFIG / SET_CONFIG (the latter with REPLY_ACK when negotiated;
  // returns the ack value, or 0 without it).
  std::vector<uint8_t> get_config(uint32_t offset, uint32_t size);
  uint64_t set_config(uint32_t offset, std::span<const uint8_t> bytes, uint32_t flags = 0);

  // A message with REPLY_ACK asked for when negotiated (ack value returned,
  // 0 when not negotiated); for the control-path tests.
  uint64_t send_acked(uint32_t request, std::span<const uint8_t> payload, std::span<const int> fds = {});
  Message call(uint32_t request, std::span<const uint8_t> payload = {}, std::span<const int> fds = {});

  GuestMemory& mem() { return *mem_; }
  Virtqueue& queue(unsigned q) { return *queues_.at(q); }
  unsigned nqueues() const { return static_cast<unsigned>(queues_.size()); }
  Channel& channel() { return *chan_; }
  const Options& options() const { return opts_; }

  // Builds a virtio-blk request on queue q (header and status in guest
  // memory the Device owns). False when the ring or the request slots are
  // full. Visible to the back end after kick(q) / kick_all().
  bool submit(unsigned q, const BlkRequest& req, uint64_t token);
  void kick(unsigned q) { queues_.at(q)->publish(); }
  void kick_all();
  // Makes the added chains visible without kicking.
  void publish_all_silently();
  // Appends completed requests of every queue to out; returns how many.
  size_t reap(std::vector<Completion>& out);
  // Waits until a queue has used elements, up to timeout_ms. Returns false
  // on timeout. Throws Disconnected if the socket closes meanwhile.
  bool wait(int timeout_ms);
  size_t in_flight() const;

  // Splits [buf, buf+len) into segments of at most options().max_seg bytes.
  std::vector<Seg> segs(const GuestMemory::Block& b, bool device_writes) const;

 private:
  void handshake(bool again);
  void setup_rings(bool again);
  uint64_t get_u64(uint32_t request);
  void set_u64(uint32_t request, uint64_t v, std::span<const int> fds = {});
  void set_state(uint32_t request, uint32_t index, uint32_t num);
  Message recv_reply(uint32_t request);
  void log(const char* dir, uint32_t request, size_t size, uint32_t flags);

  Options opts_;
  std::string path_;
  std::unique_ptr<Channel> chan_;
  std::unique_ptr<GuestMemory> mem_;
  std::vector<std::unique_ptr<Virtqueue>> queues_;
  uint64_t features_offered_ = 0, features_acked_ = 0;
  uint64_t protocol_offered_ = 0, protocol_acked_ = 0;
  uint64_t queue_num_ = 0;
  BlkConfig config_;
  std::vector<uint8_t> config_bytes_;
  Fd inflight_fd_;
  // Per queue, the ring base of the reconnection under way: computed (and
  // the outstanding chains requeued) once, however often the handshake is
  // retried.
  std::vector<std::optional<uint32_t>> resume_base_;
  uint64_t inflight_size_ = 0, inflight_offset_ = 0;
  // Per queue: request slots (16-byte header + status byte) in guest memory.
  struct Slots {
    GuestMemory::Block block;
    std::vector<uint16_t> free;
    std::vector<uint64_t> token;  // per slot
  };
  std::vector<Slots> slots_;
  std::vector<Completion> stash_;  // reaped while reconnecting
};

// 64-bit FNV-1a, for a digest of data read (the same in Python is a few
// lines).
uint64_t fnv1a64(const uint8_t* p, size_t n, uint64_t h = 0xcbf29ce484222325ull);
// Pattern bytes: a function of (seed, absolute byte offset), so any
// sub-range can be checked: byte at offset o is byte (o % 8) of
// splitmix64(seed ^ (o / 8)), little-endian.
void fill_pattern(uint8_t* p, uint64_t offset, size_t len, uint64_t seed);
// The first offset in [offset, offset+len) whose byte differs from the
// pattern, or -1.
int64_t check_pattern(const uint8_t* p, uint64_t offset, size_t len, uint64_t seed);

}  // namespace vhu
