// libFuzzer target: the QMP monitor (src/qmp/): its JSON streamer, its
// dispatcher and every command's argument decoding, run against a daemon
// whose nodes are all in memory. Byte 0 picks the mode:
//
//  - even: the rest is raw monitor bytes for the streamer alone
//    (JsonStreamer fed in pieces, then finished; each value written back
//    with to_qmp_text and its keys ordered as a QDict), and parsed whole as
//    a --blockdev JSON value;
//  - odd: the rest is a sequence of choices (fuzz/choices.h) that builds
//    up to 8 commands: a name from the registry (or qmp_capabilities, or
//    an unknown one), then for each member of its schema maybe a value of
//    the declared type, or of a wrong one; strings from the names the
//    daemon has (nodes, jobs, bitmaps, drivers, the member's enum values),
//    integers at the edges (0, -1, 2^63, 2^64 - 1, sizes), nested objects
//    with the keys blockdev-add, blockdev-create, object-add and
//    transaction take. A choice may also splice raw bytes between the
//    commands. The whole text goes to a real monitor over a unix socket
//    (qmp_capabilities first unless bit 1 of byte 0 says not to), the
//    replies are read and dropped, and the daemon shuts down.
//
// The daemon starts with nodes m0, m1 (64 KiB in memory each), q0 (a
// 64 KiB qcow2 image on the in-memory m2) and n0 (null-co, 64 KiB).
//
// Sandbox: a command is never run when anything in it could reach the
// host (fuzz/sandbox.h for block options; here the commands that listen,
// connect or create files by name: nbd-server-start, drive-backup,
// drive-mirror, blockdev-snapshot-sync, x-vblk-savevm, x-vblk-loadvm,
// object-add with a secret "file", anything with an "addr"), or could make
// the daemon's shutdown wait on purpose (throttle nodes and groups: a
// limit of 1 byte/s is valid). Such an input only goes through the
// streamer. The whole stream is parsed first with the same streamer, so
// the monitor sees exactly the messages that were checked.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "block/drivers/qcow2/qcow2.h"
#include "fuzz/choices.h"
#include "fuzz/peer.h"
#include "fuzz/sandbox.h"
#include "vblk/mem_node.h"
#include "vblk/qmp_daemon.h"
#include "vblk/qmp_json.h"
#include "vblk/secret_store.h"

using namespace vblk;
using qmp::OJson;

namespace {

// Small: the nodes are made anew for every input, and a 1 MiB one costs
// more than the commands run on it.
constexpr uint64_t kNodeSize = 64 << 10;
constexpr uint64_t kMaxNodeSize = 4 << 20;

Loop& loop() {
  static Loop l;
  return l;
}

// ---- the sandbox

const std::set<std::string>& denied_strings() {
  // Command and transaction-action names, the throttle driver and object
  // type, and the export types that reach the host's kernel (a FUSE mount
  // over an existing file, a ublk or VDUSE block device), anywhere in a
  // message.
  static const std::set<std::string> k = {"nbd-server-start",
                                          "drive-backup",
                                          "drive-mirror",
                                          "blockdev-snapshot-sync",
                                          "x-vblk-savevm",
                                          "x-vblk-loadvm",
                                          "throttle",
                                          "throttle-group",
                                          "fuse",
                                          "ublk",
                                          "vduse-blk"};
  return k;
}

bool safe_value(const OJson& v) {
  if (v.is_string()) return !denied_strings().count(v.get<std::string>());
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it)
      if (it.key() == "addr" || !safe_value(*it)) return false;
  }
  if (v.is_array()) {
    for (const auto& e : v)
      if (!safe_value(e)) return false;
  }
  return true;
}

bool safe_message(const OJson& m) {
  if (!safe_value(m) || !fuzz::in_memory_only(m)) return false;
  // A secret's "file" is read from the host.
  if (m.is_object() && m.contains("arguments") && m["arguments"].is_object() && m["arguments"].contains("file")) {
    for (const char* k : {"execute", "exec-oob"})
      if (m.contains(k) && m[k] == "object-add") return false;
  }
  return true;
}

// ---- the typed generator

