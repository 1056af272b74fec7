#include "vblk/nbd_client.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <array>
#include <cstring>

#include "vblk/nbd_protocol.h"
#include "vblk/trace.h"

namespace vblk::nbd {

struct Client::Pending {
  explicit Pending(Loop& l) : done(l) {}
  uint16_t type = 0;
  uint64_t offset = 0;
  std::span<uint8_t> buf;                  // reads: where the data goes
  std::vector<Extent>* extents = nullptr;  // block status
  Status result;
  CoEvent done;
};

namespace {

constexpr uint64_t kMagicOldstyle = 0x00420281861253ull;
constexpr uint32_t kMaxReplyPayload = 1u << 20;  // option replies and status chunks

Error protocol_error(const std::string& what) { return Error(EIO, "NBD protocol error: " + what); }

}  // namespace

Task<Result<std::shared_ptr<Client>>> Client::connect(Loop& loop, Address addr, std::string export_name, Options opts) {
  Result<Fd> fd = Error(EINVAL);
  if (!addr.unix_path.empty()) {
    fd = co_await connect_unix(loop, addr.unix_path);
  } else {
    fd = co_await connect_tcp(loop, addr.host, addr.port);
  }
  if (!fd) co_return fd.take_error();
  std::shared_ptr<Client> c(new Client(loop, std::move(*fd)));
  c->reader_done_.set();  // until the reader runs
  Status st = co_await c->handshake(export_name, opts);
  VBLK_TRACE(kNbd, "client connect {} export '{}': {}",
             addr.unix_path.empty() ? fmt::format("{}:{}", addr.host, addr.port) : addr.unix_path, export_name,
             st.ok() ? "ok" : st.error().what());
  if (!st) co_return st.take_error();
  c->reader_done_.reset();
  spawn_detached(reader(c));
  co_return c;
}

Client::~Client() {
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

Task<Status> Client::handshake(const std::string& export_name, Options opts) {
  std::array<uint8_t, 18> g;
  VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), g));
  if (get64(g.data()) != kMagicInit) co_return protocol_error("not an NBD server (bad magic)");
  if (get64(g.data() + 8) == kMagicOldstyle) co_return Error(ENOTSUP, "NBD oldstyle servers are not supported");
  if (get64(g.data() + 8) != kMagicOpt) co_return protocol_error("bad handshake magic");
  uint16_t sflags = get16(g.data() + 16);
  if (!(sflags & kFlagFixedNewstyle)) co_return Error(ENOTSUP, "NBD server does not support fixed newstyle");
  const bool no_zeroes = sflags & kFlagNoZeroes;
  {
    std::array<uint8_t, 4> cf;
    put32(cf.data(), kClientFixedNewstyle | (no_zeroes ? kClientNoZeroes : 0));
    VBLK_CO_TRY(co_await send_all(loop_, fd_.get(), cf));
  }
  auto send_opt = [this](uint32_t opt, const std::vector<uint8_t>& data) -> Task<Status> {
    Writer w;
    w.u64(kMagicOpt).u32(opt).u32(static_cast<uint32_t>(data.size()));
    w.bytes().insert(w.bytes().end(), data.begin(), data.end());
    co_return co_await send_all(loop_, fd_.get(), w.bytes());
  };
  struct OptReply {
    uint32_t type;
    std::vector<uint8_t> data;
  };
  auto read_opt = [this](uint32_t opt) -> Task<Result<OptReply>> {
    std::array<uint8_t, 20> h;
    VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), h));
    if (get64(h.data()) != kMagicOptReply) co_return protocol_error("bad option reply magic");
    if (get32(h.data() + 8) != opt) co_return protocol_error("reply to the wrong option");
    uint32_t len = get32(h.data() + 16);
    if (len > kMaxReplyPayload) co_return protocol_error("option reply too large");
    OptReply r{get32(h.data() + 12), std::vector<uint8_t>(len)};
    VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), r.data));
    co_return r;
  };
  auto server_says = [](const OptReply& r) {
    std::string msg(r.data.begin(), r.data.end());
    return msg.empty() ? std::string() : "\nserver reported: " + msg;
  };

  if (opts.structured) {
    VBLK_CO_TRY(co_await send_opt(kOptStructuredReply, {}));
    auto r = co_await read_opt(kOptStructuredReply);
    if (!r) co_return r.take_error();
    structured_ = r->type == kRepAck;
  }
  if (structured_) {
    Writer w;
    w.u32(static_cast<uint32_t>(export_name.size())).str(export_name);
    w.u32(1).u32(static_cast<uint32_t>(std::strlen(kMetaBaseAllocation))).str(kMetaBaseAllocation);
    VBLK_CO_TRY(co_await send_opt(kOptSetMetaContext, w.bytes()));
    for (;;) {
      auto r = co_await read_opt(kOptSetMetaContext);
      if (!r) co_return r.take_error();
      if (r->type == kRepMetaContext && r->data.size() > 4) {
        std::string name(r->data.begin() + 4, r->data.end());
        if (name == kMetaBaseAllocation) {
          base_allocation_ = true;
          meta_id_ = get32(r->data.data());
        }
        continue;
      }
      break;  // ACK, or an error: then no block status
    }
  }
  {
    Writer w;
    w.u32(static_cast<uint32_t>(export_name.size())).str(export_name).u16(1).u16(kInfoBlockSize);
    VBLK_CO_TRY(co_await send_opt(kOptGo, w.bytes()));
  }
  bool have_export = false;
  for (;;) {
    auto r = co_await read_opt(kOptGo);
    if (!r) co_return r.take_error();
    if (r->type == kRepInfo && r->data.size() >= 2) {
      uint16_t info = get16(r->data.data());
      if (info == kInfoExport && r->data.size() >= 12) {
        size_ = get64(r->data.data() + 2);
        flags_ = get16(r->data.data() + 10);
        have_export = true;
      } else if (info == kInfoBlockSize && r->data.size() >= 14) {
        min_block_ = std::max<uint32_t>(1, get32(r->data.data() + 2));
        max_block_ = get32(r->data.data() + 10);
      }
      continue;
    }
    if (r->type == kRepAck) {
      if (!have_export) co_return protocol_error("server did not describe the export");
      break;
    }
    if (r->type == kRepErrUnsup) {
      // An old server without GO: EXPORT_NAME gives size and flags, no errors.
      std::vector<uint8_t> name(export_name.begin(), export_name.end());
      VBLK_CO_TRY(co_await send_opt(kOptExportName, name));
      std::vector<uint8_t> reply(no_zeroes ? 10 : 134);
      auto st = co_await recv_exact(loop_, fd_.get(), reply);
      if (!st) co_return Error(EINVAL, "Requested export not available");
      size_ = get64(reply.data());
      flags_ = get16(reply.data() + 8);
      break;
    }
    if (r->type == kRepErrUnknown) co_return Error(EINVAL, "Requested export not available" + server_says(*r));
    if (r->type & kRepErrBit) co_return Error(EINVAL, fmt::format("Server error {:#x}", r->type) + server_says(*r));
    // Unknown non-error replies are skipped, as the spec allows.
  }
  if (min_block_ > 65536 || (min_block_ & (min_block_ - 1))) co_return protocol_error("bad minimum block size");
  if (max_block_ < min_block_ || max_block_ > (32u << 20)) max_block_ = 32u << 20;
  co_return Status{};
}

