#include "drivers/file_lock.h"

#include <fcntl.h>

#include <cerrno>

namespace vblk::drivers {

namespace {
constexpr int kPermBase = 100;    // QEMU's RAW_LOCK_PERM_BASE
constexpr int kSharedBase = 200;  // QEMU's RAW_LOCK_SHARED_BASE

struct flock byte_lock(short type, int off) {
  struct flock fl = {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = off;
  fl.l_len = 1;
  return fl;
}
}  // namespace

bool ImageLock::lock_byte(int off) {
  struct flock fl = byte_lock(F_RDLCK, off);
  return ::fcntl(fd_, F_OFD_SETLK, &fl) == 0;
}

void ImageLock::unlock_byte(int off) {
  struct flock fl = byte_lock(F_UNLCK, off);
  (void)::fcntl(fd_, F_OFD_SETLK, &fl);
}

bool ImageLock::held_by_others(int off) const {
  struct flock fl = byte_lock(F_WRLCK, off);
  if (::fcntl(fd_, F_OFD_GETLK, &fl) < 0) return true;
  return fl.l_type != F_UNLCK;
}

// Holds exactly the bytes for (perm, unshared), releasing the rest.
void ImageLock::set_bits(uint32_t perm, uint32_t unshared) {
  for (int i = 0; i < kPermBits; ++i) {
    uint32_t b = 1u << i;
    if ((perm_ & b) && !(perm & b)) unlock_byte(kPermBase + i);
    if ((unshared_ & b) && !(unshared & b)) unlock_byte(kSharedBase + i);
  }
  perm_ = perm;
  unshared_ = unshared;
}

Status ImageLock::apply(PermPair p) {
  if (mode_ == LockingMode::Off) return {};
  const uint32_t want_perm = p.perm & kPermAll, want_unshared = ~p.shared & kPermAll;
  const uint32_t old_perm = perm_, old_unshared = unshared_;
  // Take the new bytes first and test afterwards, as QEMU does: two
  // processes racing for the same image both see each other and both fail,
  // instead of both passing a test made before either locked.
  auto fail = [&](std::string msg) -> Status {
    set_bits(old_perm, old_unshared);  // the bytes taken meanwhile are released
    Error e(EAGAIN, std::move(msg));
    e.hint = "Is another process using the image [" + filename_ + "]?";
    return e;
  };
  for (int i = 0; i < kPermBits; ++i) {
    uint32_t b = 1u << i;
    if ((want_perm & b) && !(perm_ & b)) {
      if (!lock_byte(kPermBase + i)) return fail("Failed to lock byte " + std::to_string(kPermBase + i));
      perm_ |= b;
    }
  }
  for (int i = 0; i < kPermBits; ++i) {
    uint32_t b = 1u << i;
    if ((want_unshared & b) && !(unshared_ & b)) {
      if (!lock_byte(kSharedBase + i)) return fail("Failed to lock byte " + std::to_string(kSharedBase + i));
      unshared_ |= b;
    }
  }
  for (int i = 0; i < kPermBits; ++i) {
    uint32_t b = 1u << i;
    if ((want_perm & b) && held_by_others(kSharedBase + i)) return fail("Failed to get \"" + perm_names(b) + "\" lock");
  }
  for (int i = 0; i < kPermBits; ++i) {
    uint32_t b = 1u << i;
    if ((want_unshared & b) && held_by_others(kPermBase + i))
      return fail("Failed to get shared \"" + perm_names(b) + "\" lock");
  }
  set_bits(want_perm, want_unshared);
  return {};
}

}  // namespace vblk::drivers
