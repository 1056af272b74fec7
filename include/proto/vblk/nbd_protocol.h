// The NBD wire protocol (NetworkBlockDevice/nbd doc/proto.md): magics,
// option and command numbers, flags, reply types, and big-endian field
// helpers. Shared by the server and the client driver.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace vblk::nbd {

// ---- handshake
constexpr uint64_t kMagicInit = 0x4e42444d41474943ull;  // "NBDMAGIC"
constexpr uint64_t kMagicOpt = 0x49484156454F5054ull;   // "IHAVEOPT"
constexpr uint64_t kMagicOptReply = 0x3e889045565a9ull;
constexpr uint16_t kFlagFixedNewstyle = 1 << 0;
constexpr uint16_t kFlagNoZeroes = 1 << 1;
constexpr uint32_t kClientFixedNewstyle = 1 << 0;
constexpr uint32_t kClientNoZeroes = 1 << 1;

enum Opt : uint32_t {
  kOptExportName = 1,
  kOptAbort = 2,
  kOptList = 3,
  kOptStartTls = 5,
  kOptInfo = 6,
  kOptGo = 7,
  kOptStructuredReply = 8,
  kOptListMetaContext = 9,
  kOptSetMetaContext = 10,
};

constexpr uint32_t kRepErrBit = 1u << 31;
enum Rep : uint32_t {
  kRepAck = 1,
  kRepServer = 2,
  kRepInfo = 3,
  kRepMetaContext = 4,
  kRepErrUnsup = kRepErrBit | 1,
  kRepErrPolicy = kRepErrBit | 2,
  kRepErrInvalid = kRepErrBit | 3,
  kRepErrPlatform = kRepErrBit | 4,
  kRepErrTlsReqd = kRepErrBit | 5,
  kRepErrUnknown = kRepErrBit | 6,
  kRepErrShutdown = kRepErrBit | 7,
  kRepErrBlockSizeReqd = kRepErrBit | 8,
  kRepErrTooBig = kRepErrBit | 9,
};

enum Info : uint16_t {
  kInfoExport = 0,
  kInfoName = 1,
  kInfoDescription = 2,
  kInfoBlockSize = 3,
};

// ---- transmission flags (per export)
enum TransmissionFlags : uint16_t {
  kFlagHasFlags = 1 << 0,
  kFlagReadOnly = 1 << 1,
  kFlagSendFlush = 1 << 2,
  kFlagSendFua = 1 << 3,
  kFlagRotational = 1 << 4,
  kFlagSendTrim = 1 << 5,
  kFlagSendWriteZeroes = 1 << 6,
  kFlagSendDf = 1 << 7,
  kFlagCanMultiConn = 1 << 8,
  kFlagSendResize = 1 << 9,
  kFlagSendCache = 1 << 10,
  kFlagSendFastZero = 1 << 11,
};

// ---- transmission
constexpr uint32_t kMagicRequest = 0x25609513;
constexpr uint32_t kMagicSimpleReply = 0x67446698;
constexpr uint32_t kMagicStructuredReply = 0x668e33ef;
constexpr size_t kRequestSize = 28;
constexpr size_t kSimpleReplySize = 16;
constexpr size_t kStructuredReplySize = 20;

enum Cmd : uint16_t {
  kCmdRead = 0,
  kCmdWrite = 1,
  kCmdDisc = 2,
  kCmdFlush = 3,
  kCmdTrim = 4,
  kCmdCache = 5,
  kCmdWriteZeroes = 6,
  kCmdBlockStatus = 7,
};

enum CmdFlags : uint16_t {
  kCmdFlagFua = 1 << 0,
  kCmdFlagNoHole = 1 << 1,
  kCmdFlagDf = 1 << 2,
  kCmdFlagReqOne = 1 << 3,
  kCmdFlagFastZero = 1 << 4,
};

constexpr uint16_t kReplyFlagDone = 1 << 0;
enum ReplyType : uint16_t {
  kReplyNone = 0,
  kReplyOffsetData = 1,
  kReplyOffsetHole = 2,
  kReplyBlockStatus = 5,
  kReplyError = (1 << 15) | 1,
  kReplyErrorOffset = (1 << 15) | 2,
};
inline bool reply_type_is_error(uint16_t t) { return t & (1 << 15); }

// base:allocation extent flags
constexpr uint32_t kStateHole = 1 << 0;
constexpr uint32_t kStateZero = 1 << 1;
constexpr const char* kMetaBaseAllocation = "base:allocation";

