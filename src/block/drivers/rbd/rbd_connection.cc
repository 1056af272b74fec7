#include "drivers/rbd/rbd_connection.h"

#include <rbd/librbd.h>
#include <string.h>

#include <cstring>

#include "drivers/rbd/rbd_encryption.h"
#include "drivers/rbd/rbd_error.h"
#include "drivers/rbd/rbd_lib.h"
#include "vblk/secret_store.h"

namespace vblk::rbd {

RbdConnection::~RbdConnection() {
  if (ioctx_) rbd_lib().rados_ioctx_destroy(ioctx_);
  if (cluster_) rbd_lib().rados_shutdown(cluster_);
}

Result<std::unique_ptr<RbdConnection>> RbdConnection::connect(const RbdLocation& loc, bool cache) {
  std::string why;
  if (!load_rbd_lib(why)) return Error(ENOTSUP, why);
  std::unique_ptr<RbdConnection> c(new RbdConnection());
  int r = rbd_lib().rados_create(&c->cluster_, loc.user ? loc.user->c_str() : nullptr);
  if (r < 0) {
    c->cluster_ = nullptr;
    return rbd_error(r, "error initializing");
  }
  // No conf: try the default locations and ignore a failure.
  r = rbd_lib().rados_conf_read_file(c->cluster_, loc.conf ? loc.conf->c_str() : nullptr);
  if (loc.conf && r < 0) return rbd_error(r, "error reading conf file " + *loc.conf);
  for (const auto& [k, v] : loc.keypairs) {
    r = rbd_lib().rados_conf_set(c->cluster_, k.c_str(), v.c_str());
    if (r < 0) return Error(EINVAL, "invalid conf option " + k + ": " + std::strerror(-r));
  }
  if (!loc.servers.empty()) {
    std::string mon;
    for (const auto& s : loc.servers) {
      if (!mon.empty()) mon += ';';
      mon += s.host.find(':') != std::string::npos ? "[" + s.host + "]:" + s.port : s.host + ":" + s.port;
    }
    r = rbd_lib().rados_conf_set(c->cluster_, "mon_host", mon.c_str());
    if (r < 0) return rbd_error(r, "error setting mon_host");
  }
  // QEMU's qemu_rbd_set_auth: the key is the secret's bytes in base64 (a
  // Ceph key from a keyring is given as format=base64), the secret's id is
  // all an error may name.
  if (loc.key_secret) {
    auto key = SecretStore::process().lookup_base64(*loc.key_secret);
    if (!key) return Error(EIO, key.error().what());
    r = rbd_lib().rados_conf_set(c->cluster_, "key", key->c_str());
    explicit_bzero(key->data(), key->size());
    if (r < 0) return rbd_error(r, "Could not set 'key'");
  }
  if (!loc.auth_client_required.empty()) {
    std::string acr;
    for (const auto& a : loc.auth_client_required) acr += (acr.empty() ? "" : ";") + a;
    r = rbd_lib().rados_conf_set(c->cluster_, "auth_client_required", acr.c_str());
    if (r < 0) return rbd_error(r, "Could not set 'auth_client_required'");
  }
  // Only an error if the option is unknown, and librbd's default is off.
  rbd_lib().rados_conf_set(c->cluster_, "rbd_cache", cache ? "true" : "false");
  r = rbd_lib().rados_connect(c->cluster_);
  if (r < 0) return rbd_error(r, "error connecting");
  r = rbd_lib().rados_ioctx_create(c->cluster_, loc.pool.c_str(), &c->ioctx_);
  if (r < 0) {
    c->ioctx_ = nullptr;
    return rbd_error(r, "error opening pool " + loc.pool);
  }
  if (loc.ns && !loc.ns->empty()) {
    bool exists = false;
    r = rbd_lib().rbd_namespace_exists(c->ioctx_, loc.ns->c_str(), &exists);
    if (r < 0) return rbd_error(r, "error checking namespace");
    if (!exists) return Error(ENOENT, "namespace '" + *loc.ns + "' does not exist");
  }
  rbd_lib().rados_ioctx_set_namespace(c->ioctx_, loc.ns ? loc.ns->c_str() : nullptr);
  return c;
}

Status create_image(const RbdLocation& loc, uint64_t size, uint64_t cluster_size,
                    const std::optional<RbdEncryption>& encrypt) {
  if (loc.snapshot) return Error(EINVAL, "Can't use snapshot name for image creation");
  int order = 0;
  if (cluster_size) {
    if (cluster_size & (cluster_size - 1)) return Error(EINVAL, "obj size needs to be power of 2");
    if (cluster_size < 4096) return Error(EINVAL, "obj size too small");
    order = __builtin_ctzll(cluster_size);
  }
  auto c = RbdConnection::connect(loc, false);
  VBLK_TRY(c);
  int r = rbd_lib().rbd_create((*c)->ioctx(), loc.image.c_str(), size, &order);
  if (r < 0) return rbd_error(r, "error rbd create");
  if (!encrypt) return {};
  rbd_image_t image = nullptr;
  r = rbd_lib().rbd_open((*c)->ioctx(), loc.image.c_str(), &image, nullptr);
  if (r < 0) return rbd_error(r, "error opening image '" + loc.image + "' for encryption format");
  Status st = format_encryption(image, *encrypt);
  rbd_lib().rbd_close(image);
  if (!st) rbd_lib().rbd_remove((*c)->ioctx(), loc.image.c_str());  // as QEMU: no half-made image
  return st;
}

}  // namespace vblk::rbd
