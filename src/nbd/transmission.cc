// Server side of the transmission phase: one reader takes requests off the
// socket in order and starts a handler for each; handlers run concurrently
// (up to max_requests per connection) and send their replies whole under
// the send lock, in whatever order they finish.
//
// A request the server cannot parse (bad magic, a write longer than it will
// buffer) ends the connection; a request it can parse but not honour (out of
// range, bad flags, read-only export) gets an error reply and the
// connection goes on.
#include <fmt/format.h>

#include <array>

#include "nbd/session.h"
#include "vblk/buffer.h"

namespace vblk::nbd {

namespace {

struct Request {
  uint16_t flags = 0;
  uint16_t type = 0;
  uint64_t cookie = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  AlignedBuffer payload;  // writes
};

class Connection {
 public:
  explicit Connection(Session& s)
      : s_(s), send_lock_(s.loop), slots_(s.loop, s.server.options().max_requests), inflight_(s.loop) {}

  Task<void> run() {
    for (;;) {
      std::array<uint8_t, kRequestSize> h;
      if (!co_await recv_exact(s_.loop, s_.fd, h)) break;
      if (get32(h.data()) != kMagicRequest) break;
      Request r;
      r.flags = get16(h.data() + 4);
      r.type = get16(h.data() + 6);
      r.cookie = get64(h.data() + 8);
      r.offset = get64(h.data() + 16);
      r.length = get32(h.data() + 24);
      if (r.type == kCmdDisc) break;
      if (r.type == kCmdWrite) {
        // The payload follows whatever we decide; one we will not buffer
        // cannot be skipped safely, so the connection ends.
        if (r.length > kMaxBufferSize) break;
        r.payload = AlignedBuffer(r.length ? r.length : 1, 4096);
        if (!co_await recv_exact(s_.loop, s_.fd, r.payload.span().subspan(0, r.length))) break;
      }
      co_await slots_.acquire();
      inflight_.add();
      spawn_detached(handle(std::move(r)));
      if (broken_) break;
    }
    co_await inflight_.wait();
  }

 private:
  Task<void> handle(Request r) {
    Status st = co_await execute(r);
    slots_.release();
    if (!st && st.error().code == EPIPE) broken_ = true;
    inflight_.done();
  }

  // Checks the request against the export and the negotiated options.
  Status validate(const Request& r) const {
    const Export& e = *s_.exp;
    uint16_t allowed = 0;
    switch (r.type) {
      case kCmdRead: allowed = s_.structured ? kCmdFlagDf : 0; break;
      case kCmdWrite: allowed = kCmdFlagFua; break;
      case kCmdWriteZeroes: allowed = kCmdFlagFua | kCmdFlagNoHole | kCmdFlagFastZero; break;
      case kCmdTrim: allowed = kCmdFlagFua; break;
      case kCmdBlockStatus: allowed = kCmdFlagReqOne; break;
      case kCmdFlush: case kCmdCache: break;
      default: return Error(EINVAL, fmt::format("unsupported command {}", r.type));
    }
    if (r.flags & ~allowed) return Error(EINVAL, fmt::format("unsupported flags 0x{:x}", r.flags));
    if (r.type == kCmdBlockStatus && !s_.base_allocation) return Error(EINVAL, "no meta context negotiated");
    if (r.type == kCmdRead && r.length > kMaxBufferSize)
      return Error(EINVAL, fmt::format("len ({}) is larger than max len ({})", r.length, kMaxBufferSize));
    bool writes = r.type == kCmdWrite || r.type == kCmdWriteZeroes || r.type == kCmdTrim;
    if (writes && (!e.writable || e.node->read_only())) return Error(EPERM, "export is read-only");
    if (r.type != kCmdFlush) {
      uint64_t size = e.node->length();
      if (r.offset > size || r.length > size - r.offset) {
        int code = (r.type == kCmdWrite || r.type == kCmdWriteZeroes) ? ENOSPC : EINVAL;
        return Error(code, fmt::format("operation past EOF; From: {}, Len: {}, Size: {}", r.offset, r.length, size));
      }
    }
    return {};
  }

  Task<Status> execute(Request& r) {
    Node& n = *s_.exp->node;
    if (auto v = validate(r); !v) co_return co_await reply_error(r, v.error());
    Status st;
    switch (r.type) {
      case kCmdRead: co_return co_await read(r);
      case kCmdBlockStatus: co_return co_await block_status(r);
      case kCmdWrite:
        st = co_await n.write(r.offset, r.payload.span().subspan(0, r.length), (r.flags & kCmdFlagFua) ? kReqFua : 0);
        break;
      case kCmdWriteZeroes: {
        uint32_t f = 0;
        if (r.flags & kCmdFlagFua) f |= kReqFua;
        if (!(r.flags & kCmdFlagNoHole)) f |= kReqMayUnmap;
        if (r.flags & kCmdFlagFastZero) f |= kReqNoFallback;
        st = co_await n.write_zeroes(r.offset, r.length, f);
        break;
      }
      case kCmdTrim:
        st = co_await n.discard(r.offset, r.length);
        if (st && (r.flags & kCmdFlagFua)) st = co_await n.flush();
        break;
      case kCmdFlush:
        st = co_await n.flush();
        break;
      case kCmdCache:
        break;  // advisory; the host page cache or our own caches do the rest
    }
    if (!st) co_return co_await reply_error(r, st.error());
    co_return co_await reply_simple(r.cookie, 0);
  }

