// Block export commands for every export type: block-export-add,
// block-export-del, query-block-exports. Each type makes a BlockExport
// (export layer); the table here owns them and sends BLOCK_EXPORT_DELETED.
#include <algorithm>

#include "vblk/fuse_export.h"
#include "vblk/qmp_daemon.h"
#include "vblk/ublk_export.h"
#include "vblk/vduse_blk.h"
#include "vblk/vhost_user_blk.h"

namespace vblk::qmp {

namespace {

const std::vector<std::string> kExportTypes = {"nbd", "vhost-user-blk", "fuse", "vduse-blk", "ublk"};

// BlockExportOptions: the common members, then each type's own.
const std::vector<Arg>& common_members() {
  static const std::vector<Arg> k = {{"type", ArgType::Enum, true, kExportTypes},
                                     {"id", ArgType::Str, true},
                                     {"fixed-iothread", ArgType::Bool},
                                     {"iothread", ArgType::Str},
                                     {"node-name", ArgType::Str, true},
                                     {"writable", ArgType::Bool},
                                     {"writethrough", ArgType::Bool}};
  return k;
}

std::vector<Arg> members_of(const std::string& type) {
  std::vector<Arg> m = common_members();
  if (type == "nbd") {
    m.insert(m.end(), {{"name", ArgType::Str},
                       {"description", ArgType::Str},
                       {"bitmaps", ArgType::List},
                       {"allocation-depth", ArgType::Bool}});
  } else if (type == "vhost-user-blk") {
    m.insert(
        m.end(),
        {{"addr", ArgType::Struct, true, {}, {{"type", ArgType::Enum, true, {"inet", "unix", "vsock", "fd"}}}, true},
         {"logical-block-size", ArgType::UInt64},
         {"num-queues", ArgType::UInt32}});
  } else if (type == "fuse") {
    m.insert(m.end(), {{"mountpoint", ArgType::Str, true},
                       {"growable", ArgType::Bool},
                       {"allow-other", ArgType::Enum, false, {"off", "on", "auto"}},
                       {"io-uring", ArgType::Bool}});
  } else if (type == "vduse-blk") {
    m.insert(m.end(), {{"name", ArgType::Str, true},
                       {"num-queues", ArgType::UInt32},
                       {"queue-size", ArgType::UInt32},
                       {"logical-block-size", ArgType::UInt64},
                       {"serial", ArgType::Str}});
  } else if (type == "ublk") {
    m.insert(m.end(), {{"num-queues", ArgType::UInt32},
                       {"queue-depth", ArgType::UInt32},
                       {"logical-block-size", ArgType::UInt64},
                       {"dev-id", ArgType::Int},
                       {"recovery", ArgType::Bool}});
  }
  return m;
}

// QEMU's check_block_size (util/block-helpers.c), 0 meaning "unset".
Status check_block_size(const std::string& id, const char* name, uint64_t v) {
  if (v && (v < 512 || v > vhost::kMaxLogicalBlockSize))
    return Error(EINVAL, "Property " + id + "." + name + " doesn't take value " + std::to_string(v) +
                             " (minimum: 512, maximum: " + std::to_string(vhost::kMaxLogicalBlockSize) + ")");
  if (v & (v - 1))
    return Error(EINVAL, "Property " + id + "." + name + " doesn't take value '" + std::to_string(v) +
                             "', it's not a power of 2");
  return {};
}

// A listening socket from a SocketAddress limited to unix and fd, as
// qemu-storage-daemon's vhost-user exports take.
Result<Fd> listen_unix_or_fd(Daemon& d, const OJson& addr, std::string& unix_path) {
  const std::string type = addr.at("type");
  if (type == "unix") {
    static const std::vector<Arg> kUnix = {{"type", ArgType::Enum, true, {"inet", "unix", "vsock", "fd"}},
                                           {"path", ArgType::Str, true},
                                           {"abstract", ArgType::Bool},
                                           {"tight", ArgType::Bool}};
    if (auto e = check_args(kUnix, false, addr, "addr")) return Error(EINVAL, *e);
    return listen_socket_address(d.loop, addr, &unix_path);
  }
  if (type == "fd") {
    static const std::vector<Arg> kFd = {{"type", ArgType::Enum, true, {"inet", "unix", "vsock", "fd"}},
                                         {"str", ArgType::Str, true}};
    if (auto e = check_args(kFd, false, addr, "addr")) return Error(EINVAL, *e);
    // A descriptor number this process inherited, listening already.
    const std::string s = addr.at("str");
    char* end = nullptr;
    long fd = std::strtol(s.c_str(), &end, 10);
    int listening = 0;
    socklen_t len = sizeof listening;
    if (s.empty() || *end || fd < 0 || fd > INT32_MAX ||
        ::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) < 0 || !listening)
      return Error(EINVAL, "File descriptor named '" + s + "' has not been found");
    return Fd(::dup(static_cast<int>(fd)));
  }
  return Error(EINVAL, "Only socket address types 'unix' and 'fd' are supported");
}

Result<std::unique_ptr<BlockExport>> add_vhost_user_blk(Daemon& d, const OJson& o, const std::shared_ptr<Node>& node) {
  const std::string id = o.at("id");
  vhost::BlkOptions b;
  b.node = node;
  b.writable = o.contains("writable") && o.at("writable").get<bool>();
  b.writethrough = o.contains("writethrough") && o.at("writethrough").get<bool>();
  if (o.contains("logical-block-size")) {
    uint64_t v = o.at("logical-block-size").get<uint64_t>();
    VBLK_TRY(check_block_size(id, "logical-block-size", v));
    if (v) b.logical_block_size = static_cast<uint32_t>(v);
  }
  if (o.contains("num-queues")) {
    uint64_t v = o.at("num-queues").get<uint64_t>();
    if (v > UINT16_MAX) return Error(EINVAL, "Parameter 'num-queues' expects uint16_t");
    if (v == 0) return Error(EINVAL, "num-queues must be greater than 0");
    b.num_queues = static_cast<uint16_t>(v);
  }
  std::string path;
  auto fd = listen_unix_or_fd(d, o.at("addr"), path);
  VBLK_TRY(fd);
  auto e = vhost::BlkExport::create(d.loop, std::move(b), std::move(*fd), path);
  if (!e) {
    if (!path.empty()) ::unlink(path.c_str());
    return e.take_error();
  }
  return std::unique_ptr<BlockExport>(std::move(*e));
}

Result<std::unique_ptr<BlockExport>> add_fuse(Daemon& d, const OJson& o, const std::shared_ptr<Node>& node) {
  fuse::Options f;
  f.node = node;
  f.mountpoint = o.at("mountpoint");
  f.writable = o.contains("writable") && o.at("writable").get<bool>();
  f.growable = o.contains("growable") && o.at("growable").get<bool>();
  f.io_uring = o.contains("io-uring") && o.at("io-uring").get<bool>();
  if (o.contains("allow-other")) {
    const std::string a = o.at("allow-other");
    f.allow_other = a == "on" ? fuse::AllowOther::On : a == "off" ? fuse::AllowOther::Off : fuse::AllowOther::Auto;
  }
  auto e = fuse::FuseExport::create(d.loop, std::move(f));
  VBLK_TRY(e);
  return std::unique_ptr<BlockExport>(std::move(*e));
}

// Member `k` of `o`, if present, into `out`; refused above `max`.
Status number(const OJson& o, const char* k, uint64_t max, uint64_t& out) {
  if (!o.contains(k)) return {};
  const uint64_t v = o.at(k).get<uint64_t>();
  // QEMU's wording where the member is a QAPI uint16.
  if (v > max)
    return Error(EINVAL,
                 std::string("Parameter '") + k + (max == UINT16_MAX ? "' expects uint16_t" : "' is out of range"));
  out = v;
  return {};
}

Result<std::unique_ptr<BlockExport>> add_ublk(Daemon& d, const OJson& o, const std::shared_ptr<Node>& node) {
  ublk::Options u;
  u.node = node;
  u.writable = o.contains("writable") && o.at("writable").get<bool>();
  uint64_t nq = u.num_queues, depth = u.queue_depth, lbs = u.logical_block_size;
  VBLK_TRY(number(o, "num-queues", UINT16_MAX, nq));
  VBLK_TRY(number(o, "queue-depth", UINT16_MAX, depth));
  VBLK_TRY(number(o, "logical-block-size", UINT32_MAX, lbs));
  u.num_queues = static_cast<uint16_t>(nq);
  u.queue_depth = static_cast<uint16_t>(depth);
  u.logical_block_size = static_cast<uint32_t>(lbs);
  if (o.contains("dev-id")) u.dev_id = o.at("dev-id").get<int64_t>();
  u.recovery = o.contains("recovery") && o.at("recovery").get<bool>();
  auto e = ublk::UblkExport::create(d.loop, std::move(u));
  VBLK_TRY(e);
  return std::unique_ptr<BlockExport>(std::move(*e));
}

// qemu-storage-daemon's vduse-blk: the device is named `name` (required,
// as in 7.2); the operator attaches it with `vdpa dev add`.
Result<std::unique_ptr<BlockExport>> add_vduse_blk(Daemon& d, const OJson& o, const std::shared_ptr<Node>& node) {
  const std::string id = o.at("id");
  vduse::Options v;
  v.node = node;
  v.name = o.at("name").get<std::string>();
  v.writable = o.contains("writable") && o.at("writable").get<bool>();
  v.writethrough = o.contains("writethrough") && o.at("writethrough").get<bool>();
  if (o.contains("serial")) v.serial = o.at("serial").get<std::string>();
  uint64_t nq = v.num_queues, qsize = v.queue_size;
  VBLK_TRY(number(o, "num-queues", UINT16_MAX, nq));
  VBLK_TRY(number(o, "queue-size", UINT16_MAX, qsize));
  if (nq == 0) return Error(EINVAL, "num-queues must be greater than 0");
  v.num_queues = static_cast<uint16_t>(nq);
  v.queue_size = static_cast<uint16_t>(qsize);
  if (o.contains("logical-block-size")) {
    const uint64_t lbs = o.at("logical-block-size").get<uint64_t>();
    VBLK_TRY(check_block_size(id, "logical-block-size", lbs));
    if (lbs) v.logical_block_size = static_cast<uint32_t>(lbs);
  }
  auto e = vduse::VduseBlkExport::create(d.loop, std::move(v));
  VBLK_TRY(e);
  return std::unique_ptr<BlockExport>(std::move(*e));
}

Task<Reply> block_export_add(Daemon& d, const OJson& args) {
  if (auto e = check_export_args(args)) co_return Reply::fail(*e);
  auto st = add_block_export(d, args);
  if (!st) co_return Reply::fail(st.error().what());
  st = co_await export_ready(d, args.at("id"));
  if (!st) co_return Reply::fail(st.error().what());
  co_return Reply::ok();
}

Task<Reply> block_export_del(Daemon& d, const OJson& args) {
  std::string id = args.at("id");
  auto it = d.exports.find(id);
  if (it == d.exports.end()) co_return Reply::fail("Export '" + id + "' is not found");
  bool hard = args.contains("mode") && args.at("mode") == "hard";
  if (!hard && it->second->in_use()) co_return Reply::fail("export '" + id + "' still in use");
  co_await d.delete_export(id);
  co_return Reply::ok();
}

std::string export_node_name(const BlockExport& e) {
  const Node* n = e.node();
  return n ? n->node_name() : "";
}

Task<Reply> query_block_exports(Daemon& d, const OJson&) {
  OJson list = OJson::array();
  // Newest first, as QEMU's list.
  for (auto it = d.export_order.rbegin(); it != d.export_order.rend(); ++it) {
    const BlockExport& e = *d.exports.at(*it);
    list.push_back({{"type", e.type()}, {"id", *it}, {"node-name", export_node_name(e)}, {"shutting-down", false}});
  }
  co_return Reply::ok(std::move(list));
}

}  // namespace

