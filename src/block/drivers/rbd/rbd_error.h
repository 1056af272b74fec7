// librbd and librados return -errno; the driver's errors say which call
// failed and why, as QEMU's rbd driver words them ("MSG: strerror").
#pragma once

#include <cstring>
#include <string>

#include "vblk/result.h"

namespace vblk::rbd {

inline Error rbd_error(int r, const std::string& msg) { return Error(-r, msg + ": " + std::strerror(-r)); }

}  // namespace vblk::rbd
