#include "vblk/copy_drivers.h"

#include "drivers.h"

namespace vblk {

void register_copy_drivers() {
  register_driver({"copy-before-write", false, drivers::open_copy_before_write, nullptr});
  register_driver({"snapshot-access", false, drivers::open_snapshot_access, nullptr});
}

}  // namespace vblk
