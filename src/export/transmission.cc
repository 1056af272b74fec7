// Server side of the transmission phase.
//
// One reader per connection takes requests off the socket in order and
// starts a handler for each; handlers run concurrently (up to max_requests
// per connection) and queue their replies whole, in whatever order they
// finish; one sender writes the queue out.
//
// The hot path is shaped by syscall and wake-up counts, not by bytes:
//  - the reader receives into a buffer as much as the socket holds and
//    parses every complete request in it, so a client that pipelines 32
//    requests costs one recv, and all their disk I/O is queued in the same
//    loop round and reaches the kernel in one io_uring_enter (one device
//    kick for the batch);
//  - a write's payload is copied out of that buffer, or (the part not yet
//    received) received straight into its aligned buffer;
//  - replies are gathered: the sender starts one loop round after the first
//    reply is queued and sends everything queued by then with one sendmsg
//    (headers and read data as iovecs, no copy);
//  - data buffers come from a per-connection pool by power-of-two size.
// A request's slot is released when its reply has been sent (or dropped on
// a broken connection), so queued replies are bounded by max_requests.
//
// What one client can make the server hold is bounded, whether it is slow
// or hostile: besides the slots, the data of the requests in flight and of
// their queued replies (read and write lengths) is charged to a budget of
// kMaxInflightBytes per connection. A client that stops reading its replies
// therefore stops having its requests read (as qemu-nbd, which stops
// receiving at 16 requests in flight), and the kernel's socket buffers push
// back on it. The receive buffer starts small and grows only for a client
// that fills it, so an idle connection costs a few KiB.
//
// All clients together are bounded too: request data is also charged to the
// server's budget (Options::max_inflight_bytes), and the pools keep at most
// Server::kMaxPooledBytes of idle buffers between them. So that clients
// that pin the whole budget slow the others down but never stop them, each
// connection may have one request of up to kFloorBytes outside it.
//
// A request the server cannot parse (bad magic, a write longer than it will
// buffer) ends the connection; a request it can parse but not honour (out of
// range, bad flags, read-only export) gets an error reply and the
// connection goes on.
#include <fmt/format.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>

#include "session.h"
#include "vblk/buffer.h"

namespace vblk::nbd {

namespace {

// Aligned data buffers recycled by power-of-two size class (4 KiB .. 1 MiB);
// larger ones are allocated per request.
class BufferPool {
 public:
  static constexpr size_t kMinShift = 12, kMaxShift = 20;
  static constexpr size_t kMaxCachedBytes = 16u << 20;

  // `server_total`: the idle bytes of every pool of the server.
  explicit BufferPool(size_t& server_total) : server_total_(server_total) {}
  ~BufferPool() { server_total_ -= cached_; }
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  AlignedBuffer take(size_t n) {
    size_t c = size_class(n);
    if (c <= kMaxShift && !free_[c - kMinShift].empty()) {
      AlignedBuffer b = std::move(free_[c - kMinShift].back());
      free_[c - kMinShift].pop_back();
      cached_ -= b.size();
      server_total_ -= b.size();
      return b;
    }
    return AlignedBuffer(c <= kMaxShift ? size_t{1} << c : std::max<size_t>(n, 1), 4096);
  }
  void give(AlignedBuffer b) {
    if (!b.data()) return;
    size_t c = size_class(b.size());
    if (c > kMaxShift || (size_t{1} << c) != b.size() || cached_ + b.size() > kMaxCachedBytes ||
        server_total_ + b.size() > Server::kMaxPooledBytes)
      return;
    cached_ += b.size();
    server_total_ += b.size();
    free_[c - kMinShift].push_back(std::move(b));
  }

 private:
  static size_t size_class(size_t n) {
    size_t c = kMinShift;
    while ((size_t{1} << c) < n && c <= kMaxShift) ++c;
    return c;
  }
  std::array<std::vector<AlignedBuffer>, kMaxShift - kMinShift + 1> free_;
  size_t cached_ = 0;
  size_t& server_total_;
};

// A request's bytes as charged to the budgets, released with its reply.
struct Charge {
  uint32_t bytes = 0;   // of the connection's budget
  uint32_t shared = 0;  // of the server's budget
  bool floor = false;   // the connection's one request outside the server's budget
};

struct Request {
  uint16_t flags = 0;
  uint16_t type = 0;
  uint64_t cookie = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  AlignedBuffer payload;  // writes
  Charge charge;          // what it holds of the budgets
};

// One reply: a header (simple, or structured with its fixed chunk fields),
// then optional data (a pooled buffer) or extra bytes (block status, error
// message).
struct Reply {
  std::array<uint8_t, kStructuredReplySize + 8> head{};
  uint8_t head_len = 0;
  AlignedBuffer data;
  uint32_t data_len = 0;
  std::vector<uint8_t> extra;
  Charge charge;
};

class Connection {
 public:
  explicit Connection(Session& s)
      : s_(s),
        slots_(s.loop, s.server.options().max_requests),
        bytes_(s.loop, kMaxInflightBytes),
        inflight_(s.loop),
        pool_(s.server.pooled_bytes()),
        rbuf_(kMinRecvBuffer) {}

