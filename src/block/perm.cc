// Node permissions: the cumulative pair of a node from its users, applied
// top-down (perm.h). QEMU computes the same thing in bdrv_refresh_perms.
#include "vblk/perm.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "vblk/node.h"
#include "vblk/node_ref.h"

namespace vblk {

uint64_t next_user_stamp() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

namespace {

// One user of a node as a conflict names it.
struct User {
  PermPair need;
  std::string desc;  // "node 'd0'", "an unnamed block device"
  std::string role;  // the child name: "file", "root"
  uint64_t stamp;
};

// QEMU's bdrv_a_allow_b: a must share everything b needs.
Status a_allows_b(const std::string& node, const User& a, const User& b) {
  const uint32_t denied = b.need.perm & ~a.need.shared;
  if (!denied) return {};
  return Error(EPERM, "Permission conflict on node '" + node + "': permissions '" + perm_names(denied) +
                          "' are both required by " + b.desc + " (uses node '" + node + "' as '" + b.role +
                          "' child) and unshared by " + a.desc + " (uses node '" + node + "' as '" + a.role +
                          "' child).");
}

}  // namespace

std::string perm_names(uint32_t perms) {
  static const char* const kNames[kPermBits] = {"consistent read", "write", "write unchanged", "resize"};
  std::string out;
  for (int i = 0; i < kPermBits; ++i) {
    if (!(perms & (1u << i))) continue;
    if (!out.empty()) out += ", ";
    out += kNames[i];
  }
  return out;
}

PermPair Node::child_perm(const Child& c, PermPair self) const {
  (void)c;
  return self;
}

Status Node::refresh_perms() {
  std::vector<User> users;
  if (claim_ != PermPair{}) users.push_back({claim_, "an unnamed block device", "root", 0});
  for (const NodeRef* r : refs_) users.push_back({r->perms(), r->user_desc(), r->user_role(), r->stamp()});
  for (const Node* p : parents_) {
    for (const Child& c : p->children_) {
      if (c.node.get() != this) continue;
      const PermPair need = p->backing_filtered_ && c.role == "backing" ? PermPair{} : p->child_perm(c, p->perms_);
      users.push_back({need, "node '" + p->node_name() + "'", c.role, c.stamp});
    }
  }
  // force-share: every user shares everything (QEMU's force_share on the
  // child), so nothing here conflicts.
  if (force_share_)
    for (User& u : users) u.need.shared = kPermAll;
  std::sort(users.begin(), users.end(), [](const User& a, const User& b) { return a.stamp > b.stamp; });
  for (const User& a : users)
    for (const User& b : users)
      if (&a != &b)
        if (Status st = a_allows_b(node_name(), a, b); !st) return st;
  PermPair now;
  for (const User& u : users) {
    now.perm |= u.need.perm;
    now.shared &= u.need.shared;
  }
  const PermPair old = perms_;
  if (now != old) {
    if (Status st = apply_perms(now); !st) return st;
    perms_ = now;
  }
  for (size_t i = 0; i < children_.size(); ++i) {
    Status st = children_[i].node->refresh_perms();
    if (st) continue;
    // Put this node back as it was and let the children already updated
    // follow it back: their old pairs were held before, so this succeeds.
    if (now != old) {
      (void)apply_perms(old);
      perms_ = old;
    }
    for (size_t j = 0; j < i; ++j) (void)children_[j].node->refresh_perms();
    return st;
  }
  return {};
}

}  // namespace vblk