std::optional<std::string> check_export_args(const OJson& o) {
  if (auto e = check_args(common_members(), true, o)) return e;
  return check_args(members_of(o.at("type")), false, o);
}

Status add_block_export(Daemon& d, const OJson& o) {
  const std::string id = o.at("id");
  const std::string type = o.at("type");
  if (!id_wellformed(id)) return Error(EINVAL, "Invalid block export id");
  if (d.exports.count(id)) return Error(EEXIST, "Block export id '" + id + "' is already in use");
  const std::string node_name = o.at("node-name");
  auto node = d.graph.find(node_name);
  if (!node) return Error(ENOENT, "Cannot find device='' nor node-name='" + node_name + "'");
  if (o.contains("writable") && o.at("writable").get<bool>() && node->read_only())
    return Error(EACCES, "Cannot export read-only node as writable");
  // vblk serves every export from its one loop; an iothread is accepted
  // when it exists, as QEMU checks it.
  if (o.contains("iothread") && !d.iothreads.count(o.at("iothread").get<std::string>()))
    return Error(ENOENT, "iothread \"" + o.at("iothread").get<std::string>() + "\" not found");
  auto e = type == "nbd"              ? add_nbd_export(d, o, node)
           : type == "vhost-user-blk" ? add_vhost_user_blk(d, o, node)
           : type == "ublk"           ? add_ublk(d, o, node)
           : type == "vduse-blk"      ? add_vduse_blk(d, o, node)
                                      : add_fuse(d, o, node);
  VBLK_TRY(e);
  d.exports[id] = std::move(*e);
  d.export_order.push_back(id);
  return {};
}

