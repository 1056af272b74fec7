// The front end's memory as the back end sees it: the regions of the last
// SET_MEM_TABLE (or ADD_MEM_REG), each mapped from the descriptor that came
// with it. Every address a ring or a descriptor holds is translated here,
// and only a range that lies wholly inside mapped regions is ever touched:
// a hostile front end gets an error, never a stray access.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "vblk/net.h"
#include "vblk/result.h"
#include "vhost_user/protocol.h"

namespace vblk::vhost {

class GuestMemory {
 public:
  // At most `max_regions` regions (vhost-user's limit by default; a VDUSE
  // device's IOVA space has one per coherent allocation of its driver).
  explicit GuestMemory(size_t max_regions = kMaxMemRegions) : max_regions_(max_regions) {}
  ~GuestMemory() { clear(); }
  GuestMemory(const GuestMemory&) = delete;
  GuestMemory& operator=(const GuestMemory&) = delete;

  // Maps one region from fd (checked: non-empty, no overflow, no overlap
  // with a region already mapped, at most max_regions).
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

  // Called with an address no region holds, before a lookup fails: true
  // if it added a region that holds it (a VDUSE device's IOVA space is
  // mapped as its driver first uses each part). Unset: lookups just fail.
  std::function<bool(uint64_t addr)> on_miss;

 private:
  struct Region {
    MemRegion r;
    uint8_t* map = nullptr;  // mapping of [0, mmap_offset + memory_size) of the fd
    size_t map_len = 0;
  };
  std::span<uint8_t> find(uint64_t addr, uint64_t len, bool user) const;
  std::span<uint8_t> find_mapped(uint64_t addr, uint64_t len, bool user) const;
  bool holds(uint64_t addr, bool user) const;

  size_t max_regions_;
  std::vector<Region> regions_;
};

}  // namespace vblk::vhost
