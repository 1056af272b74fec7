// The snapshot-save / snapshot-load jobs over a socket: see
// include/job/vblk/vmstate_job.h.
#include "vblk/vmstate_job.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>

#include "vblk/image_format.h"
#include "vblk/migration_stream.h"
#include "vblk/snapshot_revert.h"

namespace vblk {

namespace {

constexpr size_t kChunk = 1 << 20;  // one recv / send per MiB of stream at most

}  // namespace

// ---------------------------------------------------------------- save

SnapshotSaveJob::SnapshotSaveJob(JobManager& mgr, const std::string& id, std::string tag, VmstateJobNodes nodes,
                                 Fd listener, VmstateOptions opts)
    : Job(mgr, id, /*auto_finalize=*/true, /*auto_dismiss=*/false),
      tag_(std::move(tag)),
      nodes_(std::move(nodes)),
      listener_(std::move(listener)),
      opts_(opts) {}

SnapshotSaveJob::~SnapshotSaveJob() { stop_listening(); }

void SnapshotSaveJob::stop_listening() {
  listener_.reset();
  if (!socket_path_.empty()) ::unlink(socket_path_.c_str());
  socket_path_.clear();
}

bool SnapshotSaveJob::on_cancel(bool force) {
  (void)force;
  // Wakes an accept or a recv in flight: the job then ends cancelled.
  if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
  if (conn_.valid()) ::shutdown(conn_.get(), SHUT_RDWR);
  return true;
}

Task<Status> SnapshotSaveJob::receive(VmstateWriter& w) {
  auto c = co_await accept_socket(loop(), listener_.get());
  stop_listening();  // one stream: nobody else may connect
  if (!c) {
    if (is_cancelled()) co_return Status{};
    co_return Error(c.error().code,
                    std::string("Failed to accept the VM state connection: ") + std::strerror(c.error().code));
  }
  conn_ = std::move(*c);
  AlignedBuffer in(kChunk);
  uint64_t pos = 0;
  // The peer is QEMU's migration: only a whole stream of its format is a
  // VM state (a peer killed mid-stream, or anything else that connected,
  // would make a snapshot that fails only when loaded).
  MigrationStreamCheck check;
  for (;;) {
    const long n = co_await loop().recv(conn_.get(), in.data(), in.size());
    if (n < 0) {
      if (n == -EINTR || n == -EAGAIN) continue;
      co_return Error(static_cast<int>(-n),
                      std::string("Error while reading VM state: ") + std::strerror(static_cast<int>(-n)));
    }
    if (is_cancelled()) break;
    if (n == 0) {
      if (auto st = check.finish(); !st) co_return st;
      break;
    }
    if (auto st = check.feed(in.span().subspan(0, static_cast<size_t>(n))); !st) {
      conn_.reset();  // the sender learns at once
      co_return st;
    }
    auto st = co_await w.write(pos, in.span().subspan(0, static_cast<size_t>(n)));
    pos += static_cast<uint64_t>(n);
    set_progress(pos, pos);
    if (!st) break;  // flush() returns it
  }
  conn_.reset();
  co_return Status{};
}

Task<Status> SnapshotSaveJob::snapshot_all(uint64_t state_size) {
  // One date for every device, taken as the state ends (QEMU stamps the
  // snapshot when the VM has stopped).
  timeval tv;
  gettimeofday(&tv, nullptr);
  std::vector<std::pair<Node*, std::string>> made;  // (node, id)
  Status st;
  for (size_t i = 0; i < nodes_.devices.size() && st; ++i) {
    Node& n = *nodes_.devices[i];
    co_await n.drain();
    SnapshotInfo sn;
    sn.name = tag_;
    sn.date_sec = static_cast<uint32_t>(tv.tv_sec);
    sn.date_nsec = static_cast<uint32_t>(tv.tv_usec * 1000);
    sn.vm_state_size = &n == nodes_.vmstate.get() ? state_size : 0;
    st = co_await image::snapshot_create(n, sn);
    if (st) {
      made.emplace_back(&n, sn.id);
    } else {
      st = Error(st.error().code,
                 "Error while creating snapshot on '" + nodes_.names[i] + "': " + std::strerror(st.error().code));
    }
  }
  if (!st) {
    // All or nothing, as QEMU's save_snapshot: what was made goes again.
    for (auto& [n, id] : made) (void)co_await image::snapshot_delete(*n, id, tag_);
  }
  co_return st;
}

Task<Status> SnapshotSaveJob::run() {
  Node& vm = *nodes_.vmstate;
  VmstateWriter w(vm, opts_);
  Status st = co_await receive(w);
  Status fl = co_await w.flush();
  if (st && !fl)
    st = Error(fl.error().code, std::string("Error while writing VM state: ") + std::strerror(fl.error().code));
  if (st && is_cancelled()) st = Error(ECANCELED);
  if (st) st = co_await snapshot_all(w.end());
  if (!st) {
    // Nothing refers to the stream's clusters: give them back (a failure
    // here only leaks, which check -r leaks reclaims).
    (void)co_await image::discard_vmstate(vm, std::max<uint64_t>(w.end(), 1));
    if (st.error().code != ECANCELED) set_error_text(st.error().what());
  }
  for (auto& n : nodes_.devices) (void)co_await n->flush();
  co_return st;
}

// ---------------------------------------------------------------- load

SnapshotLoadJob::SnapshotLoadJob(JobManager& mgr, const std::string& id, std::string tag, VmstateJobNodes nodes,
                                 Fd conn, VmstateOptions opts)
    : Job(mgr, id, /*auto_finalize=*/true, /*auto_dismiss=*/false),
      tag_(std::move(tag)),
      nodes_(std::move(nodes)),
      conn_(std::move(conn)),
      opts_(opts) {}

SnapshotLoadJob::~SnapshotLoadJob() = default;

bool SnapshotLoadJob::on_cancel(bool force) {
  (void)force;
  if (conn_.valid()) ::shutdown(conn_.get(), SHUT_RDWR);
  return true;
}

Task<Status> SnapshotLoadJob::send(VmstateReader& r) {
  AlignedBuffer out(kChunk);
  Status st;
  for (uint64_t pos = 0; pos < r.length() && st && !is_cancelled();) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(out.size(), r.length() - pos));
    st = co_await r.read(pos, out.span().subspan(0, len));
    if (!st) {
      st = Error(st.error().code, std::string("Error while reading VM state: ") + std::strerror(st.error().code));
      break;
    }
    st = co_await send_all(loop(), conn_.get(), out.span().subspan(0, len));
    if (!st) {
      st = Error(st.error().code, std::string("Error while sending VM state: ") + std::strerror(st.error().code));
      break;
    }
    pos += len;
    set_progress(pos, r.length());
  }
  co_await r.close();
  co_return st;
}

