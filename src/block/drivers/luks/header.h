// The LUKS1 on-disk header (cryptsetup's docs/on-disk-format.pdf, as QEMU's
// crypto/block-luks.c reads and writes it): 592 big-endian bytes at offset 0,
// eight key slots, the payload from `payload_offset_sector` * 512 on.
//
// parse_luks_header() checks every field before anything uses it, in the
// order and with the words of QEMU 7.2's qcrypto_block_luks_check_header, so
// a hostile header (key material past the payload, slots overlapping, zero
// stripes or iterations) is refused before a byte of key material is read.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "vblk/result.h"

namespace vblk::luks {

constexpr size_t kHeaderSize = 592;
constexpr uint64_t kSectorSize = 512;
constexpr size_t kNumKeySlots = 8;
constexpr uint32_t kStripes = 4000;
constexpr size_t kDigestLen = 20;
constexpr size_t kSaltLen = 32;
constexpr size_t kUuidLen = 40;
constexpr size_t kNameLen = 32;  // cipher name, cipher mode, hash spec
// Key material starts at 4 KiB and each slot's area is a multiple of it
// (cryptsetup's alignment, which QEMU checks and writes).
constexpr uint64_t kKeySlotOffset = 4096;
constexpr uint32_t kSlotEnabled = 0x00AC71F3;
constexpr uint32_t kSlotDisabled = 0x0000DEAD;
constexpr uint8_t kMagic[6] = {'L', 'U', 'K', 'S', 0xBA, 0xBE};

struct KeySlot {
  uint32_t active = kSlotDisabled;
  uint32_t iterations = 0;
  std::array<uint8_t, kSaltLen> salt{};
  uint32_t key_offset_sector = 0;
  uint32_t stripes = kStripes;
};

struct Header {
  uint16_t version = 1;
  std::string cipher_name;  // "aes"
  std::string cipher_mode;  // "xts-plain64", "cbc-essiv:sha256"
  std::string hash_spec;    // "sha256"
  uint32_t payload_offset_sector = 0;
  uint32_t master_key_len = 0;
  std::array<uint8_t, kDigestLen> master_key_digest{};
  std::array<uint8_t, kSaltLen> master_key_salt{};
  uint32_t master_key_iterations = 0;
  std::string uuid;
  std::array<KeySlot, kNumKeySlots> slots{};

  uint64_t payload_offset() const { return uint64_t{payload_offset_sector} * kSectorSize; }
};

// Whether `head` starts with a LUKS1 header (magic and version 1): QEMU's
// qcrypto_block_luks_has_format. LUKS2 (version 2) is not LUKS1.
bool has_luks_magic(std::span<const uint8_t> head);

// Decodes and validates the first kHeaderSize bytes.
Result<Header> parse_header(std::span<const uint8_t> bytes);

// The sectors a slot's key material takes: key bytes * stripes, rounded up
// to sectors and then to the 4 KiB header alignment.
uint64_t key_material_sectors(uint32_t master_key_len, uint32_t stripes);

// The kHeaderSize bytes of `h` (create).
std::vector<uint8_t> serialize_header(const Header& h);

}  // namespace vblk::luks
