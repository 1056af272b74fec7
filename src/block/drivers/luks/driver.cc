// The luks driver's registration, and its two create forms: qemu-img
// create's -o options and blockdev-create's BlockdevCreateOptionsLUKS, both
// ending in luks::create.
#include "drivers/luks/create.h"
#include "drivers/luks/luks.h"
#include "vblk/node_ref.h"
#include "vblk/open.h"

namespace vblk::luks {

namespace {

// block/crypto.c's create_opts (QCryptoBlockCreateOptionsLUKS), in its order.
const CreateOpt kCreateOpts[] = {
    {"size", CreateOptKind::Size, nullptr, "Virtual disk size"},
    {"key-secret", CreateOptKind::String, nullptr, "ID of the secret that provides the keyslot passphrase"},
    {"cipher-alg", CreateOptKind::String, nullptr, "Name of encryption cipher algorithm"},
    {"cipher-mode", CreateOptKind::String, nullptr, "Name of encryption cipher mode"},
    {"ivgen-alg", CreateOptKind::String, nullptr, "Name of IV generator algorithm"},
    {"ivgen-hash-alg", CreateOptKind::String, nullptr, "Name of IV generator hash algorithm"},
    {"hash-alg", CreateOptKind::String, nullptr, "Name of encryption hash algorithm"},
    {"iter-time", CreateOptKind::Number, nullptr, "Time to spend in PBKDF in milliseconds"},
};

// Validates the options (QEMU's enum checks, in its member order) and
// formats the volume in memory (secret, algorithms, PBKDF2) before the file
// is touched, so a typo in the secret leaves an existing file as it was;
// then makes the file and writes the volume, and removes the file again if
// that fails, as qemu-img create does.
Task<Status> create_from_opts(Loop& loop, const CreateRequest& req) {
  CreateOptions o;
  o.size = req.size;
  VBLK_CO_TRY(parse_create_options(req.opts, "", o));
  std::string prealloc = req.get_or("preallocation", "off");
  auto pm = parse_prealloc(prealloc);
  // block/crypto.c parses it with qapi_enum_parse: its own words.
  if (!pm) co_return Error(EINVAL, "invalid parameter value: " + prealloc);
  o.preallocation = *pm;
  auto f = format(o);
  if (!f) co_return f.take_error();
  VBLK_CO_TRY(co_await create_protocol_file(loop, req.filename));
  OpenContext ctx{loop};
  ctx.read_only = false;
  auto file = open_node(ctx, Json{{"driver", "file"}, {"filename", req.filename}});
  if (!file) {
    (void)delete_image(req.filename);
    co_return file.take_error();
  }
  (*file)->set_claim(PermPair{kPermWrite | kPermResize, kPermAll});
  VBLK_CO_TRY((*file)->refresh_perms());
  auto cr = co_await write(**file, o, *f);
  if (!cr) (void)delete_image(req.filename);
  co_return cr;
}

}  // namespace

CreateOptions from_qapi(const Json& o) {
  CreateOptions c;
  if (o.contains("key-secret")) c.key_secret = o["key-secret"].get<std::string>();
  c.cipher_alg = o.value("cipher-alg", c.cipher_alg);
  c.cipher_mode = o.value("cipher-mode", c.cipher_mode);
  c.ivgen_alg = o.value("ivgen-alg", c.ivgen_alg);
  if (o.contains("ivgen-hash-alg")) c.ivgen_hash_alg = o["ivgen-hash-alg"].get<std::string>();
  c.hash_alg = o.value("hash-alg", c.hash_alg);
  if (o.contains("iter-time")) c.iter_time = o["iter-time"].get<int64_t>();
  return c;
}

namespace {

// The create job's part (a named coroutine: its arguments live in its frame).
Task<Status> create_on_node(std::function<Result<std::shared_ptr<Node>>(const Json&)> open_ref, Json ref,
                            CreateOptions c) {
  auto file = open_ref(ref);
  if (!file) co_return file.take_error();
  NodeRef user(*file);
  VBLK_CO_TRY(user.set_perms(PermPair{kPermWrite | kPermResize, kPermAll}));
  co_return co_await create(**file, c);
}

Result<CreateBody> blockdev_create(const BlockdevCreateArgs& a) {
  const Json& o = a.options;
  CreateOptions c = from_qapi(o);
  c.size = o["size"].get<uint64_t>();
  c.preallocation = *parse_prealloc(o.value("preallocation", std::string("off")));
  return CreateBody([open_ref = a.open_ref, ref = o["file"], c] { return create_on_node(open_ref, ref, c); });
}

}  // namespace

}  // namespace vblk::luks

namespace vblk::drivers {

extern const DriverInfo luks_driver = {.name = "luks",
                                       .kind = DriverKind::Format,
                                       .open = open_luks,
                                       .probe = probe_luks,
                                       .create_opts = luks::kCreateOpts,
                                       .create = luks::create_from_opts,
                                       .blockdev_create = luks::blockdev_create};

}  // namespace vblk::drivers
