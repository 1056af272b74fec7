// What the block layer's drivers share: the registry's types (vblk/open.h).
// Each driver keeps its entry points in its own files and registers one
// DriverInfo (drivers/list.h); nothing outside its folder calls it.
#pragma once

#include "vblk/open.h"

namespace vblk::drivers {

// null.cc: registered by open.cc's registry directly, not yet by list.h.
Result<std::shared_ptr<Node>> open_null(OpenContext& ctx, Json& opts);

}  // namespace vblk::drivers
