// SnapshotRevert: reverting disks to an internal snapshot so that the
// revert can still be taken back (vblk loadvm, x-vblk-loadvm).
//
// A loadvm reverts the disks and then streams the VM state to a consumer
// (QEMU's -incoming). The disk must be reverted before the consumer has the
// whole stream (QEMU starts the guest as soon as it has), so the revert
// cannot simply move after the stream; but the stream can still fail
// after it (the consumer goes away, a read error, a full disk). Without a
// way back the disk would then have lost every write since the snapshot.
//
// So before reverting, each disk gets an "undo" snapshot of its current
// state (a qcow2 internal snapshot: metadata only, no data copied), named
// vblk-loadvm-undo-<pid>[-n]. commit() deletes them; rollback() goes
// back to them and deletes them. Either way the snapshot table ends as it
// began. A vblk killed in between leaves the undo snapshot, from which
// the operator can go back by hand: lost data is worse than a stray entry.
//
// Ownership: borrows the nodes, which must outlive it. One loop.
#pragma once

#include <string>
#include <vector>

#include "vblk/node.h"
#include "vblk/result.h"
#include "vblk/task.h"

namespace vblk {

class SnapshotRevert {
 public:
  // names: the nodes' names for messages, one per node.
  SnapshotRevert(std::vector<Node*> nodes, std::vector<std::string> names);

  // Takes the undo snapshots, then reverts every node to `snapshot` (an id
  // or a name, as Node::snapshot_goto). On failure nothing is changed: what
  // was done is undone (the error says what failed).
  Task<Status> revert(const std::string& snapshot);
  // The revert stands: the undo snapshots go. Idempotent.
  Task<Status> commit();
  // Back to the state before revert(): each node to its undo snapshot,
  // which then goes. Idempotent.
  Task<Status> rollback();

 private:
  struct Undo {
    Node* node;
    std::string id, name;
    bool reverted = false;  // the node was reverted, not only snapshotted
  };
  std::string undo_name(const Node& n) const;

  std::vector<Node*> nodes_;
  std::vector<std::string> names_;
  std::vector<Undo> undo_;
};

}  // namespace vblk
