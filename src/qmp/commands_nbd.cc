// NBD server commands: nbd-server-start/stop, nbd-server-add, and the NBD
// side of block-export-add (commands_export.cc). The exports are served by
// nbd::Server through its public API.
#include <algorithm>

#include "vblk/qmp_daemon.h"

namespace vblk::qmp {

namespace {

const std::vector<Arg> kUnixMembers = {
    {"path", ArgType::Str, true}, {"abstract", ArgType::Bool}, {"tight", ArgType::Bool}};
const std::vector<Arg> kInetMembers = {{"host", ArgType::Str, true},  {"port", ArgType::Str, true},
                                       {"numeric", ArgType::Bool},    {"to", ArgType::Int},
                                       {"ipv4", ArgType::Bool},       {"ipv6", ArgType::Bool},
                                       {"keep-alive", ArgType::Bool}, {"mptcp", ArgType::Bool}};
const std::vector<std::string> kAddrTypes = {"inet", "unix", "vsock", "fd"};

// A server task owns its nbd::Server: the object lives until every
// connection has ended, even after nbd-server-stop forgot it.
Task<void> run_server(Daemon& d, std::unique_ptr<nbd::Server> s, Fd listener, std::string unix_path) {
  co_await d.clients_open.wait();
  co_await s->serve(std::move(listener));
  if (!unix_path.empty()) ::unlink(unix_path.c_str());
  s.reset();
  d.nbd_running.done();
}

Task<Reply> nbd_server_stop(Daemon& d, const OJson&);

Task<Reply> nbd_server_start(Daemon& d, const OJson& args) {
  // SocketAddressLegacy: {"type": ..., "data": {...}}
  const OJson& addr = args.at("addr");
  std::vector<Arg> legacy = {{"type", ArgType::Enum, true, kAddrTypes}, {"data", ArgType::Object, true}};
  if (auto e = check_args(legacy, false, addr, "addr")) co_return Reply::fail(*e);
  std::string type = addr.at("type");
  const OJson& data = addr.at("data");
  if (type == "unix" || type == "inet") {
    if (auto e = check_args(type == "unix" ? kUnixMembers : kInetMembers, false, data, "addr.data"))
      co_return Reply::fail(*e);
  }
  if (args.contains("tls-creds"))
    co_return Reply::fail("No TLS credentials with id '" + args.at("tls-creds").get<std::string>() + "'");
  OJson flat = data;
  flat["type"] = type;
  unsigned maxc = nbd::Server::kDefaultMaxConnections;
  if (args.contains("max-connections")) maxc = args.at("max-connections").get<unsigned>();
  auto st = start_nbd_server(d, flat, maxc);
  if (!st) co_return Reply::fail(st.error().what());
  co_return Reply::ok();
}

Task<Reply> nbd_server_stop(Daemon& d, const OJson&) {
  if (!d.nbd) co_return Reply::fail("NBD server not running");
  co_await d.nbd_stop();
  co_return Reply::ok();
}

// The legacy form (QEMU 7.2's qmp_nbd_server_add): block-export-add with
// the device as export name and id, its one `bitmap` as the list, and a
// read-only node exported read-only rather than refused.
Task<Reply> nbd_server_add(Daemon& d, const OJson& args) {
  std::string dev = args.at("device");
  auto node = d.graph.find(dev);
  if (!node) co_return Reply::fail("Cannot find device='" + dev + "' nor node-name='" + dev + "'");
  std::string name = args.contains("name") ? args.at("name").get<std::string>() : dev;
  OJson o = {{"type", "nbd"}, {"id", name}, {"node-name", dev}, {"name", name}};
  if (args.contains("description")) o["description"] = args.at("description");
  if (args.contains("writable")) o["writable"] = args.at("writable").get<bool>() && !node->read_only();
  if (args.contains("bitmap")) o["bitmaps"] = OJson::array({args.at("bitmap")});
  auto st = add_block_export(d, o);
  if (!st) co_return Reply::fail(st.error().what());
  co_return Reply::ok();
}

}  // namespace

Result<Fd> listen_socket_address(Loop& loop, const OJson& addr, std::string* unix_path) {
  std::string type = addr.value("type", "");
  if (type == "unix") {
    std::string path = addr.value("path", "");
    auto fd = listen_unix(loop, path);
    if (fd && unix_path) *unix_path = path;
    return fd;
  }
  if (type == "inet") {
    std::string host = addr.value("host", "");
    std::string port = addr.value("port", "");
    char* end = nullptr;
    unsigned long p = std::strtoul(port.c_str(), &end, 10);
    if (port.empty() || *end || p > 65535) return Error(EINVAL, "Unable to parse port '" + port + "'");
    return listen_tcp(loop, host, static_cast<uint16_t>(p));
  }
  return Error(EINVAL, "Address type '" + type + "' is not supported by vblk");
}

Status start_nbd_server(Daemon& d, const OJson& addr, unsigned max_connections) {
  if (d.nbd) return Error(EBUSY, "NBD server already running");
  std::string path;
  auto fd = listen_socket_address(d.loop, addr, &path);
  VBLK_TRY(fd);
  auto s = std::make_unique<nbd::Server>(d.loop, nbd::Server::Options{.max_connections = max_connections});
  d.nbd = s.get();
  d.nbd_unix_path = path;
  d.nbd_running.add();
  spawn_detached(run_server(d, std::move(s), std::move(*fd), path));
  return {};
}

Task<void> Daemon::nbd_stop() {
  if (!nbd) co_return;
  // In the order they were added, as QEMU's BLOCK_EXPORT_DELETED events
  // come (its bottom halves run in the reverse of its export list's order).
  std::vector<std::string> ids;
  for (const auto& id : export_order)
    if (std::string_view(exports.at(id)->type()) == "nbd") ids.push_back(id);
  for (auto& id : ids) co_await delete_export(id);
  nbd->stop();
  nbd = nullptr;
}

Result<std::unique_ptr<BlockExport>> add_nbd_export(Daemon& d, const OJson& o, const std::shared_ptr<Node>& node) {
  const std::string node_name = o.at("node-name");
  if (!d.nbd) return Error(EINVAL, "NBD server not running");
  std::string name = o.contains("name") ? o.at("name").get<std::string>() : node_name;
  if (name.size() > 4096) return Error(EINVAL, "export name '" + name + "' too long");
  std::string desc = o.contains("description") ? o.at("description").get<std::string>() : "";
  if (desc.size() > 4096) return Error(EINVAL, "description '" + desc + "' too long");
  if (d.nbd->find_export(name)) return Error(EEXIST, "NBD server already has export named '" + name + "'");
  bool writable = o.contains("writable") && o.at("writable").get<bool>();
  // qemu:dirty-bitmap:NAME contexts: the bitmap of the node or of a node
  // down its backing chain (QEMU's nbd_export_create).
  std::vector<std::pair<std::shared_ptr<Node>, std::string>> bitmaps;
  if (o.contains("bitmaps")) {
    // A list of BlockDirtyBitmapOrStr: a name, or {node, name} anywhere.
    const OJson& list = o.at("bitmaps");
    static const std::vector<Arg> kExternal = {{"node", ArgType::Str, true}, {"name", ArgType::Str, true}};
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].is_string()) continue;
      // QEMU 7.2 names the alternate 'null' here.
      if (!list[i].is_object())
        return Error(EINVAL, "Invalid parameter type for 'null', expected: BlockDirtyBitmapOrStr");
      if (auto e = check_args(kExternal, false, list[i], "bitmaps[" + std::to_string(i) + "]"))
        return Error(EINVAL, *e);
    }
    for (const auto& v : list) {
      std::shared_ptr<Node> owner = node;
      NamedBitmap* bm = nullptr;
      std::string bname;
      if (v.is_object()) {
        bname = v.at("name").get<std::string>();
        std::string bnode = v.at("node").get<std::string>();
        owner = d.graph.find(bnode);
        if (!owner) return Error(ENOENT, "Node '" + bnode + "' not found");
        bm = owner->bitmaps().find(bname);
        if (!bm) return Error(ENOENT, "Dirty bitmap '" + bname + "' not found");
      } else {
        bname = v.get<std::string>();
        bm = nbd::find_bitmap_in_chain(owner, bname);
        if (!bm) return Error(ENOENT, "Bitmap '" + bname + "' is not found");
      }
      if (!writable && !owner->read_only() && bm->enabled)
        return Error(EINVAL, "Enabled bitmap '" + bname + "' incompatible with readonly export");
      VBLK_TRY(check_bitmap(*bm, kBitmapAllowRo));
      bitmaps.push_back({owner, bname});
    }
  }
  // Exported bitmaps are busy while the export lives (QEMU's nbd_export_create).
  std::vector<NamedBitmap*> busy;
  for (const auto& [owner, bname] : bitmaps) busy.push_back(owner->bitmaps().find(bname));
  VBLK_TRY(d.nbd->add_export(nbd::Export{name, desc, node, writable, std::move(bitmaps)}));
  for (NamedBitmap* bm : busy) bm->busy = true;
  return nbd::make_block_export(*d.nbd, name);
}

