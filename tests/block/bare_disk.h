// The generic layer's tests' disk: a MemNode (include/block/vblk/mem_node.h) with
// the given limits and only the given caps (none by default, so FUA, zero
// writes and discard are the generic layer's to emulate), recording every
// request it is handed.
#pragma once

#include "vblk/mem_node.h"

namespace vblk::testing {

inline MemNode::Options bare_disk(uint64_t size, BlockLimits limits = {}, NodeCaps caps = {}) {
  MemNode::Options o;
  o.size = size;
  o.limits = limits;
  o.caps = caps;
  o.record = true;
  return o;
}

}  // namespace vblk::testing
