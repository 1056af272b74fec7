// The mirror-job parameters block-commit and block-stream fill alike from
// their arguments: QEMU's commit and stream take one on-error for both
// sides and name the job after the device ("" for a node name).
#pragma once

#include <string>

#include "vblk/mirror.h"

namespace vblk {

template <class Args>
MirrorJobParams chain_job_params(const Args& a, MirrorJob::Sync sync) {
  MirrorJobParams p;
  p.job_id = a.job_id.value_or(std::string());
  p.filter_node_name = a.filter_node_name.value_or(std::string());
  p.sync = sync;
  p.speed = a.speed;
  p.on_source_error = a.on_error;
  p.on_target_error = a.on_error;
  p.auto_finalize = a.auto_finalize;
  p.auto_dismiss = a.auto_dismiss;
  return p;
}

}  // namespace vblk
