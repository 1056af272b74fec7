// One export of a node, whatever serves it (an NBD server's export, a
// vhost-user-blk device): what block-export-add makes, query-block-exports
// lists and block-export-del removes, one interface for every type.
//
// Ownership: the monitor's export table owns each export; an export owns
// whatever serves it (or, for NBD, its entry on the shared server) and
// holds its node through a NodeRef. One loop.
#pragma once

#include <string>

#include "vblk/node.h"
#include "vblk/task.h"

namespace vblk {

class BlockExport {
 public:
  virtual ~BlockExport() = default;
  // The QAPI BlockExportType: "nbd", "vhost-user-blk", "fuse" (and vblk's "ublk").
  virtual const char* type() const = 0;
  // The node the export serves now (a backup's filter or an overlay may
  // have been put above the node it was made for); null once removed.
  virtual const Node* node() const = 0;
  // Clients attached: block-export-del in mode "safe" refuses then.
  virtual bool in_use() const = 0;
  // Waits until the export serves (a ublk device's disk has been added);
  // an error means it never will, and the export is to be removed.
  virtual Task<Status> ready() { co_return Status{}; }
  // Ends the export: no new clients, the attached ones disconnected after
  // their requests in flight, and the node let go, before this returns.
  virtual Task<void> remove() = 0;
};

}  // namespace vblk
