#include "drivers/qcow2/format.h"

#include <fmt/format.h>

namespace vblk::qcow2 {

namespace {

struct Feature {
  uint8_t type;  // 0 incompatible, 1 compatible, 2 autoclear
  uint8_t bit;
  const char* name;
};

// The feature name table vblk writes (and QEMU writes the same names).
const Feature kFeatures[] = {
    {0, 0, "dirty bit"},        {0, 1, "corrupt bit"},         {0, 2, "external data file"},
    {0, 3, "compression type"}, {0, 4, "extended L2 entries"}, {1, 0, "lazy refcounts"},
    {2, 0, "bitmaps"},          {2, 1, "raw external data"},
};

Error invalid(const std::string& msg) { return Error(EINVAL, msg); }

}  // namespace

std::string hex(uint64_t v) { return v ? fmt::format("{:#x}", v) : std::string("0"); }

std::string incompatible_feature_names(uint64_t bits, std::span<const uint8_t> table) {
  // The names come from the image, not from vblk's table: a bit vblk does
  // not know may be named by the program that set it.
  // A short last entry reads as if padded with zeroes (QEMU reads the
  // extension into a zeroed buffer with room for two more entries).
  std::vector<uint8_t> t(table.begin(), table.end());
  t.resize((t.size() + 47) / 48 * 48 + 48, 0);
  std::string out;
  for (size_t off = 0; off < table.size() && t[off + 2] != 0; off += 48) {
    const uint8_t type = t[off], bit = t[off + 1];
    if (type != 0 || bit > 63 || !(bits & (1ull << bit))) continue;
    if (!out.empty()) out += ", ";
    const char* name = reinterpret_cast<const char*>(&t[off + 2]);
    out.append(name, strnlen(name, 46));
    bits &= ~(1ull << bit);
  }
  if (bits) {
    if (!out.empty()) out += ", ";
    out += fmt::format("Unknown incompatible feature: {:x}", bits);
  }
  return out;
}

Result<Header> parse_header(std::span<const uint8_t> head, uint64_t file_size) {
  if (head.size() < kHeaderV2Size) return invalid("Image is not in qcow2 format");
  const uint8_t* p = head.data();
  Header h;
  if (be32(p) != kMagic) return invalid("Image is not in qcow2 format");
  h.version = be32(p + 4);
  if (h.version < 2 || h.version > 3) return Error(ENOTSUP, fmt::format("Unsupported qcow2 version {}", h.version));
  h.backing_file_offset = be64(p + 8);
  h.backing_file_size = be32(p + 16);
  h.cluster_bits = be32(p + 20);
  h.size = be64(p + 24);
  h.crypt_method = be32(p + 32);
  h.l1_size = be32(p + 36);
  h.l1_table_offset = be64(p + 40);
  h.refcount_table_offset = be64(p + 48);
  h.refcount_table_clusters = be32(p + 56);
  h.nb_snapshots = be32(p + 60);
  h.snapshots_offset = be64(p + 64);
  if (h.cluster_bits < kMinClusterBits || h.cluster_bits > kMaxClusterBits)
    return invalid(fmt::format("Unsupported cluster size: 2^{}", h.cluster_bits));
  const uint64_t cs = h.cluster_size();
  if (h.version == 2) {
    h.refcount_order = 4;
    h.header_length = kHeaderV2Size;
  } else {
    if (head.size() < kHeaderV3Size) return invalid("qcow2 header too short");
    h.incompatible_features = be64(p + 72);
    h.compatible_features = be64(p + 80);
    h.autoclear_features = be64(p + 88);
    h.refcount_order = be32(p + 96);
    h.header_length = be32(p + 100);
    if (h.header_length < kHeaderV3Size) return invalid("qcow2 header too short");
  }
  if (h.header_length > cs) return invalid("qcow2 header exceeds cluster size");
  if (h.header_length > head.size()) return invalid("qcow2 header exceeds cluster size");
  if (h.header_length > 104) h.compression_type = p[104];
  if (h.backing_file_offset > cs) return invalid("Invalid backing file offset");

  // Header extensions sit between the header and the backing file name.
  uint64_t ext_end = h.backing_file_offset ? h.backing_file_offset : std::min<uint64_t>(cs, head.size());
  uint64_t off = h.version == 2 ? kHeaderV2Size : h.header_length;
  while (off + 8 <= ext_end) {
    uint32_t type = be32(p + off);
    uint32_t len = be32(p + off + 4);
    off += 8;
    if (type == kExtEnd) break;
    if (len > ext_end - off) return invalid("Header extension too large");
    std::vector<uint8_t> data(p + off, p + off + len);
    switch (type) {
      case kExtBackingFormat:
        if (len >= 16) return invalid(fmt::format("ERROR: ext_backing_format: len={} too large (>=16)", len));
        h.backing_format.assign(data.begin(), data.end());
        break;
      case kExtFeatureTable:
        h.has_feature_table = true;
        h.feature_table = data;
        break;
      case kExtCrypto:
        if (h.crypt_method > kCryptLuks)
          return invalid(fmt::format("Unsupported encryption method {}", h.crypt_method));
        if (h.crypt_method != kCryptLuks)
          return invalid("CRYPTO header extension only expected with LUKS encryption method");
        if (len != kCryptoExtSize)
          return invalid(fmt::format("CRYPTO header extension size {}, but expected size {}", len, kCryptoExtSize));
        h.has_crypto_header = true;
        h.crypto_offset = be64(data.data());
        h.crypto_length = be64(data.data() + 8);
        if (h.crypto_offset % cs)
          return invalid(
              fmt::format("Encryption header offset '{}' is not a multiple of cluster size '{}'", h.crypto_offset, cs));
        break;
      case kExtBitmaps:
        h.has_bitmaps_extension = true;
        h.bitmaps_extension = std::move(data);
        break;
      case kExtDataFile: h.data_file.assign(data.begin(), data.end()); break;
      default: h.unknown_extensions.push_back({type, std::move(data)}); break;
    }
    off += (len + 7) & ~7ull;
  }

  if (h.compression_type != kCompressionZlib && h.compression_type != kCompressionZstd)
    return Error(ENOTSUP, fmt::format("qcow2: unknown compression type: {}", h.compression_type));
  if (h.compression_type == kCompressionZlib && (h.incompatible_features & kIncompatCompression))
    return invalid("qcow2: Compression type incompatible feature bit must not be set");
  if (h.compression_type != kCompressionZlib && !(h.incompatible_features & kIncompatCompression))
    return invalid("qcow2: Compression type incompatible feature bit must be set");
  if (h.incompatible_features & ~kIncompatKnown)
    return Error(ENOTSUP, "Unsupported qcow2 feature(s): " +
                              incompatible_feature_names(h.incompatible_features & ~kIncompatKnown, h.feature_table));
  if (h.incompatible_features & kIncompatDataFile)
    return Error(ENOTSUP, "Unsupported qcow2 feature(s): external data file");
  if (h.extended_l2() && cs / kSubclusters < 512)
    return invalid(fmt::format("Unsupported subcluster size: {}", cs / kSubclusters));
  if (h.refcount_order > 6) return invalid("Reference count entry width too large; may not exceed 64 bits");
  if (h.crypt_method > 2) return invalid(fmt::format("Unsupported encryption method {}", h.crypt_method));
  if (h.crypt_method == kCryptAes)
    return Error(ENOTSUP, "AES-encrypted qcow2 images (encrypt.format=aes) are not supported by vblk");
  if (h.backing_file_offset) {
    if (h.backing_file_size > 1023 || h.backing_file_size > cs - h.backing_file_offset)
      return invalid("Backing file name too long");
    if (h.backing_file_offset + h.backing_file_size > head.size()) return invalid("Backing file name too long");
    h.backing_file.assign(reinterpret_cast<const char*>(p + h.backing_file_offset), h.backing_file_size);
  }
  (void)file_size;
  return h;
}

Result<std::vector<uint8_t>> serialize_header(const Header& h) {
  const uint64_t cs = h.cluster_size();
  std::vector<uint8_t> buf(cs, 0);
  uint8_t* p = buf.data();
  put32(p, kMagic);
  put32(p + 4, h.version);
  put32(p + 16, 0);
  put32(p + 20, h.cluster_bits);
  put64(p + 24, h.size);
  put32(p + 32, h.crypt_method);
  put32(p + 36, h.l1_size);
  put64(p + 40, h.l1_table_offset);
  put64(p + 48, h.refcount_table_offset);
  put32(p + 56, h.refcount_table_clusters);
  put32(p + 60, h.nb_snapshots);
  put64(p + 64, h.snapshots_offset);
  uint64_t off = kHeaderV2Size;
  if (h.version >= 3) {
    uint32_t hlen = 112;  // with compression_type and padding, as QEMU writes
    put64(p + 72, h.incompatible_features);
    put64(p + 80, h.compatible_features);
    put64(p + 88, h.autoclear_features);
    put32(p + 96, h.refcount_order);
    put32(p + 100, hlen);
    p[104] = h.compression_type;
    off = hlen;
  }
  auto ext = [&](uint32_t type, const uint8_t* data, size_t len) -> bool {
    uint64_t padded = (len + 7) & ~size_t{7};
    if (off + 8 + padded > cs) return false;
    put32(p + off, type);
    put32(p + off + 4, static_cast<uint32_t>(len));
    if (len) std::memcpy(p + off + 8, data, len);
    off += 8 + padded;
    return true;
  };
  bool ok = true;
  if (!h.backing_format.empty())
    ok &= ext(kExtBackingFormat, reinterpret_cast<const uint8_t*>(h.backing_format.data()), h.backing_format.size());
  if (h.has_crypto_header) {
    uint8_t e[kCryptoExtSize];
    put64(e, h.crypto_offset);
    put64(e + 8, h.crypto_length);
    ok &= ext(kExtCrypto, e, sizeof e);
  }
  // QEMU 7.2 writes the feature name table only with clusters above 4 KiB
  // (observed: 512 B to 4 KiB images never carry it), where it cannot crowd
  // out the other extensions; an image of ours looks the same.
  if (h.version >= 3 && cs > 4096) {
    std::vector<uint8_t> table;
    for (const auto& f : kFeatures) {
      uint8_t e[48] = {};
      e[0] = f.type;
      e[1] = f.bit;
      std::memcpy(e + 2, f.name, std::strlen(f.name));
      table.insert(table.end(), e, e + 48);
    }
    ok &= ext(kExtFeatureTable, table.data(), table.size());
  }
  if (h.has_bitmaps_extension) ok &= ext(kExtBitmaps, h.bitmaps_extension.data(), h.bitmaps_extension.size());
  for (const auto& u : h.unknown_extensions) ok &= ext(u.type, u.data.data(), u.data.size());
  ok &= ext(kExtEnd, nullptr, 0);
  if (!ok) return Error(ENOSPC, "Header extensions do not fit in the first cluster");
  if (!h.backing_file.empty()) {
    // Where the name already is, if that is past the extensions: a header
    // rewrite then leaves the name's bytes as they are (Qcow2Node::
    // set_backing moves a name in two steps, crash-safe).
    if (h.backing_file_offset >= off && h.backing_file_offset + h.backing_file.size() <= cs)
      off = h.backing_file_offset;
    if (off + h.backing_file.size() > cs) return Error(ENOSPC, "Backing file name too long");
    put64(p + 8, off);
    put32(p + 16, static_cast<uint32_t>(h.backing_file.size()));
    std::memcpy(p + off, h.backing_file.data(), h.backing_file.size());
  } else {
    put64(p + 8, 0);
  }
  return buf;
}

}  // namespace vblk::qcow2
