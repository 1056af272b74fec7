// blockdev-create (QEMU 7.2's qmp_blockdev_create and BlockdevCreateOptions):
// the options' union is checked here as QEMU's QAPI visitor checks it, then a
// "create" job (include/job/vblk/create_job.h) runs the block layer's creation
// code: the file driver's create_file (exact size, as QEMU's file driver)
// or Qcow2Node::create on an existing node (a node name or inline options),
// after Qcow2Node::check_create_options (qcow2_co_create's checks). Errors
// found while the job runs (an unknown node, a bad cluster size) end the job
// with QEMU's message, not the command.
#include "drivers/drivers.h"
#include "drivers/luks/create.h"
#include "drivers/qcow2/qcow2.h"
#include "transaction.h"
#include "vblk/buffer.h"
#include "vblk/create_job.h"
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

std::vector<std::string> values(const char* const* v, size_t n) { return {v, v + n}; }

// BlockdevCreateOptionsLUKS: QCryptoBlockCreateOptionsLUKS + file, size,
// preallocation.
const std::vector<Arg> kLuksCreate = {
    {"key-secret", ArgType::Str},
    {"cipher-alg", ArgType::Enum, false, values(luks::kCipherAlgs, luks::kNumCipherAlgs)},
    {"cipher-mode", ArgType::Enum, false, values(luks::kCipherModes, luks::kNumCipherModes)},
    {"ivgen-alg", ArgType::Enum, false, values(luks::kIvgenAlgs, luks::kNumIvgenAlgs)},
    {"ivgen-hash-alg", ArgType::Enum, false, values(luks::kHashAlgs, luks::kNumHashAlgs)},
    {"hash-alg", ArgType::Enum, false, values(luks::kHashAlgs, luks::kNumHashAlgs)},
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

// The luks creation options of a checked QCryptoBlockCreateOptionsLUKS (or
// BlockdevCreateOptionsLUKS) object.
luks::CreateOptions luks_options(const OJson& o) {
  luks::CreateOptions c;
  if (o.contains("key-secret")) c.key_secret = o["key-secret"].get<std::string>();
  c.cipher_alg = str_or(o, "cipher-alg", c.cipher_alg);
  c.cipher_mode = str_or(o, "cipher-mode", c.cipher_mode);
  c.ivgen_alg = str_or(o, "ivgen-alg", c.ivgen_alg);
  if (o.contains("ivgen-hash-alg")) c.ivgen_hash_alg = o["ivgen-hash-alg"].get<std::string>();
  c.hash_alg = str_or(o, "hash-alg", c.hash_alg);
  if (o.contains("iter-time")) c.iter_time = o["iter-time"].get<int64_t>();
  return c;
}

uint64_t u64(const OJson& v) {
  return v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(v.get<int64_t>());
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

Task<Status> create_file_body(std::string path, uint64_t size, std::string prealloc) {
  co_return drivers::create_file(path, size, prealloc, /*exact=*/true);
}

// The node a BlockdevRef names or describes (QEMU's bdrv_open_blockdev_ref).
Result<std::shared_ptr<Node>> open_ref(Daemon& d, const OJson& ref) {
  if (ref.is_string()) {
    std::string name = ref.get<std::string>();
    if (auto n = d.graph.find(name)) return n;
    return Error(ENODEV, "Cannot find device='" + name + "' nor node-name='" + name + "'");
  }
  OpenContext ctx{.loop = d.loop, .graph = &d.graph, .throttle_groups = &d.throttle_groups};
  return open_node(ctx, Json::parse(ref.dump()));
}

Task<Status> create_qcow2_body(Daemon& d, OJson file_ref, qcow2::Qcow2Node::CreateOptions o, int64_t refcount_bits,
                               bool data_file, std::optional<OJson> encrypt) {
  auto file = open_ref(d, file_ref);
  if (!file) co_return file.take_error();
  VBLK_CO_TRY(qcow2::Qcow2Node::check_create_options(o, refcount_bits));
  if (data_file) co_return Error(ENOTSUP, "External data files are not supported by vblk");
  if (encrypt) {
    if ((*encrypt)["format"] != "luks")
      co_return Error(ENOTSUP, "AES-encrypted qcow2 images (format qcow) are not supported by vblk");
    // QEMU's qcow2_set_up_encryption names its options "encrypt.".
    auto f = luks::format(luks_options(*encrypt), "encrypt.");
    if (!f) co_return f.take_error();
    o.encrypt = std::make_shared<const luks::Formatted>(std::move(*f));
  }
  o.refcount_bits = static_cast<uint32_t>(refcount_bits);
  o.truncate_file = false;
  if (!qcow2::Qcow2Node::check_create_size(o.size, o.cluster_size, o.extended_l2))
    co_return Error(EFBIG, "Could not resize image: Failed to grow the L1 table: File too large");
  // QEMU's qcow2_co_create writes through a BlockBackend that takes write
  // and resize on the file node: others' conflicting locks refuse it.
  NodeRef user(*file);
  VBLK_CO_TRY(user.set_perms(PermPair{kPermWrite | kPermResize, kPermAll}));
  co_return co_await qcow2::Qcow2Node::create(d.loop, *file, o);
}

// rbd_create and its connection block: they run on the loop's thread pool.
Task<Status> create_luks_body(Daemon& d, OJson file_ref, luks::CreateOptions o) {
  auto file = open_ref(d, file_ref);
  if (!file) co_return file.take_error();
  NodeRef user(*file);
  VBLK_CO_TRY(user.set_perms(PermPair{kPermWrite | kPermResize, kPermAll}));
  co_return co_await luks::create(**file, o);
}

Task<Status> create_rbd_body(Loop& loop, Json loc, uint64_t size, uint64_t cluster_size, std::optional<Json> enc) {
  Status st;
  std::function<long()> fn = [&]() -> long {
    st = drivers::create_rbd(loc, size, cluster_size, enc ? &*enc : nullptr);
    return 0;
  };
  co_await loop.run_blocking(fn);
  co_return st;
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
  if (drv != "file" && drv != "qcow2" && drv != "rbd" && drv != "luks")
    co_return Reply::fail("Driver does not support blockdev-create");

  CreateJob::Body body;
  if (drv == "rbd") {
    uint64_t cs = o.contains("cluster-size") ? u64(o["cluster-size"]) : 0;
    std::optional<Json> enc;
    if (o.contains("encrypt")) {
      enc = Json::parse(o["encrypt"].dump());
      // QMP checks the schema before the job starts.
      auto st = drivers::check_rbd_encrypt(*enc, "options.encrypt.");
      if (!st) co_return Reply::fail(st.error().what());
    }
    body = [&d, loc = Json::parse(o["location"].dump()), size = u64(o["size"]), cs, enc] {
      return create_rbd_body(d.loop, loc, size, cs, enc);
    };
  } else if (drv == "luks") {
    luks::CreateOptions c = luks_options(o);
    c.size = u64(o["size"]);
    c.preallocation = *parse_prealloc(str_or(o, "preallocation", "off"));
    body = [&d, ref = o["file"], c] { return create_luks_body(d, ref, c); };
  } else if (drv == "file") {
    std::string prealloc = str_or(o, "preallocation", "off");
    if (o.contains("extent-size-hint") && u64(o["extent-size-hint"]) > UINT32_MAX)
      co_return Reply::fail("Extent size hint is too large");
    body = [path = o["filename"].get<std::string>(), size = u64(o["size"]), prealloc] {
      return create_file_body(path, size, prealloc);
    };
  } else {
    qcow2::Qcow2Node::CreateOptions c;
    c.size = u64(o["size"]);
    if (o.contains("version")) c.version = o["version"] == "v2" ? 2 : 3;
    if (o.contains("cluster-size")) {
      uint64_t cs = u64(o["cluster-size"]);
      c.cluster_size = cs > UINT32_MAX ? 1000 : static_cast<uint32_t>(cs);  // 1000: refused as QEMU refuses it
    }
    if (o.contains("extended-l2")) c.extended_l2 = o["extended-l2"].get<bool>();
    if (o.contains("preallocation")) c.preallocation = o["preallocation"].get<std::string>();
    if (o.contains("backing-file")) c.backing_file = o["backing-file"].get<std::string>();
    if (o.contains("backing-fmt")) c.backing_format = o["backing-fmt"].get<std::string>();
    if (o.contains("lazy-refcounts")) c.lazy_refcounts = o["lazy-refcounts"].get<bool>();
    if (o.contains("compression-type") && o["compression-type"] == "zstd") c.compression_type = qcow2::kCompressionZstd;
    int64_t bits = o.contains("refcount-bits") ? o["refcount-bits"].get<int64_t>() : 16;
    bool data_file = o.contains("data-file");
    std::optional<OJson> encrypt;
    if (o.contains("encrypt")) {
      // QMP checks the union's schema before the job starts.
      if (auto e = check_args(encrypt_members(o["encrypt"]), false, o["encrypt"], "options.encrypt"))
        co_return Reply::fail(*e);
      encrypt = o["encrypt"];
    }
    body = [&d, ref = o["file"], c, bits, data_file, encrypt] {
      return create_qcow2_body(d, ref, c, bits, data_file, encrypt);
    };
  }
  auto job = d.jobs.create<CreateJob>(id, std::move(body));
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
  if (format == "raw") {
    if (!backing.empty()) co_return Error(EINVAL, "Backing file not supported for file format 'raw'");
    co_return drivers::create_file(path, size, "off");
  }
  qcow2::Qcow2Node::CreateOptions o;
  o.size = align_up(size, 512);
  o.backing_file = backing;
  o.backing_format = backing_fmt;
  VBLK_CO_TRY(qcow2::Qcow2Node::check_create_size(o.size, o.cluster_size, false));
  VBLK_CO_TRY(drivers::create_file(path, 0, "off"));
  OpenContext ctx{.loop = d.loop};
  auto file = open_node(ctx, image_options("", "", path));
  if (!file) co_return file.take_error();
  (*file)->set_claim(PermPair{kPermWrite | kPermResize, kPermAll});
  VBLK_CO_TRY((*file)->refresh_perms());
  auto st = co_await qcow2::Qcow2Node::create(d.loop, *file, o);
  if (!st) co_return st.error().prefixed("Could not create image");
  (void)co_await (*file)->close();
  co_return Status{};
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
