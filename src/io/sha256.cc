// SHA-256 through OpenSSL's EVP interface: see sha256.h.
#include "vblk/sha256.h"

#include <openssl/evp.h>

#include <cstdlib>

namespace vblk {

std::string sha256_hex(std::span<const uint8_t> data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // Only fails on allocation failure inside libcrypto.
  if (!EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr)) std::abort();
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (unsigned i = 0; i < len; ++i) {
    hex += kDigits[md[i] >> 4];
    hex += kDigits[md[i] & 15];
  }
  return hex;
}

}  // namespace vblk
