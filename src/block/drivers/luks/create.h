// Formatting a file as a LUKS1 image (QEMU's qcrypto_block_luks_create via
// block/crypto.c's create): QEMU's options, defaults and error words.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "drivers/luks/luks.h"
#include "vblk/create.h"
#include "vblk/node.h"
#include "vblk/task.h"

namespace vblk::luks {

// QCryptoBlockCreateOptionsLUKS + size/preallocation (BlockdevCreateOptionsLUKS).
struct CreateOptions {
  std::optional<std::string> key_secret;
  std::string cipher_alg = "aes-256";
  std::string cipher_mode = "xts";
  std::string ivgen_alg = "plain64";
  std::optional<std::string> ivgen_hash_alg;  // essiv: sha256 unless given
  std::string hash_alg = "sha256";
  int64_t iter_time = 2000;  // milliseconds of PBKDF2 per key slot
  uint64_t size = 0;         // of the payload (the virtual disk)
  Prealloc preallocation = Prealloc::Off;
};

// Creation options given as QemuOpts strings (qemu-img create -o), each
// named `prefix` + its QAPI name ("encrypt.cipher-alg" for qcow2): QEMU's
// "Parameter 'cipher-alg' does not accept value 'x'", "Parameter
// '<prefix>iter-time' expects a number". Size and preallocation are the
// caller's.
Status parse_create_options(const std::map<std::string, std::string>& opts, const std::string& prefix,
                            CreateOptions& o);

// A new volume in memory (QEMU's qcrypto_block_luks_create up to its
// writes): the header and slot 0 of a random master key, PBKDF2 iterations
// measured so the slot takes o.iter_time ms and the master key digest an
// eighth of it, as QEMU does. `prefix` names key-secret in "Parameter
// '<prefix>key-secret' is required for cipher".
struct Formatted {
  Volume v;                                               // with the payload cipher
  std::vector<uint8_t> header;                            // kHeaderSize bytes
  std::vector<uint8_t> material;                          // slot 0's key material
  uint64_t area() const { return v.h.payload_offset(); }  // header and key slots
};
Result<Formatted> format(const CreateOptions& o, const std::string& prefix = {});

// Writes f's header and key material to `file` at `base` (the rest of the
// area is left as it is: zeroes in a new file or cluster).
Task<Status> write_volume(Node& file, uint64_t base, const Formatted& f);

// Formats `file` (which the caller holds for write and resize) as a luks
// image: sized to the payload offset + o.size, then the header and slot 0.
Task<Status> create(Node& file, const CreateOptions& o);
// The second half of create(): `f` (format(o)) written to `file`.
Task<Status> write(Node& file, const CreateOptions& o, const Formatted& f);

// A checked QCryptoBlockCreateOptionsLUKS object (qcow2's `encrypt` too).
CreateOptions from_qapi(const Json& o);

}  // namespace vblk::luks
