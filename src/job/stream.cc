// block-stream's checks (see include/job/vblk/stream.h).
#include "vblk/stream.h"

#include <algorithm>

#include "chain_job_params.h"
#include "vblk/chain.h"
#include "vblk/image_format.h"

namespace vblk {

Result<std::shared_ptr<MirrorJob>> start_stream(JobManager& mgr, Graph& graph, const StreamArgs& a) {
  if (a.base && a.base_node) return Error(EINVAL, "'base' and 'base-node' cannot be specified at the same time");
  if (a.base && a.bottom) return Error(EINVAL, "'base' and 'bottom' cannot be specified at the same time");
  if (a.bottom && a.base_node) return Error(EINVAL, "'bottom' and 'base-node' cannot be specified at the same time");
  auto bs = graph.find(a.device);
  if (!bs) return Error(ENOENT, "Cannot find device='" + a.device + "' nor node-name='" + a.device + "'");

  std::shared_ptr<Node> base;  // the new backing file (nullptr: none)
  if (a.base) {
    base = find_backing_image(graph, *bs, *a.base);
    if (!base) return Error(ENOENT, "Can't find '" + *a.base + "' in the backing chain");
  }
  if (a.base_node) {
    base = graph.find(*a.base_node);
    if (!base) return Error(ENOENT, "Cannot find device='' nor node-name='" + *a.base_node + "'");
    if (base == bs || !chain_contains(*bs, *base))
      return Error(EINVAL, "Node '" + *a.base_node + "' is not a backing image of '" + a.device + "'");
  }
  if (a.bottom) {
    auto bottom = graph.find(*a.bottom);
    if (!bottom) return Error(ENOENT, "Cannot find device='' nor node-name='" + *a.bottom + "'");
    if (is_filter(*bottom))
      return Error(EINVAL, "Node '" + *a.bottom + "' is a filter, use a non-filter node as 'bottom'");
    if (!chain_contains(*bs, *bottom))
      return Error(EINVAL, "Node '" + *a.bottom + "' is not in a chain starting from '" + a.device + "'");
    // Everything down to `bottom` is streamed: its backing file stays.
    Node* below = filter_or_cow_child(*bottom);
    base = below ? graph.shared(*below) : nullptr;
  }
  // Op blockers on the chain from the device down to the base.
  for (Node* n = bs.get(); n && n != base.get(); n = filter_or_cow_child(*n))
    VBLK_TRY(mgr.check_not_busy(n, n->node_name()));
  if (!base && a.backing_file) return Error(EINVAL, "backing file specified, but streaming the entire chain");

  MirrorJobParams p = chain_job_params(a, MirrorJob::Sync::Stream);
  p.driver = "copy-on-read";
  // A guest write must allocate whole bitmap clusters in the node, or the
  // rest of a cluster it marks clean would be lost with the backing file.
  p.granularity = image::cluster_size(*bs) ? std::max<uint64_t>(512, image::cluster_size(*bs)) : 0;
  p.new_backing = base;
  if (base) p.backing_str = a.backing_file.value_or(base->filename());
  return start_mirror_job(mgr, graph, bs, bs, p);
}

}  // namespace vblk