const std::vector<std::string>& words() {
  static const std::vector<std::string> k = {"m0",
                                             "m1",
                                             "m2",
                                             "q0",
                                             "n0",
                                             "nope",
                                             "j0",
                                             "j1",
                                             "b0",
                                             "b1",
                                             "s0",
                                             "sec0",
                                             "io0",
                                             "e0",
                                             "",
                                             "null-co",
                                             "raw",
                                             "qcow2",
                                             "luks",
                                             "copy-before-write",
                                             "snapshot-access",
                                             "full",
                                             "top",
                                             "none",
                                             "incremental",
                                             "bitmap",
                                             "on",
                                             "off",
                                             "unmap",
                                             "ignore",
                                             "report",
                                             "stop",
                                             "enospc",
                                             "base64",
                                             "secret",
                                             "iothread",
                                             "nbd",
                                             "auto",
                                             "metadata",
                                             "falloc",
                                             "zlib",
                                             "zstd",
                                             "v2",
                                             "v3",
                                             "1.1",
                                             "#block123",
                                             "a.b",
                                             "-x",
                                             "\xc3\xa9",
                                             std::string(300, 'n'),
                                             "0x10",
                                             "1M",
                                             "-1",
                                             "65536",
                                             "blockdev-backup",
                                             "blockdev-add",
                                             "block-dirty-bitmap-add",
                                             "block-dirty-bitmap-merge",
                                             "abort",
                                             "completion-mode",
                                             "grouped",
                                             "individual",
                                             "existing",
                                             "absolute-paths",
                                             "concluded",
                                             "pending",
                                             "ready"};
  return k;
}

const std::vector<std::string>& keys() {
  static const std::vector<std::string> k = {"driver",
                                             "node-name",
                                             "file",
                                             "backing",
                                             "size",
                                             "read-only",
                                             "auto-read-only",
                                             "force-share",
                                             "cache",
                                             "direct",
                                             "no-flush",
                                             "discard",
                                             "detect-zeroes",
                                             "read-zeroes",
                                             "cluster-size",
                                             "lazy-refcounts",
                                             "refcount-bits",
                                             "version",
                                             "compression-type",
                                             "preallocation",
                                             "extended-l2",
                                             "encrypt",
                                             "format",
                                             "key-secret",
                                             "target",
                                             "bitmap",
                                             "on-cbw-error",
                                             "cbw-timeout",
                                             "qom-type",
                                             "id",
                                             "data",
                                             "job-id",
                                             "device",
                                             "sync",
                                             "speed",
                                             "node",
                                             "name",
                                             "granularity",
                                             "persistent",
                                             "disabled",
                                             "bitmaps",
                                             "type",
                                             "actions",
                                             "options",
                                             "location",
                                             "snapshot-node-name",
                                             "overlay",
                                             "top",
                                             "base",
                                             "base-node",
                                             "top-node",
                                             "auto-finalize",
                                             "auto-dismiss",
                                             "filter-node-name",
                                             "on-source-error",
                                             "on-target-error",
                                             "writable",
                                             "description",
                                             "force",
                                             "mode",
                                             "x-perf",
                                             "use-copy-range",
                                             "max-workers",
                                             "max-chunk",
                                             "compress",
                                             "offset",
                                             "l2-cache-size",
                                             "cache-size",
                                             "refcount-cache-size",
                                             "overlap-check",
                                             "keyid",
                                             "iv",
                                             "loaded",
                                             "cipher-alg",
                                             "iter-time",
                                             "hash-alg",
                                             "properties",
                                             "completion-mode",
                                             "replaces",
                                             "granularity",
                                             "buf-size",
                                             "copy-mode",
                                             "unmap",
                                             "noflush",
                                             "backing-mask-protocol",
                                             "backing-fmt",
                                             "data-file-raw"};
  return k;
}

int64_t edge_int(fuzz::Choices& c) {
  static const int64_t k[] = {0,       1,         -1,        2,         512,   4096, 65536,  1 << 20, (1 << 20) + 1,
                              1 << 30, INT32_MAX, INT64_MAX, INT64_MIN, -4096, 3,    1 << 9, 1 << 21, 1ll << 40};
  switch (c.pick(4)) {
    case 0: return static_cast<int64_t>(c.u64());
    case 1: return static_cast<int64_t>(c.byte()) << (c.byte() % 48);
    default: return k[c.pick(std::size(k))];
  }
}

