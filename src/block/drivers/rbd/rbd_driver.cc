// The rbd driver's registration and its two create forms (qemu-img's -o
// options, blockdev-create's typed ones): built with or without librbd.
#include <functional>

#include "drivers/rbd/rbd_entry.h"
#include "vblk/buffer.h"
#include "vblk/loop.h"

namespace vblk::drivers {

namespace {

// QEMU's qemu_rbd_create_opts, in its order.
const CreateOpt kRbdCreateOpts[] = {
    {"size", CreateOptKind::Size, nullptr, "Virtual disk size"},
    {"cluster_size", CreateOptKind::Size, nullptr, "RBD object size"},
    {"password-secret", CreateOptKind::String, nullptr, "ID of secret providing the password"},
    {"encrypt.format", CreateOptKind::String, nullptr, "Encrypt the image, format choices: 'luks', 'luks2'"},
    {"encrypt.cipher-alg", CreateOptKind::String, nullptr,
     "Name of encryption cipher algorithm (allowed values: aes-128, aes-256)"},
    {"encrypt.key-secret", CreateOptKind::String, nullptr, "ID of secret providing LUKS passphrase"},
};

// librbd blocks: creation runs on the loop's thread pool.
Task<Status> off_loop(Loop& loop, std::function<Status()> work) {
  Status st;
  std::function<long()> fn = [&]() -> long {
    st = work();
    return 0;
  };
  co_await loop.run_blocking(fn);
  co_return st;
}

Task<Status> create_rbd_opts(Loop& loop, const CreateRequest& req) {
  std::optional<std::string> password;
  if (auto* p = req.get("password-secret")) password = *p;
  // encrypt.* -> {format, cipher-alg, key-secret}: QEMU's encrypt.
  // sub-dictionary, absent when none is given.
  Json encrypt = Json::object();
  for (const char* k : {"format", "cipher-alg", "key-secret"})
    if (auto* v = req.get(std::string("encrypt.") + k)) encrypt[k] = *v;
  uint64_t cluster_size = req.sizes.count("cluster_size") ? req.sizes.at("cluster_size") : 0;
  // QEMU rounds the size up to whole sectors for rbd.
  uint64_t size = align_up(req.size, 512);
  co_return co_await off_loop(loop, [&] {
    return create_rbd(req.filename, size, cluster_size, password, encrypt.empty() ? nullptr : &encrypt);
  });
}

// BlockdevCreateOptionsRbd: the location is checked by the driver's
// parser, `encrypt` before the job starts (QMP checks the schema first).
Result<CreateBody> blockdev_create_rbd(const BlockdevCreateArgs& a) {
  const Json& o = a.options;
  uint64_t cs = o.contains("cluster-size") ? o["cluster-size"].get<uint64_t>() : 0;
  std::optional<Json> enc;
  if (o.contains("encrypt")) {
    enc = o["encrypt"];
    VBLK_TRY(check_rbd_encrypt(*enc, "options.encrypt."));
  }
  Loop* loop = &a.loop;
  return CreateBody([loop, loc = o["location"], size = o["size"].get<uint64_t>(), cs, enc] {
    return off_loop(*loop, [loc, size, cs, enc]() mutable { return create_rbd(loc, size, cs, enc ? &*enc : nullptr); });
  });
}

const char* const kRbdPrefixes[] = {"rbd:"};

}  // namespace

extern const DriverInfo rbd_driver = {.name = "rbd",
                                      .kind = DriverKind::Protocol,
                                      .open = open_rbd,
                                      .create_opts = kRbdCreateOpts,
                                      .create = create_rbd_opts,
                                      .blockdev_create = blockdev_create_rbd,
                                      .prefixes = kRbdPrefixes,
                                      .remove = remove_rbd};

}  // namespace vblk::drivers
