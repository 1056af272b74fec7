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

namespace vblk {

class Graph {
 public:
  // Adds n under its node_name(); an empty name gets a generated "#blockNNN".
  Status add(const std::shared_ptr<Node>& n);
  std::shared_ptr<Node> find(const std::string& name) const;
  // Removes a node nobody else references (EBUSY otherwise).
  Status remove(const std::string& name);
  std::vector<std::shared_ptr<Node>> nodes() const;
  std::string generate_name();

 private:
  std::map<std::string, std::shared_ptr<Node>> nodes_;
  unsigned next_id_ = 0;
};

}  // namespace vblk
