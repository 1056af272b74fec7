// The `nbd` protocol driver: a node backed by an export on an NBD server.
//
// Options as QEMU's: server.type=unix + server.path, or server.type=inet +
// server.host + server.port; export; or filename=nbd://... / nbd+unix://...
// vblk adds `connections` (default 1): with a server that advertises
// CAN_MULTI_CONN, requests are spread over that many connections.
#include <fmt/format.h>

#include "vblk/nbd_client.h"
#include "vblk/nbd_protocol.h"
#include "vblk/open.h"
#include "vblk/options.h"

namespace vblk {
namespace {

class NbdNode final : public Node {
 public:
  NbdNode(Loop& loop, std::vector<std::shared_ptr<nbd::Client>> conns, std::string uri)
      : Node(loop, "nbd"), conns_(std::move(conns)), uri_(std::move(uri)) {
    const nbd::Client& c = *conns_.front();
    uint16_t f = c.flags();
    caps_.native_fua = f & nbd::kFlagSendFua;
    caps_.zeroes = f & nbd::kFlagSendWriteZeroes;
    caps_.discard = f & nbd::kFlagSendTrim;
    caps_.reports_dirty_flag = false;  // QEMU's nbd has no bdrv_get_info
    limits_.request_alignment = c.min_block();
    limits_.max_transfer = c.max_block();
    limits_.max_zeroes = 1u << 30;  // one request's length is 32 bits
    set_read_only(f & nbd::kFlagReadOnly);
    set_length(c.size());
  }
  ~NbdNode() override = default;  // clients shut their sockets down

  std::string filename() const override { return uri_; }
  Result<uint64_t> allocated_size() const override { return Error(ENOTSUP); }

  Task<Status> do_close() override {
    for (auto& c : conns_) co_await c->close();
    co_return Status{};
  }

 protected:
  nbd::Client& pick() { return *conns_[next_++ % conns_.size()]; }

  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t) override {
    co_return co_await pick().read(offset, buf);
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    co_return co_await pick().write(offset, buf, flags & kReqFua);
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    nbd::Client& c = pick();
    uint16_t f = 0;
    if (flags & kReqFua) f |= nbd::kCmdFlagFua;
    if (!(flags & kReqMayUnmap)) f |= nbd::kCmdFlagNoHole;
    if (flags & kReqNoFallback) {
      // Only a server that promises to fail fast can be asked "zero, but only
      // if it is quick".
      if (!(c.flags() & nbd::kFlagSendFastZero)) co_return Error(ENOTSUP);
      f |= nbd::kCmdFlagFastZero;
    }
    co_return co_await c.write_zeroes(offset, static_cast<uint32_t>(bytes), f);
  }
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    uint64_t done = 0;
    while (done < bytes) {
      uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(bytes - done, 1u << 30));
      VBLK_CO_TRY(co_await pick().trim(offset + done, n));
      done += n;
    }
    co_return Status{};
  }
  Task<Status> do_flush() override {
    if (!(conns_.front()->flags() & nbd::kFlagSendFlush)) co_return Status{};
    // With CAN_MULTI_CONN one flush covers every connection's writes.
    co_return co_await pick().flush();
  }
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override {
    BlockStatus s{.flags = kStatusData | kStatusOffsetValid, .bytes = bytes, .map = offset, .file = this};
    nbd::Client& c = pick();
    if (!c.has_block_status()) co_return s;
    uint32_t ask = static_cast<uint32_t>(std::min<uint64_t>(bytes, 1u << 30));
    auto ext = co_await c.block_status(offset, ask);
    if (!ext) co_return ext.take_error();
    const nbd::Extent& e = ext->front();
    s.flags = kStatusOffsetValid;
    if (!(e.flags & nbd::kStateHole)) s.flags |= kStatusData;
    if (e.flags & nbd::kStateZero) s.flags |= kStatusZero;
    s.bytes = std::min<uint64_t>(e.length, bytes);
    if (s.bytes == 0) co_return Error(EIO, "NBD server answered block status with an empty extent");
    co_return s;
  }

 private:
  std::vector<std::shared_ptr<nbd::Client>> conns_;
  std::string uri_;
  size_t next_ = 0;
};

