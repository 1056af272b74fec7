#include "vblk/qdict_order.h"

#include <cstdint>
#include <map>
#include <vector>

namespace vblk {

namespace {
// QEMU's tdb_hash (qobject/qdict.c); the bucket is hash % 512.
uint32_t qdict_hash(const std::string& k) {
  uint32_t h = 0x238F13AFu * static_cast<uint32_t>(k.size());
  for (size_t i = 0; i < k.size(); ++i) h += static_cast<uint32_t>(static_cast<uint8_t>(k[i])) << (i * 5 % 24);
  return 1103515243u * h + 12345u;
}
}  // namespace

nlohmann::ordered_json qdict_order(const nlohmann::ordered_json& j) {
  if (j.is_array()) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const auto& v : j) out.push_back(qdict_order(v));
    return out;
  }
  if (!j.is_object()) return j;
  std::map<uint32_t, std::vector<std::string>> by_bucket;
  for (auto it = j.begin(); it != j.end(); ++it) {
    auto& v = by_bucket[qdict_hash(it.key()) % 512];
    v.insert(v.begin(), it.key());  // newest first
  }
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (auto& [b, keys] : by_bucket)
    for (auto& k : keys) out[k] = qdict_order(j[k]);
  return out;
}

std::string qemu_json_compact(const nlohmann::ordered_json& j) {
  if (j.is_object()) {
    std::string out = "{";
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      out += nlohmann::ordered_json(it.key()).dump() + ": " + qemu_json_compact(it.value());
    }
    return out + "}";
  }
  if (j.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + qemu_json_compact(j[i]);
    return out + "]";
  }
  return j.dump();
}

}  // namespace vblk
