// qcow2 on-disk format: constants, header and entry encodings, big-endian
// helpers. The specification is QEMU's docs/interop/qcow2.txt; field names
// here follow it. Nothing in this file does I/O.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "vblk/result.h"

namespace vblk::qcow2 {

constexpr uint32_t kMagic = 0x514649fb;  // "QFI\xfb"

// Header sizes and limits.
constexpr uint32_t kHeaderV2Size = 72;
constexpr uint32_t kHeaderV3Size = 104;
constexpr uint32_t kMinClusterBits = 9;
constexpr uint32_t kMaxClusterBits = 21;
constexpr uint64_t kMaxL1Bytes = 32ull << 20;            // QEMU's QCOW_MAX_L1_SIZE
constexpr uint64_t kMaxRefcountTableBytes = 8ull << 20;  // QCOW_MAX_REFTABLE_SIZE
constexpr uint32_t kMaxSnapshots = 65536;
constexpr uint32_t kSnapshotHeaderBytes = 40;                     // QCowSnapshotHeader
constexpr uint32_t kSnapshotExtraBytes = 24;                      // QCowSnapshotExtraData (known part)
constexpr uint32_t kMaxSnapshotExtraData = 1024;                  // QCOW_MAX_SNAPSHOT_EXTRA_DATA
constexpr uint64_t kMaxSnapshotsBytes = 1024ull * kMaxSnapshots;  // QCOW_MAX_SNAPSHOTS_SIZE

// Incompatible feature bits.
constexpr uint64_t kIncompatDirty = 1ull << 0;
constexpr uint64_t kIncompatCorrupt = 1ull << 1;
constexpr uint64_t kIncompatDataFile = 1ull << 2;
constexpr uint64_t kIncompatCompression = 1ull << 3;
constexpr uint64_t kIncompatExtendedL2 = 1ull << 4;
constexpr uint64_t kIncompatKnown =
    kIncompatDirty | kIncompatCorrupt | kIncompatDataFile | kIncompatCompression | kIncompatExtendedL2;
// Compatible feature bits.
constexpr uint64_t kCompatLazyRefcounts = 1ull << 0;
// Autoclear feature bits.
constexpr uint64_t kAutoclearBitmaps = 1ull << 0;
constexpr uint64_t kAutoclearDataFileRaw = 1ull << 1;
constexpr uint64_t kAutoclearKnown = kAutoclearBitmaps | kAutoclearDataFileRaw;

// Header extension types.
constexpr uint32_t kExtEnd = 0;
constexpr uint32_t kExtBackingFormat = 0xe2792aca;
constexpr uint32_t kExtFeatureTable = 0x6803f857;
constexpr uint32_t kExtCrypto = 0x0537be77;
constexpr uint32_t kExtBitmaps = 0x23852875;
constexpr uint32_t kExtDataFile = 0x44415441;

// Encryption methods (the header's crypt_method).
constexpr uint32_t kCryptNone = 0;
constexpr uint32_t kCryptAes = 1;
constexpr uint32_t kCryptLuks = 2;
constexpr uint32_t kCryptoExtSize = 16;  // Qcow2CryptoHeaderExtension: offset, length

// Compression types.
constexpr uint8_t kCompressionZlib = 0;
constexpr uint8_t kCompressionZstd = 1;

// L1/L2 entry bits.
constexpr uint64_t kOflagCopied = 1ull << 63;
constexpr uint64_t kOflagCompressed = 1ull << 62;
constexpr uint64_t kOflagZero = 1ull << 0;
constexpr uint64_t kL1OffsetMask = 0x00fffffffffffe00ull;
constexpr uint64_t kL2OffsetMask = 0x00fffffffffffe00ull;
constexpr uint64_t kL1ReservedMask = 0x7f000000000001ffull;
constexpr uint64_t kL2StdReservedMask = 0x3f000000000001feull;

// Extended L2: 32 subclusters per cluster.
constexpr uint32_t kSubclusters = 32;

inline uint16_t be16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
inline uint32_t be32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) << 24 | static_cast<uint32_t>(p[1]) << 16 | static_cast<uint32_t>(p[2]) << 8 |
         p[3];
}
inline uint64_t be64(const uint8_t* p) { return static_cast<uint64_t>(be32(p)) << 32 | be32(p + 4); }
inline void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}
inline void put32(uint8_t* p, uint32_t v) {
  for (int i = 3; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}
inline void put64(uint8_t* p, uint64_t v) {
  put32(p, static_cast<uint32_t>(v >> 32));
  put32(p + 4, static_cast<uint32_t>(v));
}

// printf's "%#" PRIx64: "0x1f", but plain "0" for zero (QEMU's messages).
std::string hex(uint64_t v);

struct HeaderExtension {
  uint32_t type;
  std::vector<uint8_t> data;
};

// The parsed header, with everything needed to write it back.
struct Header {
  uint32_t version = 3;
  uint64_t backing_file_offset = 0;
  uint32_t backing_file_size = 0;
  uint32_t cluster_bits = 16;
  uint64_t size = 0;
  uint32_t crypt_method = 0;
  uint32_t l1_size = 0;
  uint64_t l1_table_offset = 0;
  uint64_t refcount_table_offset = 0;
  uint32_t refcount_table_clusters = 0;
  uint32_t nb_snapshots = 0;
  uint64_t snapshots_offset = 0;
  uint64_t incompatible_features = 0;
  uint64_t compatible_features = 0;
  uint64_t autoclear_features = 0;
  uint32_t refcount_order = 4;
  uint32_t header_length = kHeaderV3Size;
  uint8_t compression_type = kCompressionZlib;

  std::string backing_file;
  std::string backing_format;
  std::string data_file;
  // The "full disk encryption header pointer" extension (LUKS): the
  // clusters holding the LUKS header and key material.
  bool has_crypto_header = false;
  uint64_t crypto_offset = 0, crypto_length = 0;
  std::vector<HeaderExtension> unknown_extensions;  // kept and written back
  bool has_bitmaps_extension = false;
  std::vector<uint8_t> bitmaps_extension;
  bool has_feature_table = false;
  std::vector<uint8_t> feature_table;  // the image's own, for "unsupported" messages

  uint64_t cluster_size() const { return 1ull << cluster_bits; }
  bool extended_l2() const { return incompatible_features & kIncompatExtendedL2; }
};

// Parses and checks a header from the first cluster of the file (`head`
// holds at least min(cluster, file size) bytes). Errors are worded as QEMU's.
Result<Header> parse_header(std::span<const uint8_t> head, uint64_t file_size);

// Serialises the header and its extensions into one cluster-sized buffer.
// Fails with ENOSPC if they do not fit in the first cluster.
Result<std::vector<uint8_t>> serialize_header(const Header& h);

// The names of incompatible feature `bits` as QEMU's
// report_unsupported_feature gives them: from the image's own feature name
// table (48-byte entries up to the first empty name), then the bits no
// entry names as one "Unknown incompatible feature: <hex>".
std::string incompatible_feature_names(uint64_t bits, std::span<const uint8_t> table);

}  // namespace vblk::qcow2
