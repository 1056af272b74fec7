// Typed access to block driver options held as JSON (QEMU's QDict).
//
// Options arrive either typed (QMP blockdev-add: true, 4096) or as strings
// (command line key=value: "on", "4k"), so every getter accepts both. Each
// getter removes the key it reads: whatever is left after a driver's open is
// an option the driver does not support, reported as QEMU does.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "vblk/result.h"

namespace vblk {

using Json = nlohmann::json;

// Parses "on"/"off"/"true"/"false"/"yes"/"no" or a JSON bool.
Result<std::optional<bool>> take_bool(Json& opts, const std::string& key);
// Parses a JSON integer or a size string with k/M/G/T/P/E suffixes.
Result<std::optional<uint64_t>> take_size(Json& opts, const std::string& key);
// QemuOpts' QEMU_OPT_NUMBER: a JSON integer or a string in any base
// qemu_strtou64 takes; a negative number wraps around, as it does in QEMU
// (so range checks see it as huge).
Result<std::optional<uint64_t>> take_number(Json& opts, const std::string& key);
Result<std::optional<std::string>> take_string(Json& opts, const std::string& key);
// Takes the sub-dictionary `key` (nested object, or flattened "key.x" entries).
std::optional<Json> take_dict(Json& opts, const std::string& key);

// Turns "a=1,b.c=2" (QEMU keyval / QemuOpts syntax, ",," escapes a comma)
// into nested JSON {"a":"1","b":{"c":"2"}}. implied_key names a leading
// value without "=" (qemu-img's --image-opts uses "file").
Result<Json> parse_keyval(const std::string& text, const std::string& implied_key = {});

// qemu_strtosz: sizes with optional B/K/M/G/T/P/E suffix (binary) and a
// fractional part; see docs/qemu-img-compat.md §2. Returns EINVAL on syntax
// errors and ERANGE on overflow.
Result<uint64_t> parse_size(const std::string& text);

}  // namespace vblk
