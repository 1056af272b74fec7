// SHA-256 hex digests (OpenSSL's libcrypto), for the few places that must
// print the digest QEMU prints (x-debug-block-dirty-bitmap-sha256).
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace vblk {

// Lowercase hex of the SHA-256 digest of `data`.
std::string sha256_hex(std::span<const uint8_t> data);

}  // namespace vblk
