// Registers the copy layer's drivers with the block layer's registry
// (vblk/open.h): copy-before-write and snapshot-access, which the block
// layer cannot name since they are built on block-copy. A program that
// opens nodes from options calls it once before (qmp::Daemon does, and so
// does the vblk command); calling it again does nothing.
#pragma once

namespace vblk {

void register_copy_drivers();

}  // namespace vblk
