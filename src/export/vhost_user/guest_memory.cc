#include "vhost_user/guest_memory.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace vblk::vhost {

namespace {
bool overlaps(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen) { return a < b + blen && b < a + alen; }
}  // namespace

Status GuestMemory::add(const MemRegion& r, int fd) {
  if (regions_.size() >= max_regions_) return Error(ENOSPC, "too many memory regions");
  uint64_t end;
  if (r.memory_size == 0 || __builtin_add_overflow(r.guest_phys_addr, r.memory_size, &end) ||
      __builtin_add_overflow(r.userspace_addr, r.memory_size, &end) ||
      __builtin_add_overflow(r.mmap_offset, r.memory_size, &end) || end > (1ull << 48))
    return Error(EINVAL, "memory region out of range");
  for (const auto& x : regions_)
    if (overlaps(x.r.guest_phys_addr, x.r.memory_size, r.guest_phys_addr, r.memory_size) ||
        overlaps(x.r.userspace_addr, x.r.memory_size, r.userspace_addr, r.memory_size))
      return Error(EINVAL, "memory regions overlap");
  // The offset need not be page-aligned: map from the start of the file
  // and skip it (as libvhost-user does).
  size_t len = r.mmap_offset + r.memory_size;
  // A file shorter than the region would fault (SIGBUS) on first touch.
  struct stat st {};
  if (::fstat(fd, &st) < 0 || (S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) < len))
    return Error(EINVAL, "memory region past the end of its file");
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) return Error(errno, std::string("mmap of guest memory: ") + std::strerror(errno));
  // A guest's RAM in a core dump of the daemon helps nobody.
  (void)::madvise(p, len, MADV_DONTDUMP);
  regions_.push_back({r, static_cast<uint8_t*>(p), len});
  return {};
}

Status GuestMemory::remove(const MemRegion& r) {
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if (it->r.guest_phys_addr == r.guest_phys_addr && it->r.memory_size == r.memory_size) {
      ::munmap(it->map, it->map_len);
      regions_.erase(it);
      return {};
    }
  }
  return Error(ENOENT, "no such memory region");
}

void GuestMemory::clear() {
  for (auto& x : regions_) ::munmap(x.map, x.map_len);
  regions_.clear();
}

std::span<uint8_t> GuestMemory::find(uint64_t addr, uint64_t len, bool user) const {
  auto got = find_mapped(addr, len, user);
  if (got.empty() && on_miss && !holds(addr, user) && on_miss(addr)) got = find_mapped(addr, len, user);
  return got;
}

bool GuestMemory::holds(uint64_t addr, bool user) const {
  for (const auto& x : regions_) {
    uint64_t base = user ? x.r.userspace_addr : x.r.guest_phys_addr;
    if (addr >= base && addr - base < x.r.memory_size) return true;
  }
  return false;
}

std::span<uint8_t> GuestMemory::find_mapped(uint64_t addr, uint64_t len, bool user) const {
  for (const auto& x : regions_) {
    uint64_t base = user ? x.r.userspace_addr : x.r.guest_phys_addr;
    if (addr < base) continue;
    uint64_t off = addr - base;
    if (off >= x.r.memory_size || len > x.r.memory_size - off) continue;
    return {x.map + x.r.mmap_offset + off, static_cast<size_t>(len)};
  }
  return {};
}

bool GuestMemory::gpa_pieces(uint64_t addr, uint64_t len, std::vector<std::span<uint8_t>>& out) const {
  bool faulted = false;  // on_miss asked once for this address
  while (len > 0) {
    bool found = false;
    for (const auto& x : regions_) {
      uint64_t base = x.r.guest_phys_addr;
      if (addr < base || addr - base >= x.r.memory_size) continue;
      uint64_t off = addr - base;
      uint64_t n = std::min(len, x.r.memory_size - off);
      out.push_back({x.map + x.r.mmap_offset + off, static_cast<size_t>(n)});
      addr += n;
      len -= n;
      found = true;
      faulted = false;
      break;
    }
    if (found) continue;
    if (!on_miss || faulted || !on_miss(addr)) return false;
    faulted = true;
  }
  return true;
}

}  // namespace vblk::vhost