  Task<void> run() {
    for (;;) {
      if (rend_ - rpos_ < kRequestSize) {
        if (!co_await fill()) break;
        continue;
      }
      const uint8_t* h = rbuf_.data() + rpos_;
      if (get32(h) != kMagicRequest) break;
      Request r;
      r.flags = get16(h + 4);
      r.type = get16(h + 6);
      r.cookie = get64(h + 8);
      r.offset = get64(h + 16);
      r.length = get32(h + 24);
      rpos_ += kRequestSize;
      if (r.type == kCmdDisc) break;
      if (r.type == kCmdWrite && r.length > kMaxBufferSize) break;
      // Before the payload is taken: a client whose replies pile up waits
      // here, its further requests left in the socket.
      r.charge.bytes = bytes_of(r);
      co_await bytes_.acquire(r.charge.bytes);
      if (r.charge.bytes && r.charge.bytes <= kFloorBytes && !floor_busy_) {
        floor_busy_ = true;
        r.charge.floor = true;
      } else if (r.charge.bytes) {
        r.charge.shared = r.charge.bytes;
        co_await s_.server.inflight_budget().acquire(r.charge.shared);
      }
      if (r.type == kCmdWrite) {
        // The payload follows whatever we decide; one we will not buffer
        // cannot be skipped safely, so the connection ended above.
        r.payload = pool_.take(r.length);
        size_t have = std::min<size_t>(rend_ - rpos_, r.length);
        if (have) std::memcpy(r.payload.data(), rbuf_.data() + rpos_, have);
        rpos_ += have;
        if (have < r.length) {
          // (Not one condition with the co_await after &&: see
          // docs/architecture.md, compiler pitfalls.)
          Status got = co_await recv_exact(s_.loop, s_.fd, r.payload.span().subspan(have, r.length - have));
          if (!got) {
            release(r.charge);
            break;
          }
        }
      }
      co_await slots_.acquire();
      inflight_.add();
      spawn_detached(handle(std::move(r)));
      if (broken_) break;
    }
    co_await inflight_.wait();
  }

 private:
  static constexpr size_t kMinRecvBuffer = 4 << 10;
  static constexpr size_t kMaxRecvBuffer = 256 << 10;
  // The size of the one request a connection may have outside the server's
  // budget: a guest's largest usual request.
  static constexpr uint32_t kFloorBytes = 1u << 20;
  // Request data one connection may have in flight or queued as replies:
  // room for a full queue of 1 MiB requests (the bench's and nbdcopy's
  // largest), and at least two requests of NBD's maximum size (32 MiB).
  static constexpr uint64_t kMaxInflightBytes = 64u << 20;

  static uint32_t bytes_of(const Request& r) {
    if (r.type == kCmdWrite) return r.length;
    // A larger read is refused without a buffer.
    if (r.type == kCmdRead && r.length <= kMaxBufferSize) return r.length;
    return 0;
  }

  // Receives whatever the socket holds (at least one byte) after the
  // unparsed rest, which moves to the front first. False on EOF or error.
  Task<bool> fill() {
    if (rpos_ == rend_) {
      rpos_ = rend_ = 0;
    } else if (rpos_ > 0) {
      std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rend_ - rpos_);
      rend_ -= rpos_;
      rpos_ = 0;
    }
    for (;;) {
      long r = co_await s_.loop.recv(s_.fd, rbuf_.data() + rend_, rbuf_.size() - rend_, 0);
      if (r == -EINTR || r == -EAGAIN) continue;
      if (r <= 0) co_return false;
      rend_ += static_cast<size_t>(r);
      // A client that fills the buffer pipelines: give it room for more.
      if (rend_ == rbuf_.size() && rbuf_.size() < kMaxRecvBuffer) rbuf_.resize(rbuf_.size() * 2);
      co_return true;
    }
  }

  Task<void> handle(Request r) {
    co_await execute(r);
    pool_.give(std::move(r.payload));
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
      case kCmdFlush:
      case kCmdCache: break;
      default: return Error(EINVAL, fmt::format("unsupported command {}", r.type));
    }
    if (r.flags & ~allowed) return Error(EINVAL, fmt::format("unsupported flags 0x{:x}", r.flags));
    if (r.type == kCmdBlockStatus && !s_.base_allocation && s_.bitmap_contexts.empty())
      return Error(EINVAL, "no meta context negotiated");
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

