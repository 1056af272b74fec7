// Walks down a node's backing chain and through its filters: the graph
// queries that jobs and commands share, each defined here once (QEMU has
// them in block.c: bdrv_filter_bs, bdrv_filter_or_cow_bs,
// bdrv_skip_filters, bdrv_chain_contains, bdrv_find_base,
// bdrv_find_backing_image).
//
// A filter is a FilterNode (blkdebug, throttle, copy-before-write,
// mirror_top, commit_top): its one `file` child is filtered, not data of
// its own. snapshot-access is not one: its `file` is what it reads from.
// Thread-safety: loop thread only, like the graph.
#pragma once

#include <memory>
#include <string>

#include "vblk/graph.h"
#include "vblk/node.h"

namespace vblk {

// What `n` filters, or nullptr when n is not a filter.
Node* filtered_child(const Node& n);
inline bool is_filter(const Node& n) { return filtered_child(n) != nullptr; }

// The next node down the chain: the backing file, or what a filter filters.
Node* filter_or_cow_child(const Node& n);

// The first node at or below `n` that is not a filter (n itself when it is
// none; nullptr for nullptr).
Node* skip_filters(Node* n);

// Whether `n` is `top` or below it through backing files and filters.
bool chain_contains(const Node& top, const Node& n);

// The bottom of top's chain (top itself when nothing is below it).
Node* chain_base(Node& top);

// The named node below `from` whose overlay records `name` as its backing
// file name, or whose own file name is `name` (block-commit's and
// block-stream's base lookup by file name).
std::shared_ptr<Node> find_backing_image(const Graph& graph, const Node& from, const std::string& name);

}  // namespace vblk