Task<Status> SnapshotLoadJob::run() {
  // The state's snapshot id and length on the vmstate node, found before
  // anything changes.
  std::string id;
  uint64_t length = 0;
  for (const auto& sn : image::snapshots(*nodes_.vmstate))
    if (sn.name == tag_) {
      id = sn.id;
      length = sn.vm_state_size;
    }
  if (id.empty()) {
    set_error_text("Snapshot '" + tag_ + "' does not exist in one or more devices");
    co_return Error(ENOENT);
  }
  // Disks first, as QEMU's load_snapshot: the VM resumes on the disks of
  // the moment its state was taken. The peer is connected already (the
  // command connected it), so what is left to fail is the stream itself;
  // the revert is undone if it does (snapshot_revert.h).
  std::vector<Node*> nodes;
  for (auto& n : nodes_.devices) nodes.push_back(n.get());
  SnapshotRevert revert(std::move(nodes), nodes_.names);
  Status st = co_await revert.revert(tag_);
  if (!st) {
    set_error_text(st.error().what());
    co_return st;
  }
  set_progress(0, length);
  if (!is_cancelled()) {
    VmstateReader r(*nodes_.vmstate, id, length, opts_);
    st = co_await send(r);
  }
  ::shutdown(conn_.get(), SHUT_WR);
  conn_.reset();
  if (st && is_cancelled()) st = Error(ECANCELED);
  Status rst;
  if (st)
    rst = co_await revert.commit();
  else
    rst = co_await revert.rollback();
  if (!st && st.error().code != ECANCELED) {
    set_error_text(st.error().what() + (rst ? std::string() : "; " + rst.error().what()));
  } else if (!rst) {
    st = rst;
    set_error_text(rst.error().what());
  }
  for (auto& n : nodes_.devices) (void)co_await n->flush();
  co_return st;
}

}  // namespace vblk
