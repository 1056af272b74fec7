// blockdev-create (QEMU 7.2's qmp_blockdev_create and BlockdevCreateOptions):
// the options' union is checked here as QEMU's QAPI visitor checks it (the
// schema, like QEMU's qapi/block-core.json, is this layer's), then the
// driver's blockdev_create (the registry, vblk/open.h) checks what QEMU
// checks before the job and hands a "create" job
// (include/job/vblk/create_job.h) what it runs. Errors found while the job
// runs (an unknown node, a bad cluster size) end the job with QEMU's
// message, not the command.
#include "transaction.h"
#include "vblk/buffer.h"
#include "vblk/create.h"
#include "vblk/create_job.h"
#include "vblk/crypto_names.h"
#include "vblk/node_ref.h"
#include "vblk/open.h"
#include "vblk/qmp_daemon.h"

namespace vblk::qmp {

namespace {

// QEMU 7.2's BlockdevDriver enum (qemu-storage-daemon's build).
const std::vector<std::string> kBlockdevDrivers = {"blkdebug",     "blklogwrites", "blkreplay",   "blkverify",
                                                   "bochs",        "cloop",        "compress",    "copy-before-write",
                                                   "copy-on-read", "dmg",          "file",        "snapshot-access",
                                                   "ftp",          "ftps",         "gluster",     "host_cdrom",
                                                   "host_device",  "http",         "https",       "iscsi",
                                                   "luks",         "nbd",          "nfs",         "null-aio",
                                                   "null-co",      "nvme",         "parallels",   "preallocate",
                                                   "qcow",         "qcow2",        "qed",         "quorum",
                                                   "raw",          "rbd",          "replication", "ssh",
                                                   "throttle",     "vdi",          "vhdx",        "vmdk",
                                                   "vpc",          "vvfat"};
// Union branches with create options that vblk has no driver for.
const char* const kForeignCreate[] = {"gluster", "nfs", "parallels", "qcow", "qed",
                                      "ssh",     "vdi", "vhdx",      "vmdk", "vpc"};
const std::vector<std::string> kPrealloc = {"off", "metadata", "falloc", "full"};

const std::vector<Arg> kFileCreate = {{"filename", ArgType::Str, true},
                                      {"size", ArgType::UInt64, true},
                                      {"preallocation", ArgType::Enum, false, kPrealloc},
                                      {"nocow", ArgType::Bool},
                                      {"extent-size-hint", ArgType::UInt64}};

const std::vector<Arg> kQcow2Create = {{"file", ArgType::Any, true},
                                       {"data-file", ArgType::Any},
                                       {"data-file-raw", ArgType::Bool},
                                       {"extended-l2", ArgType::Bool},
                                       {"size", ArgType::UInt64, true},
                                       {"version", ArgType::Enum, false, {"v2", "v3"}},
                                       {"backing-file", ArgType::Str},
                                       {"backing-fmt", ArgType::Enum, false, kBlockdevDrivers},
                                       {"encrypt", ArgType::Object},
                                       {"cluster-size", ArgType::UInt64},
                                       {"preallocation", ArgType::Enum, false, kPrealloc},
                                       {"lazy-refcounts", ArgType::Bool},
                                       {"refcount-bits", ArgType::Int},
                                       {"compression-type", ArgType::Enum, false, {"zlib", "zstd"}}};

// BlockdevCreateOptionsRbd (the location is checked by the driver's parser).
const std::vector<Arg> kRbdCreate = {{"location", ArgType::Object, true},
                                     {"size", ArgType::UInt64, true},
                                     {"cluster-size", ArgType::UInt64},
                                     {"encrypt", ArgType::Object}};

std::vector<std::string> values(std::span<const char* const> v) { return {v.begin(), v.end()}; }

// BlockdevCreateOptionsLUKS: QCryptoBlockCreateOptionsLUKS + file, size,
// preallocation.
const std::vector<Arg> kLuksCreate = {{"key-secret", ArgType::Str},
                                      {"cipher-alg", ArgType::Enum, false, values(crypto_names::kCipherAlgs)},
                                      {"cipher-mode", ArgType::Enum, false, values(crypto_names::kCipherModes)},
                                      {"ivgen-alg", ArgType::Enum, false, values(crypto_names::kIvgenAlgs)},
                                      {"ivgen-hash-alg", ArgType::Enum, false, values(crypto_names::kHashAlgs)},
                                      {"hash-alg", ArgType::Enum, false, values(crypto_names::kHashAlgs)},
                                      {"iter-time", ArgType::Int},
                                      {"file", ArgType::Any, true},
                                      {"size", ArgType::UInt64, true},
                                      {"preallocation", ArgType::Enum, false, kPrealloc}};

// QCryptoBlockCreateOptions (qcow2's `encrypt`): the format, then the
// luks branch's members (QCryptoBlockCreateOptionsLUKS, the first seven of
// kLuksCreate; qcow's only member is key-secret).
std::vector<Arg> encrypt_members(const OJson& enc) {
  std::vector<Arg> m = {{"format", ArgType::Enum, true, {"qcow", "luks"}}};
  if (enc.is_object() && enc.contains("format") && enc["format"] == "luks")
    m.insert(m.end(), kLuksCreate.begin(), kLuksCreate.begin() + 7);
  else
    m.push_back({"key-secret", ArgType::Str});
  return m;
}

// A BlockdevRef (alternate of a node name and inline blockdev options).
std::optional<std::string> check_blockdev_ref(const OJson& v, const std::string& name, const std::string& full) {
  if (v.is_string()) return std::nullopt;
  if (!v.is_object()) return "Invalid parameter type for '" + name + "', expected: BlockdevRef";
  if (!v.contains("driver")) return "Parameter '" + full + ".driver' is missing";
  if (!v["driver"].is_string()) return "Invalid parameter type for '" + full + ".driver', expected: string";
  std::string drv = v["driver"].get<std::string>();
  if (std::find(kBlockdevDrivers.begin(), kBlockdevDrivers.end(), drv) == kBlockdevDrivers.end())
    return "Parameter 'driver' does not accept value '" + drv + "'";
  if ((drv == "file" || drv == "host_device") && !v.contains("filename"))
    return "Parameter '" + full + ".filename' is missing";
  return std::nullopt;
}

// The node a BlockdevRef names or describes (QEMU's bdrv_open_blockdev_ref).
Result<std::shared_ptr<Node>> open_ref(Daemon& d, const Json& ref) {
  if (ref.is_string()) {
    std::string name = ref.get<std::string>();
    if (auto n = d.graph.find(name)) return n;
    return Error(ENODEV, "Cannot find device='" + name + "' nor node-name='" + name + "'");
  }
  OpenContext ctx{.loop = d.loop, .graph = &d.graph, .throttle_groups = &d.throttle_groups};
  return open_node(ctx, ref);
}

// The members of the union branch of `drv` (the base's driver first).
std::vector<Arg> create_members(const std::string& drv) {
  std::vector<Arg> members = {{"driver", ArgType::Str, true}};
  if (drv == "file") members.insert(members.end(), kFileCreate.begin(), kFileCreate.end());
  if (drv == "qcow2") members.insert(members.end(), kQcow2Create.begin(), kQcow2Create.end());
  if (drv == "rbd") members.insert(members.end(), kRbdCreate.begin(), kRbdCreate.end());
  if (drv == "luks") members.insert(members.end(), kLuksCreate.begin(), kLuksCreate.end());
  return members;
}

Task<Reply> blockdev_create(Daemon& d, const OJson& a) {
  const std::string id = a["job-id"].get<std::string>();
  const OJson& o = a["options"];
  if (!o.contains("driver")) co_return Reply::fail("Parameter 'options.driver' is missing");
  if (!o["driver"].is_string()) co_return Reply::fail("Invalid parameter type for 'options.driver', expected: string");
  const std::string drv = o["driver"].get<std::string>();
  if (std::find(kBlockdevDrivers.begin(), kBlockdevDrivers.end(), drv) == kBlockdevDrivers.end())
    co_return Reply::fail("Parameter 'driver' does not accept value '" + drv + "'");
  bool foreign =
      std::any_of(std::begin(kForeignCreate), std::end(kForeignCreate), [&](const char* s) { return drv == s; });
  std::vector<Arg> members = create_members(drv);
  if (auto e = check_args(members, foreign, o, "options")) co_return Reply::fail(*e);
  if (drv == "qcow2" || drv == "luks") {
    if (auto e = check_blockdev_ref(o["file"], "file", "options.file")) co_return Reply::fail(*e);
    if (o.contains("data-file"))
      if (auto e = check_blockdev_ref(o["data-file"], "data-file", "options.data-file")) co_return Reply::fail(*e);
  }
  if (foreign) co_return Reply::fail("Block driver '" + drv + "' not found or not supported");
  const DriverInfo* di = find_driver(drv);
  if (!di || !di->blockdev_create) co_return Reply::fail("Driver does not support blockdev-create");
  // QMP checks the union's schema before the job starts: qcow2's encrypt.
  if (drv == "qcow2" && o.contains("encrypt"))
    if (auto e = check_args(encrypt_members(o["encrypt"]), false, o["encrypt"], "options.encrypt"))
      co_return Reply::fail(*e);
  auto body = di->blockdev_create({d.loop, Json::parse(o.dump()), [&d](const Json& ref) { return open_ref(d, ref); }});
  if (!body) co_return Reply::fail(body.error().what());
  auto job = d.jobs.create<CreateJob>(id, std::move(*body));
  if (!job) co_return Reply::fail(job.error().what());
  (*job)->start();
  co_return Reply::ok();
}

}  // namespace

void register_create_commands(Daemon& d) {
  d.registry.add({"blockdev-create",
                  {{{"job-id", ArgType::Str, true}, {"options", ArgType::Struct, true, {}, {}, true}}},
                  [&d](const OJson& a) { return blockdev_create(d, a); }});
}

}  // namespace vblk::qmp

