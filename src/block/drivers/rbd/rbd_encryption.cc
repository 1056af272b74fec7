// RBD image encryption: see rbd_encryption.h.
#include "drivers/rbd/rbd_encryption.h"

#include <string.h>

#include <array>
#include <cstring>

#include "drivers/rbd/rbd_error.h"
#include "drivers/rbd/rbd_lib.h"
#include "vblk/secret_store.h"

namespace vblk::rbd {

namespace {

// The first bytes of LUKS1 / LUKS2 headers (magic and version).
constexpr char kLuks1Magic[8] = {'L', 'U', 'K', 'S', '\xBA', '\xBE', 0, 1};
constexpr char kLuks2Magic[8] = {'L', 'U', 'K', 'S', '\xBA', '\xBE', 0, 2};

struct Passphrase {
  std::string bytes;
  ~Passphrase() { explicit_bzero(bytes.data(), bytes.size()); }
};

}  // namespace

Status load_encryption(rbd_image_t image, const RbdEncryption& enc) {
  auto secret = SecretStore::process().lookup(enc.key_secret);
  if (!secret) return secret.error();
  Passphrase pw{std::move(*secret)};
  int r;
  if (enc.format == "luks") {
    rbd_encryption_luks1_format_options_t o{};
    o.passphrase = pw.bytes.data();
    o.passphrase_size = pw.bytes.size();
    r = rbd_lib().rbd_encryption_load(image, RBD_ENCRYPTION_FORMAT_LUKS1, &o, sizeof o);
  } else {
    rbd_encryption_luks2_format_options_t o{};
    o.passphrase = pw.bytes.data();
    o.passphrase_size = pw.bytes.size();
    r = rbd_lib().rbd_encryption_load(image, RBD_ENCRYPTION_FORMAT_LUKS2, &o, sizeof o);
  }
  if (r < 0) return rbd_error(r, "encryption load fail");
  return {};
}

Status format_encryption(rbd_image_t image, const RbdEncryption& enc) {
  uint64_t raw_size = 0, effective_size = 0;
  int r = rbd_lib().rbd_get_size(image, &raw_size);
  if (r < 0) return rbd_error(r, "cannot get raw image size");
  auto secret = SecretStore::process().lookup(enc.key_secret);
  if (!secret) return secret.error();
  Passphrase pw{std::move(*secret)};
  rbd_encryption_algorithm_t alg = RBD_ENCRYPTION_ALGORITHM_AES256;
  if (enc.cipher_alg && *enc.cipher_alg != "aes-256") {
    if (*enc.cipher_alg != "aes-128") {
      return rbd_error(-ENOTSUP, "unknown encryption algorithm: " + std::to_string(cipher_alg_number(*enc.cipher_alg)));
    }
    alg = RBD_ENCRYPTION_ALGORITHM_AES128;
  }
  if (enc.format == "luks") {
    rbd_encryption_luks1_format_options_t o{};
    o.alg = alg;
    o.passphrase = pw.bytes.data();
    o.passphrase_size = pw.bytes.size();
    r = rbd_lib().rbd_encryption_format(image, RBD_ENCRYPTION_FORMAT_LUKS1, &o, sizeof o);
  } else {
    rbd_encryption_luks2_format_options_t o{};
    o.alg = alg;
    o.passphrase = pw.bytes.data();
    o.passphrase_size = pw.bytes.size();
    r = rbd_lib().rbd_encryption_format(image, RBD_ENCRYPTION_FORMAT_LUKS2, &o, sizeof o);
  }
  if (r < 0) return rbd_error(r, "encryption format fail");
  r = rbd_lib().rbd_get_size(image, &effective_size);
  if (r < 0) return rbd_error(r, "cannot get effective image size");
  r = rbd_lib().rbd_resize(image, raw_size + (raw_size - effective_size));
  if (r < 0) return rbd_error(r, "cannot resize image after format");
  return {};
}

std::optional<std::string> probe_encryption_format(rbd_image_t image, uint64_t size) {
  char buf[8] = {};
  if (size >= sizeof buf && rbd_lib().rbd_read(image, 0, sizeof buf, buf) < 0) return std::nullopt;
  if (!std::memcmp(buf, kLuks1Magic, sizeof buf)) return "luks";
  if (!std::memcmp(buf, kLuks2Magic, sizeof buf)) return "luks2";
  return std::nullopt;
}

}  // namespace vblk::rbd
