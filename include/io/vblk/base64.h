// Base64 as QEMU's secrets use it: decoding checks the characters the way
// qbase64_decode does, then decodes as glib's g_base64_decode (lenient:
// '\n' is skipped, '=' ends a group, an incomplete last group is dropped).
#pragma once

#include <string>
#include <string_view>

#include "vblk/result.h"

namespace vblk {

// Standard alphabet, '=' padded.
std::string base64_encode(std::string_view bytes);

// Errors: "Base64 data contains embedded NUL characters", "Base64 data
// contains invalid characters" (QEMU's texts).
Result<std::string> base64_decode(std::string_view text);

}  // namespace vblk
