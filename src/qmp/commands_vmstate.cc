// x-vblk-savevm / x-vblk-loadvm: QEMU's snapshot-save / snapshot-load for
// a VM whose disks this daemon holds, the VM-state stream on a socket (the
// jobs: include/job/vblk/vmstate_job.h).
//
//   x-vblk-savevm {job-id, tag, vmstate, devices, addr, workers?, buffer-size?}
//     listens on addr (SocketAddress, as nbd-server-start's) before it
//     answers; QEMU then `migrate`s to it (stopped first, as libvirt saves);
//     at the stream's end every device gets snapshot `tag`, the state on
//     `vmstate`'s. addr must be a unix socket or a loopback address (the
//     first peer's stream becomes the snapshot) unless `allow-remote`
//     (bool, default false) is true. A device listed twice is refused.
//   x-vblk-loadvm {job-id, tag, vmstate, devices, addr, workers?, buffer-size?}
//     connects to addr (unix), where a QEMU started with `-incoming
//     unix:PATH` waits for the stream, before it answers; the job then
//     reverts the devices to `tag` and sends the stream (the revert taken
//     back if the stream fails).
//
// The checks and texts are QEMU's save_snapshot / load_snapshot ones
// (migration/savevm.c, block/snapshot.c) where QEMU has them; they run
// before the job is created, so a bad request makes no job.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "vblk/image_format.h"
#include "vblk/qmp_daemon.h"
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
    if (!image::supports_snapshots(*n) || n->read_only())
      return Error(ENOTSUP, "Device '" + name + "' is writable but does not support snapshots");
    if (auto st = d.jobs.check_not_busy(n.get(), name); !st) return st.take_error();
    // QEMU's bdrv_all_get_snapshot_devices takes the list as it comes, so
    // its snapshot-save makes two snapshots of one name on a node listed
    // twice. Refused here rather than de-duplicated: a device named twice
    // is a mistake in the request (a device meant is likely missing), and
    // the snapshot-save is all or nothing, so it is best refused whole.
    for (size_t i = 0; i < r.nodes.devices.size(); ++i)
      if (r.nodes.devices[i] == n)
        return Error(EINVAL, "Device '" + name + "' is listed twice in 'devices'" +
                                 (r.nodes.names[i] == name ? std::string() : " (as '" + r.nodes.names[i] + "')"));
    r.nodes.devices.push_back(n);
    r.nodes.names.push_back(name);
  }
  if (r.nodes.devices.empty()) return Error(EINVAL, "No block device can accept snapshots");
  const std::string vm = a["vmstate"].get<std::string>();
  for (size_t i = 0; i < r.nodes.names.size(); ++i)
    if (r.nodes.names[i] == vm) r.nodes.vmstate = r.nodes.devices[i];
  if (!r.nodes.vmstate) return Error(ENOENT, "vmstate block device '" + vm + "' does not exist");
  if (!image::supports_vmstate(*r.nodes.vmstate))
    return Error(ENOTSUP, "vmstate block device '" + vm + "' does not support snapshots");
  for (const auto& n : r.nodes.devices) {
    bool has = false;
    for (const auto& sn : image::snapshots(*n)) has = has || sn.name == r.tag;
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

// Whether a listening socket can be reached from this host only: a unix
// socket, or an inet one bound to a loopback address.
bool local_only(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return false;
  if (ss.ss_family == AF_UNIX) return true;
  if (ss.ss_family == AF_INET) return (ntohl(reinterpret_cast<sockaddr_in*>(&ss)->sin_addr.s_addr) >> 24) == 127;
  if (ss.ss_family == AF_INET6) {
    const in6_addr& a6 = reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127;
  }
  return false;
}

Task<Reply> savevm(Daemon& d, const OJson& a) {
  auto r = parse(d, a, true);
  if (!r) co_return Reply::fail(r.error().what());
  std::string path;
  auto fd = listen_socket_address(d.loop, a["addr"], &path);
  if (!fd) co_return Reply::fail(fd.error().what());
  // Whoever connects first sends the stream that becomes the snapshot: a
  // socket others can reach needs the client to say so (allow-remote).
  // Checked on the bound socket, so a host name resolving to a non-loopback
  // address is caught as 0.0.0.0 is.
  if (!a.value("allow-remote", false) && !local_only(fd->get())) {
    const OJson& addr = a["addr"];
    co_return Reply::fail("Address '" + addr.value("host", std::string()) + ":" + addr.value("port", std::string()) +
                          "' can be reached from other hosts; listen on a unix socket or a loopback address, or "
                          "set 'allow-remote'");
  }
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
          {"buffer-size", ArgType::Int},
          {"allow-remote", ArgType::Bool}};
}

}  // namespace

void register_vmstate_commands(Daemon& d) {
  d.registry.add({"x-vblk-savevm", {schema()}, [&d](const OJson& a) { return savevm(d, a); }});
  d.registry.add({"x-vblk-loadvm", {schema()}, [&d](const OJson& a) { return loadvm(d, a); }});
}

}  // namespace vblk::qmp
