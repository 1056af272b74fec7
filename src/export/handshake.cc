// Server side of the fixed newstyle handshake and option haggling.
//
// Hostile input is bounded before it is read: option payloads above
// kMaxOptionSize are refused (and the connection closed when they are too
// large to skip), names above kMaxStringSize get NBD_REP_ERR_INVALID, and
// every length inside a payload is checked against what is left of it.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <vector>

#include "session.h"
#include "vblk/buffer.h"
#include "vblk/trace.h"

namespace vblk::nbd {

namespace {

constexpr uint32_t kMaxSkippableOption = 1u << 20;  // larger ones close the connection

Task<Status> send_reply(Session& s, uint32_t opt, uint32_t type, std::span<const uint8_t> payload = {}) {
  Writer w;
  w.u64(kMagicOptReply).u32(opt).u32(type).u32(static_cast<uint32_t>(payload.size()));
  w.bytes().insert(w.bytes().end(), payload.begin(), payload.end());
  co_return co_await send_all(s.loop, s.fd, w.bytes());
}

Task<Status> send_error(Session& s, uint32_t opt, uint32_t type, const std::string& msg) {
  std::vector<uint8_t> m(msg.begin(), msg.end());
  co_return co_await send_reply(s, opt, type, m);
}

Task<Status> send_info_export(Session& s, uint32_t opt) {
  Writer w;
  w.u16(kInfoExport).u64(s.exp->node->length()).u16(transmission_flags(s));
  co_return co_await send_reply(s, opt, kRepInfo, w.bytes());
}

// NBD_OPT_INFO and NBD_OPT_GO: the export's details, then (GO) transmission.
Task<Result<bool>> info_or_go(Session& s, uint32_t opt, std::span<const uint8_t> data) {
  Reader r(data);
  uint32_t name_len = r.u32();
  if (!r.ok() || name_len > r.left()) {
    VBLK_CO_TRY(co_await send_error(s, opt, kRepErrInvalid, "request data length mismatch"));
    co_return false;
  }
  if (name_len > kMaxStringSize) {
    VBLK_CO_TRY(co_await send_error(s, opt, kRepErrInvalid, "export name too long"));
    co_return false;
  }
  std::string name = r.str(name_len);
  uint16_t nreq = r.u16();
  std::vector<uint16_t> reqs;
  for (uint16_t i = 0; r.ok() && i < nreq; ++i) reqs.push_back(r.u16());
  if (!r.ok() || r.left()) {
    VBLK_CO_TRY(co_await send_error(s, opt, kRepErrInvalid, "request data length mismatch"));
    co_return false;
  }
  auto exp = s.server.find_export(name);
  if (!exp) {
    VBLK_CO_TRY(co_await send_error(s, opt, kRepErrUnknown, fmt::format("export '{}' not present", name)));
    co_return false;
  }
  s.exp = exp;
  bool want_name = false, want_desc = false;
  for (uint16_t q : reqs) {
    want_name |= q == kInfoName;
    want_desc |= q == kInfoDescription;
  }
  if (want_name) {
    Writer w;
    w.u16(kInfoName).str(exp->name);
    VBLK_CO_TRY(co_await send_reply(s, opt, kRepInfo, w.bytes()));
  }
  if (want_desc && !exp->description.empty()) {
    Writer w;
    w.u16(kInfoDescription).str(exp->description);
    VBLK_CO_TRY(co_await send_reply(s, opt, kRepInfo, w.bytes()));
  }
  {
    // The generic request path pads unaligned requests itself, so any
    // request size works; 4 KiB is the size worth sending.
    Writer w;
    w.u16(kInfoBlockSize).u32(1).u32(4096).u32(kMaxBufferSize);
    VBLK_CO_TRY(co_await send_reply(s, opt, kRepInfo, w.bytes()));
  }
  VBLK_CO_TRY(co_await send_info_export(s, opt));
  VBLK_CO_TRY(co_await send_reply(s, opt, kRepAck));
  if (opt == kOptInfo) {
    s.exp.reset();
    co_return false;
  }
  co_return true;
}

// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT: base:allocation
// and the export's qemu:dirty-bitmap:NAME contexts.
Task<Status> meta_context(Session& s, uint32_t opt, std::span<const uint8_t> data) {
  const bool set = opt == kOptSetMetaContext;
  if (set && !s.structured)
    co_return co_await send_error(s, opt, kRepErrInvalid,
                                  "request option 'SET_META_CONTEXT' when structured reply is not negotiated");
  Reader r(data);
  uint32_t name_len = r.u32();
  if (!r.ok() || name_len > r.left())
    co_return co_await send_error(s, opt, kRepErrInvalid, "request data length mismatch");
  if (name_len > kMaxStringSize) co_return co_await send_error(s, opt, kRepErrInvalid, "export name too long");
  std::string name = r.str(name_len);
  uint32_t nq = r.u32();
  std::vector<std::string> queries;
  for (uint32_t i = 0; r.ok() && i < nq; ++i) {
    uint32_t len = r.u32();
    if (!r.ok() || len > r.left() || len > kMaxStringSize) {
      co_return co_await send_error(s, opt, kRepErrInvalid, "request data length mismatch");
    }
    queries.push_back(r.str(len));
  }
  if (!r.ok() || r.left()) co_return co_await send_error(s, opt, kRepErrInvalid, "request data length mismatch");
  auto exp = s.server.find_export(name);
  if (!exp) co_return co_await send_error(s, opt, kRepErrUnknown, fmt::format("export '{}' not present", name));
  static const std::string kBitmapPrefix = "qemu:dirty-bitmap:";
  bool match = !set && queries.empty();  // LIST with no query lists everything
  std::vector<uint32_t> bitmaps;
  auto pick = [&](uint32_t i) {
    if (std::find(bitmaps.begin(), bitmaps.end(), i) == bitmaps.end()) bitmaps.push_back(i);
  };
  const auto& offered = exp->bitmaps;
  if (match)
    for (uint32_t i = 0; i < offered.size(); ++i) pick(i);
  for (const auto& q : queries) {
    if (q == kMetaBaseAllocation || (!set && (q == "base:"))) match = true;
    if (!set && (q == "qemu:" || q == kBitmapPrefix)) {
      for (uint32_t i = 0; i < offered.size(); ++i) pick(i);
    } else if (q.rfind(kBitmapPrefix, 0) == 0) {
      for (uint32_t i = 0; i < offered.size(); ++i)
        if (offered[i].second == q.substr(kBitmapPrefix.size())) pick(i);
    }
  }
  if (set) {
    s.base_allocation = match;
    s.bitmap_contexts = bitmaps;
  }
  if (match) {
    Writer w;
    w.u32(Session::kBaseAllocationId).str(kMetaBaseAllocation);
    VBLK_CO_TRY(co_await send_reply(s, opt, kRepMetaContext, w.bytes()));
  }
  for (uint32_t i : bitmaps) {
    Writer w;
    w.u32(Session::kFirstBitmapId + i).str(kBitmapPrefix + offered[i].second);
    VBLK_CO_TRY(co_await send_reply(s, opt, kRepMetaContext, w.bytes()));
  }
  co_return co_await send_reply(s, opt, kRepAck);
}

Task<Status> list_exports(Session& s) {
  for (const auto& [name, e] : s.server.exports()) {
    Writer w;
    w.u32(static_cast<uint32_t>(name.size())).str(name).str(e->description);
    VBLK_CO_TRY(co_await send_reply(s, kOptList, kRepServer, w.bytes()));
  }
  co_return co_await send_reply(s, kOptList, kRepAck);
}

// Reads and drops `len` bytes (an option we refuse without parsing).
Task<Status> skip(Session& s, uint32_t len) {
  std::array<uint8_t, 4096> scratch;
  while (len) {
    uint32_t n = std::min<uint32_t>(len, scratch.size());
    VBLK_CO_TRY(co_await recv_exact(s.loop, s.fd, std::span(scratch.data(), n)));
    len -= n;
  }
  co_return Status{};
}

Task<Result<bool>> haggle(Session& s) {
  {
    Writer w;
    w.u64(kMagicInit).u64(kMagicOpt).u16(kFlagFixedNewstyle | kFlagNoZeroes);
    VBLK_CO_TRY(co_await send_all(s.loop, s.fd, w.bytes()));
  }
  std::array<uint8_t, 4> cf;
  VBLK_CO_TRY(co_await recv_exact(s.loop, s.fd, cf));
  uint32_t client_flags = get32(cf.data());
  // Unknown client flags: the spec says the server MUST close.
  if (client_flags & ~(kClientFixedNewstyle | kClientNoZeroes)) co_return false;
  s.no_zeroes = client_flags & kClientNoZeroes;
  for (;;) {
    std::array<uint8_t, 16> hdr;
    VBLK_CO_TRY(co_await recv_exact(s.loop, s.fd, hdr));
    if (get64(hdr.data()) != kMagicOpt) co_return false;
    uint32_t opt = get32(hdr.data() + 8), len = get32(hdr.data() + 12);
    if (len > kMaxOptionSize) {
      if (len > kMaxSkippableOption) co_return false;
      VBLK_CO_TRY(co_await skip(s, len));
      VBLK_CO_TRY(co_await send_error(s, opt, kRepErrTooBig, "option too large"));
      continue;
    }
    std::vector<uint8_t> data(len);
    VBLK_CO_TRY(co_await recv_exact(s.loop, s.fd, data));
    VBLK_TRACE(kNbd, "server option {} length {}", opt, len);
    switch (opt) {
      case kOptExportName: {
        std::string name(data.begin(), data.end());
        s.exp = s.server.find_export(name);
        if (!s.exp) co_return false;  // no way to report it: the spec says close
        Writer w;
        w.u64(s.exp->node->length()).u16(transmission_flags(s));
        if (!s.no_zeroes) w.zeroes(124);
        VBLK_CO_TRY(co_await send_all(s.loop, s.fd, w.bytes()));
        co_return true;
      }
      case kOptAbort:
        // Best effort: the client may already have gone.
        (void)co_await send_reply(s, opt, kRepAck);
        co_return false;
      case kOptList:
        if (len) {
          VBLK_CO_TRY(co_await send_error(s, opt, kRepErrInvalid, "request data length mismatch"));
        } else {
          VBLK_CO_TRY(co_await list_exports(s));
        }
        break;
      case kOptInfo:
      case kOptGo: {
        auto go = co_await info_or_go(s, opt, data);
        if (!go) co_return go.take_error();
        if (*go) co_return true;
        break;
      }
      case kOptStructuredReply:
        if (len) {
          VBLK_CO_TRY(co_await send_error(s, opt, kRepErrInvalid, "request data length mismatch"));
        } else if (s.structured) {
          VBLK_CO_TRY(co_await send_error(s, opt, kRepErrInvalid, "structured reply already negotiated"));
        } else {
          s.structured = true;
          VBLK_CO_TRY(co_await send_reply(s, opt, kRepAck));
        }
        break;
      case kOptListMetaContext:
      case kOptSetMetaContext: VBLK_CO_TRY(co_await meta_context(s, opt, data)); break;
      case kOptStartTls: VBLK_CO_TRY(co_await send_error(s, opt, kRepErrPolicy, "TLS not configured")); break;
      default: VBLK_CO_TRY(co_await send_error(s, opt, kRepErrUnsup, fmt::format("Unsupported option {}", opt))); break;
    }
  }
}

}  // namespace

uint16_t transmission_flags(const Session& s) {
  uint16_t f = kFlagHasFlags | kFlagSendFlush | kFlagSendFua | kFlagSendCache;
  // Every connection reaches the same node on one loop, so a flush on any
  // of them covers writes made on all: multiple connections are safe, and
  // advertised whenever more than one may connect.
  if (s.server.options().max_connections != 1) f |= kFlagCanMultiConn;
  if (s.structured) f |= kFlagSendDf;
  if (!s.exp || !s.exp->writable || s.exp->node->read_only()) {
    f |= kFlagReadOnly;
  } else {
    f |= kFlagSendTrim | kFlagSendWriteZeroes | kFlagSendFastZero;
  }
  return f;
}

Task<bool> negotiate(Session& s) {
  auto r = co_await haggle(s);
  co_return r&&* r;
}

}  // namespace vblk::nbd
