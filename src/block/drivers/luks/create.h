// Formatting a file as a LUKS1 image (QEMU's qcrypto_block_luks_create via
// block/crypto.c's create): QEMU's options, defaults and error words.
#pragma once

#include <optional>
#include <string>

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

// The QAPI enum values each option accepts (QCryptoCipherAlgorithm, ...),
// for "Parameter 'cipher-alg' does not accept value 'x'".
extern const char* const kCipherAlgs[];
extern const size_t kNumCipherAlgs;
extern const char* const kCipherModes[];
extern const size_t kNumCipherModes;
extern const char* const kIvgenAlgs[];
extern const size_t kNumIvgenAlgs;
extern const char* const kHashAlgs[];
extern const size_t kNumHashAlgs;

// Writes the header and slot 0 to `file` (which the caller holds for write
// and resize) and sizes it to the payload offset + o.size. The master key
// is random; iterations are measured so PBKDF2 takes o.iter_time ms for
// the slot and an eighth of it for the master key digest, as QEMU does.
Task<Status> create(Node& file, const CreateOptions& o);

}  // namespace vblk::luks
