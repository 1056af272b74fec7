#include "vblk/graph.h"

#include <fmt/format.h>

namespace vblk {

Status Graph::add(const std::shared_ptr<Node>& n) {
  if (n->node_name().empty()) n->set_node_name(generate_name());
  if (nodes_.count(n->node_name())) return Error(EEXIST, "Duplicate nodes with node-name='" + n->node_name() + "'");
  nodes_[n->node_name()] = n;
  return {};
}

std::shared_ptr<Node> Graph::find(const std::string& name) const {
  auto it = nodes_.find(name);
  return it == nodes_.end() ? nullptr : it->second;
}

Status Graph::remove(const std::string& name) {
  auto it = nodes_.find(name);
  if (it == nodes_.end()) return Error(ENOENT, "Failed to find node with node-name='" + name + "'");
  if (it->second.use_count() > 1) return Error(EBUSY, "Node '" + name + "' is busy: node is used as child or by a job");
  nodes_.erase(it);
  return {};
}

std::shared_ptr<Node> Graph::shared(const Node& n) const {
  for (const auto& [name, node] : nodes_)
    if (node.get() == &n) return node;
  return nullptr;
}

std::vector<std::shared_ptr<Node>> Graph::nodes() const {
  std::vector<std::shared_ptr<Node>> out;
  for (auto& [k, v] : nodes_) out.push_back(v);
  return out;
}

std::string Graph::generate_name() {
  std::string name;
  do {
    name = fmt::format("#block{:03d}", next_id_++);
  } while (nodes_.count(name));
  return name;
}

std::shared_ptr<Node> Graph::parent_of(const Node& n, const Node* except) const {
  for (auto& [name, p] : nodes_) {
    if (p.get() == except) continue;
    for (auto& c : p->children())
      if (c.node.get() == &n) return p;
  }
  return nullptr;
}

Status Graph::insert_filter(const std::shared_ptr<Node>& below, const std::shared_ptr<Node>& filter) {
  // A node that only reads `below` as its backing file (fleecing's temporary
  // image over the source) reads the same through the filter, so it may
  // keep its child as it is; any other parent would bypass the filter.
  for (auto& [name, p] : nodes_) {
    if (p == filter) continue;
    for (auto& c : p->children())
      if (c.node == below && c.role != "backing")
        return Error(EBUSY, "Cannot insert a filter above node '" + below->node_name() + "': it is a child of node '" +
                                p->node_name() + "'");
  }
  if (auto st = add(filter); !st) return st;
  // Copy the list first: reset() edits it.
  std::vector<NodeRef*> refs = below->refs();
  for (NodeRef* r : refs) r->reset(filter);
  return {};
}

void Graph::remove_filter(const std::shared_ptr<Node>& filter, const std::shared_ptr<Node>& below) {
  std::vector<NodeRef*> refs = filter->refs();
  for (NodeRef* r : refs) r->reset(below);
  auto it = nodes_.find(filter->node_name());
  if (it != nodes_.end() && it->second == filter) nodes_.erase(it);
}

}  // namespace vblk
