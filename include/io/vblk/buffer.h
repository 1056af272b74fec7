// AlignedBuffer: an owned, zero-initialisable byte buffer with a chosen
// alignment, as O_DIRECT needs (memory address, not only offset, aligned).
//
// Ownership: the buffer owns its memory (freed on destruction); span() lends it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>
#include <utility>

namespace vblk {

inline constexpr size_t kDefaultBufferAlign = 4096;

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t size, size_t align = kDefaultBufferAlign) : size_(size) {
    if (size == 0) return;
    void* p = nullptr;
    if (posix_memalign(&p, align < sizeof(void*) ? sizeof(void*) : align, size) != 0) throw std::bad_alloc();
    data_ = static_cast<uint8_t*>(p);
  }
  // A large buffer on transparent huge pages where the kernel allows: few
  // physical segments per request, so the device queue does not have to
  // split big requests (measured: 1 MiB O_DIRECT writes on virtio-blk).
  static AlignedBuffer huge(size_t size);

  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        mapped_(std::exchange(o.mapped_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      mapped_ = std::exchange(o.mapped_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<uint8_t> span() { return {data_, size_}; }
  std::span<const uint8_t> span() const { return {data_, size_}; }
  void zero() {
    if (data_) std::memset(data_, 0, size_);
  }

 private:
  void release();

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  // Bytes mapped with mmap (huge buffers), 0 for malloc'd memory. A mapping
  // goes back to the kernel when freed; a large free() may stay in the heap
  // (glibc's sliding mmap threshold, ASan's quarantine), so a cancelled COW
  // buffer would keep its RSS.
  size_t mapped_ = 0;
};

inline bool is_aligned(const void* p, size_t align) {
  return align <= 1 || (reinterpret_cast<uintptr_t>(p) % align) == 0;
}
inline bool is_aligned(uint64_t v, uint64_t align) { return align <= 1 || v % align == 0; }
inline uint64_t align_down(uint64_t v, uint64_t align) { return v - v % align; }
inline uint64_t align_up(uint64_t v, uint64_t align) { return align_down(v + align - 1, align); }

// True if every byte of buf is zero (fast path for zero detection).
bool buffer_is_zero(std::span<const uint8_t> buf);

}  // namespace vblk
