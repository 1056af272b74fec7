// Block node commands: blockdev-add, blockdev-del, query-named-block-nodes.
// Nodes are opened through open_node with the daemon's Graph, so every
// driver vblk has is available; errors are worded as QEMU words them.
#include <algorithm>

#include "vblk/backup.h"
#include "vblk/chain.h"
#include "vblk/copy_before_write.h"
#include "vblk/format_info_json.h"
#include "vblk/image_format.h"
#include "vblk/open.h"
#include "vblk/qmp_daemon.h"
#include "vblk/snapshot_info_json.h"

namespace vblk::qmp {

Task<void> drop_orphans(Daemon& d);

namespace {

// QMP is typed: where the command line accepts "on" or "4k", QMP wants a
// JSON bool or integer. The option names vblk's drivers read, by type.
const char* const kBoolOpts[] = {"read-only", "auto-read-only", "force-share", "read-zeroes", "direct",
                                 "no-flush",  "lazy-refcounts", "once",        "immediately", "locking-optional"};
const char* const kIntOpts[] = {"size",
                                "offset",
                                "latency-ns",
                                "align",
                                "errno",
                                "sector",
                                "state",
                                "connections",
                                "max-transfer",
                                "cache-size",
                                "l2-cache-size",
                                "refcount-cache-size",
                                "cache-clean-interval"};
const char* const kStrOpts[] = {"driver", "node-name", "filename",       "discard",  "detect-zeroes",
                                "aio",    "export",    "path",           "host",     "port",
                                "event",  "locking",   "x-dirty-bitmap", "tls-creds"};

template <size_t N>
bool in(const char* const (&list)[N], const std::string& k) {
  return std::any_of(std::begin(list), std::end(list), [&](const char* s) { return k == s; });
}

// Type checks of one options dict that is not a node (an inject-error rule).
std::optional<std::string> check_fields(const OJson& o, const std::string& prefix);

// qcow2's overlap-check, QAPI's alternate Qcow2OverlapChecks: a mode, or
// Qcow2OverlapCheckFlags (a template mode and per-kind booleans).
std::optional<std::string> check_overlap_checks(const OJson& v, const std::string& full) {
  auto mode_ok = [](const OJson& m) {
    return m.is_string() && (m == "none" || m == "constant" || m == "cached" || m == "all");
  };
  if (v.is_string()) {
    if (!mode_ok(v)) return "Parameter '" + full + "' does not accept value '" + v.get<std::string>() + "'";
    return std::nullopt;
  }
  if (!v.is_object()) return "Invalid parameter type for '" + full + "', expected: Qcow2OverlapChecks";
  static const char* const kinds[] = {"main-header",    "active-l1",      "active-l2",
                                      "refcount-table", "refcount-block", "snapshot-table",
                                      "inactive-l1",    "inactive-l2",    "bitmap-directory"};
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string k = it.key();
    if (k == "template") {
      if (!it->is_string()) return "Invalid parameter type for '" + full + ".template', expected: string";
      if (!mode_ok(*it)) return "Parameter 'template' does not accept value '" + it->get<std::string>() + "'";
    } else if (std::any_of(std::begin(kinds), std::end(kinds), [&](const char* n) { return k == n; })) {
      if (!it->is_boolean()) return "Invalid parameter type for '" + full + "." + k + "', expected: boolean";
    } else {
      return "Parameter '" + full + "." + k + "' is unexpected";
    }
  }
  return std::nullopt;
}

// Child roles whose value is blockdev options (or a node name).
const char* const kChildOpts[] = {"file", "backing", "image"};

std::optional<std::string> check_types(const OJson& o, const std::string& prefix) {
  // What QMP's schema demands of every node's options, before any opening.
  std::string p = prefix.empty() ? "" : prefix + ".";
  if (!o.contains("driver")) return "Parameter '" + p + "driver' is missing";
  if (o["driver"].is_string()) {
    std::string drv = o["driver"];
    if ((drv == "file" || drv == "host_device") && !o.contains("filename"))
      return "Parameter '" + p + "filename' is missing";
  }
  for (auto it = o.begin(); it != o.end(); ++it) {
    std::string full = prefix.empty() ? it.key() : prefix + "." + it.key();
    const OJson& v = *it;
    const char* want = nullptr;
    if (in(kBoolOpts, it.key()) && !v.is_boolean()) want = "boolean";
    if (in(kIntOpts, it.key()) && !v.is_number_integer()) want = "integer";
    if (in(kStrOpts, it.key()) && !v.is_string()) want = "string";
    if (want) return "Invalid parameter type for '" + full + "', expected: " + want;
    if (it.key() == "overlap-check" && o["driver"] == "qcow2") {
      if (auto e = check_overlap_checks(v, full)) return e;
    } else if (v.is_object() && it.key() == "cache") {
      if (auto e = check_fields(v, full)) return e;
    } else if (v.is_object() && in(kChildOpts, it.key())) {
      if (auto e = check_types(v, full)) return e;
    } else if (v.is_array()) {
      // Lists (inject-error) name their elements without an index.
      for (size_t i = 0; i < v.size(); ++i)
        if (v[i].is_object())
          if (auto r = check_fields(v[i], full + "[" + std::to_string(i) + "]")) return r;
    }
  }
  return std::nullopt;
}

std::optional<std::string> check_fields(const OJson& o, const std::string& prefix) {
  for (auto it = o.begin(); it != o.end(); ++it) {
    std::string full = prefix + "." + it.key();
    const OJson& v = *it;
    if (in(kBoolOpts, it.key()) && !v.is_boolean())
      return "Invalid parameter type for '" + full + "', expected: boolean";
    if (in(kIntOpts, it.key()) && !v.is_number_integer())
      return "Invalid parameter type for '" + full + "', expected: integer";
    if (in(kStrOpts, it.key()) && !v.is_string()) return "Invalid parameter type for '" + full + "', expected: string";
  }
  return std::nullopt;
}

// vblk's open path says "Block format 'raw' does not support the option
// 'x'"; QMP's schema check says "Parameter 'x' is unexpected".
std::string qmp_open_error(std::string msg) {
  // What vblk prints as a second line is a hint to QEMU, not part of desc.
  if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  auto pos = msg.find(" support the option '");
  if ((msg.rfind("Block format '", 0) == 0 || msg.rfind("Block protocol '", 0) == 0) && pos != std::string::npos) {
    std::string key = msg.substr(pos + 21);
    if (!key.empty() && key.back() == '\'') key.pop_back();
    return "Parameter '" + key + "' is unexpected";
  }
  if (msg.rfind("Unknown driver '", 0) == 0) {
    std::string drv = msg.substr(16);
    if (!drv.empty() && drv.back() == '\'') drv.pop_back();
    return "Parameter 'driver' does not accept value '" + drv + "'";
  }
  return msg;
}

Task<Reply> blockdev_add(Daemon& d, const OJson& args) {
  if (auto e = check_types(args, "")) co_return Reply::fail(*e);
  auto n = d.blockdev_add(Json::parse(args.dump()));
  if (!n) co_return Reply::fail(qmp_open_error(n.error().what()));
  co_return Reply::ok();
}

}  // namespace

