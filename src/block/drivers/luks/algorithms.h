// The algorithms a LUKS header names, as QEMU's QAPI enums spell them
// (cipher "aes-256", mode "xts", ivgen "plain64", hash "sha256"), parsed from
// the header's cipher_name / cipher_mode ("xts-plain64", "cbc-essiv:sha256")
// / hash_spec with QEMU 7.2's rules and error words
// (qcrypto_block_luks_parse_header).
#pragma once

#include <cstdint>
#include <string>

#include "drivers/luks/header.h"

namespace vblk::luks {

struct Algorithms {
  std::string cipher_alg;      // "aes-256": QCryptoCipherAlgorithm
  std::string cipher_mode;     // "ecb" | "cbc" | "xts" | "ctr"
  std::string ivgen_alg;       // "plain" | "plain64" | "essiv"
  std::string ivgen_hash_alg;  // "" unless the header names one
  std::string hash_alg;        // PBKDF2 and anti-forensic hash
  uint32_t key_bytes = 0;      // the master key (both halves for xts)
};

// The header's algorithms, or QEMU's error: "Unexpected cipher mode string
// format 'x'", "Cipher mode 'x' not supported", "Algorithm 'x' with key size
// N bytes not supported", "Hash algorithm 'x' not supported", "IV generator
// 'x' not supported", "Missing IV generator hash specification".
Result<Algorithms> parse_algorithms(const Header& h);

// Bytes of key a QCryptoCipherAlgorithm takes (aes-256: 32), 0 if unknown.
uint32_t cipher_key_len(const std::string& alg);
// The LUKS cipher_name of a QCryptoCipherAlgorithm ("aes-256" -> "aes").
std::string cipher_family(const std::string& alg);
// Digest length of a QCryptoHashAlgorithm name, 0 if unknown.
size_t hash_digest_len(const std::string& hash);

}  // namespace vblk::luks
