// Malformed input for a vhost-user-blk back end: broken descriptor chains,
// rings and messages, each sent on a fresh connection. run_hostile() reports
// what the back end did - a used element (and its status byte), nothing
// within the timeout, or a closed connection - and whether the export then
// serves a new client (one 4 KiB read).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "vhost_user_client.h"

namespace vhu {

struct HostileKind {
  std::string name;
  std::string what;
};
const std::vector<HostileKind>& hostile_kinds();

// {"kind", "outcome": "reply"|"no_reply"|"disconnect"|"refused"|"setup_failed",
//  "status", "used_len", "still_responds", "recovered", ...}
nlohmann::ordered_json run_hostile(const std::string& socket, const std::string& kind, const Options& opts,
                                   int timeout_ms);

}  // namespace vhu
