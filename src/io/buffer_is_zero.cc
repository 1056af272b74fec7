#include <cstring>

#include "vblk/buffer.h"

namespace vblk {

bool buffer_is_zero(std::span<const uint8_t> buf) {
  const uint8_t* p = buf.data();
  size_t n = buf.size();
  // Check a short head, then compare the buffer against itself shifted by 16
  // bytes: memcmp is vectorised by libc, so this runs at memory bandwidth.
  size_t head = n < 16 ? n : 16;
  for (size_t i = 0; i < head; ++i)
    if (p[i]) return false;
  if (n <= 16) return true;
  return std::memcmp(p, p + 16, n - 16) == 0;
}

}  // namespace vblk
