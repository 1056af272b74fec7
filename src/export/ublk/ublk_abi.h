// The ublk driver's interface (linux/ublk_cmd.h), as far as the ublk export
// uses it. Debian 12's headers are Linux 6.1's: they lack the
// ioctl-encoded command numbers (UBLK_U_*, required by newer kernels unless
// they keep the legacy ones) and the later feature flags, hence our own
// copy of the few definitions needed. Layouts are the kernel's ABI.
#pragma once

#include <linux/ioctl.h>

#include <cstdint>

namespace vblk::ublk {

struct CtrlCmd {  // struct ublksrv_ctrl_cmd, in a 128-byte SQE's command area
  uint32_t dev_id;
  uint16_t queue_id;  // 0xffff when not for a queue
  uint16_t len;       // of the buffer at addr
  uint64_t addr;
  uint64_t data[2];
};
static_assert(sizeof(CtrlCmd) == 32);

struct DevInfo {  // struct ublksrv_ctrl_dev_info
  uint16_t nr_hw_queues;
  uint16_t queue_depth;
  uint16_t state;
  uint16_t pad0;
  uint32_t max_io_buf_bytes;
  uint32_t dev_id;
  int32_t ublksrv_pid;
  uint32_t pad1;
  uint64_t flags;
  uint64_t ublksrv_flags;
  uint32_t owner_uid;
  uint32_t owner_gid;
  uint64_t reserved1;
  uint64_t reserved2;
};
static_assert(sizeof(DevInfo) == 64);

struct IoDesc {       // struct ublksrv_io_desc: one per tag, in the mapped queue area
  uint32_t op_flags;  // op in bits 0-7, flags above
  uint32_t nr_sectors;
  uint64_t start_sector;
  uint64_t addr;
};
static_assert(sizeof(IoDesc) == 24);

struct IoCmd {  // struct ublksrv_io_cmd, in a 64-byte SQE's command area
  uint16_t q_id;
  uint16_t tag;
  int32_t result;
  uint64_t addr;
};
static_assert(sizeof(IoCmd) == 16);

struct ParamBasic {
  uint32_t attrs;
  uint8_t logical_bs_shift;
  uint8_t physical_bs_shift;
  uint8_t io_opt_shift;
  uint8_t io_min_shift;
  uint32_t max_sectors;
  uint32_t chunk_sectors;
  uint64_t dev_sectors;
  uint64_t virt_boundary_mask;
};
struct ParamDiscard {
  uint32_t discard_alignment;
  uint32_t discard_granularity;
  uint32_t max_discard_sectors;
  uint32_t max_write_zeroes_sectors;
  uint16_t max_discard_segments;
  uint16_t reserved0;
};
struct Params {  // struct ublk_params: the first two parameter types
  uint32_t len;
  uint32_t types;
  ParamBasic basic;
  ParamDiscard discard;
};
static_assert(sizeof(Params) == 64);

constexpr uint32_t kParamBasic = 1u << 0;
constexpr uint32_t kParamDiscard = 1u << 1;
constexpr uint32_t kAttrReadOnly = 1u << 0;
constexpr uint32_t kAttrVolatileCache = 1u << 2;
constexpr uint32_t kAttrFua = 1u << 3;

constexpr uint64_t kFlagUserRecovery = 1ull << 3;
constexpr uint64_t kFlagUserRecoveryReissue = 1ull << 4;
constexpr uint64_t kFlagCmdIoctlEncode = 1ull << 6;

constexpr uint16_t kStateDead = 0, kStateLive = 1, kStateQuiesced = 2, kStateFailIo = 3;

constexpr uint32_t kCmdGetDevInfo = _IOR('u', 0x02, CtrlCmd);
constexpr uint32_t kCmdAddDev = _IOWR('u', 0x04, CtrlCmd);
constexpr uint32_t kCmdDelDev = _IOWR('u', 0x05, CtrlCmd);
constexpr uint32_t kCmdStartDev = _IOWR('u', 0x06, CtrlCmd);
constexpr uint32_t kCmdStopDev = _IOWR('u', 0x07, CtrlCmd);
constexpr uint32_t kCmdSetParams = _IOWR('u', 0x08, CtrlCmd);
constexpr uint32_t kCmdStartUserRecovery = _IOWR('u', 0x10, CtrlCmd);
constexpr uint32_t kCmdEndUserRecovery = _IOWR('u', 0x11, CtrlCmd);

constexpr uint32_t kIoFetchReq = _IOWR('u', 0x20, IoCmd);
constexpr uint32_t kIoCommitAndFetchReq = _IOWR('u', 0x21, IoCmd);

constexpr uint8_t kOpRead = 0, kOpWrite = 1, kOpFlush = 2, kOpDiscard = 3, kOpWriteZeroes = 5;
constexpr uint32_t kIoFlagFua = 1u << 13;      // in op_flags
constexpr uint32_t kIoFlagNoUnmap = 1u << 15;  // in op_flags

constexpr int kIoResAbort = -19;  // -ENODEV: a fetch the driver will never answer
constexpr uint16_t kMaxQueueDepth = 4096;
// Where a queue's descriptors are mapped from the char device.
constexpr uint64_t kCmdBufOffset = 0;
constexpr uint64_t kMaxCmdBufBytes = uint64_t{kMaxQueueDepth} * sizeof(IoDesc);

}  // namespace vblk::ublk