// Drops implicit nodes (children opened inline) that nothing uses any more.
Task<void> drop_orphans(Daemon& d) {
  for (bool again = true; again;) {
    again = false;
    std::vector<std::string> names;
    for (auto& n : d.graph.nodes()) names.push_back(n->node_name());
    for (const auto& name : names) {
      auto n = d.graph.find(name);
      // Held by the graph and by `n` here: nobody else.
      if (!n || d.monitor_owned.count(name) || n.use_count() > 2) continue;
      (void)co_await n->close();
      d.settings.erase(n.get());
      n.reset();
      (void)d.graph.remove(name);
      again = true;
    }
  }
}

std::shared_ptr<Node> backing_parent(Daemon& d, const Node& n) {
  for (auto& p : d.graph.nodes())
    if (p->child("backing") == &n) return p;
  return nullptr;
}

namespace {

Task<Reply> blockdev_del(Daemon& d, const OJson& args) {
  std::string name = args.at("node-name").get<std::string>();
  auto node = d.graph.find(name);
  if (!node) co_return Reply::fail("Failed to find node with node-name='" + name + "'");
  for (auto& in_use : d.node_users)
    if (in_use(*node)) co_return Reply::fail("Node " + name + " is in use");
  // A job's op blocker (a backup's target).
  if (auto st = d.jobs.check_not_busy(node.get(), name); !st) co_return Reply::fail(st.error().what());
  // QEMU blocks every operation but a few on a backing node (bdrv_set_backing_hd).
  if (auto p = backing_parent(d, *node))
    co_return Reply::fail("Node '" + name + "' is busy: node is used as backing hd of '" + p->node_name() + "'");
  if (!d.monitor_owned.count(name)) co_return Reply::fail("Node " + name + " is not owned by the monitor");
  // The graph and `node` hold it; anything more is a parent.
  if (node.use_count() > 2) co_return Reply::fail("Block device " + name + " is in use");
  d.monitor_owned.erase(name);
  d.settings.erase(node.get());
  // Closing writes back what the driver caches (qcow2 metadata); QEMU
  // reports no error here either.
  co_await node->drain();
  (void)co_await node->close();
  node.reset();
  (void)d.graph.remove(name);
  co_await drop_orphans(d);
  co_return Reply::ok();
}

Node* backing_of(const Node& n) { return n.child("backing"); }

OJson image_info(Daemon& d, Node& n, bool flat) {
  const ImageFormat* f = n.format();
  OJson img = OJson::object();
  img["filename"] = n.filename();
  img["format"] = n.driver();
  img["virtual-size"] = n.length();  // whole sectors, as bdrv_getlength
  if (auto a = n.allocated_size()) img["actual-size"] = *a;
  if (image::cluster_size(n)) img["cluster-size"] = image::cluster_size(n);
  if (f && f->encrypted()) img["encrypted"] = true;
  if (n.caps().reports_dirty_flag) img["dirty-flag"] = f && f->dirty_flag();
  if (auto spec = f ? f->format_info() : std::nullopt) img["format-specific"] = format_info_json(*spec);
  std::string bf = image::backing_file_name(n);
  if (!bf.empty()) {
    img["backing-filename"] = bf;
    if (Node* b = backing_of(n)) img["full-backing-filename"] = b->filename();
    if (!image::backing_file_format(n).empty()) img["backing-filename-format"] = image::backing_file_format(n);
  }
  // Internal snapshots (qcow2's; rbd's, also through a raw node over it, as
  // QEMU's snapshot fallback lists them), when there are any.
  auto snaps = image::snapshots(n);
  if (!snaps.empty()) {
    OJson list = OJson::array();
    for (const auto& sn : snaps) list.push_back(snapshot_info_json(sn));
    img["snapshots"] = std::move(list);
  }
  if (!flat)
    if (Node* b = filter_or_cow_child(n)) img["backing-image"] = image_info(d, *b, flat);
  return img;
}

OJson node_info(Daemon& d, Node& n, bool flat) {
  NodeSettings st;
  if (auto it = d.settings.find(&n); it != d.settings.end()) st = it->second;
  OJson o = OJson::object();
  o["file"] = n.filename();
  o["node-name"] = n.node_name();
  o["ro"] = n.read_only();
  o["drv"] = n.driver();
  // QEMU counts the chain only while gathering it (not with flat).
  int depth = 0;
  if (!flat)
    for (Node* b = filter_or_cow_child(n); b; b = filter_or_cow_child(*b)) ++depth;
  if (Node* b = backing_of(n)) o["backing_file"] = b->filename();
  o["backing_file_depth"] = depth;
  o["encrypted"] = n.format() && n.format()->encrypted();
  o["detect_zeroes"] = st.detect_zeroes;
  for (const char* k : {"bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"}) o[k] = 0;
  o["image"] = image_info(d, n, flat);
  o["cache"] = {{"writeback", true}, {"direct", st.direct}, {"no-flush", st.no_flush}};
  o["write_threshold"] = 0;
  if (n.bitmaps().has_named()) o["dirty-bitmaps"] = dirty_bitmaps_info(n);
  // vblk: a copy-before-write filter's COW buffer (fleecing).
  if (auto* cbw = dynamic_cast<CopyBeforeWrite*>(&n); cbw && cbw->has_buffer())
    o["x-cow-buffer"] = cow_buffer_json(cbw->buffer_stats());
  return o;
}

Task<Reply> query_named_block_nodes(Daemon& d, const OJson& args) {
  // A node QEMU would have freed when its last user went (a drive-mirror
  // target after its job) is not listed: collect such nodes first.
  co_await drop_orphans(d);
  bool flat = args.contains("flat") && args.at("flat").get<bool>();
  OJson list = OJson::array();
  for (auto it = d.node_order.rbegin(); it != d.node_order.rend(); ++it) {
    auto n = it->lock();
    if (!n || d.graph.find(n->node_name()) != n) continue;
    list.push_back(node_info(d, *n, flat));
  }
  co_return Reply::ok(std::move(list));
}

// QEMU's bdrv_assign_node_name: user-given names are id_wellformed (so
// they never clash with the generated "#blockNNN") and fit its 32-byte
// array. Inline children's names are checked too, the root's first.
Status check_node_names(const Json& opts) {
  if (auto it = opts.find("node-name"); it != opts.end() && it->is_string()) {
    const std::string name = it->get<std::string>();
    if (!id_wellformed(name)) return Error(EINVAL, "Invalid node-name: '" + name + "'");
    if (name.size() >= 32) return Error(EINVAL, "Node name too long");
  }
  for (auto it = opts.begin(); it != opts.end(); ++it)
    if (it->is_object())
      if (auto st = check_node_names(*it); !st) return st;
  return {};
}

}  // namespace

