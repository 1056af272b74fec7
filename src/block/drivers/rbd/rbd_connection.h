// A connection to a Ceph cluster and one pool (librados), made the way
// QEMU's qemu_rbd_connect makes it: the user as the client id, the conf file
// (the default locations when none is given, failures ignored), the
// filename's Ceph options, mon_host from `server`, auth options (the key from
// key-secret, a secret object of util/secret_store.h), rbd_cache
// per cache mode, then connect, open the pool's I/O context and select the
// namespace. Blocking: used while opening and creating, not for I/O.
#pragma once

#include <rados/librados.h>

#include <memory>

#include "drivers/rbd/rbd_location.h"

namespace vblk::rbd {

class RbdConnection {
 public:
  ~RbdConnection();
  RbdConnection(const RbdConnection&) = delete;
  RbdConnection& operator=(const RbdConnection&) = delete;

  // Errors read as QEMU's: "error reading conf file X: <strerror>",
  // "invalid conf option X: ...", "error connecting: ...",
  // "error opening pool X: ...", "namespace 'X' does not exist".
  static Result<std::unique_ptr<RbdConnection>> connect(const RbdLocation& loc, bool cache);

  rados_ioctx_t ioctx() const { return ioctx_; }

 private:
  RbdConnection() = default;
  rados_t cluster_ = nullptr;
  rados_ioctx_t ioctx_ = nullptr;
};

// Creates an image of `size` bytes (QEMU's qemu_rbd_do_create: rbd_create
// with the object order from cluster_size, 0 = librbd's default), then with
// `encrypt` formats it (removing the image again if that fails).
Status create_image(const RbdLocation& loc, uint64_t size, uint64_t cluster_size,
                    const std::optional<RbdEncryption>& encrypt = std::nullopt);

}  // namespace vblk::rbd
