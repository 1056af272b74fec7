// drive-mirror (see drive_mirror.h), in QEMU's qmp_drive_mirror order: the
// source's checks, the target created (its errors are QEMU's
// bdrv_img_create's), the target opened (bdrv_open's), then everything
// blockdev-mirror checks. The target node is the daemon's, not the
// monitor's: blockdev-del refuses it, and it goes when nothing uses it
// (drop_orphans: at the next blockdev-del or query-named-block-nodes).
#include "drive_mirror.h"
#include "transaction.h"
#include "vblk/mirror.h"
#include "vblk/open.h"

namespace vblk::qmp {

namespace {}  // namespace

Task<Reply> drive_mirror(Daemon& d, const OJson& a) {
  const std::string device = a["device"].get<std::string>();
  const std::string target = a["target"].get<std::string>();
  auto src = d.graph.find(device);
  if (!src) co_return Reply::fail("Cannot find device='" + device + "' nor node-name='" + device + "'");
  if (d.graph.parent_of(*src)) co_return Reply::fail("Need a root block node");
  if (auto st = d.jobs.check_not_busy(src.get(), src->node_name()); !st) co_return Reply::fail(st.error());

  const std::string mode = a.contains("mode") ? a["mode"].get<std::string>() : "absolute-paths";
  std::string format = a.contains("format") ? a["format"].get<std::string>() : "";
  if (!a.contains("format") && mode != "existing") format = src->driver();
  std::string sync = a["sync"].get<std::string>();
  Node* target_backing = src->child("backing");
  if (!target_backing && sync == "top") sync = "full";
  if (sync == "none") target_backing = src.get();
  if (a.contains("replaces") && !a.contains("node-name"))
    co_return Reply::fail("a node-name must be provided when replacing a named node of the graph");

  if (!format.empty() && format != "raw" && format != "qcow2") {
    if (find_driver(format) && mode == "existing") {
      // An existing image of another format is opened below.
    } else {
      co_return Reply::fail("Unknown file format '" + format + "'");
    }
  }
  if ((sync == "full" || !target_backing) && mode != "existing") {
    if (Status st = co_await create_image(d, target, format, src->length(), "", ""); !st)
      co_return Reply::fail(st.error());
  } else if (mode == "absolute-paths") {
    Status st =
        co_await create_image(d, target, format, src->length(), target_backing->filename(), target_backing->driver());
    if (!st) co_return Reply::fail(st.error());
  }

  // Open the target: without its backing chain (the mirror's source has
  // it; QEMU's BDRV_O_NO_BACKING).
  if (format.empty()) {
    OpenContext pctx{d.loop};
    auto file = open_node(pctx, Json{{"driver", "file"}, {"filename", target}});
    if (!file) co_return Reply::fail(file.error());
    auto probed = co_await probe_format(**file);
    (void)co_await (*file)->close();
    format = probed ? *probed : "raw";
  }
  Json opts = {{"driver", format}, {"file", {{"driver", "file"}, {"filename", target}}}};
  if (format == "qcow2") opts["backing"] = nullptr;
  std::string name;
  if (a.contains("node-name")) {
    name = a["node-name"].get<std::string>();
    if (d.graph.find(name)) co_return Reply::fail("Duplicate nodes with node-name='" + name + "'");
    opts["node-name"] = name;
  }
  OpenContext ctx{.loop = d.loop, .graph = &d.graph, .throttle_groups = &d.throttle_groups};
  auto tgt = open_node(ctx, std::move(opts));
  if (!tgt) {
    std::string msg = tgt.error().what();
    if (msg.rfind("Could not open", 0) != 0) msg = "Could not open '" + target + "': " + msg;
    co_return Reply::fail(msg);
  }
  d.note_new_nodes(*tgt);

  MirrorArgs m;
  if (a.contains("job-id")) m.job_id = a["job-id"].get<std::string>();
  m.device = device;
  m.target = (*tgt)->node_name();
  if (a.contains("replaces")) m.replaces = a["replaces"].get<std::string>();
  m.sync = sync;
  if (a.contains("speed")) m.speed = a["speed"].get<int64_t>();
  if (a.contains("granularity")) m.granularity = a["granularity"].get<uint64_t>();
  if (a.contains("buf-size")) m.buf_size = a["buf-size"].get<int64_t>();
  if (a.contains("on-source-error")) parse_on_error(a["on-source-error"].get<std::string>(), m.on_source_error);
  if (a.contains("on-target-error")) parse_on_error(a["on-target-error"].get<std::string>(), m.on_target_error);
  if (a.contains("unmap")) m.unmap = a["unmap"].get<bool>();
  if (a.contains("copy-mode")) m.write_blocking = a["copy-mode"].get<std::string>() == "write-blocking";
  if (a.contains("auto-finalize")) m.auto_finalize = a["auto-finalize"].get<bool>();
  if (a.contains("auto-dismiss")) m.auto_dismiss = a["auto-dismiss"].get<bool>();
  // On completion the target takes the source's backing chain (QEMU's
  // MIRROR_SOURCE_BACKING_CHAIN); its header already names it.
  if (format == "qcow2" && target_backing && sync != "full")
    for (auto& n : d.graph.nodes())
      if (n.get() == target_backing) m.target_backing = n;
  m.owns_target = true;
  auto job = start_mirror(d.jobs, d.graph, m);
  if (!job.ok()) {
    // The target goes again (nothing else holds it).
    tgt = Error(ENOENT);
    co_await drop_orphans(d);
    co_return Reply::fail(job.error());
  }
  d.note_new_nodes((*job)->filter_node());
  co_return Reply::ok();
}

}  // namespace vblk::qmp