Task<void> Daemon::drop_node(const std::string& name) {
  auto node = graph.find(name);
  if (!node) co_return;
  monitor_owned.erase(name);
  settings.erase(node.get());
  co_await node->drain();
  (void)co_await node->close();
  node.reset();
  (void)graph.remove(name);
  co_await drop_orphans(*this);
}

Result<std::shared_ptr<Node>> Daemon::blockdev_add(const Json& in) {
  Json opts = in;
  if (!opts.is_object()) return Error(EINVAL, "Invalid parameter type, expected: object");
  if (!opts.contains("driver")) return Error(EINVAL, "Parameter 'driver' is missing");
  if (opts["driver"].is_string() && !find_driver(opts["driver"]))
    return Error(EINVAL, "Parameter 'driver' does not accept value '" + opts["driver"].get<std::string>() + "'");
  if (!opts.contains("node-name")) return Error(EINVAL, "'node-name' must be specified for the root node");
  std::string name = opts["node-name"].is_string() ? opts["node-name"].get<std::string>() : "";
  if (auto st = check_node_names(opts); !st) return st.take_error();
  if (graph.find(name)) return Error(EEXIST, "Duplicate nodes with node-name='" + name + "'");
  NodeSettings st;
  if (opts.contains("cache") && opts["cache"].is_object()) {
    const Json& c = opts["cache"];
    auto truthy = [](const Json& v) {
      return v.is_boolean() ? v.get<bool>() : (v.is_string() && v.get<std::string>() == "on");
    };
    if (c.contains("direct")) st.direct = truthy(c["direct"]);
    if (c.contains("no-flush")) st.no_flush = truthy(c["no-flush"]);
  }
  if (opts.contains("detect-zeroes") && opts["detect-zeroes"].is_string()) st.detect_zeroes = opts["detect-zeroes"];
  OpenContext ctx{.loop = loop, .graph = &graph, .throttle_groups = &throttle_groups};
  auto n = open_node(ctx, std::move(opts));
  if (!n) {
    // open_node registers children as it goes: forget the half-built tree.
    for (bool again = true; again;) {
      again = false;
      std::vector<std::string> names;
      for (auto& g : graph.nodes()) {
        bool known = std::any_of(node_order.begin(), node_order.end(), [&](auto& w) { return w.lock() == g; });
        if (!known) names.push_back(g->node_name());
      }
      for (const auto& nm : names)
        if (graph.remove(nm)) again = true;
    }
    return n;
  }
  monitor_owned.insert((*n)->node_name());
  forget_dead_nodes();  // so that `before` still counts after note_new_nodes' own
  size_t before = node_order.size();
  note_new_nodes(*n);
  // Cache modes are inherited by implicit children; detect-zeroes is not.
  NodeSettings child_st = st;
  child_st.detect_zeroes = "off";
  for (size_t i = before; i < node_order.size(); ++i)
    if (auto p = node_order[i].lock()) settings[p.get()] = p == *n ? st : child_st;
  return n;
}

void register_block_commands(Daemon& d) {
  d.registry.add(
      {"blockdev-add", {{{"driver", ArgType::Str, true}}, true}, [&d](const OJson& a) { return blockdev_add(d, a); }});
  d.registry.add(
      {"blockdev-del", {{{"node-name", ArgType::Str, true}}}, [&d](const OJson& a) { return blockdev_del(d, a); }});
  d.registry.add({"query-named-block-nodes", {{{"flat", ArgType::Bool}}}, [&d](const OJson& a) {
                    return query_named_block_nodes(d, a);
                  }});
}

}  // namespace vblk::qmp
