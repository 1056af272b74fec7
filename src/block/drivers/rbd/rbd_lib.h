// librbd and librados, opened on first use.
//
// Linking them into vblk made every process pay for them, rbd or not: an
// empty program linked against the two takes 15.8 ms and 21 MiB to run,
// and vblk --version took 14 ms against qemu-img's 4.6 ms, with 22 MiB
// resident against 7.3 (bench/bench_startup.py; now 3.4 ms and 6.3 MiB).
// QEMU keeps its rbd driver in a module for the same reason. The driver
// calls the libraries through this table, filled by dlopen on the first rbd
// connection; a host without them gets a clear error at that point, and
// everything else works.
#pragma once

#include <rados/librados.h>
#include <rbd/librbd.h>

#include <string>

namespace vblk::rbd {

// The X-macro list is kept packed by hand.
// clang-format off
#define VBLK_RBD_FUNCTIONS(X)                                                                                      \
  X(rados_create) X(rados_conf_read_file) X(rados_conf_set) X(rados_connect) X(rados_ioctx_create)              \
  X(rados_ioctx_set_namespace) X(rados_ioctx_destroy) X(rados_shutdown) X(rbd_namespace_exists) X(rbd_create)   \
  X(rbd_remove) X(rbd_open) X(rbd_close) X(rbd_stat) X(rbd_get_size) X(rbd_get_features) X(rbd_get_flags)        \
  X(rbd_get_parent) X(rbd_linked_image_spec_cleanup) X(rbd_snap_spec_cleanup) X(rbd_resize) X(rbd_read)         \
  X(rbd_diff_iterate2) X(rbd_snap_list) X(rbd_snap_list_end) X(rbd_snap_create) X(rbd_snap_remove)              \
  X(rbd_snap_rollback) X(rbd_encryption_format) X(rbd_encryption_load) X(rbd_aio_create_completion)             \
  X(rbd_aio_get_return_value) X(rbd_aio_release) X(rbd_aio_read) X(rbd_aio_write) X(rbd_aio_write_zeroes)      \
  X(rbd_aio_discard) X(rbd_aio_flush)
// clang-format on

struct RbdLib {
#define VBLK_RBD_MEMBER(f) decltype(&::f) f = nullptr;
  VBLK_RBD_FUNCTIONS(VBLK_RBD_MEMBER)
#undef VBLK_RBD_MEMBER
};

// Loads the libraries once (thread-safe); null with `why` set when they
// cannot be loaded or lack a function.
const RbdLib* load_rbd_lib(std::string& why);

// The loaded table. Only for code that runs on a connection or an image,
// which exist only once load_rbd_lib succeeded.
const RbdLib& rbd_lib();

}  // namespace vblk::rbd
