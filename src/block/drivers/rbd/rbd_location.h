// Where an RBD image lives and how to reach its cluster: QEMU's
// BlockdevOptionsRbd (pool, namespace, image, conf, user, snapshot,
// key-secret, auth-client-required, server) and its legacy filename syntax
//   rbd:pool[/namespace]/image[@snapshot][:key=value[:key=value...]]
// where `conf` and `id` (the user) are special and every other pair is a
// Ceph option passed to rados_conf_set; `\` escapes ':', '@', '/' and '='.
//
// Parsing only: no librados here (rbd_connection.h connects).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vblk/options.h"
#include "vblk/result.h"

namespace vblk::rbd {

struct RbdServer {
  std::string host;
  std::string port;
};

struct RbdEncryption {
  std::string format;  // "luks" or "luks2"
  std::string key_secret;
  std::optional<std::string> cipher_alg;  // creating only: QCryptoCipherAlgorithm name
};

// RbdEncryptionOptions (luks, luks2) from a dict (`encrypt` of blockdev options, or the
// encrypt.* create options). `prefix` names members in "is missing" errors
// ("encrypt." for blockdev options, "" for create options, as QEMU's
// visitors name them); create allows cipher-alg.
Result<RbdEncryption> parse_encryption(const Json& dict, const std::string& prefix, bool create);
// The number of a QCryptoCipherAlgorithm name (QEMU's errors show it), -1 if none.
int cipher_alg_number(const std::string& name);

struct RbdLocation {
  std::string pool;
  std::optional<std::string> ns;  // "namespace"; the filename syntax always sets it ("" if none)
  std::string image;
  std::optional<std::string> snapshot;
  std::optional<std::string> conf;
  std::optional<std::string> user;
  std::optional<std::string> key_secret;
  std::vector<std::string> auth_client_required;  // "cephx", "none"
  std::vector<RbdServer> servers;                 // mon_host override
  std::optional<RbdEncryption> encrypt;           // loaded after rbd_open (rbd_encryption.h)
  // Ceph options from the filename, in order (QEMU's "=keyvalue-pairs").
  std::vector<std::pair<std::string, std::string>> keypairs;
};

// QEMU's qemu_rbd_parse_filename with its error texts ("Pool name is required",
// "conf option X has no value", "File name must start with 'rbd:'").
Result<RbdLocation> parse_rbd_filename(const std::string& filename);

// Takes the rbd options from blockdev options (`filename` in the legacy
// syntax, or pool/image/...), with QEMU's "Parameter 'x' is missing" texts.
Result<RbdLocation> take_rbd_location(Json& opts);

// The options as QEMU's json: filename shows them (QDict order), e.g.
// {"pool": "rbd", "image": "a", "conf": "/c", "driver": "rbd", "namespace": ""}.
nlohmann::ordered_json location_json(const RbdLocation& loc);

}  // namespace vblk::rbd
