// Image locking as QEMU does it (file-posix.c), so vblk and QEMU exclude
// each other: one byte per permission, OFD read locks on the image file.
// A user that needs permission i holds byte 100+i; one that does not share
// it holds byte 200+i. Taking a permission fails while someone else holds
// its "unshared" byte, and refusing to share one fails while someone else
// holds its "needed" byte (tested with F_OFD_GETLK for a write lock).
//
// OFD locks belong to the open file description: closing the fd drops them,
// a second open of the same file (in this process too) is somebody else.
// Owned by the file node; loop thread only.
#pragma once

#include <cstdint>
#include <string>

#include "vblk/perm.h"
#include "vblk/result.h"

namespace vblk::drivers {

enum class LockingMode { Auto, On, Off };

class ImageLock {
 public:
  ImageLock(int fd, std::string filename, LockingMode mode) : fd_(fd), filename_(std::move(filename)), mode_(mode) {}

  // Holds the bytes `p` asks for and releases the others. On a conflict
  // (QEMU's 'Failed to get "write" lock', with its hint) nothing changes.
  Status apply(PermPair p);

 private:
  bool lock_byte(int off);
  void unlock_byte(int off);
  bool held_by_others(int off) const;
  void set_bits(uint32_t perm, uint32_t unshared);

  int fd_;
  std::string filename_;
  LockingMode mode_;
  uint32_t perm_ = 0;      // bits whose byte at 100+i we hold
  uint32_t unshared_ = 0;  // bits whose byte at 200+i we hold
};

}  // namespace vblk::drivers