  Task<void> execute(Request& r) {
    Node& n = *s_.exp->node;
    if (auto v = validate(r); !v) {
      reply_error(r, v.error());
      co_return;
    }
    Status st;
    switch (r.type) {
      case kCmdRead: co_await read(r); co_return;
      case kCmdBlockStatus: co_await block_status(r); co_return;
      case kCmdWrite: {
        uint32_t f = 0;
        if (r.flags & kCmdFlagFua) f |= kReqFua;
        st = co_await n.write(r.offset, r.payload.span().subspan(0, r.length), f);
        break;
      }
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
      case kCmdFlush: st = co_await n.flush(); break;
      case kCmdCache: break;  // advisory; the host page cache or our own caches do the rest
    }
    if (!st) {
      reply_error(r, st.error());
      co_return;
    }
    reply_simple(r, 0);
  }

  Task<void> read(Request& r) {
    Reply rep;
    rep.data = pool_.take(r.length);
    if (r.length) {
      Status st = co_await s_.exp->node->read(r.offset, rep.data.span().subspan(0, r.length));
      if (!st) {
        pool_.give(std::move(rep.data));
        reply_error(r, st.error());
        co_return;
      }
    }
    if (!s_.structured || r.length == 0) {
      put_simple(rep.head.data(), r.cookie, 0);
      rep.head_len = kSimpleReplySize;
      // A structured client gets a zero-length read as a bare simple reply.
      rep.data_len = s_.structured ? 0 : r.length;
    } else {
      put_structured(rep.head.data(), kReplyFlagDone, kReplyOffsetData, r.cookie, 8 + r.length);
      put64(rep.head.data() + kStructuredReplySize, r.offset);
      rep.head_len = kStructuredReplySize + 8;
      rep.data_len = r.length;
    }
    queue(r, std::move(rep));
  }

  // One block-status chunk per negotiated context (base:allocation first,
  // then the dirty bitmaps), all in one Reply so the request holds one slot:
  // the first chunk's header is the reply head, the rest follows in `extra`.
  Task<void> block_status(Request& r) {
    const size_t max_extents = (r.flags & kCmdFlagReqOne) ? 1 : 2048;
    std::vector<std::pair<uint32_t, std::vector<std::pair<uint32_t, uint32_t>>>> chunks;  // id, (length, flags)
    if (s_.base_allocation) {
      Node& n = *s_.exp->node;
      std::vector<std::pair<uint32_t, uint32_t>> ext;  // length, flags
      uint64_t off = r.offset, end = r.offset + r.length;
      while (off < end && ext.size() <= max_extents) {
        auto bs = co_await n.block_status_above(off, end - off);
        if (!bs) {
          reply_error(r, bs.error());
          co_return;
        }
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
      if (ext.empty()) {
        reply_error(r, Error(EINVAL, "empty block status request"));
        co_return;
      }
      chunks.push_back({Session::kBaseAllocationId, std::move(ext)});
    }
    for (uint32_t i : s_.bitmap_contexts) {
      const auto& [owner, name] = s_.exp->bitmaps[i];
      const NamedBitmap* b = owner->bitmaps().find(name);
      if (!b) {
        reply_error(r, Error(EINVAL, "Bitmap '" + name + "' is gone"));
        co_return;
      }
      // NBD_STATE_DIRTY (1) where the bitmap is dirty; extents end where
      // the bitmap changes, at most 4 GiB - 512 each.
      constexpr uint64_t kMaxLen = 0xfffffe00ull;
      std::vector<std::pair<uint32_t, uint32_t>> ext;
      uint64_t off = r.offset, end = std::min<uint64_t>(r.offset + r.length, b->bits.size());
      while (off < end && ext.size() < max_extents) {
        const bool dirty = b->bits.get(off);
        std::optional<uint64_t> next = dirty ? b->bits.next_clean(off, end) : b->bits.next_dirty(off, end);
        uint64_t stop = next && *next > off ? *next : end;
        uint64_t len = std::min(stop - off, kMaxLen);
        ext.push_back({static_cast<uint32_t>(len), dirty ? 1u : 0u});
        off += len;
      }
      if (ext.empty()) ext.push_back({r.length, 0});
      chunks.push_back({Session::kFirstBitmapId + i, std::move(ext)});
    }
    Reply rep;
    Writer w;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const auto& [id, ext] = chunks[c];
      const uint16_t flags = c + 1 == chunks.size() ? kReplyFlagDone : 0;
      const uint32_t len = 4 + 8 * static_cast<uint32_t>(ext.size());
      if (c == 0) {
        put_structured(rep.head.data(), flags, kReplyBlockStatus, r.cookie, len);
        rep.head_len = kStructuredReplySize;
      } else {
        std::array<uint8_t, kStructuredReplySize> h{};
        put_structured(h.data(), flags, kReplyBlockStatus, r.cookie, len);
        w.bytes().insert(w.bytes().end(), h.begin(), h.end());
      }
      w.u32(id);
      for (auto [l, f] : ext) w.u32(l).u32(f);
    }
    rep.extra = std::move(w.bytes());
    queue(r, std::move(rep));
  }

