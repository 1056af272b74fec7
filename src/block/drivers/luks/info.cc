// The luks driver's helpers shared by open and create: see luks.h.
#include <cstring>

#include "drivers/luks/luks.h"
#include "vblk/secret_store.h"

namespace vblk::luks {

namespace {

// Well-formed UTF-8 sequences (lead byte, length, continuation bytes).
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80                   ? 1
                 : (c >= 0xC2 && c <= 0xDF) ? 2
                 : (c & 0xF0) == 0xE0       ? 3
                 : (c >= 0xF0 && c <= 0xF4) ? 4
                                            : 0;
    if (!len || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

}  // namespace

Result<std::string> lookup_password(const std::string& id) {
  auto secret = SecretStore::process().lookup(id);
  VBLK_TRY(secret);
  std::string pw = std::move(*secret);
  if (!valid_utf8(pw)) {
    explicit_bzero(pw.data(), pw.size());
    return Error(EINVAL, "Data from secret " + id + " is not valid UTF-8");
  }
  size_t nul = pw.find('\0');
  if (nul != std::string::npos) {
    explicit_bzero(pw.data() + nul, pw.size() - nul);
    pw.resize(nul);
  }
  return pw;
}

LuksInfo info(const Header& h, const Algorithms& a) {
  LuksInfo d;
  d.cipher_alg = a.cipher_alg;
  d.cipher_mode = a.cipher_mode;
  d.ivgen_alg = a.ivgen_alg;
  if (a.ivgen_alg == "essiv") d.ivgen_hash_alg = a.ivgen_hash_alg;
  d.hash_alg = a.hash_alg;
  d.payload_offset = h.payload_offset();
  d.master_key_iters = h.master_key_iterations;
  d.uuid = h.uuid;
  for (const auto& s : h.slots) {
    LuksSlotInfo j;
    j.active = s.active == kSlotEnabled;
    if (j.active) {
      j.iters = s.iterations;
      j.stripes = s.stripes;
    }
    j.key_offset = uint64_t{s.key_offset_sector} * kSectorSize;
    d.slots.push_back(j);
  }
  return d;
}

}  // namespace vblk::luks
