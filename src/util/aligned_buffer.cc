#include <sys/mman.h>

#include "vblk/buffer.h"

namespace vblk {

AlignedBuffer AlignedBuffer::huge(size_t size) {
  constexpr size_t kHuge = 2 << 20;
  if (size < kHuge / 2) return AlignedBuffer(size);
  size_t rounded = (size + kHuge - 1) / kHuge * kHuge;
  AlignedBuffer b(rounded, kHuge);
  ::madvise(b.data(), rounded, MADV_HUGEPAGE);  // advisory: failure is fine
  b.size_ = size;
  return b;
}

}  // namespace vblk
