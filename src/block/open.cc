#include "vblk/open.h"

#include <sys/stat.h>

#include <cstring>

#include "vblk/buffer.h"
#include "vblk/graph.h"
#include "vblk/trace.h"

namespace vblk {

namespace drivers {
#define VBLK_DRIVER(id) extern const DriverInfo id##_driver;
#include "drivers/list.h"
#undef VBLK_DRIVER
}  // namespace drivers

namespace {

// The registry: the block layer's own drivers in a fixed order (the probe
// order, drivers/list.h), then what higher layers add through
// register_driver (no self-registering objects: static libraries drop those
// nobody references). Filled on first use, on the loop thread.
std::vector<DriverInfo>& registry() {
  static std::vector<DriverInfo> r = {
#define VBLK_DRIVER(id) drivers::id##_driver,
#include "drivers/list.h"
#undef VBLK_DRIVER
  };
  return r;
}

std::string leftover_error(const DriverInfo& d, const std::string& key) {
  if (d.is_protocol()) return "Block protocol '" + std::string(d.name) + "' doesn't support the option '" + key + "'";
  return "Block format '" + std::string(d.name) + "' does not support the option '" + key + "'";
}

// First leaf key in nested options, dotted ("cache.foo").
std::string first_key(const Json& j) {
  auto it = j.begin();
  if (it->is_object() && !it->empty()) return it.key() + "." + first_key(*it);
  return it.key();
}

}  // namespace

const DriverInfo* find_driver(const std::string& name) {
  for (const auto& d : registry())
    if (name == d.name) return &d;
  return nullptr;
}

const std::vector<DriverInfo>& registered_drivers() { return registry(); }

void register_driver(const DriverInfo& d) {
  if (!find_driver(d.name)) registry().push_back(d);
}

const DriverInfo& protocol_for_filename(const std::string& filename) {
  for (const auto& d : registry())
    for (const char* p : d.prefixes)
      if (filename.rfind(p, 0) == 0) return d;
  return *find_driver("file");
}

Status check_write_without_resize(const Node& file) {
  if (!file.read_only() && file.exact_length() % file.limits().request_alignment)
    return Error(EINVAL,
                 "Cannot get 'write' permission without 'resize': Image size is not a multiple of request alignment");
  return {};
}

Result<std::shared_ptr<Node>> open_node(OpenContext& ctx, Json opts) {
  if (!opts.is_object()) return Error(EINVAL, "Invalid parameter type, expected: object");
  auto driver = take_string(opts, "driver");
  VBLK_TRY(driver);
  if (!*driver) return Error(EINVAL, "Parameter 'driver' is missing");
  const DriverInfo* d = find_driver(**driver);
  if (!d) return Error(EINVAL, "Unknown driver '" + **driver + "'");
  auto name = take_string(opts, "node-name");
  VBLK_TRY(name);
  // Generic options every node takes; cache.* is inherited by children.
  OpenContext nctx = ctx;
  if (auto cache = take_dict(opts, "cache")) {
    auto direct = take_bool(*cache, "direct");
    VBLK_TRY(direct);
    auto no_flush = take_bool(*cache, "no-flush");
    VBLK_TRY(no_flush);
    if (!cache->empty()) return Error(EINVAL, leftover_error(*d, "cache." + first_key(*cache)));
    nctx.cache_direct = direct->value_or(ctx.cache_direct);
    nctx.cache_no_flush = no_flush->value_or(ctx.cache_no_flush);
  }
  nctx.discard_unmap = false;
  auto discard = take_string(opts, "discard");
  VBLK_TRY(discard);
  if (*discard) nctx.discard_unmap = **discard == "unmap" || **discard == "on";
  // detect-zeroes is the node's own (not inherited), checked as QEMU's
  // bdrv_parse_detect_zeroes does.
  auto dz_s = take_string(opts, "detect-zeroes");
  VBLK_TRY(dz_s);
  DetectZeroes dz = DetectZeroes::Off;
  if (*dz_s) {
    if (**dz_s == "on") {
      dz = DetectZeroes::On;
    } else if (**dz_s == "unmap") {
      dz = DetectZeroes::Unmap;
    } else if (**dz_s != "off") {
      return Error(EINVAL, "Parameter 'detect-zeroes' does not accept value '" + **dz_s + "'");
    }
  }
  if (dz == DetectZeroes::Unmap && !nctx.discard_unmap)
    return Error(EINVAL, "setting detect-zeroes to unmap is not allowed without setting discard operation to unmap");
  auto auto_ro = take_bool(opts, "auto-read-only");
  VBLK_TRY(auto_ro);
  auto force_share = take_bool(opts, "force-share");
  VBLK_TRY(force_share);
  nctx.force_share = force_share->value_or(ctx.force_share);
  nctx.node_name = name->value_or("");
  auto node = d->open(nctx, opts);
  VBLK_TRY(node);
  if (!opts.empty()) return Error(EINVAL, leftover_error(*d, first_key(opts)));
  (*node)->set_detect_zeroes(dz);
  if (nctx.force_share) {
    if (!(*node)->read_only()) return Error(EINVAL, "force-share=on can only be used with read-only images");
    (*node)->set_force_share(true);
  }
  // The node's locks as its children and (for a file) its own users need
  // them now; parents and exports added later refresh them again.
  if (*name) (*node)->set_node_name(**name);
  VBLK_TRY((*node)->refresh_perms());
  if (ctx.graph) VBLK_TRY(ctx.graph->add(*node));
  VBLK_TRACE(kBlock, "open node '{}' driver {} length {}{}", (*node)->node_name(), (*node)->driver(), (*node)->length(),
             (*node)->read_only() ? " read-only" : "");
  return node;
}

Result<std::shared_ptr<Node>> open_child(OpenContext& ctx, Json& parent_opts, const std::string& role, bool required) {
  auto it = parent_opts.find(role);
  if (it == parent_opts.end()) {
    if (required) return Error(EINVAL, "A block device must be specified for \"" + role + "\"");
    return std::shared_ptr<Node>();
  }
  Json spec = *it;
  parent_opts.erase(it);
  if (spec.is_string()) {
    std::string ref = spec.get<std::string>();
    if (ctx.graph) {
      if (auto n = ctx.graph->find(ref)) return n;
    }
    return Error(ENOENT, "Cannot find device='" + ref + "' nor node-name='" + ref + "'");
  }
  if (!spec.is_object()) return Error(EINVAL, "Invalid parameter type for '" + role + "', expected: object");
  // A child with a file name and no driver is a file (QEMU's protocol
  // probing: --image-opts driver=qcow2,file.filename=x).
  if (!spec.contains("driver") && spec.contains("filename")) spec["driver"] = "file";
  return open_node(ctx, std::move(spec));
}

std::string child_filename_json(const Node& child) {
  std::string f = child.filename();
  if (f.rfind("json:", 0) == 0) return f.substr(5);
  return "{\"driver\": " + nlohmann::json(child.driver()).dump() + ", \"filename\": " + nlohmann::json(f).dump() + "}";
}

std::string path_combine(const std::string& base, const std::string& name) {
  if (name.empty() || name[0] == '/' || name.find("://") != std::string::npos || name.rfind("json:", 0) == 0)
    return name;
  size_t slash = base.rfind('/');
  if (slash == std::string::npos) return name;
  return base.substr(0, slash + 1) + name;
}

Task<Result<std::string>> probe_format(Node& file) {
  AlignedBuffer head(std::min<uint64_t>(2048, std::max<uint64_t>(file.length(), 512)), 4096);
  head.zero();
  if (file.length() > 0) {
    uint64_t n = std::min<uint64_t>(head.size(), file.length());
    auto st = co_await file.read(0, head.span().subspan(0, n));
    if (!st) co_return st.take_error();
  }
  const DriverInfo* best = nullptr;
  int best_score = 0;
  for (const auto& d : registry()) {
    if (!d.probe) continue;
    int s = d.probe(head.span());
    if (s > best_score) {
      best_score = s;
      best = &d;
    }
  }
  co_return std::string(best ? best->name : "raw");
}

Result<std::shared_ptr<Node>> open_image(OpenContext& ctx, const std::string& filename, const ImageOpenOptions& o,
                                         bool* probed_raw) {
  if (probed_raw) *probed_raw = false;
  Json file = Json::object();
  // A plain name picks the protocol driver by what it is, as qemu-img does.
  struct stat st;
  bool is_dev = ::stat(filename.c_str(), &st) == 0 && (S_ISBLK(st.st_mode) || S_ISCHR(st.st_mode));
  file["driver"] = is_dev ? "host_device" : "file";
  // NBD URIs and rbd: names say their protocol (qemu-img's protocol prefixes).
  const DriverInfo& proto = protocol_for_filename(filename);
  if (proto.name != std::string("file")) file["driver"] = proto.name;
  if (proto.parse_filename)
    VBLK_TRY(proto.parse_filename(filename, file));
  else
    file["filename"] = filename;
  if (o.direct) file["cache"]["direct"] = true;
  if (o.no_flush) file["cache"]["no-flush"] = true;
  if (!o.aio.empty() && file["driver"] != "nbd" && file["driver"] != "rbd") file["aio"] = o.aio;
  OpenContext fctx = ctx;
  fctx.read_only = o.read_only;
  fctx.no_io = fctx.no_io || o.no_io;
  std::string format = o.format;
  if (format == "file" || format == "host_device") {
    file["driver"] = format;
    auto n = open_node(fctx, file);
    VBLK_TRY(n);
    VBLK_TRY(check_write_without_resize(**n));
    (*n)->set_no_flush(o.no_flush);
    (*n)->set_writethrough(o.writethrough);
    return n;
  }
  if (!format.empty() && !find_driver(format)) return Error(EINVAL, "Unknown driver '" + format + "'");
  auto fnode = open_node(fctx, file);
  VBLK_TRY(fnode);
  (*fnode)->set_no_flush(o.no_flush);
  if (format.empty()) {
    auto probed = ctx.loop.run(probe_format(**fnode));
    VBLK_TRY(probed);
    format = *probed;
    if (probed_raw && format == "raw") *probed_raw = true;
  }
  // Hand the open file node to the format through a private graph.
  Graph local;
  VBLK_TRY(local.add(*fnode));
  Json fmt = Json::object();
  fmt["driver"] = format;
  fmt["file"] = (*fnode)->node_name();
  if (o.no_backing && format == "qcow2") fmt["backing"] = nullptr;
  OpenContext gctx = fctx;
  gctx.graph = &local;
  auto top = open_node(gctx, fmt);
  VBLK_TRY(top);
  (*fnode)->set_node_name("");
  (*top)->set_node_name("");
  (*top)->set_writethrough(o.writethrough);
  // No set_no_flush on the format: cache=unsafe is the file's business (the
  // format's metadata must still be written back on flush and close).
  return top;
}

}  // namespace vblk
