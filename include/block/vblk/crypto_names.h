// The names QEMU's QAPI crypto enums take (qapi/crypto.json:
// QCryptoCipherAlgorithm, QCryptoCipherMode, QCryptoIVGenAlgorithm,
// QCryptoHashAlgorithm), in the schema's order: the luks driver parses
// creation options against them, QMP's blockdev-create schema checks them
// ("Parameter 'cipher-alg' does not accept value 'x'").
#pragma once

#include <span>

namespace vblk::crypto_names {

inline constexpr const char* kCipherAlgArray[] = {
    "aes-128",     "aes-192",     "aes-256",     "des",         "3des",        "cast5-128", "serpent-128",
    "serpent-192", "serpent-256", "twofish-128", "twofish-192", "twofish-256", "sm4"};
inline constexpr const char* kCipherModeArray[] = {"ecb", "cbc", "xts", "ctr"};
inline constexpr const char* kIvgenAlgArray[] = {"plain", "plain64", "essiv"};
inline constexpr const char* kHashAlgArray[] = {"md5", "sha1", "sha224", "sha256", "sha384", "sha512", "ripemd160"};

inline constexpr std::span<const char* const> kCipherAlgs = kCipherAlgArray;
inline constexpr std::span<const char* const> kCipherModes = kCipherModeArray;
inline constexpr std::span<const char* const> kIvgenAlgs = kIvgenAlgArray;
inline constexpr std::span<const char* const> kHashAlgs = kHashAlgArray;

}  // namespace vblk::crypto_names
