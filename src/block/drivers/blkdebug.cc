// The `blkdebug` filter driver: passes requests to its `image` child and
// fails those that match an `inject-error` rule, as QEMU's blkdebug does,
// so that error paths (job error policies, NBD error replies) can be
// tested against real peers.
//
// QEMU fires rules on "debug events" that format drivers emit (raw emits
// read_aio/write_aio for every guest request; qcow2 emits them only for
// data, not metadata). vblk's formats emit no events, so a request that
// reaches this node counts as the event of its kind: read -> read_aio,
// write and write_zeroes -> write_aio, flush -> flush_to_disk. A rule
// matches when its event fits, the state machine is in the rule's `state`
// (any, if none), and `sector` (512-byte units, -1 = any) lies in the
// request; a flush only matches sector -1. `once` rules are removed after
// they fire. `set-state` rules move the state machine on an event.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "vblk/filter_node.h"
#include "vblk/open.h"

namespace vblk {
namespace {

// QEMU 7.2's BlkdebugEvent names (the ones vblk can fire are marked in the
// comment at the top; the others are accepted and never fire).
const char* const kEvents[] = {"l1_update",
                               "l1_grow_alloc_table",
                               "l1_grow_write_table",
                               "l1_grow_activate_table",
                               "l2_load",
                               "l2_update",
                               "l2_update_compressed",
                               "l2_alloc_cow_read",
                               "l2_alloc_write",
                               "read_aio",
                               "read_backing_aio",
                               "read_compressed",
                               "write_aio",
                               "write_compressed",
                               "vmstate_load",
                               "vmstate_save",
                               "cow_read",
                               "cow_write",
                               "reftable_load",
                               "reftable_grow",
                               "reftable_update",
                               "refblock_load",
                               "refblock_update",
                               "refblock_update_part",
                               "refblock_alloc",
                               "refblock_alloc_hookup",
                               "refblock_alloc_write",
                               "refblock_alloc_write_blocks",
                               "refblock_alloc_write_table",
                               "refblock_alloc_switch_table",
                               "cluster_alloc",
                               "cluster_alloc_bytes",
                               "cluster_free",
                               "flush_to_os",
                               "flush_to_disk",
                               "pwritev_rmw_head",
                               "pwritev_rmw_after_head",
                               "pwritev_rmw_tail",
                               "pwritev_rmw_after_tail",
                               "pwritev",
                               "pwritev_zero",
                               "pwritev_done",
                               "empty_image_prepare",
                               "l1_shrink_write_table",
                               "l1_shrink_free_l2_clusters",
                               "cor_write",
                               "cluster_alloc_space",
                               "none"};

enum class Io { Read, Write, WriteZeroes, Discard, Flush };

struct Rule {
  std::string event;
  int err = EIO;
  int64_t sector = -1;
  bool once = false;
  int64_t state = 0;      // 0: any state
  int64_t new_state = 0;  // set-state rules
  uint32_t iotypes = ~0u;
};

class BlkdebugNode final : public FilterNode {
 public:
  BlkdebugNode(Loop& loop, std::shared_ptr<Node> image, uint32_t align, std::vector<Rule> inject,
               std::vector<Rule> set_state)
      : FilterNode(loop, "blkdebug", std::move(image)), inject_(std::move(inject)), set_state_(std::move(set_state)) {
    if (align) limits_.request_alignment = std::max(limits_.request_alignment, align);
  }

