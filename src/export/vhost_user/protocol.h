// The vhost-user wire format (QEMU's docs/interop/vhost-user.rst) and the
// parts of virtio (split rings, virtio-blk) a back end reads from guest
// memory. Everything here is little-endian on the wire and in the rings;
// vblk runs on little-endian hosts only (x86-64, arm64), so the structs are
// read as they are.
#pragma once

#include <cstdint>

namespace vblk::vhost {

// ---- messages on the unix socket

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
  kSetBackendReqFd = 21,
  kGetConfig = 24,
  kSetConfig = 25,
  kGetInflightFd = 31,
  kSetInflightFd = 32,
  kResetDevice = 34,
  kGetMaxMemSlots = 36,
  kAddMemReg = 37,
  kRemMemReg = 38,
};

constexpr uint32_t kVersion = 0x1;
constexpr uint32_t kFlagVersionMask = 0x3;
constexpr uint32_t kFlagReply = 1u << 2;
constexpr uint32_t kFlagNeedReply = 1u << 3;

struct MsgHeader {
  uint32_t request;
  uint32_t flags;
  uint32_t size;  // of the payload that follows
};
static_assert(sizeof(MsgHeader) == 12);

// The largest payload any message here carries (a full memory table).
constexpr uint32_t kMaxMemRegions = 8;
constexpr uint32_t kMaxFds = kMaxMemRegions;

struct MemRegion {
  uint64_t guest_phys_addr;
  uint64_t memory_size;
  uint64_t userspace_addr;  // the front end's address for it
  uint64_t mmap_offset;     // where in the fd the region starts
};
struct MemTable {
  uint32_t nregions;
  uint32_t padding;
  MemRegion regions[kMaxMemRegions];
};
struct SingleMemRegion {
  uint64_t padding;
  MemRegion region;
};
struct VringState {
  uint32_t index;
  uint32_t num;
};
struct VringAddr {
  uint32_t index;
  uint32_t flags;  // bit 0: log
  uint64_t desc_user_addr;
  uint64_t used_user_addr;
  uint64_t avail_user_addr;
  uint64_t log_guest_addr;
};
struct ConfigMsg {
  uint32_t offset;
  uint32_t size;
  uint32_t flags;
  uint8_t region[256];
};
constexpr uint32_t kConfigHeader = 12;
struct InflightMsg {
  uint64_t mmap_size;
  uint64_t mmap_offset;
  uint16_t num_queues;
  uint16_t queue_size;
};
// The inflight area (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD) is the back
// end's own: the front end only keeps its descriptor across a back-end
// restart and hands it back. vblk lays each queue's part out as
// libvhost-user does for split rings: a header, then one entry per
// descriptor, each part rounded up to 64 bytes.
struct InflightDesc {
  uint8_t inflight;  // popped, not yet completed
  uint8_t padding[5];
  uint16_t next;
  uint64_t counter;  // pop order, for resubmitting in order
};
struct InflightQueue {
  uint64_t features;
  uint16_t version;  // 0: never used; kInflightVersion once started
  uint16_t desc_num;
  uint16_t last_batch_head;  // the head being completed
  uint16_t used_idx;         // the used index once it was
  InflightDesc desc[];
};
static_assert(sizeof(InflightDesc) == 16 && sizeof(InflightQueue) == 16);
constexpr uint16_t kInflightVersion = 1;
constexpr uint64_t inflight_queue_bytes(uint32_t queue_size) {
  return (sizeof(InflightQueue) + uint64_t{queue_size} * sizeof(InflightDesc) + 63) & ~uint64_t{63};
}

constexpr uint32_t kMaxPayload = sizeof(MemTable) > sizeof(ConfigMsg) ? sizeof(MemTable) : sizeof(ConfigMsg);
static_assert(sizeof(ConfigMsg) <= kMaxPayload);

// SET_VRING_KICK/CALL/ERR payload: the queue in bits 0-7, bit 8 set when
// no descriptor comes with it.
constexpr uint64_t kVringIndexMask = 0xff;
constexpr uint64_t kVringNoFd = 1ull << 8;

