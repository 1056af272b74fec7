#include "vblk/copy_drivers.h"

#include "drivers.h"

namespace vblk {

void register_copy_drivers() {
  register_driver({.name = "copy-before-write", .kind = DriverKind::Filter, .open = drivers::open_copy_before_write});
  register_driver({.name = "snapshot-access", .kind = DriverKind::Filter, .open = drivers::open_snapshot_access});
}

}  // namespace vblk
