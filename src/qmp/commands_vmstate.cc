// x-vblk-savevm / x-vblk-loadvm: QEMU's snapshot-save / snapshot-load for
// a VM whose disks this daemon holds, the VM-state stream on a socket (the
// jobs: include/vblk/vmstate_job.h).
//
//   x-vblk-savevm {job-id, tag, vmstate, devices, addr, workers?, buffer-size?}
//     listens on addr (SocketAddress, as nbd-server-start's) before it
//     answers; QEMU then `migrate`s to it (stopped first, as libvirt saves);
//     at the stream's end every device gets snapshot `tag`, the state on
//     `vmstate`'s.
//   x-vblk-loadvm {job-id, tag, vmstate, devices, addr, workers?, buffer-size?}
//     connects to addr (unix), where a QEMU started with `-incoming
//     unix:PATH` waits for the stream, before it answers; the job then
//     reverts the devices to `tag` and sends the stream (the revert taken
//     back if the stream fails).
//
// The checks and texts are QEMU's save_snapshot / load_snapshot ones
// (migration/savevm.c, block/snapshot.c) where QEMU has them; they run
// before the job is created, so a bad request makes no job.
#include <unistd.h>

#include "qmp/daemon.h"
#include "vblk/vmstate_job.h"

namespace vblk::qmp {

namespace {

const std::vector<std::string> kAddrTypes = {"inet", "unix", "vsock", "fd"};

struct Request {
  std::string job_id, tag;
  VmstateJobNodes nodes;
  VmstateOptions opts;
};

// Devices and the vmstate node, as QEMU's bdrv_all_get_snapshot_devices
// and bdrv_all_find_vmstate_bs check them.
Result<Request> parse(Daemon& d, const OJson& a, bool save) {
  Request r;
  r.job_id = a["job-id"].get<std::string>();
  r.tag = a["tag"].get<std::string>();
  if (auto st = d.jobs.check_new_id(r.job_id); !st) return st.take_error();
  if (r.tag.empty()) return Error(EINVAL, "Snapshot tag cannot be empty");
  if (r.tag.size() > 255) return Error(EINVAL, "Snapshot tag is longer than 255 characters");
  for (const auto& dev : a["devices"]) {
    if (!dev.is_string()) return Error(EINVAL, "Invalid parameter type for 'devices[]', expected: string");
    const std::string name = dev.get<std::string>();
    auto n = d.graph.find(name);
    if (!n) return Error(ENOENT, "No block device node '" + name + "'");
    if (!n->supports_snapshots() || n->read_only())
      return Error(ENOTSUP, "Device '" + name + "' is writable but does not support snapshots");
    if (auto st = d.jobs.check_not_busy(n.get(), name); !st) return st.take_error();
    r.nodes.devices.push_back(n);
    r.nodes.names.push_back(name);
  }
  if (r.nodes.devices.empty()) return Error(EINVAL, "No block device can accept snapshots");
  const std::string vm = a["vmstate"].get<std::string>();
  for (size_t i = 0; i < r.nodes.names.size(); ++i)
    if (r.nodes.names[i] == vm) r.nodes.vmstate = r.nodes.devices[i];
  if (!r.nodes.vmstate) return Error(ENOENT, "vmstate block device '" + vm + "' does not exist");
  if (!r.nodes.vmstate->supports_vmstate())
    return Error(ENOTSUP, "vmstate block device '" + vm + "' does not support snapshots");
  for (const auto& n : r.nodes.devices) {
    bool has = false;
    for (const auto& sn : n->snapshots()) has = has || sn.name == r.tag;
    if (save && has) return Error(EEXIST, "Snapshot '" + r.tag + "' already exists in one or more devices");
    if (!save && !has) return Error(ENOENT, "Snapshot '" + r.tag + "' does not exist in one or more devices");
  }
  if (a.contains("workers")) {
    const int64_t w = a["workers"].get<int64_t>();
    if (w < 1 || w > 64) return Error(EINVAL, "Parameter 'workers' expects a value between 1 and 64");
    r.opts.workers = static_cast<unsigned>(w);
  }
  if (a.contains("buffer-size")) {
    const int64_t b = a["buffer-size"].get<int64_t>();
    if (b < 4096 || b > (int64_t{256} << 20))
      return Error(EINVAL, "Parameter 'buffer-size' expects a value between 4096 and 268435456");
    r.opts.buffer_size = static_cast<uint64_t>(b);
  }
  return r;
}

Task<Reply> savevm(Daemon& d, const OJson& a) {
  auto r = parse(d, a, true);
  if (!r) co_return Reply::fail(r.error().what());
  std::string path;
  auto fd = listen_socket_address(d.loop, a["addr"], &path);
  if (!fd) co_return Reply::fail(fd.error().what());
  auto job = d.jobs.create<SnapshotSaveJob>(r->job_id, r->tag, r->nodes, std::move(*fd), r->opts);
  if (!job) {
    if (!path.empty()) ::unlink(path.c_str());
    co_return Reply::fail(job.error().what());
  }
  (*job)->set_socket_path(path);
  (*job)->start();
  co_return Reply::ok();
}

Task<Reply> loadvm(Daemon& d, const OJson& a) {
  auto r = parse(d, a, false);
  if (!r) co_return Reply::fail(r.error().what());
  const OJson& addr = a["addr"];
  if (addr.value("type", "") != "unix")
    co_return Reply::fail("Address type '" + addr.value("type", std::string()) + "' is not supported by vblk");
  // The peer before any disk changes: a mistyped address fails here, with
  // no job and the disks as they were.
  const std::string path = addr.value("path", std::string());
  auto c = co_await connect_unix(d.loop, path);
  if (!c) co_return Reply::fail(c.error().what());
  auto job = d.jobs.create<SnapshotLoadJob>(r->job_id, r->tag, r->nodes, std::move(*c), r->opts);
  if (!job) co_return Reply::fail(job.error().what());
  (*job)->start();
  co_return Reply::ok();
}

std::vector<Arg> schema() {
  return {{"job-id", ArgType::Str, true},
          {"tag", ArgType::Str, true},
          {"vmstate", ArgType::Str, true},
          {"devices", ArgType::List, true},
          {"addr", ArgType::Struct, true, {}, {{"type", ArgType::Enum, true, kAddrTypes}}, true},
          {"workers", ArgType::Int},
          {"buffer-size", ArgType::Int}};
}

}  // namespace

void register_vmstate_commands(Daemon& d) {
  d.registry.add({"x-vblk-savevm", {schema()}, [&d](const OJson& a) { return savevm(d, a); }});
  d.registry.add({"x-vblk-loadvm", {schema()}, [&d](const OJson& a) { return loadvm(d, a); }});
}

}  // namespace vblk::qmp
