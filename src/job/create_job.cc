// The blockdev-create job (include/job/vblk/create_job.h).
#include "vblk/create_job.h"

namespace vblk {

CreateJob::CreateJob(JobManager& mgr, const std::string& id, Body body)
    : Job(mgr, id, /*auto_finalize=*/true, /*auto_dismiss=*/false), body_(std::move(body)) {}

Task<Status> CreateJob::run() {
  set_progress(0, 1);
  Status st = co_await body_();
  set_progress(1, 1);
  if (!st) set_error_text(st.error().what());
  co_return st;
}

}  // namespace vblk
