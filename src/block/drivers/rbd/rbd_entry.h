// The rbd driver's entry points: rbd.cc when librbd is found, else
// rbd_unavailable.cc (which fails every call saying the build has no rbd
// driver); rbd_driver.cc registers them either way.
#pragma once

#include <optional>
#include <string>

#include "vblk/open.h"

namespace vblk::drivers {

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

}  // namespace vblk::drivers
