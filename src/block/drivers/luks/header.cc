// LUKS1 header decoding and validation: see header.h.
#include "drivers/luks/header.h"

#include <cstring>

namespace vblk::luks {

namespace {

uint32_t get32(const uint8_t* p) { return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | p[3]; }
void put32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}

// Field offsets of the packed on-disk structure.
constexpr size_t kOffVersion = 6, kOffCipherName = 8, kOffCipherMode = 40, kOffHashSpec = 72, kOffPayload = 104,
                 kOffKeyBytes = 108, kOffDigest = 112, kOffMkSalt = 132, kOffMkIters = 164, kOffUuid = 168,
                 kOffSlots = 208, kSlotSize = 48;

// A fixed-size text field: the text before its NUL, or nothing when it has
// none (the caller reports that).
bool get_text(const uint8_t* p, size_t len, std::string& out) {
  const void* nul = std::memchr(p, 0, len);
  if (!nul) return false;
  out.assign(reinterpret_cast<const char*>(p), static_cast<const uint8_t*>(nul) - p);
  return true;
}

Status check_header(const Header& h) {
  const uint64_t header_sectors = kKeySlotOffset / kSectorSize;
  if (h.payload_offset_sector < header_sectors) return Error(EINVAL, "LUKS payload is overlapping with the header");
  if (h.master_key_iterations == 0) return Error(EINVAL, "LUKS key iteration count is zero");
  for (size_t i = 0; i < kNumKeySlots; ++i) {
    const KeySlot& s1 = h.slots[i];
    if (s1.stripes != kStripes)
      return Error(EINVAL, "Keyslot " + std::to_string(i) + " is corrupted (stripes " + std::to_string(s1.stripes) +
                               " != " + std::to_string(kStripes) + ")");
    if (s1.active != kSlotDisabled && s1.active != kSlotEnabled)
      return Error(EINVAL, "Keyslot " + std::to_string(i) + " state (active/disable) is corrupted");
    if (s1.active == kSlotEnabled && s1.iterations == 0)
      return Error(EINVAL, "Keyslot " + std::to_string(i) + " iteration count is zero");
    uint64_t start1 = s1.key_offset_sector;
    uint64_t len1 = key_material_sectors(h.master_key_len, s1.stripes);
    if (start1 < header_sectors)
      return Error(EINVAL, "Keyslot " + std::to_string(i) + " is overlapping with the LUKS header");
    if (start1 + len1 > h.payload_offset_sector)
      return Error(EINVAL, "Keyslot " + std::to_string(i) + " is overlapping with the encrypted payload");
    for (size_t j = i + 1; j < kNumKeySlots; ++j) {
      const KeySlot& s2 = h.slots[j];
      uint64_t start2 = s2.key_offset_sector;
      uint64_t len2 = key_material_sectors(h.master_key_len, s2.stripes);
      if (start1 < start2 + len2 && start2 < start1 + len1)
        return Error(EINVAL,
                     "Keyslots " + std::to_string(i) + " and " + std::to_string(j) + " are overlapping in the header");
    }
  }
  return {};
}

}  // namespace

bool has_luks_magic(std::span<const uint8_t> head) {
  return head.size() >= kOffCipherName && std::memcmp(head.data(), kMagic, sizeof kMagic) == 0 &&
         head[kOffVersion] == 0 && head[kOffVersion + 1] == 1;
}

uint64_t key_material_sectors(uint32_t master_key_len, uint32_t stripes) {
  const uint64_t header_sectors = kKeySlotOffset / kSectorSize;
  uint64_t sectors = (uint64_t{master_key_len} * stripes + kSectorSize - 1) / kSectorSize;
  return (sectors + header_sectors - 1) / header_sectors * header_sectors;
}

