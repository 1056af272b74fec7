// Job commands: blockdev-backup, block-job-* and job-* verbs, query-jobs and
// query-block-jobs, with QEMU 7.2's argument schemas, lookups and error
// classes (block-job-* say DeviceNotActive "Block job 'x' not found", job-*
// say GenericError "Job not found"). The job logic itself is in src/job.
#include "qmp/daemon.h"
#include "qmp/drive_mirror.h"
#include "vblk/backup.h"
#include "vblk/commit.h"
#include "vblk/mirror.h"
#include "vblk/stream.h"

namespace vblk::qmp {

namespace {

const std::vector<std::string> kSyncModes = {"top", "full", "none", "incremental", "bitmap"};
const std::vector<std::string> kOnError = {"report", "ignore", "enospc", "stop", "auto"};
const std::vector<std::string> kCopyModes = {"background", "write-blocking"};

Reply fail(const Error& e, const char* cls = "GenericError") { return Reply::fail(e.what(), cls); }

Reply status_reply(const Status& st) {
  if (!st.ok()) return fail(st.error());
  return Reply::ok();
}

Task<Reply> blockdev_backup(Daemon& d, const OJson& a) {
  BackupArgs b;
  if (a.contains("job-id")) b.job_id = a["job-id"].get<std::string>();
  b.device = a["device"].get<std::string>();
  b.target = a["target"].get<std::string>();
  b.sync = a["sync"].get<std::string>();
  if (a.contains("speed")) b.speed = a["speed"].get<int64_t>();
  if (a.contains("bitmap")) b.bitmap = a["bitmap"].get<std::string>();
  if (a.contains("bitmap-mode")) b.bitmap_mode = a["bitmap-mode"].get<std::string>();
  if (a.contains("compress")) b.compress = a["compress"].get<bool>();
  if (a.contains("on-source-error")) parse_on_error(a["on-source-error"].get<std::string>(), b.on_source_error);
  if (a.contains("on-target-error")) parse_on_error(a["on-target-error"].get<std::string>(), b.on_target_error);
  if (a.contains("auto-finalize")) b.auto_finalize = a["auto-finalize"].get<bool>();
  if (a.contains("auto-dismiss")) b.auto_dismiss = a["auto-dismiss"].get<bool>();
  if (a.contains("filter-node-name")) b.filter_node_name = a["filter-node-name"].get<std::string>();
  if (a.contains("x-perf")) {
    const OJson& p = a["x-perf"];
    if (p.contains("use-copy-range")) b.use_copy_range = p["use-copy-range"].get<bool>();
    if (p.contains("max-workers")) b.max_workers = p["max-workers"].get<int64_t>();
    if (p.contains("max-chunk")) b.max_chunk = p["max-chunk"].get<int64_t>();
    // vblk's COW buffer (SPEC part 5).
    if (p.contains("cow-buffer-size")) b.cow_buffer_size = p["cow-buffer-size"].get<int64_t>();
    if (p.contains("cow-spill-dir")) b.cow_spill_dir = p["cow-spill-dir"].get<std::string>();
    if (p.contains("cow-spill-size")) b.cow_spill_size = p["cow-spill-size"].get<int64_t>();
    if (p.contains("cow-spill-direct")) b.cow_spill_direct = p["cow-spill-direct"].get<bool>();
  }
  auto job = start_backup(d.jobs, d.graph, b);
  if (!job.ok()) co_return fail(job.error());
  d.note_new_nodes((*job)->filter_node());
  co_return Reply::ok();
}

Task<Reply> blockdev_mirror(Daemon& d, const OJson& a) {
  MirrorArgs m;
  if (a.contains("job-id")) m.job_id = a["job-id"].get<std::string>();
  m.device = a["device"].get<std::string>();
  m.target = a["target"].get<std::string>();
  if (a.contains("replaces")) m.replaces = a["replaces"].get<std::string>();
  m.sync = a["sync"].get<std::string>();
  if (a.contains("speed")) m.speed = a["speed"].get<int64_t>();
  if (a.contains("granularity")) m.granularity = a["granularity"].get<uint64_t>();
  if (a.contains("buf-size")) m.buf_size = a["buf-size"].get<int64_t>();
  if (a.contains("on-source-error")) parse_on_error(a["on-source-error"].get<std::string>(), m.on_source_error);
  if (a.contains("on-target-error")) parse_on_error(a["on-target-error"].get<std::string>(), m.on_target_error);
  if (a.contains("filter-node-name")) m.filter_node_name = a["filter-node-name"].get<std::string>();
  if (a.contains("copy-mode")) m.write_blocking = a["copy-mode"].get<std::string>() == "write-blocking";
  if (a.contains("auto-finalize")) m.auto_finalize = a["auto-finalize"].get<bool>();
  if (a.contains("auto-dismiss")) m.auto_dismiss = a["auto-dismiss"].get<bool>();
  auto job = start_mirror(d.jobs, d.graph, m);
  if (!job.ok()) co_return fail(job.error());
  d.note_new_nodes((*job)->filter_node());
  co_return Reply::ok();
}

Task<Reply> block_commit(Daemon& d, const OJson& a) {
  CommitArgs c;
  if (a.contains("job-id")) c.job_id = a["job-id"].get<std::string>();
  c.device = a["device"].get<std::string>();
  for (auto [key, field] : {std::pair{"base-node", &c.base_node}, {"base", &c.base}, {"top-node", &c.top_node},
                            {"top", &c.top}, {"backing-file", &c.backing_file},
                            {"filter-node-name", &c.filter_node_name}})
    if (a.contains(key)) *field = a[key].get<std::string>();
  if (a.contains("speed")) c.speed = a["speed"].get<int64_t>();
  if (a.contains("on-error")) parse_on_error(a["on-error"].get<std::string>(), c.on_error);
  if (a.contains("auto-finalize")) c.auto_finalize = a["auto-finalize"].get<bool>();
  if (a.contains("auto-dismiss")) c.auto_dismiss = a["auto-dismiss"].get<bool>();
  auto job = start_commit(d.jobs, d.graph, c);
  // libvirt probes for live commit by this class (QEMU's comment).
  if (!job.ok()) co_return fail(job.error(), job.error().code == ENODEV ? "DeviceNotFound" : "GenericError");
  d.note_new_nodes((*job)->filter_node());
  co_return Reply::ok();
}

Task<Reply> block_stream(Daemon& d, const OJson& a) {
  StreamArgs c;
  if (a.contains("job-id")) c.job_id = a["job-id"].get<std::string>();
  c.device = a["device"].get<std::string>();
  for (auto [key, field] : {std::pair{"base", &c.base}, {"base-node", &c.base_node}, {"backing-file", &c.backing_file},
                            {"bottom", &c.bottom}, {"filter-node-name", &c.filter_node_name}})
    if (a.contains(key)) *field = a[key].get<std::string>();
  if (a.contains("speed")) c.speed = a["speed"].get<int64_t>();
  if (a.contains("on-error")) parse_on_error(a["on-error"].get<std::string>(), c.on_error);
  if (a.contains("auto-finalize")) c.auto_finalize = a["auto-finalize"].get<bool>();
  if (a.contains("auto-dismiss")) c.auto_dismiss = a["auto-dismiss"].get<bool>();
  auto job = start_stream(d.jobs, d.graph, c);
  if (!job.ok()) co_return fail(job.error());
  d.note_new_nodes((*job)->filter_node());
  co_return Reply::ok();
}

// Lookups, as QEMU's find_block_job_locked / find_job_locked answer.
Result<std::shared_ptr<BlockJob>> block_job(Daemon& d, const OJson& a, const char* key) {
  return d.jobs.find_block_job(a[key].get<std::string>());
}

Task<Reply> block_job_verb(Daemon& d, const OJson& a, std::string verb) {
  const char* key = (verb == "finalize" || verb == "dismiss") ? "id" : "device";
  auto j = block_job(d, a, key);
  if (!j.ok()) co_return fail(j.error(), "DeviceNotActive");
  BlockJob& job = **j;
  if (verb == "pause") co_return status_reply(job.user_pause());
  if (verb == "resume") co_return status_reply(job.user_resume());
  if (verb == "complete") co_return status_reply(job.complete());
  if (verb == "finalize") co_return status_reply(job.finalize());
  if (verb == "dismiss") co_return status_reply(job.dismiss());
  if (verb == "set-speed") co_return status_reply(job.set_speed(a["speed"].get<int64_t>()));
  // cancel
  bool force = a.contains("force") && a["force"].get<bool>();
  if (job.user_paused() && !force)
    co_return Reply::fail("The block job for device '" + job.id() + "' is currently paused");
  co_return status_reply(job.user_cancel(force));
}

Task<Reply> job_verb(Daemon& d, const OJson& a, std::string verb) {
  auto j = d.jobs.find_job(a["id"].get<std::string>());
  if (!j.ok()) co_return fail(j.error());
  Job& job = **j;
  if (verb == "pause") co_return status_reply(job.user_pause());
  if (verb == "resume") co_return status_reply(job.user_resume());
  if (verb == "complete") co_return status_reply(job.complete());
  if (verb == "finalize") co_return status_reply(job.finalize());
  if (verb == "dismiss") co_return status_reply(job.dismiss());
  co_return status_reply(job.user_cancel(true));  // job-cancel always forces
}

Task<Reply> query_block_jobs(Daemon& d, const OJson&) { co_return Reply::ok(d.jobs.query_block_jobs()); }
Task<Reply> query_jobs(Daemon& d, const OJson&) { co_return Reply::ok(d.jobs.query_jobs()); }

}  // namespace

void register_job_commands(Daemon& d) {
  d.jobs.set_event_sink([&d](const std::string& name, const OJson& data) { d.emit(name, data); });
  // A job's own use of a node (a mirror's target) is a BlockBackend in
  // QEMU: blockdev-del says "Node x is in use".
  d.node_users.push_back([](const Node& n) { return !n.refs().empty(); });
  d.registry.add({"blockdev-backup",
                  {{{"job-id", ArgType::Str},
                    {"device", ArgType::Str, true},
                    {"sync", ArgType::Enum, true, kSyncModes},
                    {"speed", ArgType::Int},
                    {"bitmap", ArgType::Str},
                    {"bitmap-mode", ArgType::Enum, false, {"on-success", "never", "always"}},
                    {"compress", ArgType::Bool},
                    {"on-source-error", ArgType::Enum, false, kOnError},
                    {"on-target-error", ArgType::Enum, false, kOnError},
                    {"auto-finalize", ArgType::Bool},
                    {"auto-dismiss", ArgType::Bool},
                    {"filter-node-name", ArgType::Str},
                    {"x-perf",
                     ArgType::Struct,
                     false,
                     {},
                     {{"use-copy-range", ArgType::Bool},
                      {"max-workers", ArgType::Int},
                      {"max-chunk", ArgType::Int},
                      {"cow-buffer-size", ArgType::Int},
                      {"cow-spill-dir", ArgType::Str},
                      {"cow-spill-size", ArgType::Int},
                      {"cow-spill-direct", ArgType::Bool}}},
                    {"target", ArgType::Str, true}}},
                  [&d](const OJson& a) { return blockdev_backup(d, a); }});
  d.registry.add({"blockdev-mirror",
                  {{{"job-id", ArgType::Str},
                    {"device", ArgType::Str, true},
                    {"target", ArgType::Str, true},
                    {"replaces", ArgType::Str},
                    {"sync", ArgType::Enum, true, kSyncModes},
                    {"speed", ArgType::Int},
                    {"granularity", ArgType::UInt32},
                    {"buf-size", ArgType::Int},
                    {"on-source-error", ArgType::Enum, false, kOnError},
                    {"on-target-error", ArgType::Enum, false, kOnError},
                    {"filter-node-name", ArgType::Str},
                    {"copy-mode", ArgType::Enum, false, kCopyModes},
                    {"auto-finalize", ArgType::Bool},
                    {"auto-dismiss", ArgType::Bool}}},
                  [&d](const OJson& a) { return blockdev_mirror(d, a); }});
  d.registry.add({"drive-mirror",
                  {{{"job-id", ArgType::Str},
                    {"device", ArgType::Str, true},
                    {"target", ArgType::Str, true},
                    {"format", ArgType::Str},
                    {"node-name", ArgType::Str},
                    {"replaces", ArgType::Str},
                    {"sync", ArgType::Enum, true, kSyncModes},
                    {"mode", ArgType::Enum, false, {"existing", "absolute-paths"}},
                    {"speed", ArgType::Int},
                    {"granularity", ArgType::UInt32},
                    {"buf-size", ArgType::Int},
                    {"on-source-error", ArgType::Enum, false, kOnError},
                    {"on-target-error", ArgType::Enum, false, kOnError},
                    {"unmap", ArgType::Bool},
                    {"copy-mode", ArgType::Enum, false, kCopyModes},
                    {"auto-finalize", ArgType::Bool},
                    {"auto-dismiss", ArgType::Bool}}},
                  [&d](const OJson& a) { return drive_mirror(d, a); }});
  d.registry.add({"block-commit",
                  {{{"job-id", ArgType::Str},
                    {"device", ArgType::Str, true},
                    {"base-node", ArgType::Str},
                    {"base", ArgType::Str},
                    {"top-node", ArgType::Str},
                    {"top", ArgType::Str},
                    {"backing-file", ArgType::Str},
                    {"speed", ArgType::Int},
                    {"on-error", ArgType::Enum, false, kOnError},
                    {"filter-node-name", ArgType::Str},
                    {"auto-finalize", ArgType::Bool},
                    {"auto-dismiss", ArgType::Bool}}},
                  [&d](const OJson& a) { return block_commit(d, a); }});
  d.registry.add({"block-stream",
                  {{{"job-id", ArgType::Str},
                    {"device", ArgType::Str, true},
                    {"base", ArgType::Str},
                    {"base-node", ArgType::Str},
                    {"backing-file", ArgType::Str},
                    {"bottom", ArgType::Str},
                    {"speed", ArgType::Int},
                    {"on-error", ArgType::Enum, false, kOnError},
                    {"filter-node-name", ArgType::Str},
                    {"auto-finalize", ArgType::Bool},
                    {"auto-dismiss", ArgType::Bool}}},
                  [&d](const OJson& a) { return block_stream(d, a); }});
  for (const char* verb : {"pause", "resume", "complete"}) {
    std::string v = verb;
    d.registry.add({"block-job-" + v, {{{"device", ArgType::Str, true}}},
                    [&d, v](const OJson& a) { return block_job_verb(d, a, v); }});
  }
  d.registry.add({"block-job-cancel", {{{"device", ArgType::Str, true}, {"force", ArgType::Bool}}},
                  [&d](const OJson& a) { return block_job_verb(d, a, "cancel"); }});
  d.registry.add({"block-job-set-speed", {{{"device", ArgType::Str, true}, {"speed", ArgType::Int, true}}},
                  [&d](const OJson& a) { return block_job_verb(d, a, "set-speed"); }});
  for (const char* verb : {"finalize", "dismiss"}) {
    std::string v = verb;
    d.registry.add({"block-job-" + v, {{{"id", ArgType::Str, true}}},
                    [&d, v](const OJson& a) { return block_job_verb(d, a, v); }});
  }
  for (const char* verb : {"pause", "resume", "cancel", "complete", "dismiss", "finalize"}) {
    std::string v = verb;
    d.registry.add({"job-" + v, {{{"id", ArgType::Str, true}}}, [&d, v](const OJson& a) { return job_verb(d, a, v); }});
  }
  d.registry.add({"query-block-jobs", {}, [&d](const OJson& a) { return query_block_jobs(d, a); }});
  d.registry.add({"query-jobs", {}, [&d](const OJson& a) { return query_jobs(d, a); }});
}

}  // namespace vblk::qmp
