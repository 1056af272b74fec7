// QEMU's QDict key order and its compact JSON text, for output that must
// read as QEMU's does (qemu-img info, json: filenames).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace vblk {

// Reorders object keys (recursively) the way QEMU's QDict iterates them:
// by hash bucket, newest insertion first within a bucket. Build objects in
// the QAPI schema's field order, then pass them through this.
nlohmann::ordered_json qdict_order(const nlohmann::ordered_json& j);

// qobject_to_json(): one line, ": " and ", " separators ({"a": 1, "b": "x"}),
// keys in the order given.
std::string qemu_json_compact(const nlohmann::ordered_json& j);

}  // namespace vblk
