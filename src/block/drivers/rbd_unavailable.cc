// Stands in for the rbd driver (rbd/) in builds without librbd: the driver
// name is known, but opening or creating says this build cannot.
#include "drivers/rbd/rbd_entry.h"

namespace vblk::drivers {

namespace {
Error unavailable() { return Error(ENOTSUP, "vblk was built without the rbd driver (librbd-dev, librados-dev)"); }
}  // namespace

Result<std::shared_ptr<Node>> open_rbd(OpenContext&, Json&) { return unavailable(); }
Status create_rbd(const std::string&, uint64_t, uint64_t, const std::optional<std::string>&, const Json*) {
  return unavailable();
}
Status create_rbd(Json&, uint64_t, uint64_t, const Json*) { return unavailable(); }
Status check_rbd_encrypt(const Json&, const std::string&) { return {}; }  // creating says why not
Status remove_rbd(const std::string&) { return unavailable(); }

}  // namespace vblk::drivers
