// The front end's memory as the back end sees it: the regions of the last
// SET_MEM_TABLE (or ADD_MEM_REG), each mapped from the descriptor that came
// with it. Every address a ring or a descriptor holds is translated here,
// and only a range that lies wholly inside mapped regions is ever touched:
// a hostile front end gets an error, never a stray access.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "vblk/net.h"
#include "vblk/result.h"
#include "vhost_user/protocol.h"

namespace vblk::vhost {

class GuestMemory {
 public:
  GuestMemory() = default;
  ~GuestMemory() { clear(); }
  GuestMemory(const GuestMemory&) = delete;
  GuestMemory& operator=(const GuestMemory&) = delete;

  // Maps one region from fd (checked: non-empty, no overflow, no overlap
  // with a region already mapped, at most kMaxMemRegions).
  Status add(const MemRegion& r, int fd);
  // Unmaps the region starting at guest address r.guest_phys_addr with the
  // same size; ENOENT if there is none.
  Status remove(const MemRegion& r);
  void clear();
  size_t regions() const { return regions_.size(); }

  // The host bytes for [addr, addr + len) in guest physical (gpa) or front
  // end (uva) addresses, when the range is inside one region; empty if not.
  std::span<uint8_t> gpa(uint64_t addr, uint64_t len) const { return find(addr, len, false); }
  std::span<uint8_t> uva(uint64_t addr, uint64_t len) const { return find(addr, len, true); }
  // Appends the host pieces of a guest physical range that may cross from
  // one region into the next adjacent one; false if any byte is unmapped.
  bool gpa_pieces(uint64_t addr, uint64_t len, std::vector<std::span<uint8_t>>& out) const;

 private:
  struct Region {
    MemRegion r;
    uint8_t* map = nullptr;  // mapping of [0, mmap_offset + memory_size) of the fd
    size_t map_len = 0;
  };
  std::span<uint8_t> find(uint64_t addr, uint64_t len, bool user) const;

  std::vector<Region> regions_;
};

}  // namespace vblk::vhost