// Wire error numbers (the protocol's, not the host's).
enum WireErr : uint32_t {
  kErrPerm = 1,
  kErrIo = 5,
  kErrNoMem = 12,
  kErrInval = 22,
  kErrNoSpc = 28,
  kErrOverflow = 75,
  kErrNotSup = 95,
  kErrShutdown = 108,
};
inline uint32_t errno_to_wire(int e) {
  switch (e) {
    case EPERM:
    case EROFS: return kErrPerm;
    case EIO: return kErrIo;
    case ENOMEM: return kErrNoMem;
    case ENOSPC:
    case EFBIG:
    case EDQUOT: return kErrNoSpc;
    case EOVERFLOW: return kErrOverflow;
    case ENOTSUP: return kErrNotSup;
    case ESHUTDOWN: return kErrShutdown;
    // Everything else, as QEMU's system_errno_to_nbd_errno: EINVAL (a
    // dropped qcow2 driver's ENOMEDIUM, a broken snapshot's EACCES, a
    // copy-before-write's ETIMEDOUT).
    default: return kErrInval;
  }
}
inline int wire_to_errno(uint32_t e) {
  switch (e) {
    case kErrPerm: return EPERM;
    case kErrIo: return EIO;
    case kErrNoMem: return ENOMEM;
    case kErrInval: return EINVAL;
    case kErrNoSpc: return ENOSPC;
    case kErrOverflow: return EOVERFLOW;
    case kErrNotSup: return ENOTSUP;
    case kErrShutdown: return ESHUTDOWN;
    default: return EINVAL;  // the spec: unknown errors are treated as EINVAL
  }
}

// Limits. Names and option payloads beyond these are refused rather than read.
constexpr uint32_t kMaxStringSize = 4096;       // names, descriptions, queries
constexpr uint32_t kMaxOptionSize = 64 * 1024;  // one option's payload
constexpr uint32_t kMaxBufferSize = 32u << 20;  // one read or write (as QEMU)

// ---- big-endian fields
inline void put16(uint8_t* p, uint16_t v) {
  p[0] = v >> 8;
  p[1] = v;
}
inline void put32(uint8_t* p, uint32_t v) {
  for (int i = 3; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}
inline void put64(uint8_t* p, uint64_t v) {
  for (int i = 7; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}
inline uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
inline uint32_t get32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) << 24 | static_cast<uint32_t>(p[1]) << 16 | static_cast<uint32_t>(p[2]) << 8 |
         p[3];
}
inline uint64_t get64(const uint8_t* p) { return static_cast<uint64_t>(get32(p)) << 32 | get32(p + 4); }

// Appends big-endian fields to a growing message.
class Writer {
 public:
  Writer& u16(uint16_t v) {
    size_t n = b_.size();
    b_.resize(n + 2);
    put16(&b_[n], v);
    return *this;
  }
  Writer& u32(uint32_t v) {
    size_t n = b_.size();
    b_.resize(n + 4);
    put32(&b_[n], v);
    return *this;
  }
  Writer& u64(uint64_t v) {
    size_t n = b_.size();
    b_.resize(n + 8);
    put64(&b_[n], v);
    return *this;
  }
  Writer& str(const std::string& s) {
    b_.insert(b_.end(), s.begin(), s.end());
    return *this;
  }
  Writer& zeroes(size_t n) {
    b_.resize(b_.size() + n, 0);
    return *this;
  }
  std::vector<uint8_t>& bytes() { return b_; }
  size_t size() const { return b_.size(); }

 private:
  std::vector<uint8_t> b_;
};

// Reads big-endian fields from an option payload; `ok()` turns false on
// overrun instead of reading past the end.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  bool ok() const { return ok_; }
  size_t left() const { return ok_ ? b_.size() - pos_ : 0; }
  uint16_t u16() { return take(2) ? get16(&b_[pos_ - 2]) : 0; }
  uint32_t u32() { return take(4) ? get32(&b_[pos_ - 4]) : 0; }
  std::string str(size_t n) {
    if (!take(n)) return {};
    return std::string(reinterpret_cast<const char*>(&b_[pos_ - n]), n);
  }

 private:
  bool take(size_t n) {
    if (!ok_ || b_.size() - pos_ < n) {
      ok_ = false;
      return false;
    }
    pos_ += n;
    return true;
  }
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace vblk::nbd
