// block-commit's checks and the active commit (see include/job/vblk/commit.h).
#include "vblk/commit.h"

#include "chain_job_params.h"
#include "vblk/chain.h"

namespace vblk {

Result<std::shared_ptr<MirrorJob>> start_commit(JobManager& mgr, Graph& graph, const CommitArgs& a) {
  auto bs = graph.find(a.device);
  if (!bs) return Error(ENODEV, "Device '" + a.device + "' not found");
  if (graph.parent_of(*bs)) return Error(EINVAL, "Need a root block node");
  VBLK_TRY(mgr.check_not_busy(bs.get(), bs->node_name()));

  std::shared_ptr<Node> top = bs;
  if (a.top_node && a.top) return Error(EINVAL, "'top-node' and 'top' are mutually exclusive");
  if (a.top_node) {
    top = graph.find(*a.top_node);
    if (!top) return Error(ENOENT, "Cannot find device='' nor node-name='" + *a.top_node + "'");
    if (!chain_contains(*bs, *top)) return Error(EINVAL, "'" + *a.top_node + "' is not in this backing file chain");
  } else if (a.top && bs->filename() != *a.top) {
    top = find_backing_image(graph, *bs, *a.top);
    if (!top) return Error(ENOENT, "Top image file " + *a.top + " not found");
  }

  std::shared_ptr<Node> base;
  if (a.base_node && a.base) return Error(EINVAL, "'base-node' and 'base' are mutually exclusive");
  if (a.base_node) {
    base = graph.find(*a.base_node);
    if (!base) return Error(ENOENT, "Cannot find device='' nor node-name='" + *a.base_node + "'");
    if (!chain_contains(*top, *base)) return Error(EINVAL, "'" + *a.base_node + "' is not in this backing file chain");
  } else if (a.base) {
    base = find_backing_image(graph, *top, *a.base);
    if (!base) return Error(ENOENT, "Can't find '" + *a.base + "' in the backing chain");
  } else {
    base = graph.shared(*chain_base(*top));
    if (!base) return Error(ENOENT, "There is no backimg image");
  }
  // Nodes from top down to the base are the commit's targets.
  for (Node* n = top.get(); n && n != filter_or_cow_child(*base); n = filter_or_cow_child(*n))
    VBLK_TRY(mgr.check_not_busy(n, n->node_name()));
  if (top == base) return Error(EINVAL, "cannot commit an image into itself");

  if (top != bs) {
    // An intermediate commit (QEMU's commit_start): copy once, then the
    // overlay of `top` takes the base as its backing file.
    std::shared_ptr<Node> overlay;
    for (auto& n : graph.nodes())
      if (n->child("backing") == top.get()) overlay = n;
    if (!overlay) return Error(ENOENT, "Could not find overlay image for " + top->filename() + ":");
    VBLK_TRY(mgr.check_not_busy(overlay.get(), overlay->node_name()));
    MirrorJobParams p = chain_job_params(a, MirrorJob::Sync::CommitIntermediate);
    p.driver = "commit_top";
    p.job_before_filter = true;
    p.overlay = overlay;
    p.backing_str = a.backing_file.value_or(base->filename());
    return start_mirror_job(mgr, graph, top, base, p);
  }
  if (a.backing_file) return Error(EINVAL, "'backing-file' specified, but 'top' is the active layer");
  MirrorJobParams p = chain_job_params(a, MirrorJob::Sync::Commit);
  return start_mirror_job(mgr, graph, top, base, p);
}

}  // namespace vblk
