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
  NodeRef(NodeRef&& o) noexcept { reset(o.node_); o.reset(); }
  NodeRef& operator=(NodeRef&& o) noexcept {
    if (this != &o) {
      reset(o.node_);
      o.reset();
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

  // Points this reference at n (or nowhere).
  void reset(std::shared_ptr<Node> n = {}) {
    if (node_) std::erase(node_->refs_, this);
    node_ = std::move(n);
    if (node_) node_->refs_.push_back(this);
  }

 private:
  std::shared_ptr<Node> node_;
};

}  // namespace vblk
