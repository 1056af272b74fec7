// The qcow2 driver's registration: open, probe, and its two create forms
// (qemu-img create's -o options, blockdev-create's
// BlockdevCreateOptionsQcow2), both ending in Qcow2Node::create after
// check_create_options (qcow2_co_create's checks).
#include <cstdlib>

#include "drivers/luks/create.h"
#include "drivers/qcow2/qcow2.h"
#include "vblk/node_ref.h"
#include "vblk/open.h"

namespace vblk::qcow2 {

namespace {

Result<std::shared_ptr<Node>> open(OpenContext& ctx, Json& opts) { return Qcow2Node::open(ctx, opts); }

int probe(std::span<const uint8_t> head) {
  if (head.size() >= 8 && be32(head.data()) == kMagic && be32(head.data() + 4) >= 2) return 100;
  return 0;
}

// QEMU's qcow2_create_opts, in its order (QEMU's "encryption", the
// deprecated spelling of encrypt.format=aes, is not taken: vblk has no aes).
const CreateOpt kCreateOpts[] = {
    {"encrypt.format", CreateOptKind::String, nullptr, "Encrypt the image, format choices: 'aes', 'luks'"},
    {"encrypt.key-secret", CreateOptKind::String, nullptr, "ID of secret providing qcow AES key or LUKS passphrase"},
    {"encrypt.cipher-alg", CreateOptKind::String, nullptr, "Name of encryption cipher algorithm"},
    {"encrypt.cipher-mode", CreateOptKind::String, nullptr, "Name of encryption cipher mode"},
    {"encrypt.ivgen-alg", CreateOptKind::String, nullptr, "Name of IV generator algorithm"},
    {"encrypt.ivgen-hash-alg", CreateOptKind::String, nullptr, "Name of IV generator hash algorithm"},
    {"encrypt.hash-alg", CreateOptKind::String, nullptr, "Name of encryption hash algorithm"},
    {"encrypt.iter-time", CreateOptKind::Number, nullptr, "Time to spend in PBKDF in milliseconds"},
    {"cluster_size", CreateOptKind::Size, "65536", "qcow2 cluster size"},
    {"extended_l2", CreateOptKind::Bool, "off", "Extended L2 tables"},
    {"preallocation", CreateOptKind::String, nullptr,
     "Preallocation mode (allowed values: off, metadata, falloc, full)"},
    {"compression_type", CreateOptKind::String, "zlib", "Compression method used for image cluster compression"},
    {"size", CreateOptKind::Size, nullptr, "Virtual disk size"},
    {"compat", CreateOptKind::String, nullptr, "Compatibility level (v2 [0.10] or v3 [1.1])"},
    {"backing_file", CreateOptKind::String, nullptr, "File name of a base image"},
    {"backing_fmt", CreateOptKind::String, nullptr, "Image format of the base image"},
    {"data_file", CreateOptKind::String, nullptr, "File name of an external data file"},
    {"data_file_raw", CreateOptKind::Bool, nullptr, "The external data file must stay valid as a raw image"},
    {"lazy_refcounts", CreateOptKind::Bool, "off", "Postpone refcount updates"},
    {"refcount_bits", CreateOptKind::Number, "16", "Width of a reference count entry in bits"},
};

// Validates the options (QEMU's wording: the QAPI visitor's member checks,
// then qcow2_co_create's on the whole set) and creates the image.
Task<Status> create_from_opts(Loop& loop, const CreateRequest& req) {
  Qcow2Node::CreateOptions o;
  o.size = align_up(req.size, 512);
  std::string compat = req.get_or("compat", "1.1");
  if (compat == "0.10" || compat == "v2") {
    o.version = 2;
  } else if (compat == "1.1" || compat == "v3") {
    o.version = 3;
  } else {
    co_return Error(EINVAL, "Parameter 'version' does not accept value '" + compat + "'");
  }
  // encrypt.*: QCryptoBlockCreateOptions, format first.
  std::optional<luks::CreateOptions> enc;
  bool any_encrypt = false;
  for (const auto& [k, v] : req.opts) any_encrypt |= k.rfind("encrypt.", 0) == 0;
  if (any_encrypt) {
    const std::string* ef = req.get("encrypt.format");
    if (!ef) co_return Error(EINVAL, "Parameter 'encrypt.format' is missing");
    if (*ef == "aes" || *ef == "qcow")
      co_return Error(ENOTSUP, "AES-encrypted qcow2 images (encrypt.format=" + *ef + ") are not supported by vblk");
    if (*ef != "luks") co_return Error(EINVAL, "Parameter 'format' does not accept value '" + *ef + "'");
    enc.emplace();
    VBLK_CO_TRY(luks::parse_create_options(req.opts, "encrypt.", *enc));
  }
  if (req.get("data_file")) co_return Error(ENOTSUP, "External data files are not supported by vblk");
  std::string prealloc = req.get_or("preallocation", "off");
  if (prealloc != "off" && prealloc != "metadata" && prealloc != "falloc" && prealloc != "full")
    co_return Error(EINVAL, "Parameter 'preallocation' does not accept value '" + prealloc + "'");
  // A number (the caller checked): beyond 64 is refused below.
  uint64_t bits = std::strtoull(req.get_or("refcount_bits", "16").c_str(), nullptr, 0);
  std::string ct = req.get_or("compression_type", "zlib");
  if (ct == "zstd") {
    o.compression_type = kCompressionZstd;
  } else if (ct != "zlib") {
    co_return Error(EINVAL, "Parameter 'compression-type' does not accept value '" + ct + "'");
  }
  uint64_t cs = req.sizes.at("cluster_size");
  o.cluster_size = cs > UINT32_MAX ? 1000 : static_cast<uint32_t>(cs);  // 1000: refused as QEMU refuses it
  o.extended_l2 = req.get_or("extended_l2", "off") == "on";
  o.lazy_refcounts = req.get_or("lazy_refcounts", "off") == "on";
  if (auto* b = req.get("backing_file")) o.backing_file = *b;
  if (auto* b = req.get("backing_fmt")) o.backing_format = *b;
  o.preallocation = prealloc;
  VBLK_CO_TRY(Qcow2Node::check_create_options(o, static_cast<int64_t>(std::min<uint64_t>(bits, 128))));
  o.refcount_bits = static_cast<uint32_t>(bits);
  VBLK_CO_TRY(Qcow2Node::check_create_size(o.size, o.cluster_size, o.extended_l2));
  if (enc) {
    // The volume (secret, algorithms, PBKDF2) before the file is touched:
    // a typo in the secret leaves an existing file as it was (QEMU fails
    // after creating it, and removes it then).
    auto f = luks::format(*enc, "encrypt.");
    if (!f) co_return f.take_error();
    o.encrypt = std::make_shared<const luks::Formatted>(std::move(*f));
  }
  VBLK_CO_TRY(co_await create_protocol_file(loop, req.filename));
  OpenContext ctx{loop};
  ctx.read_only = false;
  auto file = open_node(ctx, Json{{"driver", "file"}, {"filename", req.filename}});
  if (!file) {
    (void)delete_image(req.filename);
    co_return file.take_error();
  }
  // Written while being formatted: held for writing and resizing.
  (*file)->set_claim(PermPair{kPermWrite | kPermResize, kPermAll});
  VBLK_CO_TRY((*file)->refresh_perms());
  auto cr = co_await Qcow2Node::create(loop, *file, o);
  if (!cr) {
    // A half-made image (a full disk during preallocation) is no image:
    // removed, as QEMU's qcow2_co_create_opts removes it.
    (void)delete_image(req.filename);
    co_return cr.error().prefixed("Could not create image");
  }
  co_return Status{};
}

// The job's part: what QEMU's qcow2_co_create checks and does once the job
// runs (an unknown node or a bad cluster size end the job, not the command).
Task<Status> create_on_node(Loop& loop, std::function<Result<std::shared_ptr<Node>>(const Json&)> open_ref,
                            Json file_ref, Qcow2Node::CreateOptions o, int64_t refcount_bits, bool data_file,
                            std::optional<Json> encrypt) {
  auto file = open_ref(file_ref);
  if (!file) co_return file.take_error();
  VBLK_CO_TRY(Qcow2Node::check_create_options(o, refcount_bits));
  if (data_file) co_return Error(ENOTSUP, "External data files are not supported by vblk");
  if (encrypt) {
    if ((*encrypt)["format"] != "luks")
      co_return Error(ENOTSUP, "AES-encrypted qcow2 images (format qcow) are not supported by vblk");
    // QEMU's qcow2_set_up_encryption names its options "encrypt.".
    auto f = luks::format(luks::from_qapi(*encrypt), "encrypt.");
    if (!f) co_return f.take_error();
    o.encrypt = std::make_shared<const luks::Formatted>(std::move(*f));
  }
  o.refcount_bits = static_cast<uint32_t>(refcount_bits);
  o.truncate_file = false;
  if (!Qcow2Node::check_create_size(o.size, o.cluster_size, o.extended_l2))
    co_return Error(EFBIG, "Could not resize image: Failed to grow the L1 table: File too large");
  // QEMU's qcow2_co_create writes through a BlockBackend that takes write
  // and resize on the file node: others' conflicting locks refuse it.
  NodeRef user(*file);
  VBLK_CO_TRY(user.set_perms(PermPair{kPermWrite | kPermResize, kPermAll}));
  co_return co_await Qcow2Node::create(loop, *file, o);
}

Result<CreateBody> blockdev_create(const BlockdevCreateArgs& a) {
  const Json& o = a.options;
  Qcow2Node::CreateOptions c;
  c.size = o["size"].get<uint64_t>();
  if (o.contains("version")) c.version = o["version"] == "v2" ? 2 : 3;
  if (o.contains("cluster-size")) {
    uint64_t cs = o["cluster-size"].get<uint64_t>();
    c.cluster_size = cs > UINT32_MAX ? 1000 : static_cast<uint32_t>(cs);  // 1000: refused as QEMU refuses it
  }
  if (o.contains("extended-l2")) c.extended_l2 = o["extended-l2"].get<bool>();
  if (o.contains("preallocation")) c.preallocation = o["preallocation"].get<std::string>();
  if (o.contains("backing-file")) c.backing_file = o["backing-file"].get<std::string>();
  if (o.contains("backing-fmt")) c.backing_format = o["backing-fmt"].get<std::string>();
  if (o.contains("lazy-refcounts")) c.lazy_refcounts = o["lazy-refcounts"].get<bool>();
  if (o.contains("compression-type") && o["compression-type"] == "zstd") c.compression_type = kCompressionZstd;
  int64_t bits = o.contains("refcount-bits") ? o["refcount-bits"].get<int64_t>() : 16;
  bool data_file = o.contains("data-file");
  std::optional<Json> encrypt;
  if (o.contains("encrypt")) encrypt = o["encrypt"];
  Loop* loop = &a.loop;
  return CreateBody([loop, open_ref = a.open_ref, ref = o["file"], c, bits, data_file, encrypt] {
    return create_on_node(*loop, open_ref, ref, c, bits, data_file, encrypt);
  });
}

}  // namespace

}  // namespace vblk::qcow2

namespace vblk::drivers {

extern const DriverInfo qcow2_driver = {.name = "qcow2",
                                        .kind = DriverKind::Format,
                                        .open = qcow2::open,
                                        .probe = qcow2::probe,
                                        .create_opts = qcow2::kCreateOpts,
                                        .create = qcow2::create_from_opts,
                                        .blockdev_create = qcow2::blockdev_create};

}  // namespace vblk::drivers