Task<Status> Client::request(Pending& p, uint16_t type, uint16_t flags, uint64_t offset, uint32_t length,
                             std::span<const uint8_t> payload) {
  if (!dead_) co_return dead_.error();
  if (closing_) co_return Error(ESHUTDOWN, "NBD connection is closing");
  uint64_t cookie = next_cookie_++;
  p.type = type;
  p.offset = offset;
  pending_[cookie] = &p;
  std::array<uint8_t, kRequestSize> h;
  put32(h.data(), kMagicRequest);
  put16(h.data() + 4, flags);
  put16(h.data() + 6, type);
  put64(h.data() + 8, cookie);
  put64(h.data() + 16, offset);
  put32(h.data() + 24, length);
  {
    auto g = co_await send_lock_.scoped();
    const int more = payload.empty() ? 0 : MSG_MORE;
    Status st = co_await send_all(loop_, fd_.get(), h, more);
    if (st && !payload.empty()) st = co_await send_all(loop_, fd_.get(), payload);
    if (!st) {
      pending_.erase(cookie);
      fail_all(st.error());
      co_return Error(EIO, "NBD connection lost: " + st.error().what());
    }
  }
  co_await p.done.wait();
  co_return p.result;
}

void Client::fail_all(const Error& e) {
  if (dead_) dead_ = Error(EIO, "NBD connection lost: " + e.what());
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& [_, p] : pending) {
    p->result = dead_;
    p->done.set();
  }
}

