// LUKS header algorithm names: see algorithms.h.
#include "drivers/luks/algorithms.h"

#include <array>
#include <cstring>

namespace vblk::luks {

namespace {

// QEMU's cipher name map: the family and its key sizes (bytes).
struct Family {
  const char* name;
  std::array<uint32_t, 3> sizes;  // 0: none
};
constexpr Family kFamilies[] = {
    {"aes", {16, 24, 32}},
    {"cast5", {16, 0, 0}},
    {"serpent", {16, 24, 32}},
    {"twofish", {16, 24, 32}},
};

struct Hash {
  const char* name;
  size_t len;
};
constexpr Hash kHashes[] = {{"md5", 16},    {"sha1", 20},   {"sha224", 28},   {"sha256", 32},
                            {"sha384", 48}, {"sha512", 64}, {"ripemd160", 20}};

bool known(const char* const* names, size_t n, const std::string& s) {
  for (size_t i = 0; i < n; ++i)
    if (s == names[i]) return true;
  return false;
}

constexpr const char* kModes[] = {"ecb", "cbc", "xts", "ctr"};
constexpr const char* kIvgens[] = {"plain", "plain64", "essiv"};

Error not_supported(const char* type, const std::string& name) {
  return Error(ENOTSUP, std::string(type) + " '" + name + "' not supported");
}

}  // namespace

size_t hash_digest_len(const std::string& hash) {
  for (const auto& h : kHashes)
    if (hash == h.name) return h.len;
  return 0;
}

uint32_t cipher_key_len(const std::string& alg) {
  size_t dash = alg.rfind('-');
  if (dash == std::string::npos) return 0;
  std::string fam = alg.substr(0, dash), bits = alg.substr(dash + 1);
  for (const auto& f : kFamilies) {
    if (fam != f.name) continue;
    for (uint32_t s : f.sizes)
      if (s && bits == std::to_string(s * 8)) return s;
  }
  return 0;
}

std::string cipher_family(const std::string& alg) { return alg.substr(0, alg.rfind('-')); }

Result<Algorithms> parse_algorithms(const Header& h) {
  Algorithms a;
  // <mode>-<ivgen>[:<ivhash>]
  size_t dash = h.cipher_mode.find('-');
  if (dash == std::string::npos) return Error(EINVAL, "Unexpected cipher mode string format '" + h.cipher_mode + "'");
  std::string mode = h.cipher_mode.substr(0, dash);
  std::string ivgen = h.cipher_mode.substr(dash + 1);
  size_t colon = ivgen.find(':');
  bool has_ivhash = colon != std::string::npos;
  if (has_ivhash) {
    a.ivgen_hash_alg = ivgen.substr(colon + 1);
    ivgen.resize(colon);
    if (!hash_digest_len(a.ivgen_hash_alg)) return not_supported("Hash algorithm", a.ivgen_hash_alg);
  }
  if (!known(kModes, std::size(kModes), mode)) return not_supported("Cipher mode", mode);
  a.cipher_mode = mode;
  // xts keys are two keys of the cipher's size.
  uint32_t key_bytes = h.master_key_len;
  if (mode == "xts") key_bytes /= 2;
  for (const auto& f : kFamilies) {
    if (h.cipher_name != f.name) continue;
    for (uint32_t s : f.sizes)
      if (s && s == key_bytes) a.cipher_alg = std::string(f.name) + "-" + std::to_string(s * 8);
  }
  if (a.cipher_alg.empty())
    return Error(ENOTSUP, "Algorithm '" + h.cipher_name + "' with key size " + std::to_string(key_bytes) +
                              " bytes not supported");
  a.key_bytes = h.master_key_len;
  if (!hash_digest_len(h.hash_spec)) return not_supported("Hash algorithm", h.hash_spec);
  a.hash_alg = h.hash_spec;
  if (!known(kIvgens, std::size(kIvgens), ivgen)) return not_supported("IV generator", ivgen);
  a.ivgen_alg = ivgen;
  if (ivgen == "essiv" && !has_ivhash) return Error(EINVAL, "Missing IV generator hash specification");
  return a;
}

}  // namespace vblk::luks