std::string word(fuzz::Choices& c) { return words()[c.pick(words().size())]; }

// A string for member `key`: mostly a name of what such a member names in
// this daemon (so that commands get past their lookups), else any word.
std::string word_for(fuzz::Choices& c, const std::string& key) {
  static const std::set<std::string> kNodes = {"device",
                                               "node",
                                               "node-name",
                                               "target",
                                               "file",
                                               "overlay",
                                               "top",
                                               "base",
                                               "base-node",
                                               "top-node",
                                               "bottom",
                                               "backing",
                                               "snapshot-node-name",
                                               "filter-node-name",
                                               "replaces",
                                               "location"};
  static const char* kNodeNames[] = {"m0", "m1", "m2", "q0", "n0", "x0", "x1"};
  static const char* kJobs[] = {"j0", "j1"};
  static const char* kBitmaps[] = {"b0", "b1"};
  if (c.pick(4) != 0) {
    if (kNodes.count(key)) return kNodeNames[c.pick(std::size(kNodeNames))];
    if (key == "job-id" || key == "id") return kJobs[c.pick(std::size(kJobs))];
    if (key == "name" || key == "bitmap") return kBitmaps[c.pick(std::size(kBitmaps))];
    if (key == "driver") {
      static const char* kDrivers[] = {"null-co", "raw", "qcow2", "luks", "copy-before-write", "snapshot-access"};
      return kDrivers[c.pick(std::size(kDrivers))];
    }
  }
  return word(c);
}

OJson generic(fuzz::Choices& c, int depth);

OJson generic_object(fuzz::Choices& c, int depth) {
  OJson o = OJson::object();
  // Mostly a node of a driver that stays in memory, as blockdev-add and
  // blockdev-create want.
  if (c.pick(4) != 0) o["driver"] = word_for(c, "driver");
  const size_t n = c.pick(6);
  for (size_t i = 0; i < n; ++i) {
    const std::string& k = keys()[c.pick(keys().size())];
    o[k] = c.flag() ? OJson(word_for(c, k)) : generic(c, depth + 1);
  }
  return o;
}

OJson generic(fuzz::Choices& c, int depth) {
  switch (c.pick(depth > 2 ? 5 : 8)) {
    case 0: return word(c);
    case 1: return edge_int(c);
    case 2: return static_cast<bool>(c.flag());
    case 3: return nullptr;
    case 4: return word(c);
    case 5:
    case 6: return generic_object(c, depth);
    default: {
      OJson a = OJson::array();
      const size_t n = c.pick(4);
      for (size_t i = 0; i < n; ++i) a.push_back(generic(c, depth + 1));
      return a;
    }
  }
}

OJson value_of(fuzz::Choices& c, const qmp::Arg& a, int depth);

OJson object_of(fuzz::Choices& c, const std::vector<qmp::Arg>& members, bool open, int depth) {
  OJson o = OJson::object();
  for (const auto& m : members) {
    // Required members are there most of the time, the others half of it.
    if (c.pick(8) < (m.required ? 7u : 4u)) o[m.name] = value_of(c, m, depth + 1);
  }
  if (open) {
    const size_t n = c.pick(5);
    for (size_t i = 0; i < n; ++i) {
      const std::string& k = keys()[c.pick(keys().size())];
      o[k] = c.flag() ? OJson(word_for(c, k)) : generic(c, depth + 1);
    }
  }
  // Now and then a member nobody declared.
  if (c.pick(16) == 0) o["x-" + word(c)] = generic(c, depth + 1);
  return o;
}

