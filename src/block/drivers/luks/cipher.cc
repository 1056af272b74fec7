// LUKS sector cipher over OpenSSL EVP: see cipher.h.
#include "drivers/luks/cipher.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cstring>

namespace vblk::luks {

namespace {

// OpenSSL's name of a QEMU cipher in a mode, "" when it has none (aes-192
// in xts: OpenSSL implements xts for 128 and 256 only).
std::string openssl_cipher_name(const std::string& alg, const std::string& mode) {
  if (cipher_family(alg) != "aes") return {};
  std::string bits = alg.substr(4);
  if (mode == "xts" && bits == "192") return {};
  std::string m = mode;
  for (auto& c : m) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return "AES-" + bits + "-" + m;
}

EVP_CIPHER_CTX* new_ctx(const EVP_CIPHER* c, std::span<const uint8_t> key, int enc) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  if (!ctx) return nullptr;
  if (EVP_CipherInit_ex2(ctx, c, key.data(), nullptr, enc, nullptr) != 1) {
    EVP_CIPHER_CTX_free(ctx);
    return nullptr;
  }
  EVP_CIPHER_CTX_set_padding(ctx, 0);
  return ctx;
}

struct CipherRef {
  EVP_CIPHER* c;
  ~CipherRef() { EVP_CIPHER_free(c); }
};

}  // namespace

KeyBuffer& KeyBuffer::operator=(KeyBuffer&& o) noexcept {
  wipe();
  b_ = std::move(o.b_);
  return *this;
}

void KeyBuffer::wipe() {
  if (!b_.empty()) OPENSSL_cleanse(b_.data(), b_.size());
}

std::string openssl_hash_name(const std::string& hash) {
  std::string n = hash;
  for (auto& c : n) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return n;
}

Result<std::unique_ptr<SectorCipher>> SectorCipher::create(const Algorithms& a, std::span<const uint8_t> key) {
  std::string name = openssl_cipher_name(a.cipher_alg, a.cipher_mode);
  CipherRef c{name.empty() ? nullptr : EVP_CIPHER_fetch(nullptr, name.c_str(), nullptr)};
  if (!c.c)
    return Error(ENOTSUP,
                 "Cipher algorithm '" + a.cipher_alg + "' in mode '" + a.cipher_mode + "' is not supported by vblk");
  if (static_cast<size_t>(EVP_CIPHER_get_key_length(c.c)) != key.size())
    return Error(EINVAL, "Cipher key length " + std::to_string(key.size()) + " does not match " + a.cipher_alg + "-" +
                             a.cipher_mode);
  std::unique_ptr<SectorCipher> s(new SectorCipher());
  s->niv_ = a.cipher_mode == "ecb" ? 0 : static_cast<size_t>(EVP_CIPHER_get_iv_length(c.c));
  s->enc_ = new_ctx(c.c, key, 1);
  s->dec_ = new_ctx(c.c, key, 0);
  if (!s->enc_ || !s->dec_) return Error(EINVAL, "Cannot initialize cipher " + a.cipher_alg + "-" + a.cipher_mode);
  if (a.ivgen_alg == "plain") {
    s->ivgen_ = Ivgen::kPlain;
  } else if (a.ivgen_alg == "essiv") {
    s->ivgen_ = Ivgen::kEssiv;
    // The IV cipher is keyed with the hash of the key; its size is the
    // digest's (sha256 makes aes-256 whatever the payload's aes size).
    size_t dlen = hash_digest_len(a.ivgen_hash_alg);
    if (dlen != 16 && dlen != 24 && dlen != 32)
      return Error(ENOTSUP, "No AES cipher with key size " + std::to_string(dlen) + " available");
    std::string md_name = openssl_hash_name(a.ivgen_hash_alg);
    EVP_MD* md = EVP_MD_fetch(nullptr, md_name.c_str(), nullptr);
    if (!md) return Error(ENOTSUP, "Hash algorithm '" + a.ivgen_hash_alg + "' not supported by vblk");
    KeyBuffer digest(dlen);
    unsigned int out = 0;
    int ok = EVP_Digest(key.data(), key.size(), digest.data(), &out, md, nullptr);
    EVP_MD_free(md);
    if (ok != 1 || out != dlen) return Error(EIO, "Unable to hash the key for essiv");
    std::string ename = "AES-" + std::to_string(dlen * 8) + "-ECB";
    CipherRef ec{EVP_CIPHER_fetch(nullptr, ename.c_str(), nullptr)};
    s->essiv_ = ec.c ? new_ctx(ec.c, digest.span(), 1) : nullptr;
    if (!s->essiv_) return Error(ENOTSUP, "Cannot initialize the essiv cipher " + ename);
  }
  return s;
}

SectorCipher::~SectorCipher() {
  EVP_CIPHER_CTX_free(enc_);
  EVP_CIPHER_CTX_free(dec_);
  EVP_CIPHER_CTX_free(essiv_);
}

Status SectorCipher::make_iv(uint64_t sector, uint8_t* iv) {
  std::memset(iv, 0, niv_);
  uint64_t n = ivgen_ == Ivgen::kPlain ? (sector & 0xffffffffu) : sector;
  size_t nbytes = ivgen_ == Ivgen::kPlain ? 4 : 8;
  for (size_t i = 0; i < std::min(nbytes, niv_); ++i) iv[i] = static_cast<uint8_t>(n >> (8 * i));
  if (ivgen_ == Ivgen::kEssiv) {
    int outl = 0;
    if (EVP_CipherUpdate(essiv_, iv, &outl, iv, static_cast<int>(niv_)) != 1 || outl != static_cast<int>(niv_))
      return Error(EIO, "essiv IV generation failed");
  }
  return {};
}

Status SectorCipher::crypt(uint64_t sector, std::span<uint8_t> buf, EVP_CIPHER_CTX* ctx) {
  uint8_t iv[32];
  for (size_t off = 0; off < buf.size(); off += kSectorSize, ++sector) {
    size_t n = std::min<size_t>(kSectorSize, buf.size() - off);
    const uint8_t* ivp = nullptr;
    if (niv_) {
      VBLK_TRY(make_iv(sector, iv));
      ivp = iv;
    }
    int outl = 0;
    if (EVP_CipherInit_ex2(ctx, nullptr, nullptr, ivp, -1, nullptr) != 1 ||
        EVP_CipherUpdate(ctx, buf.data() + off, &outl, buf.data() + off, static_cast<int>(n)) != 1 ||
        outl != static_cast<int>(n))
      return Error(EIO, "Sector encryption failed");
  }
  return {};
}

}  // namespace vblk::luks