Task<Result<std::vector<std::shared_ptr<nbd::Client>>>> connect_all(Loop& loop, nbd::Address addr, std::string name,
                                                                    unsigned count) {
  std::vector<std::shared_ptr<nbd::Client>> conns;
  auto first = co_await nbd::Client::connect(loop, addr, name, {});
  if (!first) co_return first.take_error();
  conns.push_back(*first);
  // Several connections only where the server says they see each other's
  // writes after a flush.
  if (!((*first)->flags() & nbd::kFlagCanMultiConn)) count = 1;
  while (conns.size() < count) {
    auto c = co_await nbd::Client::connect(loop, addr, name, {});
    if (!c) co_return c.take_error();
    conns.push_back(*c);
  }
  co_return conns;
}

std::string uri_of(const nbd::Address& a, const std::string& name) {
  // QEMU's nbd_refresh_filename: no path part when the export name is empty.
  if (!a.unix_path.empty()) {
    if (name.empty()) return fmt::format("nbd+unix://?socket={}", a.unix_path);
    return fmt::format("nbd+unix:///{}?socket={}", name, a.unix_path);
  }
  if (name.empty()) return fmt::format("nbd://{}:{}", a.host, a.port);
  return fmt::format("nbd://{}:{}/{}", a.host, a.port, name);
}

}  // namespace

namespace drivers {

Result<std::shared_ptr<Node>> open_nbd(OpenContext& ctx, Json& opts) {
  nbd::Address addr;
  std::string name;
  auto filename = take_string(opts, "filename");
  VBLK_TRY(filename);
  auto exp = take_string(opts, "export");
  VBLK_TRY(exp);
  if (*filename) {
    std::string err;
    if (!nbd::parse_nbd_uri(**filename, addr, name, &err)) return Error(EINVAL, "invalid NBD URI '" + **filename + "'");
    if (!err.empty()) return Error(EINVAL, err);
  } else if (auto server = take_dict(opts, "server")) {
    auto type = take_string(*server, "type");
    VBLK_TRY(type);
    auto path = take_string(*server, "path");
    VBLK_TRY(path);
    auto host = take_string(*server, "host");
    VBLK_TRY(host);
    auto port = take_string(*server, "port");
    VBLK_TRY(port);
    if (!server->empty()) return Error(EINVAL, "Invalid parameter 'server." + server->begin().key() + "'");
    std::string t = type->value_or("");
    if (t == "unix") {
      if (!*path) return Error(EINVAL, "Parameter 'server.path' is missing");
      addr.unix_path = **path;
    } else if (t == "inet") {
      if (!*host) return Error(EINVAL, "Parameter 'server.host' is missing");
      addr.host = **host;
      if (*port) {
        char* end = nullptr;
        unsigned long p = std::strtoul((*port)->c_str(), &end, 10);
        if (*end || p == 0 || p > 65535) return Error(EINVAL, "Invalid port '" + **port + "'");
        addr.port = static_cast<uint16_t>(p);
      }
    } else if (t.empty()) {
      return Error(EINVAL, "Parameter 'server.type' is missing");
    } else {
      return Error(EINVAL, "Parameter 'server.type' does not accept value '" + t + "'");
    }
  } else {
    return Error(EINVAL, "Parameter 'server' is missing");
  }
  if (*exp) name = **exp;
  auto conns = take_size(opts, "connections");
  VBLK_TRY(conns);
  unsigned n = static_cast<unsigned>(conns->value_or(1));
  if (n < 1 || n > 16) return Error(EINVAL, "connections must be between 1 and 16");
  auto ro = take_bool(opts, "read-only");
  VBLK_TRY(ro);
  auto c = ctx.loop.run(connect_all(ctx.loop, addr, name, n));
  if (!c) return c.take_error();
  bool want_ro = ro->value_or(ctx.read_only);
  if (!want_ro && ((*c).front()->flags() & nbd::kFlagReadOnly)) return Error(EACCES, "NBD export is read-only");
  auto node = std::make_shared<NbdNode>(ctx.loop, std::move(*c), uri_of(addr, name));
  if (want_ro) node->set_read_only(true);
  return std::shared_ptr<Node>(node);
}

namespace {
const char* const kNbdPrefixes[] = {"nbd://", "nbd+unix://", "nbd+tcp://"};
}  // namespace

extern const DriverInfo nbd_driver = {
    .name = "nbd", .kind = DriverKind::Protocol, .open = open_nbd, .prefixes = kNbdPrefixes};

}  // namespace drivers
}  // namespace vblk
