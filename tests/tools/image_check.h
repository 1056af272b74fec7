// qemu-img as the power-loss tools' judge of an image left by a crash.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vblk::power {

// What a check let through after repairing it.
struct CheckStats {
  uint64_t dirty = 0;          // lazy refcounts left to the next open's repair
  uint64_t copied_behind = 0;  // COPIED flags not yet set where refcount fell to 1
};

// Runs argv (no shell), stderr with stdout into *out; the exit status.
int run_cmd(const std::vector<std::string>& argv, std::string* out);
bool write_file(const std::string& path, const std::vector<uint8_t>& data);
std::vector<uint8_t> read_file(const std::string& path);

// `qemu-img check` of the qcow2 at `path` (holding `img`): "" when clean or
// leaking only (a crash may leak clusters, as in QEMU's), else the report.
// Two reports are let through once `-r all` has repaired them and a second
// check is clean (counted in stats):
//   - the dirty bit of lazy refcounts: the refcounts are to be rebuilt,
//     which every read-write open (QEMU's and vblk's) does first;
//   - only OFLAG_COPIED missing on entries whose refcount is 1: a snapshot
//     delete cut between its refcount decrements (flushed first) and the
//     COPIED flags they allow, which costs a copy on the next write, never
//     data. QEMU orders these the same way.
std::string check_qcow2(const std::string& qemu_img, const std::string& path, const std::vector<uint8_t>& img,
                        CheckStats& stats);

}  // namespace vblk::power
