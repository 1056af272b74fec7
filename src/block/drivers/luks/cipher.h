// Sector encryption of a LUKS payload (and of key material, which LUKS
// encrypts the same way): each 512-byte sector is encrypted on its own with
// an IV made from its sector number (QEMU's qcrypto_block_cipher_*_helper
// with crypto/ivgen-*.c):
//   plain    the number's low 32 bits, little-endian, zero padded
//   plain64  the number, 64-bit little-endian, zero padded
//   essiv    plain64 encrypted (ECB) with hash(key) as the key, the AES size
//            matching the hash's digest (dm-crypt's rule)
// through OpenSSL EVP (aes in ecb, cbc, xts, ctr modes; QEMU's cast5,
// serpent and twofish have no OpenSSL provider and are refused).
//
// Thread-safety: none; one cipher per node, used from its loop.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "drivers/luks/algorithms.h"

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;

namespace vblk::luks {

// Key bytes that are wiped when they go.
class KeyBuffer {
 public:
  KeyBuffer() = default;
  explicit KeyBuffer(size_t n) : b_(n, 0) {}
  KeyBuffer(KeyBuffer&& o) noexcept = default;
  KeyBuffer& operator=(KeyBuffer&& o) noexcept;
  KeyBuffer(const KeyBuffer&) = delete;
  KeyBuffer& operator=(const KeyBuffer&) = delete;
  ~KeyBuffer() { wipe(); }
  uint8_t* data() { return b_.data(); }
  const uint8_t* data() const { return b_.data(); }
  size_t size() const { return b_.size(); }
  std::span<uint8_t> span() { return b_; }
  std::span<const uint8_t> span() const { return b_; }

 private:
  void wipe();
  std::vector<uint8_t> b_;
};

class SectorCipher {
 public:
  // A cipher for `a` keyed with `key` (a.key_bytes long). Errors: the
  // algorithm has no OpenSSL implementation, essiv's hash has no AES size.
  static Result<std::unique_ptr<SectorCipher>> create(const Algorithms& a, std::span<const uint8_t> key);
  ~SectorCipher();
  SectorCipher(const SectorCipher&) = delete;
  SectorCipher& operator=(const SectorCipher&) = delete;

  // In place, whole sectors; the first has number `sector`.
  Status encrypt(uint64_t sector, std::span<uint8_t> buf) { return crypt(sector, buf, enc_); }
  Status decrypt(uint64_t sector, std::span<uint8_t> buf) { return crypt(sector, buf, dec_); }

 private:
  SectorCipher() = default;
  Status crypt(uint64_t sector, std::span<uint8_t> buf, EVP_CIPHER_CTX* ctx);
  Status make_iv(uint64_t sector, uint8_t* iv);

  EVP_CIPHER_CTX* enc_ = nullptr;
  EVP_CIPHER_CTX* dec_ = nullptr;
  EVP_CIPHER_CTX* essiv_ = nullptr;  // essiv only
  size_t niv_ = 0;                   // IV bytes (0 for ecb)
  enum class Ivgen { kPlain, kPlain64, kEssiv } ivgen_ = Ivgen::kPlain64;
};

// The OpenSSL name of a QCryptoHashAlgorithm ("sha256" -> "SHA256").
std::string openssl_hash_name(const std::string& hash);

}  // namespace vblk::luks
