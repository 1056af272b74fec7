// Base64 for secrets: see base64.h.
#include "util/base64.h"

#include <array>
#include <cstdint>

namespace vblk {

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

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
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t v = static_cast<uint8_t>(bytes[i]) << 16 | static_cast<uint8_t>(bytes[i + 1]) << 8 |
                 static_cast<uint8_t>(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  size_t rest = bytes.size() - i;
  if (rest) {
    uint32_t v = static_cast<uint8_t>(bytes[i]) << 16;
    if (rest == 2) v |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
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
