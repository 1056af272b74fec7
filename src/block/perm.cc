// Node permissions: the cumulative pair of a node from its users, applied
// top-down (perm.h). QEMU computes the same thing in bdrv_refresh_perms.
#include "vblk/node.h"
#include "vblk/node_ref.h"
#include "vblk/perm.h"

namespace vblk {

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
  PermPair now = claim_;
  for (const NodeRef* r : refs_) {
    now.perm |= r->perms().perm;
    now.shared &= r->perms().shared;
  }
  for (const Node* p : parents_) {
    for (const Child& c : p->children_) {
      if (c.node.get() != this) continue;
      PermPair need = p->child_perm(c, p->perms_);
      now.perm |= need.perm;
      now.shared &= need.shared;
    }
  }
  if (force_share_) now.shared = kPermAll;
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
