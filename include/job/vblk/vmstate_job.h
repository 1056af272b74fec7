// SnapshotSaveJob and SnapshotLoadJob: QEMU's snapshot-save / snapshot-load
// jobs for a VM whose disks a vblk daemon holds (its disk is vblk's NBD
// export), with the VM-state stream on a socket instead of inside QEMU.
//
// Save: QEMU migrates into the socket the daemon listens on
// (`migrate unix:PATH`); the job gathers the stream into the VM-state area
// of the `vmstate` node through a VmstateWriter, and at the stream's end
// (QEMU has stopped the VM, flushed its disks and sent its last section)
// takes an internal snapshot named `tag` of every device, the state
// attached to the vmstate node's. The stream must be a whole QEMU
// migration stream (MigrationStreamCheck, migration_stream.h): EOF is not
// the end of a state, a sender killed mid-stream is refused. All or
// nothing: on any error (the stream's, its format's, a write's, a
// snapshot's) the snapshots made so far are deleted and the state's
// clusters given back, so no device keeps an entry.
//
// Load: the command connects to the socket a QEMU started with
// `-incoming unix:PATH` listens on; the job reverts every device to the
// snapshot `tag` (as QEMU's loadvm reverts the disks first) and sends the
// stream through a VmstateReader. All or nothing: a stream that fails
// after the revert takes the revert back (snapshot_revert.h).
//
// Both are plain jobs (not block jobs): JOB_STATUS_CHANGE events, manual
// dismiss, the error in query-jobs, as QEMU's snapshot jobs. Cancel
// (job-cancel) shuts the socket down, so a job waiting for a peer ends.
//
// Ownership: the jobs hold their nodes (shared) and sockets. One loop.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "vblk/job.h"
#include "vblk/net.h"
#include "vblk/node.h"
#include "vblk/vmstate.h"

namespace vblk {

struct VmstateJobNodes {
  std::shared_ptr<Node> vmstate;               // carries the stream; also in devices
  std::vector<std::shared_ptr<Node>> devices;  // snapshotted / reverted together
  std::vector<std::string> names;              // devices' names, for messages
};

class SnapshotSaveJob : public Job {
 public:
  // `listener` is listening already (so the command's reply means the
  // peer may connect).
  SnapshotSaveJob(JobManager& mgr, const std::string& id, std::string tag, VmstateJobNodes nodes, Fd listener,
                  VmstateOptions opts);
  ~SnapshotSaveJob() override;
  const char* type() const override { return "snapshot-save"; }
  // A unix socket's path, unlinked once the job stops listening.
  void set_socket_path(std::string path) { socket_path_ = std::move(path); }

 private:
  Task<Status> run() override;
  bool on_cancel(bool force) override;
  Task<Status> receive(VmstateWriter& w);
  void stop_listening();
  Task<Status> snapshot_all(uint64_t state_size);

  std::string tag_;
  VmstateJobNodes nodes_;
  Fd listener_;
  std::string socket_path_;
  Fd conn_;
  VmstateOptions opts_;
};

class SnapshotLoadJob : public Job {
 public:
  // `conn` is connected to the peer already: a wrong address fails the
  // command before any disk is touched.
  SnapshotLoadJob(JobManager& mgr, const std::string& id, std::string tag, VmstateJobNodes nodes, Fd conn,
                  VmstateOptions opts);
  ~SnapshotLoadJob() override;
  const char* type() const override { return "snapshot-load"; }

 private:
  Task<Status> run() override;
  bool on_cancel(bool force) override;
  Task<Status> send(VmstateReader& r);

  std::string tag_;
  VmstateJobNodes nodes_;
  Fd conn_;
  VmstateOptions opts_;
};

}  // namespace vblk
