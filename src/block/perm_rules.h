// How a node's needs become its children's, for the roles QEMU's block
// layer knows (block.c: bdrv_filter_default_perms, bdrv_default_perms_for_
// storage, bdrv_default_perms_for_cow). Drivers' child_perm() overrides
// pick the rule for the role a child plays.
#pragma once

#include "vblk/perm.h"

namespace vblk::perm_rules {

// A filter's child: everything passes through.
inline PermPair filtered(PermPair self) { return self; }

// Where a format keeps its metadata and/or data (qcow2's `file`, raw's
// `file` with offset or size). `writable`: the format node itself may be
// written (it then writes its metadata whoever its users are); `no_io`:
// opened only to be described, no consistent read needed.
inline PermPair storage(PermPair self, bool metadata, bool data, bool writable, bool no_io) {
  PermPair c = self;
  if (metadata) {
    if (writable) c.perm |= kPermWrite | kPermResize;
    if (!no_io) c.perm |= kPermConsistentRead;
    // Metadata must stay consistent: nobody else writes or resizes it.
    c.shared &= ~(kPermWrite | kPermResize);
  }
  if (data) {
    // The format relies on the size of its data file.
    c.shared &= ~kPermResize;
    // Unchanged writes may still need real ones underneath (copy-on-read).
    if (c.perm & kPermWriteUnchanged) c.perm |= kPermWrite;
    // Writes may grow the file.
    if (c.perm & kPermWrite) c.perm |= kPermResize;
  }
  return c;
}

// A backing file: read for its data only; others may write it only if the
// users of the overlay can live with changing data.
inline PermPair cow(PermPair self) {
  PermPair c;
  c.perm = self.perm & kPermConsistentRead;
  c.shared = (self.shared & kPermWrite) ? (kPermWrite | kPermResize) : 0;
  c.shared |= kPermConsistentRead | kPermWriteUnchanged;
  return c;
}

}  // namespace vblk::perm_rules
