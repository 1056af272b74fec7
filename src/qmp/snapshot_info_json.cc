#include "vblk/snapshot_info_json.h"

#include <cstdint>

namespace vblk {

nlohmann::ordered_json snapshot_info_json(const SnapshotInfo& sn) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  j["id"] = sn.id;
  j["name"] = sn.name;
  j["vm-state-size"] = sn.vm_state_size;
  j["date-sec"] = sn.date_sec;
  j["date-nsec"] = sn.date_nsec;
  j["vm-clock-sec"] = sn.vm_clock_nsec / 1000000000u;
  j["vm-clock-nsec"] = sn.vm_clock_nsec % 1000000000u;
  if (sn.icount != UINT64_MAX) j["icount"] = sn.icount;
  return j;
}

}  // namespace vblk
