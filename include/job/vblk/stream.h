// block-stream (QEMU 7.2's qmp_block_stream / block/stream.c): copies into a
// node what its backing chain (down to `base`, or all of it) provides and
// the node does not allocate, then makes `base` its backing file (none when
// the whole chain was streamed), recording `backing-file` or the base's file
// name in the image.
//
// The job (type "stream") is the mirror job in stream mode
// (include/job/vblk/mirror.h): source and target are the node itself, a
// copy-on-read filter above it (the mirror's filter, covering mode) makes
// guest writes and the copy wait for each other, and a cluster the guest
// wrote is not copied. No ready: the job completes once copied.
//
// Ownership and threads: as the mirror job.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "vblk/graph.h"
#include "vblk/job.h"
#include "vblk/mirror.h"

namespace vblk {

struct StreamArgs {
  std::optional<std::string> job_id;
  std::string device;
  std::optional<std::string> base, base_node, backing_file, bottom;
  std::optional<int64_t> speed;
  OnError on_error = OnError::Report;
  std::optional<std::string> filter_node_name;
  bool auto_finalize = true;
  bool auto_dismiss = true;
};

// QEMU's checks and texts in its order, then the job.
Result<std::shared_ptr<MirrorJob>> start_stream(JobManager& mgr, Graph& graph, const StreamArgs& args);

}  // namespace vblk
