// SnapshotRevert (include/block/vblk/snapshot_revert.h).
#include "vblk/snapshot_revert.h"

#include <sys/time.h>
#include <unistd.h>

#include <cstring>

#include "vblk/image_format.h"

namespace vblk {

SnapshotRevert::SnapshotRevert(std::vector<Node*> nodes, std::vector<std::string> names)
    : nodes_(std::move(nodes)), names_(std::move(names)) {}

std::string SnapshotRevert::undo_name(const Node& n) const {
  const std::string base = "vblk-loadvm-undo-" + std::to_string(::getpid());
  std::string name = base;
  for (int i = 2;; ++i) {
    bool taken = false;
    for (const auto& s : image::snapshots(n)) taken = taken || s.name == name || s.id == name;
    if (!taken) return name;
    name = base + "-" + std::to_string(i);
  }
}

Task<Status> SnapshotRevert::revert(const std::string& snapshot) {
  timeval tv;
  gettimeofday(&tv, nullptr);
  Status st;
  // 1. Every undo snapshot first: a node that cannot take one (a full
  //    snapshot table, a write error) stops the load before any revert.
  for (size_t i = 0; i < nodes_.size() && st; ++i) {
    Node& n = *nodes_[i];
    co_await n.drain();
    SnapshotInfo sn;
    sn.name = undo_name(n);
    sn.date_sec = static_cast<uint32_t>(tv.tv_sec);
    sn.date_nsec = static_cast<uint32_t>(tv.tv_usec * 1000);
    st = co_await image::snapshot_create(n, sn);
    if (st)
      undo_.push_back({&n, sn.id, sn.name});
    else
      st = Error(st.error().code, "Could not take an undo snapshot of '" + names_[i] + "': " + st.error().what());
  }
  // 2. The reverts.
  for (size_t i = 0; i < nodes_.size() && st; ++i) {
    st = co_await image::snapshot_goto(*undo_[i].node, snapshot);
    undo_[i].reverted = true;  // a failed goto may have changed something too
    if (!st)
      st = Error(st.error().code, "Could not load snapshot '" + snapshot + "' on '" + names_[i] +
                                      "': " + std::strerror(st.error().code));
  }
  if (!st) (void)co_await rollback();
  co_return st;
}

Task<Status> SnapshotRevert::commit() {
  Status first;
  for (auto& u : undo_) {
    auto st = co_await image::snapshot_delete(*u.node, u.id, u.name);
    if (!st && first)
      first = Error(st.error().code, "Could not delete the undo snapshot '" + u.name + "': " + st.error().what());
  }
  undo_.clear();
  co_return first;
}

Task<Status> SnapshotRevert::rollback() {
  Status first;
  for (auto& u : undo_) {
    Status st;
    if (u.reverted) {
      co_await u.node->drain();
      st = co_await image::snapshot_goto(*u.node, u.id);
    }
    // Kept when the way back failed: it is the only copy of the old state.
    if (st) st = co_await image::snapshot_delete(*u.node, u.id, u.name);
    if (!st && first)
      first = Error(st.error().code, "Could not go back to the undo snapshot '" + u.name + "': " + st.error().what());
  }
  undo_.clear();
  co_return first;
}

}  // namespace vblk
