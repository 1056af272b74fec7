// What an image format shows beyond the generic image info (QAPI's
// ImageInfoSpecific), as data: one struct per driver that has any. The
// block layer fills them; the layer that shows them renders them (qmp's
// format_info_json.h: the QAPI JSON that `vblk info` and
// query-named-block-nodes print).
//
// Optional members are the ones QAPI leaves out when absent; each struct
// lists its members in the schema's order.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace vblk {

// QCryptoBlockInfoLUKSSlot.
struct LuksSlotInfo {
  bool active = false;
  uint32_t iters = 0;    // shown only when active
  uint32_t stripes = 0;  // shown only when active
  uint64_t key_offset = 0;
};

// QCryptoBlockInfoLUKS: a luks node's info, and a qcow2 image's encryption.
struct LuksInfo {
  std::string cipher_alg;
  std::string cipher_mode;
  std::string ivgen_alg;
  std::optional<std::string> ivgen_hash_alg;  // essiv only
  std::string hash_alg;
  uint64_t payload_offset = 0;
  uint32_t master_key_iters = 0;
  std::string uuid;
  std::vector<LuksSlotInfo> slots;
};

// Qcow2BitmapInfo: one entry of the bitmap directory as stored.
struct Qcow2BitmapInfo {
  std::string name;
  uint64_t granularity = 0;
  bool in_use = false;    // flags "in-use"
  bool autoload = false;  // flags "auto"
};

// ImageInfoSpecificQCow2.
struct Qcow2Info {
  std::string compat;                  // "1.1" (version 3) or "0.10"
  std::optional<bool> lazy_refcounts;  // version 3
  std::optional<bool> corrupt;         // version 3
  uint32_t refcount_bits = 16;
  std::optional<LuksInfo> encrypt;       // encrypt.format=luks
  std::vector<Qcow2BitmapInfo> bitmaps;  // shown when there are any
  std::string compression_type;          // "zlib" or "zstd"
  std::optional<bool> extended_l2;       // version 3
};

// ImageInfoSpecificRbd.
struct RbdInfo {
  std::optional<std::string> encryption_format;
};

// ImageInfoSpecific: the variant names the "type" (qcow2, luks, rbd).
using FormatInfo = std::variant<Qcow2Info, LuksInfo, RbdInfo>;

}  // namespace vblk
