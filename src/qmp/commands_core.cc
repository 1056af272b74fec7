// The daemon's bookkeeping and the core QMP commands: query-version,
// query-commands, quit (qmp_capabilities is the monitor's own).
#include <fnmatch.h>

#include <algorithm>

#include "vblk/copy_drivers.h"
#include "vblk/open.h"
#include "vblk/qmp_daemon.h"
#include "vblk/trace.h"

#ifndef VBLK_VERSION
#define VBLK_VERSION "0.0.0"
#define VBLK_VERSION_MAJOR 0
#define VBLK_VERSION_MINOR 0
#define VBLK_VERSION_PATCH 0
#endif

namespace vblk::qmp {

namespace {

OJson version_json() {
  OJson v = OJson::object();
  v["qemu"] = {{"major", VBLK_VERSION_MAJOR}, {"minor", VBLK_VERSION_MINOR}, {"micro", VBLK_VERSION_PATCH}};
  v["package"] = "vblk " VBLK_VERSION;
  return v;
}

Task<Reply> query_version(Daemon&, const OJson&) { co_return Reply::ok(version_json()); }

Task<Reply> query_commands(Daemon& d, const OJson&) {
  OJson list = OJson::array();
  auto names = d.registry.names();
  names.push_back("qmp_capabilities");
  // QEMU lists the newest registration first.
  std::reverse(names.begin(), names.end());
  for (const auto& n : names) list.push_back({{"name", n}});
  co_return Reply::ok(std::move(list));
}

// QEMU's trace-event-get-state / -set-state over vblk's trace categories
// (vblk/trace.h): the categories are the events, `name` a glob over them.
Task<Reply> trace_event_get_state(Daemon&, const OJson& a) {
  const std::string pattern = a["name"].get<std::string>();
  OJson list = OJson::array();
  for (const auto& c : trace::categories()) {
    if (fnmatch(pattern.c_str(), c.name, 0) != 0) continue;
    list.push_back({{"name", c.name}, {"state", trace::on(c.category) ? "enabled" : "disabled"}, {"vcpu", false}});
  }
  co_return Reply::ok(std::move(list));
}

Task<Reply> trace_event_set_state(Daemon&, const OJson& a) {
  const std::string pattern = a["name"].get<std::string>();
  if (trace::set_state(pattern, a["enable"].get<bool>()).empty())
    co_return Reply::fail("unknown event \"" + pattern + "\"");
  co_return Reply::ok();
}

Task<Reply> quit(Daemon& d, const OJson&) {
  d.quit.set();
  co_return Reply::ok();
}

}  // namespace

Daemon::Daemon(Loop& l) : loop(l), monitors(l, registry, version_json()), nbd_running(l), quit(l), clients_open(l) {
  register_copy_drivers();  // blockdev-add of copy-before-write, snapshot-access
  clients_open.set();
}

Daemon::~Daemon() = default;

void Daemon::forget_dead_nodes() {
  std::erase_if(node_order, [](const std::weak_ptr<Node>& w) { return w.expired(); });
  std::set<const Node*> live;
  for (auto& w : node_order)
    if (auto n = w.lock()) live.insert(n.get());
  std::erase_if(settings, [&](const auto& kv) { return !live.count(kv.first); });
}

void Daemon::note_new_nodes(const std::shared_ptr<Node>& top) {
  forget_dead_nodes();
  // QEMU's creation order: a format node's file child is named before it;
  // a protocol-level filter's children (blkdebug's image) and a backing
  // chain after it (they are opened once the node has its name).
  std::vector<Node*> seen;
  for (auto& w : node_order)
    if (auto n = w.lock()) seen.push_back(n.get());
  std::vector<std::shared_ptr<Node>> created;
  auto visit = [&](auto&& self, const std::shared_ptr<Node>& n) -> void {
    if (std::find(seen.begin(), seen.end(), n.get()) != seen.end()) return;
    seen.push_back(n.get());
    const DriverInfo* drv = find_driver(n->driver());
    bool children_first = !(drv && drv->is_protocol());
    for (const auto& c : n->children())
      if (c.role != "backing" && children_first) self(self, c.node);
    created.push_back(n);
    for (const auto& c : n->children())
      if (c.role == "backing" || !children_first) self(self, c.node);
  };
  visit(visit, top);
  for (auto& n : created) {
    // Nodes opened outside the graph (backing files) get #blockNNN names.
    if (n->node_name().empty()) (void)graph.add(n);
    node_order.push_back(n);
    // QEMU's BLOCK_IMAGE_CORRUPTED. No node here has a BlockBackend name,
    // so "device" is empty, as from qemu-storage-daemon.
    n->set_corruption_handler([this](const Node& node, const CorruptionEvent& ev) {
      OJson data = OJson::object();
      data["device"] = "";
      if (!node.node_name().empty()) data["node-name"] = node.node_name();
      data["msg"] = ev.msg;
      if (ev.offset >= 0) data["offset"] = ev.offset;
      if (ev.size >= 0) data["size"] = ev.size;
      data["fatal"] = ev.fatal;
      emit("BLOCK_IMAGE_CORRUPTED", std::move(data));
    });
  }
}

void register_core_commands(Daemon& d) {
  d.registry.add({"query-version", {}, [&d](const OJson& a) { return query_version(d, a); }});
  d.registry.add({"query-commands", {}, [&d](const OJson& a) { return query_commands(d, a); }});
  d.registry.add({"quit", {}, [&d](const OJson& a) { return quit(d, a); }});
  d.registry.add({"trace-event-get-state",
                  {{{"name", ArgType::Str, true}, {"vcpu", ArgType::Int}}},
                  [&d](const OJson& a) { return trace_event_get_state(d, a); }});
  d.registry.add({"trace-event-set-state",
                  {{{"name", ArgType::Str, true},
                    {"enable", ArgType::Bool, true},
                    {"ignore-unavailable", ArgType::Bool},
                    {"vcpu", ArgType::Int}}},
                  [&d](const OJson& a) { return trace_event_set_state(d, a); }});
}

}  // namespace vblk::qmp