// Removes the export, ends its clients and waits until they let go of it,
// so the node is free when the BLOCK_EXPORT_DELETED event and the reply go
// out. (QEMU sends the event once the clients' coroutines have ended, which
// can be later than its reply.)
Task<Status> export_ready(Daemon& d, std::string id) {
  auto it = d.exports.find(id);
  if (it == d.exports.end()) co_return Error(ENOENT, "Export '" + id + "' is not found");
  Status st = co_await it->second->ready();
  if (st) co_return st;
  it = d.exports.find(id);
  if (it == d.exports.end()) co_return st;
  std::unique_ptr<BlockExport> e = std::move(it->second);
  d.exports.erase(it);
  std::erase(d.export_order, id);
  co_await e->remove();
  co_return st;
}

Task<void> Daemon::delete_export(std::string id) {
  auto it = exports.find(id);
  if (it == exports.end()) co_return;
  std::unique_ptr<BlockExport> e = std::move(it->second);
  exports.erase(it);
  std::erase(export_order, id);
  co_await e->remove();
  e.reset();
  emit("BLOCK_EXPORT_DELETED", {{"id", id}});
}

void register_export_commands(Daemon& d) {
  d.node_users.push_back([&d](const Node& n) {
    return std::any_of(d.exports.begin(), d.exports.end(), [&](auto& kv) { return kv.second->node() == &n; });
  });
  d.registry.add(
      {"block-export-add", {common_members(), true}, [&d](const OJson& a) { return block_export_add(d, a); }});
  d.registry.add({"block-export-del",
                  {{{"id", ArgType::Str, true}, {"mode", ArgType::Enum, false, {"safe", "hard"}}}},
                  [&d](const OJson& a) { return block_export_del(d, a); }});
  d.registry.add({"query-block-exports", {}, [&d](const OJson& a) { return query_block_exports(d, a); }});
}

}  // namespace vblk::qmp
