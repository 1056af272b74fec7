// LUKS key slots: see keyslot.h.
#include "drivers/luks/keyslot.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <cstring>

namespace vblk::luks {

namespace {

struct MdRef {
  EVP_MD* md;
  ~MdRef() { EVP_MD_free(md); }
};

Result<EVP_MD*> fetch_md(const std::string& hash) {
  std::string name = openssl_hash_name(hash);
  EVP_MD* md = EVP_MD_fetch(nullptr, name.c_str(), nullptr);
  if (!md) return Error(ENOTSUP, "Hash algorithm '" + hash + "' not supported by vblk");
  return md;
}

// cryptsetup's diffuser: the block is hashed in digest-sized pieces, each
// prefixed by its big-endian index; the last piece may be short.
Status diffuse(const EVP_MD* md, std::span<uint8_t> block) {
  const size_t dlen = static_cast<size_t>(EVP_MD_get_size(md));
  uint8_t out[EVP_MAX_MD_SIZE];
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  if (!ctx) return Error(ENOMEM);
  Status st;
  for (size_t i = 0, off = 0; off < block.size(); ++i, off += dlen) {
    size_t n = std::min(dlen, block.size() - off);
    uint8_t iv[4] = {static_cast<uint8_t>(i >> 24), static_cast<uint8_t>(i >> 16), static_cast<uint8_t>(i >> 8),
                     static_cast<uint8_t>(i)};
    if (EVP_DigestInit_ex(ctx, md, nullptr) != 1 || EVP_DigestUpdate(ctx, iv, 4) != 1 ||
        EVP_DigestUpdate(ctx, block.data() + off, n) != 1 || EVP_DigestFinal_ex(ctx, out, nullptr) != 1) {
      st = Error(EIO, "Anti-forensic diffusion failed");
      break;
    }
    std::memcpy(block.data() + off, out, n);
  }
  EVP_MD_CTX_free(ctx);
  OPENSSL_cleanse(out, sizeof out);
  return st;
}

void xor_into(const uint8_t* a, const uint8_t* b, uint8_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] ^ b[i];
}

}  // namespace

Status pbkdf2(const std::string& hash, std::span<const uint8_t> password, std::span<const uint8_t> salt,
              uint32_t iterations, std::span<uint8_t> out) {
  auto md = fetch_md(hash);
  VBLK_TRY(md);
  MdRef ref{*md};
  // OpenSSL takes the count as an int.
  if (iterations == 0 || iterations > INT32_MAX) return Error(EINVAL, "PBKDF2 iteration count out of range");
  if (PKCS5_PBKDF2_HMAC(reinterpret_cast<const char*>(password.data()), static_cast<int>(password.size()), salt.data(),
                        static_cast<int>(salt.size()), static_cast<int>(iterations), ref.md,
                        static_cast<int>(out.size()), out.data()) != 1)
    return Error(EIO, "PBKDF2 failed");
  return {};
}

Status af_merge(const std::string& hash, uint32_t stripes, std::span<const uint8_t> split, std::span<uint8_t> out) {
  const size_t blen = out.size();
  if (stripes == 0 || split.size() != blen * stripes) return Error(EINVAL, "Bad anti-forensic split size");
  auto md = fetch_md(hash);
  VBLK_TRY(md);
  MdRef ref{*md};
  KeyBuffer block(blen);
  for (uint32_t i = 0; i + 1 < stripes; ++i) {
    xor_into(split.data() + i * blen, block.data(), block.data(), blen);
    VBLK_TRY(diffuse(ref.md, block.span()));
  }
  xor_into(split.data() + (stripes - 1) * blen, block.data(), out.data(), blen);
  return {};
}

Status af_split(const std::string& hash, uint32_t stripes, std::span<const uint8_t> key, std::span<uint8_t> out) {
  const size_t blen = key.size();
  if (stripes == 0 || out.size() != blen * stripes) return Error(EINVAL, "Bad anti-forensic split size");
  auto md = fetch_md(hash);
  VBLK_TRY(md);
  MdRef ref{*md};
  KeyBuffer block(blen);
  for (uint32_t i = 0; i + 1 < stripes; ++i) {
    if (RAND_bytes(out.data() + i * blen, static_cast<int>(blen)) != 1)
      return Error(EIO, "Unable to read random bytes");
    xor_into(out.data() + i * blen, block.data(), block.data(), blen);
    VBLK_TRY(diffuse(ref.md, block.span()));
  }
  xor_into(key.data(), block.data(), out.data() + (stripes - 1) * blen, blen);
  return {};
}

Result<KeyBuffer> unlock(const Header& h, const Algorithms& a, std::span<const uint8_t> password,
                         std::span<const std::vector<uint8_t>> material) {
  KeyBuffer master(h.master_key_len);
  for (size_t i = 0; i < kNumKeySlots; ++i) {
    const KeySlot& s = h.slots[i];
    if (s.active != kSlotEnabled) continue;
    if (i >= material.size() || material[i].size() != key_material_bytes(h, s))
      return Error(EINVAL, "Key material of keyslot " + std::to_string(i) + " is missing");
    // The passphrase's key for this slot decrypts its split master key.
    KeyBuffer slot_key(h.master_key_len);
    VBLK_TRY(pbkdf2(a.hash_alg, password, s.salt, s.iterations, slot_key.span()));
    auto cipher = SectorCipher::create(a, slot_key.span());
    VBLK_TRY(cipher);
    KeyBuffer split(material[i].size());
    std::memcpy(split.data(), material[i].data(), split.size());
    VBLK_TRY((*cipher)->decrypt(0, split.span()));
    VBLK_TRY(af_merge(a.hash_alg, s.stripes, split.span(), master.span()));
    std::array<uint8_t, kDigestLen> digest{};
    VBLK_TRY(pbkdf2(a.hash_alg, master.span(), h.master_key_salt, h.master_key_iterations, digest));
    if (CRYPTO_memcmp(digest.data(), h.master_key_digest.data(), kDigestLen) == 0) return master;
  }
  return Error(EACCES, "Invalid password, cannot unlock any keyslot");
}

Result<std::vector<uint8_t>> make_slot(const Header& h, const Algorithms& a, KeySlot& s,
                                       std::span<const uint8_t> password, uint32_t iterations,
                                       std::span<const uint8_t> master_key) {
  if (RAND_bytes(s.salt.data(), static_cast<int>(s.salt.size())) != 1) return Error(EIO, "Unable to read random bytes");
  s.iterations = iterations;
  s.stripes = kStripes;
  s.active = kSlotEnabled;
  KeyBuffer slot_key(h.master_key_len);
  VBLK_TRY(pbkdf2(a.hash_alg, password, s.salt, s.iterations, slot_key.span()));
  std::vector<uint8_t> split(key_material_bytes(h, s));
  VBLK_TRY(af_split(a.hash_alg, s.stripes, master_key, split));
  auto cipher = SectorCipher::create(a, slot_key.span());
  VBLK_TRY(cipher);
  VBLK_TRY((*cipher)->encrypt(0, split));
  return split;
}

}  // namespace vblk::luks