Task<void> Client::reader(std::shared_ptr<Client> self) {
  for (;;) {
    Status st = co_await self->read_reply();
    if (!st) {
      self->fail_all(st.error());
      break;
    }
  }
  self->reader_done_.set();
}

// Reads one reply (or chunk) and routes it to its request.
Task<Status> Client::read_reply() {
  std::array<uint8_t, 20> h;
  VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), std::span(h.data(), 4)));
  uint32_t magic = get32(h.data());
  if (magic == kMagicSimpleReply) {
    VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), std::span(h.data() + 4, 12)));
    uint32_t err = get32(h.data() + 4);
    uint64_t cookie = get64(h.data() + 8);
    auto it = pending_.find(cookie);
    if (it == pending_.end()) co_return protocol_error("reply to an unknown request");
    Pending* p = it->second;
    if (err) {
      p->result = Error(wire_to_errno(err));
    } else if (p->type == kCmdRead) {
      if (structured_) co_return protocol_error("simple reply to a read with structured replies");
      // Still pending while its data arrives: if the connection breaks
      // meanwhile, fail_all() ends this request too.
      VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), p->buf));
    }
    pending_.erase(cookie);
    p->done.set();
    co_return Status{};
  }
  if (magic != kMagicStructuredReply || !structured_) co_return protocol_error("bad reply magic");
  VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), std::span(h.data() + 4, 16)));
  uint16_t flags = get16(h.data() + 4), type = get16(h.data() + 6);
  uint64_t cookie = get64(h.data() + 8);
  uint32_t len = get32(h.data() + 16);
  auto it = pending_.find(cookie);
  if (it == pending_.end()) co_return protocol_error("reply to an unknown request");
  Pending* p = it->second;
  auto payload = [&](std::vector<uint8_t>& b) -> Task<Status> {
    if (len > kMaxReplyPayload) co_return protocol_error("reply chunk too large");
    b.resize(len);
    co_return co_await recv_exact(loop_, fd_.get(), b);
  };
  std::vector<uint8_t> b;
  switch (type) {
    case kReplyNone:
      if (len) co_return protocol_error("payload on a NONE chunk");
      break;
    case kReplyOffsetData: {
      if (p->type != kCmdRead || len <= 8) co_return protocol_error("unexpected data chunk");
      std::array<uint8_t, 8> o;
      VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), o));
      uint64_t off = get64(o.data()), n = len - 8;
      if (off < p->offset || off - p->offset > p->buf.size() || n > p->buf.size() - (off - p->offset))
        co_return protocol_error("data chunk outside the request");
      VBLK_CO_TRY(co_await recv_exact(loop_, fd_.get(), p->buf.subspan(off - p->offset, n)));
      break;
    }
    case kReplyOffsetHole: {
      if (p->type != kCmdRead || len != 12) co_return protocol_error("unexpected hole chunk");
      VBLK_CO_TRY(co_await payload(b));
      uint64_t off = get64(b.data());
      uint32_t n = get32(b.data() + 8);
      if (off < p->offset || off - p->offset > p->buf.size() || n > p->buf.size() - (off - p->offset))
        co_return protocol_error("hole chunk outside the request");
      std::memset(p->buf.data() + (off - p->offset), 0, n);
      break;
    }
    case kReplyBlockStatus: {
      if (p->type != kCmdBlockStatus || len < 12 || (len - 4) % 8) co_return protocol_error("bad block status chunk");
      VBLK_CO_TRY(co_await payload(b));
      if (get32(b.data()) == meta_id_ && p->extents) {
        for (size_t i = 4; i + 8 <= b.size(); i += 8) p->extents->push_back({get32(&b[i]), get32(&b[i + 4])});
      }
      break;
    }
    default:
      if (!reply_type_is_error(type)) co_return protocol_error(fmt::format("unknown reply type {}", type));
      VBLK_CO_TRY(co_await payload(b));
      if (b.size() < 6) co_return protocol_error("short error chunk");
      {
        uint32_t err = get32(b.data());
        uint16_t mlen = get16(b.data() + 4);
        std::string msg(b.begin() + 6, b.begin() + 6 + std::min<size_t>(mlen, b.size() - 6));
        if (p->result) p->result = Error(wire_to_errno(err), msg);
      }
      break;
  }
  if (flags & kReplyFlagDone) {
    pending_.erase(cookie);
    p->done.set();
  }
  co_return Status{};
}

