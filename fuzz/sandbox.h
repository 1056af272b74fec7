// Which block options the fuzz targets may open: only drivers that stay in
// memory. Options are refused (not opened) when any node in them names
// another driver (file, host_device, nbd, rbd: the host's files and
// sockets; blkdebug: its config file), when a child would become a file
// (a "filename" without a driver), or when they carry the keys that name
// host files or make a request sleep (latency-ns: a fuzz input must not
// hang on purpose).
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>

namespace vblk::fuzz {

template <class J>
bool in_memory_only(const J& v) {
  static const std::set<std::string> kDrivers = {
      "null-co", "raw", "qcow2", "luks", "throttle", "copy-before-write", "snapshot-access"};
  static const std::set<std::string> kKeys = {"filename",      "backing-file", "data-file", "config", "path",
                                              "snapshot-file", "latency-ns",   "host",      "port",   "server"};
  if (v.is_array()) {
    for (const auto& e : v)
      if (!in_memory_only(e)) return false;
    return true;
  }
  if (!v.is_object()) return true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (kKeys.count(it.key())) return false;
    if (it.key() == "driver" && (!it->is_string() || !kDrivers.count(it->template get<std::string>()))) return false;
    // Flattened keys ("file.driver", "file.filename") count as their last part.
    if (auto dot = it.key().rfind('.'); dot != std::string::npos) {
      std::string last = it.key().substr(dot + 1);
      if (kKeys.count(last)) return false;
      if (last == "driver" && (!it->is_string() || !kDrivers.count(it->template get<std::string>()))) return false;
    }
    if (!in_memory_only(*it)) return false;
  }
  return true;
}

}  // namespace vblk::fuzz
