// drive-mirror (QEMU 7.2's legacy mirror command): the target is a file the
// command creates (mode absolute-paths, with the source's backing file for
// sync=top/none) or opens (mode existing), then the blockdev-mirror job.
#pragma once

#include "vblk/qmp_daemon.h"

namespace vblk::qmp {

Task<Reply> drive_mirror(Daemon& d, const OJson& args);

// Closes and forgets implicit nodes nothing uses any more (children opened
// inline, a drive-mirror target left behind); commands_block.cc.
Task<void> drop_orphans(Daemon& d);

}  // namespace vblk::qmp