  // QEMU's name for it; and like QEMU's blkdebug it does not know the
  // allocated size of what it filters.
  std::string filename() const override { return "blkdebug::" + filtered().filename(); }
  Result<uint64_t> allocated_size() const override { return Error(ENOTSUP); }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override {
    VBLK_CO_TRY(fire("read_aio", Io::Read, offset, buf.size()));
    co_return co_await FilterNode::do_read(offset, buf, flags);
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    VBLK_CO_TRY(fire("write_aio", Io::Write, offset, buf.size()));
    co_return co_await FilterNode::do_write(offset, buf, flags);
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    VBLK_CO_TRY(fire("write_aio", Io::WriteZeroes, offset, bytes));
    co_return co_await FilterNode::do_write_zeroes(offset, bytes, flags);
  }
  Task<Status> do_flush() override {
    VBLK_CO_TRY(fire("flush_to_disk", Io::Flush, 0, 0));
    co_return co_await FilterNode::do_flush();
  }

 private:
  // The event happens: state transitions first take effect after the
  // event's rules were checked against the old state (QEMU's new_state).
  Status fire(const std::string& event, Io io, uint64_t offset, uint64_t bytes) {
    int64_t next = state_;
    for (const auto& r : set_state_)
      if (r.event == event && (r.state == 0 || r.state == state_)) next = r.new_state;
    Status result;
    for (auto it = inject_.begin(); it != inject_.end(); ++it) {
      const Rule& r = *it;
      if (r.event != event || (r.state != 0 && r.state != state_)) continue;
      if (!(r.iotypes & (1u << static_cast<unsigned>(io)))) continue;
      if (r.sector != -1) {
        uint64_t at = static_cast<uint64_t>(r.sector) * 512;
        if (bytes == 0 || at < offset || at >= offset + bytes) continue;
      }
      result = Error(r.err);
      if (r.once) inject_.erase(it);
      break;
    }
    state_ = next;
    return result;
  }

