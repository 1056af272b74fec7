#include "vblk/chain.h"

#include "vblk/filter_node.h"
#include "vblk/image_format.h"

namespace vblk {

Node* filtered_child(const Node& n) {
  auto* f = dynamic_cast<const FilterNode*>(&n);
  return f ? &f->filtered() : nullptr;
}

Node* filter_or_cow_child(const Node& n) {
  if (Node* b = n.child("backing")) return b;
  return filtered_child(n);
}

Node* skip_filters(Node* n) {
  while (n)
    if (Node* f = filtered_child(*n))
      n = f;
    else
      break;
  return n;
}

bool chain_contains(const Node& top, const Node& n) {
  for (const Node* p = &top; p; p = filter_or_cow_child(*p))
    if (p == &n) return true;
  return false;
}

Node* chain_base(Node& top) {
  Node* n = &top;
  while (Node* next = filter_or_cow_child(*n)) n = next;
  return n;
}

std::shared_ptr<Node> find_backing_image(const Graph& graph, const Node& from, const std::string& name) {
  for (const Node* p = &from; p; p = filter_or_cow_child(*p)) {
    Node* b = p->child("backing");
    if (b && (image::backing_file_name(*p) == name || b->filename() == name)) return graph.shared(*b);
  }
  return nullptr;
}

}  // namespace vblk
