// The copy layer's drivers: copy-before-write (copy_before_write.cc) and
// snapshot-access (snapshot_access.cc), added to the block layer's
// registry by register_copy_drivers() (vblk/copy_drivers.h).
#pragma once

#include "vblk/open.h"

namespace vblk::drivers {

Result<std::shared_ptr<Node>> open_copy_before_write(OpenContext& ctx, Json& opts);
Result<std::shared_ptr<Node>> open_snapshot_access(OpenContext& ctx, Json& opts);

}  // namespace vblk::drivers