  std::vector<Rule> inject_;
  std::vector<Rule> set_state_;
  int64_t state_ = 1;
};

// Options from QMP are typed; from the command line (keyval) they are
// strings, and lists arrive as {"0": {...}, "1": {...}}.
Result<std::vector<Json>> take_list(Json& opts, const std::string& key) {
  std::vector<Json> out;
  auto it = opts.find(key);
  if (it == opts.end()) return out;
  Json v = *it;
  opts.erase(it);
  if (v.is_array()) {
    for (auto& e : v) out.push_back(e);
  } else if (v.is_object()) {
    for (size_t i = 0; v.contains(std::to_string(i)); ++i) out.push_back(v[std::to_string(i)]);
    if (out.size() != v.size()) return Error(EINVAL, "Parameter '" + key + "' expects a list");
  } else {
    return Error(EINVAL, "Invalid parameter type for '" + key + "', expected: array");
  }
  return out;
}

Result<int64_t> take_int(Json& o, const std::string& key, int64_t dflt, const std::string& path) {
  auto it = o.find(key);
  if (it == o.end()) return dflt;
  Json v = *it;
  o.erase(it);
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    char* end = nullptr;
    errno = 0;
    long long n = std::strtoll(s.c_str(), &end, 0);
    if (!s.empty() && !*end && errno == 0) return static_cast<int64_t>(n);
  }
  return Error(EINVAL, "Invalid parameter type for '" + path + "', expected: integer");
}

Result<Rule> parse_rule(Json e, const std::string& path, bool set_state) {
  if (!e.is_object()) return Error(EINVAL, "Invalid parameter type for '" + path + "', expected: object");
  Rule r;
  auto ev = take_string(e, "event");
  VBLK_TRY(ev);
  if (!*ev) return Error(EINVAL, "Parameter '" + path + ".event' is missing");
  if (std::none_of(std::begin(kEvents), std::end(kEvents), [&](const char* n) { return **ev == n; }))
    return Error(EINVAL, "Parameter 'event' does not accept value '" + **ev + "'");
  r.event = **ev;
  auto state = take_int(e, "state", 0, path + ".state");
  VBLK_TRY(state);
  r.state = *state;
  if (set_state) {
    auto ns = take_int(e, "new_state", -1, path + ".new_state");
    VBLK_TRY(ns);
    if (*ns < 0) return Error(EINVAL, "Parameter '" + path + ".new_state' is missing");
    r.new_state = *ns;
  } else {
    auto err = take_int(e, "errno", EIO, path + ".errno");
    VBLK_TRY(err);
    r.err = static_cast<int>(*err);
    auto sector = take_int(e, "sector", -1, path + ".sector");
    VBLK_TRY(sector);
    r.sector = *sector;
    auto once = take_bool(e, "once");
    VBLK_TRY(once);
    r.once = once->value_or(false);
    auto imm = take_bool(e, "immediately");
    VBLK_TRY(imm);
    if (e.contains("iotype")) {
      auto types = take_list(e, "iotype");
      VBLK_TRY(types);
      static const char* const kIo[] = {"read", "write", "write-zeroes", "discard", "flush"};
      r.iotypes = 0;
      for (auto& t : *types) {
        std::string s = t.is_string() ? t.get<std::string>() : "";
        auto f = std::find_if(std::begin(kIo), std::end(kIo), [&](const char* n) { return s == n; });
        if (f == std::end(kIo)) {
          if (s == "block-status") continue;
          return Error(EINVAL, "Parameter 'iotype' does not accept value '" + s + "'");
        }
        r.iotypes |= 1u << (f - std::begin(kIo));
      }
    }
  }
  if (!e.empty()) return Error(EINVAL, "Parameter '" + path + "." + e.begin().key() + "' is unexpected");
  if (r.err <= 0) return Error(EINVAL, "Parameter '" + path + ".errno' must be positive");
  return r;
}

// A blkdebug config file (the legacy blkdebug:CONFIG:IMAGE name, or the
// config option) in QEMU's qemu_config_parse format: "[inject-error]" or
// "[set-state]" groups of `key = "value"` lines, '#' comments, read with
// the same scanf patterns and refused with the same words. Each group
// becomes a rule object with string values, as keyval options are.
Status read_config(const std::string& path, std::vector<Json>& inject, std::vector<Json>& set_state) {
  std::ifstream f(path);
  if (!f) return Error(errno, std::string("Could not read blkdebug config file: ") + std::strerror(errno));
  static const std::vector<std::string> kInjectKeys = {"event", "state",       "errno", "sector",
                                                       "once",  "immediately", "iotype"};
  static const std::vector<std::string> kSetStateKeys = {"event", "state", "new_state"};
  std::vector<Json>* group = nullptr;
  const std::vector<std::string>* keys = nullptr;
  std::string line;
  while (std::getline(f, line)) {
    char name[64], arg[64], value[1024];
    const auto first = line.find_first_not_of(" \t\r\n");
    if (first == std::string::npos || line[first] == '#') continue;
    if (std::sscanf(line.c_str(), "[%63s \"%63[^\"]\"]", name, value) == 2)
      return Error(EINVAL, std::string("There is no option group '") + name + "'");
    if (std::sscanf(line.c_str(), "[%63[^]]]", name) == 1) {
      if (!std::strcmp(name, "inject-error")) {
        group = &inject;
        keys = &kInjectKeys;
      } else if (!std::strcmp(name, "set-state")) {
        group = &set_state;
        keys = &kSetStateKeys;
      } else {
        return Error(EINVAL, std::string("There is no option group '") + name + "'");
      }
      group->push_back(Json::object());
      continue;
    }
    value[0] = 0;
    if (std::sscanf(line.c_str(), " %63s = \"%1023[^\"]\"", arg, value) == 2 ||
        std::sscanf(line.c_str(), " %63s = \"\"", arg) == 1) {
      if (!group) return Error(EINVAL, "no group defined");
      if (std::find(keys->begin(), keys->end(), arg) == keys->end())
        return Error(EINVAL, std::string("Invalid parameter '") + arg + "'");
      if (!std::strcmp(arg, "iotype"))
        group->back()[arg] = Json::array({value});
      else
        group->back()[arg] = value;
      continue;
    }
    return Error(EINVAL, "parse error");
  }
  return {};
}

// blkdebug:[CONFIG]:IMAGE (QEMU's blkdebug_parse_filename): the config file
// and the image's file name, which is opened by its own protocol.
Status parse_blkdebug_filename(const std::string& filename, Json& opts) {
  const std::string rest = filename.substr(std::strlen("blkdebug:"));
  const auto colon = rest.find(':');
  if (colon == std::string::npos) return Error(EINVAL, "blkdebug requires both config file and image path");
  if (colon) opts["config"] = rest.substr(0, colon);
  opts["x-image"] = rest.substr(colon + 1);
  return {};
}

const char* const kBlkdebugPrefixes[] = {"blkdebug:"};

}  // namespace