  void reply_error(const Request& r, const Error& e) {
    uint32_t code = errno_to_wire(e.code);
    // Reads and block status with structured replies carry the error as a
    // chunk with a message; everything else gets a simple reply.
    if (s_.structured && (r.type == kCmdRead || r.type == kCmdBlockStatus)) {
      std::string msg = e.what().substr(0, kMaxStringSize);
      Reply rep;
      put_structured(rep.head.data(), kReplyFlagDone, kReplyError, r.cookie, 6 + static_cast<uint32_t>(msg.size()));
      rep.head_len = kStructuredReplySize;
      Writer w;
      w.u32(code).u16(static_cast<uint16_t>(msg.size())).str(msg);
      rep.extra = std::move(w.bytes());
      queue(r, std::move(rep));
      return;
    }
    reply_simple(r, code);
  }

  void reply_simple(const Request& r, uint32_t err) {
    Reply rep;
    put_simple(rep.head.data(), r.cookie, err);
    rep.head_len = kSimpleReplySize;
    queue(r, std::move(rep));
  }

  // Queues the reply to r; the request's slot and bytes stay taken until
  // it is sent.
  void release(const Charge& c) {
    bytes_.release(c.bytes);
    if (c.shared) s_.server.inflight_budget().release(c.shared);
    if (c.floor) floor_busy_ = false;
  }

  void queue(const Request& r, Reply rep) {
    rep.charge = r.charge;
    replies_.push_back(std::move(rep));
    if (!sending_) {
      sending_ = true;
      inflight_.add();
      spawn_detached(sender());
    }
  }

  Task<void> sender() {
    // One loop round later: replies that complete in this round join the
    // same sendmsg.
    co_await s_.loop.yield();
    std::vector<Reply> batch;
    std::vector<iovec> iov;
    while (!replies_.empty()) {
      batch.clear();
      iov.clear();
      // Moved out first: the iovecs point into the replies' own headers.
      while (!replies_.empty() && batch.size() < kMaxIov / 2) {
        batch.push_back(std::move(replies_.front()));
        replies_.pop_front();
      }
      for (Reply& rep : batch) {
        iov.push_back({rep.head.data(), rep.head_len});
        if (rep.data_len) iov.push_back({rep.data.data(), rep.data_len});
        if (!rep.extra.empty()) iov.push_back({rep.extra.data(), rep.extra.size()});
      }
      if (!broken_) {
        Status st = co_await send_iov(iov);
        if (!st) {
          // The peer is gone or the socket broke: wake the reader (it ends
          // the connection) and drop what is queued.
          broken_ = true;
          ::shutdown(s_.fd, SHUT_RDWR);
        }
      }
      for (Reply& rep : batch) {
        pool_.give(std::move(rep.data));
        release(rep.charge);
      }
      slots_.release(batch.size());
    }
    sending_ = false;
    inflight_.done();
  }

  Task<Status> send_iov(std::vector<iovec>& iov) {
    size_t first = 0;
    while (first < iov.size()) {
      msghdr msg{};
      msg.msg_iov = iov.data() + first;
      msg.msg_iovlen = iov.size() - first;
      long r = co_await s_.loop.sendmsg(s_.fd, &msg, MSG_NOSIGNAL);
      if (r == -EINTR || r == -EAGAIN) continue;
      if (r < 0) co_return Error(static_cast<int>(-r));
      if (r == 0) co_return Error(EPIPE);
      // Partial send: skip what went out, resume mid-iovec.
      size_t n = static_cast<size_t>(r);
      while (first < iov.size() && n >= iov[first].iov_len) n -= iov[first++].iov_len;
      if (n) {
        iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + n;
        iov[first].iov_len -= n;
      }
    }
    co_return Status{};
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

  static constexpr size_t kMaxIov = 1024;  // IOV_MAX

  Session& s_;
  CoSemaphore slots_;
  CoSemaphore bytes_;   // of kMaxInflightBytes
  WaitGroup inflight_;  // handlers and the sender still running
  BufferPool pool_;
  std::vector<uint8_t> rbuf_;
  size_t rpos_ = 0, rend_ = 0;  // unparsed bytes of rbuf_
  std::deque<Reply> replies_;
  bool sending_ = false;
  bool broken_ = false;
  bool floor_busy_ = false;  // a request holds the connection's floor
};

}  // namespace

Task<void> transmit(Session& s) {
  Connection c(s);
  co_await c.run();
}

}  // namespace vblk::nbd
