// What a guest wrote and what a disk may hold after a crash, sector by
// sector: the power-loss tools' oracle.
//
// Every guest write fills each 512-byte sector with its own id, the
// sector's number and bytes derived from both, so a sector read back after
// a crash names the write it came from, and a sector from another write,
// another place or nowhere is told apart from a legitimate one.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace vblk::power {

constexpr uint64_t kSector = 512;

// Fills p with write `id`'s content for guest sector `sector`; id 0 is
// zeroes.
void fill_sector(uint8_t* p, uint64_t id, uint64_t sector);
// The id a read-back sector holds, or -1 if it is no sector ever written.
int64_t decode_sector(const uint8_t* p, uint64_t sector);

// What each guest sector may hold after a crash.
struct Model {
  explicit Model(uint64_t sectors) : durable(sectors, {0}), current(sectors, {0}), since(sectors) {}
  // A disk whose sectors hold these ids, all flushed.
  explicit Model(const std::vector<uint64_t>& ids);
  std::vector<std::set<uint64_t>> durable;  // possible values at the last completed flush
  std::vector<std::set<uint64_t>> current;  // possible values now
  std::vector<std::set<uint64_t>> since;    // written (or being written) after it
  void flushed() {
    durable = current;
    for (auto& s : since) s.clear();
  }
  bool allowed(uint64_t sector, uint64_t id) const { return durable[sector].count(id) || since[sector].count(id); }
};

// Every guest sector of `disk` is allowed by the model; the first that is
// not, described ("" when all are).
std::string verify_content(const std::vector<uint8_t>& disk, const Model& model, const char* reader);
// Every sector of `disk` is zeroes or some write's content for that very
// sector (a copy in progress: no garbage, nothing from elsewhere).
std::string verify_no_garbage(const std::vector<uint8_t>& disk, uint64_t sectors, const char* reader);

}  // namespace vblk::power