Task<Status> Client::read(uint64_t offset, std::span<uint8_t> buf) {
  Pending p(loop_);
  p.buf = buf;
  co_return co_await request(p, kCmdRead, 0, offset, static_cast<uint32_t>(buf.size()));
}

Task<Status> Client::write(uint64_t offset, std::span<const uint8_t> buf, bool fua) {
  Pending p(loop_);
  const uint16_t flags = fua ? kCmdFlagFua : 0;
  co_return co_await request(p, kCmdWrite, flags, offset, static_cast<uint32_t>(buf.size()), buf);
}

Task<Status> Client::write_zeroes(uint64_t offset, uint32_t bytes, uint16_t cmd_flags) {
  Pending p(loop_);
  co_return co_await request(p, kCmdWriteZeroes, cmd_flags, offset, bytes);
}

Task<Status> Client::trim(uint64_t offset, uint32_t bytes) {
  Pending p(loop_);
  co_return co_await request(p, kCmdTrim, 0, offset, bytes);
}

Task<Status> Client::flush() {
  Pending p(loop_);
  co_return co_await request(p, kCmdFlush, 0, 0, 0);
}

Task<Result<std::vector<Extent>>> Client::block_status(uint64_t offset, uint32_t bytes) {
  std::vector<Extent> ext;
  Pending p(loop_);
  p.extents = &ext;
  VBLK_CO_TRY(co_await request(p, kCmdBlockStatus, 0, offset, bytes));
  if (ext.empty()) co_return protocol_error("empty block status reply");
  co_return ext;
}

Task<void> Client::close() {
  if (!closing_ && dead_) {
    closing_ = true;
    std::array<uint8_t, kRequestSize> h{};
    put32(h.data(), kMagicRequest);
    put16(h.data() + 6, kCmdDisc);
    auto g = co_await send_lock_.scoped();
    (void)co_await send_all(loop_, fd_.get(), h);
  }
  closing_ = true;
  // The server closes after DISC; the reader sees EOF and stops.
  ::shutdown(fd_.get(), SHUT_WR);
  co_await reader_done_.wait();
}

bool parse_nbd_uri(const std::string& uri, Address& addr, std::string& export_name, std::string* err) {
  auto fail = [&](const std::string& m) {
    if (err) *err = m;
    return true;
  };
  std::string rest;
  bool unix_sock = false;
  if (uri.rfind("nbd://", 0) == 0) {
    rest = uri.substr(6);
  } else if (uri.rfind("nbd+tcp://", 0) == 0) {
    rest = uri.substr(10);
  } else if (uri.rfind("nbd+unix://", 0) == 0) {
    rest = uri.substr(11);
    unix_sock = true;
  } else {
    return false;
  }
  std::string query;
  if (auto q = rest.find('?'); q != std::string::npos) {
    query = rest.substr(q + 1);
    rest.resize(q);
  }
  std::string authority = rest.substr(0, rest.find('/'));
  std::string path = rest.size() > authority.size() ? rest.substr(authority.size() + 1) : "";
  export_name = path;
  if (unix_sock) {
    if (!authority.empty()) return fail("NBD URI with unix socket must not have a host");
    if (query.rfind("socket=", 0) != 0 || query.size() == 7) return fail("NBD URI with unix socket needs ?socket=PATH");
    addr.unix_path = query.substr(7);
    return true;
  }
  if (!query.empty()) return fail("NBD URI over TCP takes no query parameters");
  if (authority.empty()) return fail("NBD URI needs a host");
  std::string host = authority, port;
  if (host[0] == '[') {
    auto close = host.find(']');
    if (close == std::string::npos) return fail("bad IPv6 address in NBD URI");
    if (close + 1 < host.size() && host[close + 1] == ':') port = host.substr(close + 2);
    host = host.substr(1, close - 1);
  } else if (auto c = host.rfind(':'); c != std::string::npos) {
    port = host.substr(c + 1);
    host.resize(c);
  }
  addr.host = host;
  if (!port.empty()) {
    char* end = nullptr;
    unsigned long p = std::strtoul(port.c_str(), &end, 10);
    if (*end || p == 0 || p > 65535) return fail("bad port in NBD URI");
    addr.port = static_cast<uint16_t>(p);
  }
  return true;
}

}  // namespace vblk::nbd