// A transaction action: a type the transaction knows, with data shaped
// like that command's arguments where the registry has it.
OJson action(fuzz::Choices& c, const qmp::Registry& r, int depth) {
  static const char* kTypes[] = {"abort",
                                 "block-dirty-bitmap-add",
                                 "block-dirty-bitmap-remove",
                                 "block-dirty-bitmap-clear",
                                 "block-dirty-bitmap-enable",
                                 "block-dirty-bitmap-disable",
                                 "block-dirty-bitmap-merge",
                                 "blockdev-backup",
                                 "blockdev-snapshot",
                                 "blockdev-snapshot-internal-sync"};
  const std::string type = kTypes[c.pick(std::size(kTypes))];
  OJson a = {{"type", type}};
  if (const qmp::Command* cmd = r.find(type)) {
    a["data"] = object_of(c, cmd->args.members, cmd->args.open, depth + 1);
  } else {
    a["data"] = generic_object(c, depth + 1);
  }
  return a;
}

const qmp::Registry* g_registry = nullptr;

OJson value_of(fuzz::Choices& c, const qmp::Arg& a, int depth) {
  using qmp::ArgType;
  // One value in eight is of any type at all.
  if (c.pick(8) == 0 || depth > 4) return generic(c, depth);
  switch (a.type) {
    case ArgType::Str: return word_for(c, a.name);
    case ArgType::Enum:
      if (!a.values.empty() && c.pick(8) != 0) return a.values[c.pick(a.values.size())];
      return word(c);
    case ArgType::Bool: return static_cast<bool>(c.flag());
    case ArgType::Int:
    case ArgType::UInt32:
    case ArgType::UInt64: return edge_int(c);
    case ArgType::Number: return c.flag() ? OJson(edge_int(c)) : OJson(static_cast<double>(edge_int(c)) / 3);
    case ArgType::Struct: return object_of(c, a.members, a.open, depth);
    case ArgType::Object: return generic_object(c, depth);
    case ArgType::List: {
      OJson l = OJson::array();
      const size_t n = c.pick(4);
      for (size_t i = 0; i < n; ++i) {
        if (a.name == "actions" && g_registry) {
          l.push_back(action(c, *g_registry, depth));
        } else if (a.name == "bitmaps" && c.flag()) {
          l.push_back(c.flag() ? OJson(word_for(c, "name"))
                               : OJson({{"node", word_for(c, "node")}, {"name", word_for(c, "name")}}));
        } else {
          l.push_back(generic(c, depth + 1));
        }
      }
      return l;
    }
    case ArgType::Any: return generic(c, depth);
  }
  return nullptr;
}

std::string typed_stream(fuzz::Choices& c, const qmp::Registry& r, bool negotiate, bool ids) {
  std::string out;
  if (negotiate) out += "{\"execute\": \"qmp_capabilities\"}\r\n";
  // The denied commands are not generated (they would only make the
  // whole input unrunnable); safe_message() still checks everything.
  std::vector<std::string> names;
  for (const auto& n : r.names())
    if (!denied_strings().count(n)) names.push_back(n);
  for (int i = 0; i < 8 && !c.empty(); ++i) {
    const size_t k = c.pick(names.size() + 4);
    if (k == names.size()) {  // raw bytes spliced in
      out += c.bytes(64);
      continue;
    }
    OJson m = OJson::object();
    if (ids && c.flag()) m["id"] = edge_int(c);
    const std::string name = k < names.size() ? names[k] : k == names.size() + 1 ? "qmp_capabilities" : word(c);
    m["execute"] = name;
    if (const qmp::Command* cmd = r.find(name)) {
      OJson args = object_of(c, cmd->args.members, cmd->args.open, 0);
      if (!args.empty() || c.flag()) m["arguments"] = std::move(args);
    } else if (c.flag()) {
      m["arguments"] = generic_object(c, 1);
    }
    out += qmp::to_qmp_text(m) + "\r\n";
  }
  return out;
}

// ---- the daemon

// A 64 KiB qcow2 image of 4 KiB clusters (16 L2 entries' worth of
// tables: small, and every table in a cluster of its own), made once.
const std::vector<uint8_t>& qcow2_image() {
  static const std::vector<uint8_t> img = [] {
    MemNode::Options o;
    o.max_size = kMaxNodeSize;
    auto m = std::make_shared<MemNode>(loop(), o);
    qcow2::Qcow2Node::CreateOptions co;
    co.size = kNodeSize;
    co.cluster_size = 4096;
    (void)loop().run(qcow2::Qcow2Node::create(loop(), m, co));
    (void)loop().run(m->flush());
    return m->data();
  }();
  return img;
}

