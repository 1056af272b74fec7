#include <sys/mman.h>

#include "vblk/buffer.h"

namespace vblk {

AlignedBuffer AlignedBuffer::huge(size_t size) {
  constexpr size_t kHuge = 2 << 20;
  if (size < kHuge / 2) return AlignedBuffer(size);
  const size_t rounded = (size + kHuge - 1) / kHuge * kHuge;
  // Map one huge page more than needed and trim both ends to a 2 MiB boundary.
  void* p = ::mmap(nullptr, rounded + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto* raw = static_cast<uint8_t*>(p);
  const auto addr = reinterpret_cast<uintptr_t>(raw);
  const size_t head = (kHuge - addr % kHuge) % kHuge;
  if (head) ::munmap(raw, head);
  const size_t tail = kHuge - head;
  if (tail) ::munmap(raw + head + rounded, tail);
  ::madvise(raw + head, rounded, MADV_HUGEPAGE);  // advisory: failure is fine
  AlignedBuffer b;
  b.data_ = raw + head;
  b.size_ = size;
  b.mapped_ = rounded;
  return b;
}

void AlignedBuffer::release() {
  if (mapped_) {
    ::munmap(data_, mapped_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  mapped_ = 0;
}

}  // namespace vblk
