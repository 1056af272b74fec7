// Graph: the named nodes of one daemon or command (QEMU's node-name space).
//
// Ownership: the graph holds one reference per named node; parents hold
// references to their children, so a node stays alive while anything uses it.
// Thread-safety: loop thread only.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vblk/node.h"
#include "vblk/node_ref.h"

namespace vblk {

class Graph {
 public:
  // Adds n under its node_name(); an empty name gets a generated "#blockNNN".
  Status add(const std::shared_ptr<Node>& n);
  std::shared_ptr<Node> find(const std::string& name) const;
  // Removes a node nobody else references (EBUSY otherwise).
  Status remove(const std::string& name);
  // Drops the graph's reference and name whoever else holds the node.
  void forget(const std::string& name) { nodes_.erase(name); }
  std::vector<std::shared_ptr<Node>> nodes() const;
  // The graph's reference to `n`, or nullptr when n is not a named node.
  std::shared_ptr<Node> shared(const Node& n) const;
  std::string generate_name();

  // Filters above a node (QEMU's bdrv_insert_node / bdrv_drop_filter, for
  // what backup needs). insert_filter adds `filter` (whose child is already
  // `below`) to the graph and re-points every NodeRef to `below` at it, so
  // exports and devices write through the filter from now on. Node parents
  // are not re-pointed: if a named node has `below` as a child other than
  // its backing file (which reads the same through the filter), EBUSY.
  Status insert_filter(const std::shared_ptr<Node>& below, const std::shared_ptr<Node>& filter);
  // Undoes insert_filter: the filter's NodeRefs point at `below` again and
  // the filter leaves the graph (callers keep it alive until its in-flight
  // requests are done).
  void remove_filter(const std::shared_ptr<Node>& filter, const std::shared_ptr<Node>& below);
  // A named node that has n as a child, or nullptr.
  std::shared_ptr<Node> parent_of(const Node& n, const Node* except = nullptr) const;

 private:
  std::map<std::string, std::shared_ptr<Node>> nodes_;
  unsigned next_id_ = 0;
};

}  // namespace vblk