namespace drivers {

Result<std::shared_ptr<Node>> open_blkdebug(OpenContext& ctx, Json& opts) {
  auto align = take_size(opts, "align");
  VBLK_TRY(align);
  if (*align && (**align == 0 || (**align & (**align - 1)) || **align > INT32_MAX))
    return Error(EINVAL, "Cannot meet constraints with align " + std::to_string(**align));
  auto cfg = take_string(opts, "config");
  VBLK_TRY(cfg);
  // The config file's rules come first, then the options' (QEMU's read_config).
  std::vector<Json> inject_specs, set_state_specs;
  if (*cfg) VBLK_TRY(read_config(**cfg, inject_specs, set_state_specs));
  auto ie = take_list(opts, "inject-error");
  VBLK_TRY(ie);
  inject_specs.insert(inject_specs.end(), ie->begin(), ie->end());
  auto ss = take_list(opts, "set-state");
  VBLK_TRY(ss);
  set_state_specs.insert(set_state_specs.end(), ss->begin(), ss->end());
  std::vector<Rule> inject, set_state;
  for (size_t i = 0; i < inject_specs.size(); ++i) {
    auto r = parse_rule(inject_specs[i], "inject-error[" + std::to_string(i) + "]", false);
    VBLK_TRY(r);
    inject.push_back(*r);
  }
  for (size_t i = 0; i < set_state_specs.size(); ++i) {
    auto r = parse_rule(set_state_specs[i], "set-state[" + std::to_string(i) + "]", true);
    VBLK_TRY(r);
    set_state.push_back(*r);
  }
  // x-image: the image named by a blkdebug:CONFIG:IMAGE file name.
  auto x_image = take_string(opts, "x-image");
  VBLK_TRY(x_image);
  if (*x_image && !opts.contains("image")) {
    const DriverInfo& proto = protocol_for_filename(**x_image);
    Json child = {{"driver", proto.name}};
    if (proto.parse_filename)
      VBLK_TRY(proto.parse_filename(**x_image, child));
    else
      child["filename"] = **x_image;
    opts["image"] = std::move(child);
  }
  auto ro = take_bool(opts, "read-only");
  VBLK_TRY(ro);
  OpenContext child_ctx = ctx;
  child_ctx.read_only = ro->value_or(ctx.read_only);
  auto image = open_child(child_ctx, opts, "image", true);
  VBLK_TRY(image);
  auto node = std::make_shared<BlkdebugNode>(ctx.loop, *image, static_cast<uint32_t>(align->value_or(0)),
                                             std::move(inject), std::move(set_state));
  node->set_read_only(child_ctx.read_only || (*image)->read_only());
  return std::shared_ptr<Node>(node);
}

// A protocol in QEMU's sense (it has a protocol name, "blkdebug:"), though it
// passes I/O to its image: errors and query-named-block-nodes treat it so.
extern const DriverInfo blkdebug_driver = {.name = "blkdebug",
                                           .kind = DriverKind::Protocol,
                                           .open = open_blkdebug,
                                           .prefixes = kBlkdebugPrefixes,
                                           .parse_filename = parse_blkdebug_filename};

}  // namespace drivers
}  // namespace vblk
