// Job commands: blockdev-backup, block-job-* and job-* verbs, query-jobs and
// query-block-jobs, with QEMU 7.2's argument schemas, lookups and error
// classes (block-job-* say DeviceNotActive "Block job 'x' not found", job-*
// say GenericError "Job not found"). The job logic itself is in src/job.
#include "drive_mirror.h"
#include "transaction.h"
#include "vblk/backup.h"
#include "vblk/commit.h"
#include "vblk/mirror.h"
#include "vblk/open.h"
#include "vblk/qmp_daemon.h"
#include "vblk/stream.h"

namespace vblk::qmp {

namespace {

const std::vector<std::string> kSyncModes = {"top", "full", "none", "incremental", "bitmap"};
const std::vector<std::string> kOnError = {"report", "ignore", "enospc", "stop", "auto"};
const std::vector<std::string> kCopyModes = {"background", "write-blocking"};

Reply status_reply(const Status& st) {
  if (!st.ok()) return Reply::fail(st.error());
  return Reply::ok();
}

BackupArgs parse_backup_args(const OJson& a) {
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
  return b;
}

// blockdev-backup and drive-backup as transaction actions (QEMU 7.2's
// blockdev_backup_* / drive_backup_*): prepare makes the job without
// starting it (drive-backup first creates or opens its target, as
// drive_backup_prepare does), commit starts it, abort cancels it.
class BackupAction final : public TxAction {
 public:
  BackupAction(const OJson& a, bool drive) : a_(a), drive_(drive) {}
  const char* name() const override { return drive_ ? "drive-backup" : "blockdev-backup"; }
  bool supports_grouped() const override { return true; }

  Task<Status> prepare(TxContext& tx) override {
    Daemon& d = tx.d;
    BackupArgs b = parse_backup_args(a_);
    b.start = false;
    if (drive_) VBLK_CO_TRY(co_await open_drive_target(d, b));
    auto job = start_backup(d.jobs, d.graph, b);
    if (!job.ok()) co_return job.take_error();
    job_ = *job;
    d.note_new_nodes(job_->filter_node());
    if (!target_name_.empty()) d.job_nodes[job_->id()].push_back(target_name_);
    tx.jobs.push_back(job_);
    co_return Status{};
  }

  Task<void> commit(TxContext& tx) override {
    if (tx.grouped) job_->join_group(tx.group);
    job_->start();
    co_return;
  }

  Task<void> abort(TxContext& tx) override {
    if (job_) {
      (void)job_->user_cancel(true);
    } else if (!target_name_.empty()) {
      co_await tx.d.drop_node(target_name_);
    }
  }

 private:
  // drive_backup_prepare: the target image is created (unless mode is
  // existing) with the source's format, or the source's backing file as
  // its backing file for sync=top, then opened with discard=unmap and
  // detect-zeroes=unmap under a generated name; sync=none makes the
  // source its backing node.
  Task<Status> open_drive_target(Daemon& d, BackupArgs& b) {
    auto src = lookup_node(d, b.device, b.device);
    if (!src) co_return src.take_error();
    co_await (*src)->drain();
    std::string mode = str_or(a_, "mode", "absolute-paths");
    std::string format = str_or(a_, "format", "");
    if (format.empty() && mode != "existing") format = (*src)->driver();
    VBLK_CO_TRY(d.jobs.check_not_busy(src->get(), (*src)->node_name()));
    if (b.sync == "top") {
      if (Node* bk = (*src)->child("backing")) {
        backing_name_ = bk->filename();
        backing_fmt_ = bk->driver();
      } else {
        b.sync = "full";
      }
    }
    if (b.sync == "none") {
      // The target reads through the source (QEMU's set_backing_hd case).
      backing_name_ = (*src)->filename();
      backing_fmt_ = (*src)->driver();
    }
    const std::string path = b.target;
    if (mode != "existing")
      VBLK_CO_TRY(co_await create_image(d, path, format, (*src)->length(), backing_name_, backing_fmt_));
    if (format.empty()) {
      OpenContext ctx{.loop = d.loop};
      auto f = open_node(ctx, image_options("", "", path));
      if (!f) co_return f.take_error();
      auto probed = co_await probe_format(**f);
      if (!probed) co_return probed.take_error();
      format = *probed;
    }
    // No node-name: QEMU's drive-backup target is an anonymous #blockNNN.
    Json opts = image_options(format, "", path);
    opts["discard"] = "unmap";
    opts["detect-zeroes"] = "unmap";
    if (b.sync == "none" && format == "qcow2") opts["backing"] = nullptr;
    OpenContext ctx{.loop = d.loop, .graph = &d.graph, .throttle_groups = &d.throttle_groups};
    auto t = open_node(ctx, std::move(opts));
    if (!t) co_return t.take_error();
    d.note_new_nodes(*t);
    target_name_ = (*t)->node_name();
    if (b.sync == "none") VBLK_CO_TRY((*t)->attach_backing(*src));
    b.target = target_name_;
    co_return Status{};
  }

