#include "drivers/rbd/rbd_lib.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace vblk::rbd {

namespace {

RbdLib g_lib;
std::string g_why;

void load() {
  // The soname librbd-dev's symlink points at (Debian's librbd1); librados,
  // which it needs, comes with it, and dlsym on the handle finds both
  // libraries' functions. RTLD_LOCAL: their symbols stay out of the
  // process's global scope, as a plugin's would.
  // VBLK_LIBRBD names another file (a test's stand-in for a host without
  // librbd, or a packager's path).
  const char* env = std::getenv("VBLK_LIBRBD");
  void* h = ::dlopen(env && *env ? env : "librbd.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    g_why = std::string("could not load librbd: ") + (e ? e : "unknown error");
    return;
  }
  RbdLib lib;
#define VBLK_RBD_RESOLVE(f)                                  \
  lib.f = reinterpret_cast<decltype(lib.f)>(::dlsym(h, #f)); \
  if (!lib.f) {                                              \
    g_why = "could not load librbd: " #f " not found";       \
    return;                                                  \
  }
  VBLK_RBD_FUNCTIONS(VBLK_RBD_RESOLVE)
#undef VBLK_RBD_RESOLVE
  // The library stays loaded for the life of the process, as a linked one
  // would (librados' threads may outlive a shutdown).
  g_lib = lib;
}

std::once_flag g_once;

// The table once loaded, null if it could not be (g_why says why).
const RbdLib* loaded() {
  std::call_once(g_once, load);
  return g_why.empty() ? &g_lib : nullptr;
}

}  // namespace

const RbdLib* load_rbd_lib(std::string& why) {
  const RbdLib* lib = loaded();
  if (!lib) why = g_why;
  return lib;
}

const RbdLib& rbd_lib() {
  const RbdLib* lib = loaded();
  if (!lib) std::abort();  // a connection or image exists only after a successful load
  return *lib;
}

}  // namespace vblk::rbd
