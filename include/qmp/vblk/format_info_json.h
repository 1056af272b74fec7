// QAPI's ImageInfoSpecific as JSON: {"type": driver, "data": {...}}, members
// in the schema's order, from the block layer's FormatInfo (format_info.h).
// One renderer for `vblk info` (format-specific, human and json) and
// query-named-block-nodes / query-block (image.format-specific).
#pragma once

#include <nlohmann/json.hpp>

#include "vblk/format_info.h"

namespace vblk {

nlohmann::ordered_json format_info_json(const FormatInfo& info);

}  // namespace vblk
