// How an export finds a dirty bitmap given by name: see server.h.
#include "vblk/nbd_server.h"

namespace vblk::nbd {

NamedBitmap* find_bitmap_in_chain(std::shared_ptr<Node>& node, const std::string& name) {
  for (std::shared_ptr<Node> n = node; n;) {
    if (NamedBitmap* bm = n->bitmaps().find(name)) {
      node = n;
      return bm;
    }
    std::shared_ptr<Node> next;
    for (const auto& c : n->children())
      if (c.role == "backing") next = c.node;
    n = next;
  }
  return nullptr;
}

}  // namespace vblk::nbd
