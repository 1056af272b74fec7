// block-commit (QEMU 7.2's qmp_block_commit): merges the layers from `top`
// down to just above `base` into `base`.
//
// The active commit (`top` is the device's own node, the chain's top) is a
// mirror of it into the base (QEMU's commit_active_start, job type
// "commit"): the clusters the layers above the base allocate are copied,
// guest writes go on through the mirror's filter, BLOCK_JOB_READY once in
// sync, and block-job-complete moves the top's users (NBD exports) to the
// base. An intermediate commit (QEMU's commit_start) copies the same way
// once, with no ready, and then points the overlay of `top` at the base
// (`backing-file`, or the base's file name, written into its header).
// The base must be writable (vblk cannot reopen a read-only node, QEMU's
// bdrv_reopen_set_read_only): add it as a node of its own and name it as
// the `backing` of the node above.
//
// Ownership and threads: as the mirror job (include/job/vblk/mirror.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "vblk/graph.h"
#include "vblk/job.h"
#include "vblk/mirror.h"

namespace vblk {

struct CommitArgs {
  std::optional<std::string> job_id;
  std::string device;
  std::optional<std::string> base_node, base, top_node, top, backing_file;
  std::optional<int64_t> speed;
  OnError on_error = OnError::Report;
  std::optional<std::string> filter_node_name;
  bool auto_finalize = true;
  bool auto_dismiss = true;
};

// QEMU's checks and texts in its order; the device must exist (the QMP
// layer answers DeviceNotFound before calling this).
Result<std::shared_ptr<MirrorJob>> start_commit(JobManager& mgr, Graph& graph, const CommitArgs& args);

}  // namespace vblk