Result<Header> parse_header(std::span<const uint8_t> b) {
  if (b.size() < kHeaderSize) return Error(EINVAL, "Volume is not in LUKS format");
  const uint8_t* p = b.data();
  Header h;
  if (std::memcmp(p, kMagic, sizeof kMagic) != 0) return Error(EINVAL, "Volume is not in LUKS format");
  h.version = static_cast<uint16_t>(p[kOffVersion] << 8 | p[kOffVersion + 1]);
  if (h.version != 1) return Error(ENOTSUP, "LUKS version " + std::to_string(h.version) + " is not supported");
  if (!get_text(p + kOffCipherName, kNameLen, h.cipher_name))
    return Error(EINVAL, "LUKS header cipher name is not NUL terminated");
  if (!get_text(p + kOffCipherMode, kNameLen, h.cipher_mode))
    return Error(EINVAL, "LUKS header cipher mode is not NUL terminated");
  if (!get_text(p + kOffHashSpec, kNameLen, h.hash_spec))
    return Error(EINVAL, "LUKS header hash spec is not NUL terminated");
  h.payload_offset_sector = get32(p + kOffPayload);
  h.master_key_len = get32(p + kOffKeyBytes);
  std::memcpy(h.master_key_digest.data(), p + kOffDigest, kDigestLen);
  std::memcpy(h.master_key_salt.data(), p + kOffMkSalt, kSaltLen);
  h.master_key_iterations = get32(p + kOffMkIters);
  // The UUID field need not be NUL terminated (36 characters in 40 bytes;
  // QEMU prints up to the first NUL or all 40).
  const uint8_t* u = p + kOffUuid;
  h.uuid.assign(reinterpret_cast<const char*>(u), strnlen(reinterpret_cast<const char*>(u), kUuidLen));
  for (size_t i = 0; i < kNumKeySlots; ++i) {
    const uint8_t* s = p + kOffSlots + i * kSlotSize;
    KeySlot& k = h.slots[i];
    k.active = get32(s);
    k.iterations = get32(s + 4);
    std::memcpy(k.salt.data(), s + 8, kSaltLen);
    k.key_offset_sector = get32(s + 40);
    k.stripes = get32(s + 44);
  }
  VBLK_TRY(check_header(h));
  return h;
}

std::vector<uint8_t> serialize_header(const Header& h) {
  std::vector<uint8_t> b(kHeaderSize, 0);
  uint8_t* p = b.data();
  std::memcpy(p, kMagic, sizeof kMagic);
  p[kOffVersion] = static_cast<uint8_t>(h.version >> 8);
  p[kOffVersion + 1] = static_cast<uint8_t>(h.version);
  // Callers keep the names shorter than the field (create checks).
  std::memcpy(p + kOffCipherName, h.cipher_name.data(), std::min(h.cipher_name.size(), kNameLen - 1));
  std::memcpy(p + kOffCipherMode, h.cipher_mode.data(), std::min(h.cipher_mode.size(), kNameLen - 1));
  std::memcpy(p + kOffHashSpec, h.hash_spec.data(), std::min(h.hash_spec.size(), kNameLen - 1));
  put32(p + kOffPayload, h.payload_offset_sector);
  put32(p + kOffKeyBytes, h.master_key_len);
  std::memcpy(p + kOffDigest, h.master_key_digest.data(), kDigestLen);
  std::memcpy(p + kOffMkSalt, h.master_key_salt.data(), kSaltLen);
  put32(p + kOffMkIters, h.master_key_iterations);
  std::memcpy(p + kOffUuid, h.uuid.data(), std::min(h.uuid.size(), kUuidLen));
  for (size_t i = 0; i < kNumKeySlots; ++i) {
    uint8_t* s = p + kOffSlots + i * kSlotSize;
    const KeySlot& k = h.slots[i];
    put32(s, k.active);
    put32(s + 4, k.iterations);
    std::memcpy(s + 8, k.salt.data(), kSaltLen);
    put32(s + 40, k.key_offset_sector);
    put32(s + 44, k.stripes);
  }
  return b;
}

}  // namespace vblk::luks
