// SHA-256 (FIPS 180-4), for the few places that must print the digest QEMU
// prints (x-debug-block-dirty-bitmap-sha256). Not for anything hot.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

namespace vblk {

std::array<uint8_t, 32> sha256(std::span<const uint8_t> data);
// Lowercase hex of the digest.
std::string sha256_hex(std::span<const uint8_t> data);

}  // namespace vblk
