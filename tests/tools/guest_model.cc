#include "guest_model.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace vblk::power {

void fill_sector(uint8_t* p, uint64_t id, uint64_t sector) {
  if (id == 0) {
    std::memset(p, 0, kSector);
    return;
  }
  std::memcpy(p, &id, 8);
  std::memcpy(p + 8, &sector, 8);
  for (uint64_t i = 16; i < kSector; ++i) p[i] = static_cast<uint8_t>(id * 31 + sector * 7 + i);
}

int64_t decode_sector(const uint8_t* p, uint64_t sector) {
  uint64_t id;
  std::memcpy(&id, p, 8);
  if (id == 0) {
    for (uint64_t i = 0; i < kSector; ++i)
      if (p[i]) return -1;
    return 0;
  }
  uint8_t want[kSector];
  fill_sector(want, id, sector);
  return std::memcmp(want, p, kSector) == 0 ? static_cast<int64_t>(id) : -1;
}

Model::Model(const std::vector<uint64_t>& ids) : durable(ids.size()), current(ids.size()), since(ids.size()) {
  for (size_t s = 0; s < ids.size(); ++s) durable[s] = current[s] = {ids[s]};
}

std::string verify_content(const std::vector<uint8_t>& disk, const Model& model, const char* reader) {
  const uint64_t sectors = model.durable.size();
  if (disk.size() < sectors * kSector) return std::string(reader) + ": short read";
  for (uint64_t s = 0; s < sectors; ++s) {
    const int64_t id = decode_sector(disk.data() + s * kSector, s);
    if (id < 0 || !model.allowed(s, static_cast<uint64_t>(id))) {
      char msg[200];
      std::snprintf(msg, sizeof msg, "%s: guest sector %" PRIu64 " holds %s%" PRId64 ", not a value it may hold (",
                    reader, s, id < 0 ? "garbage " : "write ", id);
      std::string allowed;
      for (uint64_t v : model.durable[s]) allowed += (allowed.empty() ? "" : " ") + std::to_string(v);
      for (uint64_t v : model.since[s]) allowed += " " + std::to_string(v) + "(unflushed)";
      return msg + allowed + ")";
    }
  }
  return {};
}

std::string verify_no_garbage(const std::vector<uint8_t>& disk, uint64_t sectors, const char* reader) {
  if (disk.size() < sectors * kSector) return std::string(reader) + ": short read";
  for (uint64_t s = 0; s < sectors; ++s) {
    if (decode_sector(disk.data() + s * kSector, s) < 0) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "%s: sector %" PRIu64 " holds garbage", reader, s);
      return msg;
    }
  }
  return {};
}

}  // namespace vblk::power