// ---- feature bits

constexpr uint64_t bit(unsigned n) { return 1ull << n; }
// virtio
constexpr unsigned kFRingIndirectDesc = 28;
constexpr unsigned kFRingEventIdx = 29;
constexpr unsigned kFProtocolFeatures = 30;  // VHOST_USER_F_PROTOCOL_FEATURES
constexpr unsigned kFVersion1 = 32;
// vhost-user protocol features
constexpr unsigned kPfMq = 0;
constexpr unsigned kPfReplyAck = 3;
constexpr unsigned kPfConfig = 9;
constexpr unsigned kPfInflightShmfd = 12;
constexpr unsigned kPfResetDevice = 13;
constexpr unsigned kPfConfigureMemSlots = 15;

// ---- split virtqueues (virtio 1.x, 2.7)

constexpr unsigned kMaxQueueSize = 32768;
struct Desc {
  uint64_t addr;
  uint32_t len;
  uint16_t flags;
  uint16_t next;
};
static_assert(sizeof(Desc) == 16);
constexpr uint16_t kDescNext = 1;
constexpr uint16_t kDescWrite = 2;
constexpr uint16_t kDescIndirect = 4;
constexpr uint16_t kAvailNoInterrupt = 1;
constexpr uint16_t kUsedNoNotify = 1;
struct UsedElem {
  uint32_t id;
  uint32_t len;
};

// ---- virtio-blk (virtio 1.x, 5.2)

constexpr unsigned kBlkFSizeMax = 1;
constexpr unsigned kBlkFSegMax = 2;
constexpr unsigned kBlkFRo = 5;
constexpr unsigned kBlkFBlkSize = 6;
constexpr unsigned kBlkFFlush = 9;
constexpr unsigned kBlkFTopology = 10;
constexpr unsigned kBlkFConfigWce = 11;
constexpr unsigned kBlkFMq = 12;
constexpr unsigned kBlkFDiscard = 13;
constexpr unsigned kBlkFWriteZeroes = 14;

constexpr uint32_t kBlkTIn = 0;
constexpr uint32_t kBlkTOut = 1;
constexpr uint32_t kBlkTFlush = 4;
constexpr uint32_t kBlkTGetId = 8;
constexpr uint32_t kBlkTDiscard = 11;
constexpr uint32_t kBlkTWriteZeroes = 13;

constexpr uint8_t kBlkSOk = 0;
constexpr uint8_t kBlkSIoErr = 1;
constexpr uint8_t kBlkSUnsupp = 2;

constexpr uint32_t kBlkIdBytes = 20;
constexpr uint32_t kSectorShift = 9;

struct BlkReqHeader {
  uint32_t type;
  uint32_t ioprio;
  uint64_t sector;
};
static_assert(sizeof(BlkReqHeader) == 16);
struct BlkDiscardWriteZeroes {
  uint64_t sector;
  uint32_t num_sectors;
  uint32_t flags;  // bit 0: unmap
};
static_assert(sizeof(BlkDiscardWriteZeroes) == 16);

#pragma pack(push, 1)
struct BlkConfig {
  uint64_t capacity;  // in 512-byte sectors
  uint32_t size_max;
  uint32_t seg_max;
  uint16_t cylinders;
  uint8_t heads;
  uint8_t sectors;
  uint32_t blk_size;
  uint8_t physical_block_exp;
  uint8_t alignment_offset;
  uint16_t min_io_size;
  uint32_t opt_io_size;
  uint8_t wce;
  uint8_t unused;
  uint16_t num_queues;
  uint32_t max_discard_sectors;
  uint32_t max_discard_seg;
  uint32_t discard_sector_alignment;
  uint32_t max_write_zeroes_sectors;
  uint32_t max_write_zeroes_seg;
  uint8_t write_zeroes_may_unmap;
  uint8_t unused1[3];
};
#pragma pack(pop)
static_assert(sizeof(BlkConfig) == 60);

}  // namespace vblk::vhost
