// The process's QOM objects by id, holding the value of every `secret`
// object (QEMU's qom `secret` class, crypto/secret.c) for the drivers that
// look one up by id: rbd's key-secret.
//
// QEMU keeps every user-created object under one /objects container per
// process, secrets and others alike, so ids are unique across types and a
// lookup can tell "no such object" from "not a secret". vblk's objects live
// in different places (throttle groups in the daemon, secrets here), so the
// other types register their ids here too (add_other / remove).
//
// A secret is loaded when it is added, as QEMU's complete() does: `data` or
// `file` (exactly one), decoded if `format` is base64, and decrypted with
// AES-256-CBC if `keyid` names a 32-byte secret (`iv`: 16 bytes, base64).
// The value is never printed: errors name the secret's id only, and the
// memory is wiped when the secret goes.
//
// Thread-safety: a mutex; lookups may come from pool threads (create).
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "vblk/result.h"

namespace vblk {

enum class SecretFormat { kRaw, kBase64 };

// SecretProperties + SecretCommonProperties (qapi/qom.json).
struct SecretSpec {
  std::optional<std::string> data;
  std::optional<std::string> file;
  SecretFormat format = SecretFormat::kRaw;
  std::optional<std::string> keyid;
  std::optional<std::string> iv;
};

class SecretStore {
 public:
  // The one store of this process (QEMU's object root is per process too).
  static SecretStore& process();

  ~SecretStore();

  // Adds and loads a secret. Errors as QEMU's: "attempt to add duplicate
  // property 'X' to object (type 'container')", "Either 'file' or 'data'
  // must be provided", "'file' and 'data' are mutually exclusive",
  // "Unable to read F: ...", base64 and decryption errors.
  Status add(const std::string& id, const SecretSpec& spec);
  // Registers the id of an object of another type (duplicate ids fail).
  Status add_other(const std::string& id);
  bool contains(const std::string& id) const;
  bool is_secret(const std::string& id) const;
  // Removes an object of any type; false if there is none with this id.
  bool remove(const std::string& id);

  // The secret's bytes: "No secret with id 'X'", "Object with id 'X' is
  // not a secret" (qcrypto_secret_lookup).
  Result<std::string> lookup(const std::string& id) const;
  // The bytes base64-encoded (qcrypto_secret_lookup_as_base64: how rbd
  // hands a key to librados).
  Result<std::string> lookup_base64(const std::string& id) const;

 private:
  Result<std::string> load(const SecretSpec& spec) const;

  mutable std::mutex mu_;
  // id -> the secret's bytes, or nullopt for an object of another type.
  std::map<std::string, std::optional<std::string>> objects_;
};

}  // namespace vblk