std::shared_ptr<MemNode> mem_node(const std::string& name, std::vector<uint8_t> contents) {
  MemNode::Options o;
  o.size = contents.size();
  o.max_size = kMaxNodeSize;
  auto m = std::make_shared<MemNode>(loop(), std::move(contents), o);
  m->set_node_name(name);
  return m;
}

void add_nodes(qmp::Daemon& d) {
  for (const char* name : {"m0", "m1"}) {
    auto m = mem_node(name, std::vector<uint8_t>(kNodeSize));
    if (d.graph.add(m)) {
      d.note_new_nodes(m);
      d.monitor_owned.insert(name);
    }
  }
  auto m2 = mem_node("m2", qcow2_image());
  if (d.graph.add(m2)) {
    d.note_new_nodes(m2);
    d.monitor_owned.insert("m2");
  }
  (void)d.blockdev_add({{"driver", "qcow2"}, {"node-name", "q0"}, {"file", "m2"}});
  (void)d.blockdev_add({{"driver", "null-co"}, {"node-name", "n0"}, {"size", kNodeSize}, {"read-zeroes", true}});
}

Task<void> run_monitor(std::span<const uint8_t> stream) {
  qmp::Daemon d(loop());
  qmp::register_all_commands(d);
  add_nodes(d);
  // A socketpair, not a listening socket: no file, bind or accept per input.
  Fd mine, theirs;
  if (fuzz::loop_socketpair(loop(), mine, theirs)) {
    d.monitors.add_client(std::move(mine));
    fuzz::Peer peer(loop(), std::move(theirs), stream);
    co_await peer.done();
  }
  co_await d.shutdown();
}

// ---- the streamer alone

void streamer(std::string_view text, size_t piece) {
  qmp::JsonStreamer s;
  std::vector<qmp::JsonMessage> out;
  for (size_t pos = 0; pos < text.size(); pos += piece) s.feed(text.substr(pos, piece), out);
  s.finish(out);
  for (const auto& m : out) {
    if (!m.ok) continue;
    (void)qmp::to_qmp_text(m.value);
    if (m.value.is_object()) (void)qmp::qdict_key_order(m.value);
  }
}

// Every message the monitor will see, checked; the ids of objects added
// collected so that they can be removed from the process-wide store.
bool checked(std::string_view text, std::vector<std::string>& object_ids) {
  qmp::JsonStreamer s;
  std::vector<qmp::JsonMessage> out;
  s.feed(text, out);
  s.finish(out);
  for (const auto& m : out) {
    if (!m.ok) continue;
    if (!safe_message(m.value)) return false;
    if (m.value.is_object() && m.value.contains("arguments") && m.value["arguments"].is_object()) {
      const OJson& a = m.value["arguments"];
      if (a.contains("id") && a["id"].is_string()) object_ids.push_back(a["id"].get<std::string>());
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::span<const uint8_t> rest(data + 1, size - 1);
  if ((data[0] & 1) == 0) {
    std::string_view text(reinterpret_cast<const char*>(rest.data()), rest.size());
    streamer(text, 1 + (data[0] >> 1) % 64);
    (void)qmp::parse_json_value(text);
    return 0;
  }
  (void)qcow2_image();
  std::string text;
  {
    // The registry's names and schemas, from a daemon of its own.
    static qmp::Daemon* schema = [] {
      auto* d = new qmp::Daemon(loop());
      qmp::register_all_commands(*d);
      return d;
    }();
    g_registry = &schema->registry;
    fuzz::Choices c(rest);
    text = typed_stream(c, schema->registry, !(data[0] & 2), data[0] & 4);
  }
  // VBLK_FUZZ_QMP_PRINT=1: show what an input decodes to.
  static const bool print = std::getenv("VBLK_FUZZ_QMP_PRINT");
  if (print) std::fprintf(stderr, "%s", text.c_str());
  std::vector<std::string> object_ids;
  if (!checked(text, object_ids)) {
    streamer(text, 4096);
    return 0;
  }
  loop().run(run_monitor(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size())));
  for (const auto& id : object_ids) (void)SecretStore::process().remove(id);
  return 0;
}
