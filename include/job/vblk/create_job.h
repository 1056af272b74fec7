// The blockdev-create job (QEMU's block/create.c): a plain job of type
// "create" that runs one image-creation coroutine. QEMU makes it with
// JOB_MANUAL_DISMISS: auto-finalize, but the user dismisses it; progress is
// 0/1 while it runs and 1/1 once the body returned, whatever the result. A
// failure's message becomes the job's "error".
//
// Ownership: the JobManager owns the job; the body owns what it captured.
#pragma once

#include <functional>
#include <string>

#include "vblk/job.h"

namespace vblk {

class CreateJob : public Job {
 public:
  using Body = std::function<Task<Status>()>;
  CreateJob(JobManager& mgr, const std::string& id, Body body);
  const char* type() const override { return "create"; }

 protected:
  Task<Status> run() override;

 private:
  Body body_;
};

}  // namespace vblk
