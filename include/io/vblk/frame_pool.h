// FramePool: a per-thread free list of coroutine frames by size class.
//
// Every request crosses several coroutine frames (node -> driver -> child ->
// loop); recycling them keeps malloc off the I/O path. Frames are small
// (a few hundred bytes); classes are 64-byte steps up to 2 KiB, larger ones
// go straight to malloc. A frame freed on another thread simply joins that
// thread's list. Disabled under AddressSanitizer so use-after-free of a
// frame is still caught.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace vblk::detail {

#if defined(__SANITIZE_ADDRESS__)
inline void* frame_alloc(std::size_t n) { return ::operator new(n); }
inline void frame_free(void* p, std::size_t) { ::operator delete(p); }
#else
class FramePool {
 public:
  static constexpr std::size_t kStep = 64;
  static constexpr std::size_t kClasses = 32;      // up to 2 KiB
  static constexpr std::size_t kMaxCached = 4096;  // per class

  void* alloc(std::size_t n) {
    std::size_t c = (n + kStep - 1) / kStep;
    if (c < kClasses && heads_[c]) {
      Free* f = heads_[c];
      heads_[c] = f->next;
      --counts_[c];
      return f;
    }
    void* p = std::malloc(c < kClasses ? c * kStep : n);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void free(void* p, std::size_t n) {
    std::size_t c = (n + kStep - 1) / kStep;
    if (c < kClasses && counts_[c] < kMaxCached) {
      auto* f = static_cast<Free*>(p);
      f->next = heads_[c];
      heads_[c] = f;
      ++counts_[c];
      return;
    }
    std::free(p);
  }
  ~FramePool() {
    for (std::size_t c = 0; c < kClasses; ++c) {
      while (Free* f = heads_[c]) {
        heads_[c] = f->next;
        std::free(f);
      }
    }
  }

 private:
  struct Free {
    Free* next;
  };
  Free* heads_[kClasses] = {};
  std::size_t counts_[kClasses] = {};
};

inline FramePool& frame_pool() {
  thread_local FramePool pool;
  return pool;
}
inline void* frame_alloc(std::size_t n) { return frame_pool().alloc(n); }
inline void frame_free(void* p, std::size_t n) { frame_pool().free(p, n); }
#endif

}  // namespace vblk::detail
