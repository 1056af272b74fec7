// Base64 for secrets: see base64.h.
#include "vblk/base64.h"

#include <openssl/evp.h>

#include <array>
#include <cstdint>

namespace vblk {

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// Decoding stays here rather than in OpenSSL: EVP_DecodeBlock rejects what
// glib's decoder (QEMU's) takes: '\n' anywhere, an incomplete last group.
// 0..63 for the alphabet, 0 for '=' (it fills a group), -1 otherwise.
constexpr std::array<int8_t, 256> make_ranks() {
  std::array<int8_t, 256> r{};
  for (auto& x : r) x = -1;
  for (int i = 0; i < 64; ++i) r[static_cast<uint8_t>(kAlphabet[i])] = static_cast<int8_t>(i);
  r['='] = 0;
  return r;
}
constexpr auto kRanks = make_ranks();

}  // namespace

std::string base64_encode(std::string_view bytes) {
  // OpenSSL's encoder: standard alphabet, '=' padded, no line breaks.
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

Result<std::string> base64_decode(std::string_view text) {
  if (text.find('\0') != std::string_view::npos) return Error(EINVAL, "Base64 data contains embedded NUL characters");
  for (char c : text)
    if (c != '\n' && kRanks[static_cast<uint8_t>(c)] < 0)
      return Error(EINVAL, "Base64 data contains invalid characters");
  std::string out;
  uint32_t v = 0;
  int n = 0;
  char prev = 0, last = 0;
  for (char c : text) {
    if (c == '\n') continue;
    prev = last;
    last = c;
    v = v << 6 | static_cast<uint8_t>(kRanks[static_cast<uint8_t>(c)]);
    if (++n < 4) continue;
    // A group of four: three bytes, less one for each trailing '='.
    out += static_cast<char>(v >> 16);
    if (prev != '=') out += static_cast<char>(v >> 8);
    if (last != '=') out += static_cast<char>(v);
    v = 0;
    n = 0;
  }
  return out;
}

}  // namespace vblk
