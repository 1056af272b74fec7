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

nlohmann::ordered_json info_json(const Header& h, const Algorithms& a) {
  nlohmann::ordered_json d;
  d["cipher-alg"] = a.cipher_alg;
  d["cipher-mode"] = a.cipher_mode;
  d["ivgen-alg"] = a.ivgen_alg;
  if (a.ivgen_alg == "essiv") d["ivgen-hash-alg"] = a.ivgen_hash_alg;
  d["hash-alg"] = a.hash_alg;
  d["payload-offset"] = h.payload_offset();
  d["master-key-iters"] = h.master_key_iterations;
  d["uuid"] = h.uuid;
  nlohmann::ordered_json slots = nlohmann::ordered_json::array();
  for (const auto& s : h.slots) {
    nlohmann::ordered_json j;
    j["active"] = s.active == kSlotEnabled;
    if (s.active == kSlotEnabled) {
      j["iters"] = s.iterations;
      j["stripes"] = s.stripes;
    }
    j["key-offset"] = uint64_t{s.key_offset_sector} * kSectorSize;
    slots.push_back(std::move(j));
  }
  d["slots"] = std::move(slots);
  return {{"type", "luks"}, {"data", std::move(d)}};
}

}  // namespace vblk::luks