  OJson a_;
  bool drive_;
  std::shared_ptr<BackupJob> job_;
  std::string target_name_;  // drive-backup: the target node it opened
  std::string backing_name_, backing_fmt_;
};

// The node and the implicit nodes below it leave the graph (the job may
// still hold them until it is dismissed); the node is closed.
void forget_tree(Daemon& d, Node& n) {
  for (const auto& c : n.children())
    if (!d.monitor_owned.count(c.node->node_name()) && d.graph.find(c.node->node_name()) == c.node)
      forget_tree(d, *c.node);
  d.settings.erase(&n);
  d.graph.forget(n.node_name());
}

Task<void> close_job_node(Daemon& d, std::string name) {
  auto n = d.graph.find(name);
  if (!n) co_return;
  forget_tree(d, *n);
  co_await n->drain();
  (void)co_await n->close();
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
  if (!job.ok()) co_return Reply::fail(job.error());
  d.note_new_nodes((*job)->filter_node());
  co_return Reply::ok();
}

Task<Reply> block_commit(Daemon& d, const OJson& a) {
  CommitArgs c;
  if (a.contains("job-id")) c.job_id = a["job-id"].get<std::string>();
  c.device = a["device"].get<std::string>();
  for (auto [key, field] : {std::pair{"base-node", &c.base_node},
                            {"base", &c.base},
                            {"top-node", &c.top_node},
                            {"top", &c.top},
                            {"backing-file", &c.backing_file},
                            {"filter-node-name", &c.filter_node_name}})
    if (a.contains(key)) *field = a[key].get<std::string>();
  if (a.contains("speed")) c.speed = a["speed"].get<int64_t>();
  if (a.contains("on-error")) parse_on_error(a["on-error"].get<std::string>(), c.on_error);
  if (a.contains("auto-finalize")) c.auto_finalize = a["auto-finalize"].get<bool>();
  if (a.contains("auto-dismiss")) c.auto_dismiss = a["auto-dismiss"].get<bool>();
  auto job = start_commit(d.jobs, d.graph, c);
  // libvirt probes for live commit by this class (QEMU's comment).
  if (!job.ok()) co_return Reply::fail(job.error(), job.error().code == ENODEV ? "DeviceNotFound" : "GenericError");
  d.note_new_nodes((*job)->filter_node());
  co_return Reply::ok();
}

Task<Reply> block_stream(Daemon& d, const OJson& a) {
  StreamArgs c;
  if (a.contains("job-id")) c.job_id = a["job-id"].get<std::string>();
  c.device = a["device"].get<std::string>();
  for (auto [key, field] : {std::pair{"base", &c.base},
                            {"base-node", &c.base_node},
                            {"backing-file", &c.backing_file},
                            {"bottom", &c.bottom},
                            {"filter-node-name", &c.filter_node_name}})
    if (a.contains(key)) *field = a[key].get<std::string>();
  if (a.contains("speed")) c.speed = a["speed"].get<int64_t>();
  if (a.contains("on-error")) parse_on_error(a["on-error"].get<std::string>(), c.on_error);
  if (a.contains("auto-finalize")) c.auto_finalize = a["auto-finalize"].get<bool>();
  if (a.contains("auto-dismiss")) c.auto_dismiss = a["auto-dismiss"].get<bool>();
  auto job = start_stream(d.jobs, d.graph, c);
  if (!job.ok()) co_return Reply::fail(job.error());
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
  if (!j.ok()) co_return Reply::fail(j.error(), "DeviceNotActive");
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
  if (!j.ok()) co_return Reply::fail(j.error());
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

const std::vector<Arg> kBlockdevBackupArgs = {{"job-id", ArgType::Str},
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
                                              {"target", ArgType::Str, true}};

const std::vector<Arg> kDriveBackupArgs = [] {
  std::vector<Arg> v = kBlockdevBackupArgs;
  v.push_back({"format", ArgType::Str});
  v.push_back({"mode", ArgType::Enum, false, {"existing", "absolute-paths"}});
  return v;
}();

std::unique_ptr<TxAction> make_backup(const OJson& args, bool drive) {
  return std::make_unique<BackupAction>(args, drive);
}

void register_job_commands(Daemon& d) {
  d.jobs.set_event_sink([&d](const std::string& name, const OJson& data) {
    d.emit(name, data);
    // Nodes a job opened for itself (drive-backup's target) are closed and
    // forgotten once it concluded: nothing writes to them any more.
    if (name == "JOB_STATUS_CHANGE" && data["status"] == "concluded") {
      auto it = d.job_nodes.find(data["id"].get<std::string>());
      if (it != d.job_nodes.end()) {
        for (const auto& n : it->second) spawn_detached(close_job_node(d, n));
        d.job_nodes.erase(it);
      }
    }
  });
  // A job's own use of a node (a mirror's target) is a BlockBackend in
  // QEMU: blockdev-del says "Node x is in use".
  d.node_users.push_back([](const Node& n) { return !n.refs().empty(); });
  d.registry.add({"blockdev-backup", {kBlockdevBackupArgs}, [&d](const OJson& a) {
                    return run_single_action(d, make_backup(a, false));
                  }});
  d.registry.add({"drive-backup", {kDriveBackupArgs}, [&d](const OJson& a) {
                    return run_single_action(d, make_backup(a, true));
                  }});
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
    d.registry.add({"block-job-" + v, {{{"device", ArgType::Str, true}}}, [&d, v](const OJson& a) {
                      return block_job_verb(d, a, v);
                    }});
  }
  d.registry.add({"block-job-cancel",
                  {{{"device", ArgType::Str, true}, {"force", ArgType::Bool}}},
                  [&d](const OJson& a) { return block_job_verb(d, a, "cancel"); }});
  d.registry.add({"block-job-set-speed",
                  {{{"device", ArgType::Str, true}, {"speed", ArgType::Int, true}}},
                  [&d](const OJson& a) { return block_job_verb(d, a, "set-speed"); }});
  for (const char* verb : {"finalize", "dismiss"}) {
    std::string v = verb;
    d.registry.add({"block-job-" + v, {{{"id", ArgType::Str, true}}}, [&d, v](const OJson& a) {
                      return block_job_verb(d, a, v);
                    }});
  }
  for (const char* verb : {"pause", "resume", "cancel", "complete", "dismiss", "finalize"}) {
    std::string v = verb;
    d.registry.add({"job-" + v, {{{"id", ArgType::Str, true}}}, [&d, v](const OJson& a) { return job_verb(d, a, v); }});
  }
  d.registry.add({"query-block-jobs", {}, [&d](const OJson& a) { return query_block_jobs(d, a); }});
  d.registry.add({"query-jobs", {}, [&d](const OJson& a) { return query_jobs(d, a); }});
}

}  // namespace vblk::qmp
