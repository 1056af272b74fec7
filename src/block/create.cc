// Image creation through the registry (vblk/create.h): which options a
// format on a protocol takes, and who creates what.
#include "vblk/create.h"

#include <cerrno>
#include <cstdlib>

#include "vblk/open.h"

namespace vblk {

namespace {

// The driver `fmt` names, or qemu-img create's error.
Result<const DriverInfo*> creating_driver(const std::string& fmt) {
  const DriverInfo* d = find_driver(fmt);
  if (!d) return Error(EINVAL, "Unknown file format '" + fmt + "'");
  if (!d->create)
    return Error(ENOTSUP, std::string(d->is_protocol() ? "Protocol" : "Format") + " driver '" + fmt +
                              "' does not support image creation");
  return d;
}

// Formats other than raw go on files only: vblk formats no image inside
// an rbd image or an NBD export.
Status check_format_on(const DriverInfo& d, const DriverInfo& proto) {
  if (!d.is_protocol() && proto.name != std::string("file") && d.name != std::string("raw"))
    return Error(ENOTSUP, std::string("vblk creates only raw images on ") + proto.name);
  return {};
}

}  // namespace

Result<std::vector<CreateOpt>> create_options(const std::string& fmt, const std::string& filename) {
  auto d = creating_driver(fmt);
  VBLK_TRY(d);
  std::vector<CreateOpt> opts((*d)->create_opts.begin(), (*d)->create_opts.end());
  if (filename.empty() || (*d)->is_protocol()) return opts;
  const DriverInfo& proto = protocol_for_filename(filename);
  VBLK_TRY(check_format_on(**d, proto));
  // QEMU's bdrv_img_create appends the protocol's create_opts to the format's.
  for (const CreateOpt& o : proto.create_opts) {
    bool have = false;
    for (const CreateOpt& mine : opts) have |= std::string(mine.name) == o.name;
    if (!have) opts.push_back(o);
  }
  return opts;
}

Status check_create_value(const CreateOpt& opt, const std::string& value) {
  if (opt.kind == CreateOptKind::Bool && value != "on" && value != "off")
    return Error(EINVAL, std::string("Parameter '") + opt.name + "' expects 'on' or 'off'");
  if (opt.kind == CreateOptKind::Number) {
    // qemu_strtou64: a sign is taken (and wraps), nothing may follow.
    errno = 0;
    char* end = nullptr;
    (void)std::strtoull(value.c_str(), &end, 0);
    if (value.empty() || *end || end == value.c_str())
      return Error(EINVAL, std::string("Parameter '") + opt.name + "' expects a number");
    if (errno == ERANGE) return Error(ERANGE, "Value '" + value + "' is too large for parameter '" + opt.name + "'");
  }
  return {};
}

Status fill_create_sizes(std::span<const CreateOpt> opts, CreateRequest& req) {
  for (const CreateOpt& o : opts) {
    if (o.kind != CreateOptKind::Size || o.name == std::string("size")) continue;
    std::string v = req.get_or(o.name, o.def ? o.def : "");
    if (v.empty()) continue;
    auto n = parse_size(v);
    if (!n) return Error(EINVAL, std::string("Parameter '") + o.name + "' expects a non-negative number below 2^64");
    req.sizes[o.name] = *n;
  }
  return {};
}

Task<Status> create_image(Loop& loop, const std::string& fmt, const CreateRequest& req) {
  auto d = creating_driver(fmt);
  if (!d) co_return d.take_error();
  const DriverInfo& proto = protocol_for_filename(req.filename);
  VBLK_CO_TRY(check_format_on(**d, proto));
  // A protocol named as the format (-f rbd) must be the one the name is for.
  if ((*d)->is_protocol() && &proto != *d && !(*d)->prefixes.empty())
    co_return Error(EINVAL, std::string("File name must start with '") + (*d)->prefixes[0] + "'");
  co_return co_await (*d)->create(loop, req);
}

Task<Status> create_protocol_file(Loop& loop, const std::string& filename) {
  const DriverInfo& proto = protocol_for_filename(filename);
  if (proto.name != std::string("file"))
    co_return Error(ENOTSUP, std::string("vblk creates only raw images on ") + proto.name);
  CreateRequest empty;
  empty.filename = filename;
  co_return co_await proto.create(loop, empty);
}

Status delete_image(const std::string& filename) {
  const DriverInfo& proto = protocol_for_filename(filename);
  if (!proto.remove) return Error(ENOTSUP, std::string("Protocol driver '") + proto.name + "' cannot remove images");
  return proto.remove(filename);
}

}  // namespace vblk