namespace vblk::qmp {

Task<Status> create_image(Daemon& d, const std::string& path, const std::string& format, uint64_t size,
                          const std::string& backing, const std::string& backing_fmt) {
  if (format != "qcow2" && format != "raw") co_return Error(EINVAL, "Unknown file format '" + format + "'");
  if (format == "raw" && !backing.empty()) co_return Error(EINVAL, "Backing file not supported for file format 'raw'");
  auto specs = create_options(format, path);
  if (!specs) co_return specs.take_error();
  CreateRequest req;
  req.filename = path;
  req.size = size;
  if (!backing.empty()) req.opts["backing_file"] = backing;
  if (!backing_fmt.empty()) req.opts["backing_fmt"] = backing_fmt;
  VBLK_CO_TRY(fill_create_sizes(*specs, req));
  co_return co_await vblk::create_image(d.loop, format, req);
}

std::string str_or(const OJson& a, const char* key, const std::string& def) {
  if (!a.contains(key)) return def;
  return a[key].get<std::string>();
}

Json image_options(const std::string& format, const std::string& node_name, const std::string& path) {
  Json file = Json::object();
  file["driver"] = "file";
  file["filename"] = path;
  if (format.empty()) return file;
  Json o = Json::object();
  o["driver"] = format;
  if (!node_name.empty()) o["node-name"] = node_name;
  o["file"] = std::move(file);
  return o;
}

Result<std::shared_ptr<Node>> lookup_node(Daemon& d, const std::string& device, const std::string& node_name) {
  if (!node_name.empty())
    if (auto n = d.graph.find(node_name)) return n;
  return Error(ENODEV, "Cannot find device='" + device + "' nor node-name='" + node_name + "'");
}

}  // namespace vblk::qmp
