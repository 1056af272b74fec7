// The built-in drivers' entry points (one file each in this folder).
#pragma once

#include "vblk/open.h"

namespace vblk::drivers {

Result<std::shared_ptr<Node>> open_file(OpenContext& ctx, Json& opts);
Result<std::shared_ptr<Node>> open_host_device(OpenContext& ctx, Json& opts);
Result<std::shared_ptr<Node>> open_raw(OpenContext& ctx, Json& opts);
Result<std::shared_ptr<Node>> open_null(OpenContext& ctx, Json& opts);
Result<std::shared_ptr<Node>> open_nbd(OpenContext& ctx, Json& opts);
Result<std::shared_ptr<Node>> open_blkdebug(OpenContext& ctx, Json& opts);
int probe_raw(std::span<const uint8_t> head);
Result<std::shared_ptr<Node>> open_qcow2(OpenContext& ctx, Json& opts);
int probe_qcow2(std::span<const uint8_t> head);
// luks/: LUKS1 encryption (QEMU's `luks` format).
Result<std::shared_ptr<Node>> open_luks(OpenContext& ctx, Json& opts);
int probe_luks(std::span<const uint8_t> head);
Result<std::shared_ptr<Node>> open_throttle(OpenContext& ctx, Json& opts);
// rbd/rbd.cc when librbd is found, else rbd_unavailable.cc (which fails
// every call saying the build has no rbd driver).
Result<std::shared_ptr<Node>> open_rbd(OpenContext& ctx, Json& opts);
// Creates an RBD image named in QEMU's filename syntax (rbd:pool/image...)
// or by blockdev options (pool, image, conf...); cluster_size is the
// object size (0: librbd's default). `password_secret` (qemu-img's legacy
// create option) is the key-secret; `encrypt` ({format, key-secret,
// cipher-alg}, QEMU's RbdEncryptionCreateOptions) formats the new image with
// librbd's LUKS.
Status create_rbd(const std::string& filename, uint64_t size, uint64_t cluster_size,
                  const std::optional<std::string>& password_secret = {}, const Json* encrypt = nullptr);
Status create_rbd(Json& opts, uint64_t size, uint64_t cluster_size, const Json* encrypt = nullptr);
// blockdev-create's schema check of `encrypt` (RbdEncryptionCreateOptions),
// members named under `prefix` ("options.encrypt.") as QEMU's QMP names them.
Status check_rbd_encrypt(const Json& encrypt, const std::string& prefix);
// Removes the image an rbd: name points at (a failed `vblk backup` takes
// back the target it created, as it unlinks a file).
Status remove_rbd(const std::string& filename);

// Creates (or truncates) a file the way qemu-img create does for raw/file:
// size rounded up to 512, preallocation off|falloc|full, first block written
// so later O_DIRECT alignment probing reads real data. `exact` (QMP's
// blockdev-create) keeps the size as given, as QEMU's file driver does.
Status create_file(const std::string& path, uint64_t size, const std::string& prealloc, bool exact = false);

}  // namespace vblk::drivers