void register_nbd_commands(Daemon& d) {
  d.registry.add({"nbd-server-start",
                  {{{"addr", ArgType::Struct, true, {}, {{"type", ArgType::Enum, true, kAddrTypes}}, true},
                    {"tls-creds", ArgType::Str},
                    {"tls-authz", ArgType::Str},
                    {"max-connections", ArgType::UInt32}}},
                  [&d](const OJson& a) { return nbd_server_start(d, a); }});
  d.registry.add({"nbd-server-stop", {}, [&d](const OJson& a) { return nbd_server_stop(d, a); }});
  d.registry.add({"nbd-server-add",
                  {{{"device", ArgType::Str, true},
                    {"name", ArgType::Str},
                    {"description", ArgType::Str},
                    {"writable", ArgType::Bool},
                    {"bitmap", ArgType::Str}}},
                  [&d](const OJson& a) { return nbd_server_add(d, a); }});
}

Task<void> Daemon::shutdown() {
  monitors.stop();
  // As qemu-storage-daemon does at exit: cancel every job and wait for it
  // (backup filters leave the graph before the nodes close).
  co_await jobs.cancel_all();
  co_await nbd_stop();
  // The other exports, oldest first.
  while (!export_order.empty()) co_await delete_export(export_order.front());
  co_await nbd_running.wait();
  co_await monitors.wait();
  // Close every node, parents first (they write back into their children).
  for (auto it = node_order.rbegin(); it != node_order.rend(); ++it) {
    if (auto n = it->lock()) {
      co_await n->drain();
      (void)co_await n->close();
    }
  }
}

}  // namespace vblk::qmp
