// NodeRef: a reference from a user of a node that is not itself a node (an
// NBD export, a job, a monitor-level device) — QEMU's BdrvChild of a
// BlockBackend. The node knows its NodeRefs, so the graph can re-point them
// all at once: inserting a filter above a node (backup's copy-before-write)
// makes every such user go through the filter without knowing it, and
// removing the filter points them back.
//
// A NodeRef keeps its node alive (it holds a shared_ptr). Requests already
// running keep using the node they started on; only new ones see the change.
// Thread-safety: loop thread only, like the node.
#pragma once

#include <memory>

#include "vblk/node.h"

namespace vblk {

class NodeRef {
 public:
  NodeRef() = default;
  // Implicit: an export's options take a node like a shared_ptr.
  NodeRef(std::shared_ptr<Node> n) { reset(std::move(n)); }  // NOLINT
  ~NodeRef() { reset(); }
  NodeRef(NodeRef&& o) noexcept { take(o); }
  NodeRef& operator=(NodeRef&& o) noexcept {
    if (this != &o) {
      reset();
      take(o);
    }
    return *this;
  }
  NodeRef(const NodeRef&) = delete;
  NodeRef& operator=(const NodeRef&) = delete;

  Node* get() const { return node_.get(); }
  Node& operator*() const { return *node_; }
  Node* operator->() const { return node_.get(); }
  explicit operator bool() const { return bool(node_); }
  const std::shared_ptr<Node>& shared() const { return node_; }

  // Points this reference at n (or nowhere); its permissions go along.
  // Re-pointing keeps what the graph below needs (a filter inserted above
  // a node passes the same needs down), so no lock is refused here.
  void reset(std::shared_ptr<Node> n = {}) {
    std::shared_ptr<Node> old = std::move(node_);
    if (old) std::erase(old->refs_, this);
    node_ = std::move(n);
    if (node_) {
      node_->refs_.push_back(this);
      stamp_ = next_user_stamp();
    }
    if (perms_ != PermPair{}) {
      if (node_) (void)node_->refresh_perms();
      if (old) (void)old->refresh_perms();
    }
  }

  // What this user needs of the node and shares (perm.h); refused with
  // QEMU's "Failed to get ... lock", keeping the previous pair.
  Status set_perms(PermPair p) {
    PermPair old = perms_;
    perms_ = p;
    if (!node_) return {};
    Status st = node_->refresh_perms();
    if (!st) {
      perms_ = old;
      (void)node_->refresh_perms();
    }
    return st;
  }
  const PermPair& perms() const { return perms_; }

  // How a permission conflict names this user (QEMU's get_parent_desc and
  // child name): "an unnamed block device" as "root" for an export or a
  // blockdev-create, "backup job 'j0'" as "main node" for a job.
  void set_user(std::string desc, std::string role) {
    desc_ = std::move(desc);
    role_ = std::move(role);
  }
  const std::string& user_desc() const { return desc_; }
  const std::string& user_role() const { return role_; }
  uint64_t stamp() const { return stamp_; }

 private:
  // Moves o's node and pair here (the node's needs do not change).
  void take(NodeRef& o) {
    perms_ = o.perms_;
    o.perms_ = {};
    desc_ = std::move(o.desc_);
    role_ = std::move(o.role_);
    stamp_ = o.stamp_;
    std::shared_ptr<Node> n = o.node_;
    o.reset();
    node_ = std::move(n);
    if (node_) node_->refs_.push_back(this);
  }

  std::shared_ptr<Node> node_;
  PermPair perms_;
  std::string desc_ = "an unnamed block device";
  std::string role_ = "root";
  uint64_t stamp_ = 0;
};

}  // namespace vblk