  Task<Status> read(Request& r) {
    AlignedBuffer buf(std::max<uint32_t>(r.length, 1), 4096);
    auto data = buf.span().subspan(0, r.length);
    if (r.length) {
      Status st = co_await s_.exp->node->read(r.offset, data);
      if (!st) co_return co_await reply_error(r, st.error());
    }
    auto g = co_await send_lock_.scoped();
    if (!s_.structured || r.length == 0) {
      std::array<uint8_t, kSimpleReplySize> h;
      put_simple(h.data(), r.cookie, 0);
      if (!s_.structured) {
        VBLK_CO_TRY(co_await send_all(s_.loop, s_.fd, h, r.length ? MSG_MORE : 0));
        co_return co_await send_all(s_.loop, s_.fd, data);
      }
      co_return co_await send_all(s_.loop, s_.fd, h);
    }
    std::array<uint8_t, kStructuredReplySize + 8> h;
    put_structured(h.data(), kReplyFlagDone, kReplyOffsetData, r.cookie, 8 + r.length);
    put64(h.data() + kStructuredReplySize, r.offset);
    VBLK_CO_TRY(co_await send_all(s_.loop, s_.fd, h, MSG_MORE));
    co_return co_await send_all(s_.loop, s_.fd, data);
  }

  // base:allocation extents from the node's status through its backing chain.
  Task<Status> block_status(Request& r) {
    Node& n = *s_.exp->node;
    const size_t max_extents = (r.flags & kCmdFlagReqOne) ? 1 : 2048;
    std::vector<std::pair<uint32_t, uint32_t>> ext;  // length, flags
    uint64_t off = r.offset, end = r.offset + r.length;
    while (off < end && ext.size() <= max_extents) {
      auto bs = co_await n.block_status_above(off, end - off);
      if (!bs) co_return co_await reply_error(r, bs.error());
      uint64_t len = std::min<uint64_t>(bs->bytes, end - off);
      if (len == 0) break;
      uint32_t f = ((bs->flags & kStatusData) ? 0 : kStateHole) | ((bs->flags & kStatusZero) ? kStateZero : 0);
      if (!ext.empty() && ext.back().second == f) {
        ext.back().first += static_cast<uint32_t>(len);
      } else {
        if (ext.size() == max_extents) break;
        ext.push_back({static_cast<uint32_t>(len), f});
      }
      off += len;
    }
    if (ext.empty()) co_return co_await reply_error(r, Error(EINVAL, "empty block status request"));
    Writer w;
    w.zeroes(kStructuredReplySize);
    put_structured(w.bytes().data(), kReplyFlagDone, kReplyBlockStatus, r.cookie, 4 + 8 * static_cast<uint32_t>(ext.size()));
    w.u32(Session::kBaseAllocationId);
    for (auto [len, f] : ext) w.u32(len).u32(f);
    auto g = co_await send_lock_.scoped();
    co_return co_await send_all(s_.loop, s_.fd, w.bytes());
  }

  Task<Status> reply_error(const Request& r, const Error& e) {
    uint32_t code = errno_to_wire(e.code);
    // Reads and block status with structured replies carry the error as a
    // chunk with a message; everything else gets a simple reply.
    if (s_.structured && (r.type == kCmdRead || r.type == kCmdBlockStatus)) {
      std::string msg = e.what().substr(0, kMaxStringSize);
      Writer w;
      w.zeroes(kStructuredReplySize);
      put_structured(w.bytes().data(), kReplyFlagDone, kReplyError, r.cookie, 6 + static_cast<uint32_t>(msg.size()));
      w.u32(code).u16(static_cast<uint16_t>(msg.size())).str(msg);
      auto g = co_await send_lock_.scoped();
      co_return co_await send_all(s_.loop, s_.fd, w.bytes());
    }
    co_return co_await reply_simple(r.cookie, code);
  }

  Task<Status> reply_simple(uint64_t cookie, uint32_t err) {
    std::array<uint8_t, kSimpleReplySize> h;
    put_simple(h.data(), cookie, err);
    auto g = co_await send_lock_.scoped();
    co_return co_await send_all(s_.loop, s_.fd, h);
  }

  static void put_simple(uint8_t* p, uint64_t cookie, uint32_t err) {
    put32(p, kMagicSimpleReply);
    put32(p + 4, err);
    put64(p + 8, cookie);
  }
  static void put_structured(uint8_t* p, uint16_t flags, uint16_t type, uint64_t cookie, uint32_t len) {
    put32(p, kMagicStructuredReply);
    put16(p + 4, flags);
    put16(p + 6, type);
    put64(p + 8, cookie);
    put32(p + 16, len);
  }

  Session& s_;
  CoMutex send_lock_;
  CoSemaphore slots_;
  WaitGroup inflight_;
  bool broken_ = false;
};

}  // namespace

Task<void> transmit(Session& s) {
  Connection c(s);
  co_await c.run();
}

}  // namespace vblk::nbd
