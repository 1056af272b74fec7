// Snapshots: external (blockdev-snapshot, blockdev-snapshot-sync: an
// overlay takes the node as its backing file and takes over its users) and
// internal (blockdev-snapshot-internal-sync, blockdev-snapshot-delete-
// internal-sync on a qcow2 node), with QEMU 7.2's checks, order and texts
// (blockdev.c: external_snapshot_*, internal_snapshot_*). The creating
// commands are transaction actions (transaction.h) run alone.
//
// Taking over users: every NodeRef of the old node (NBD exports) is
// re-pointed at the overlay, as QEMU's bdrv_append replaces the node under
// its parents; at commit the old node is reopened read-only. Parent nodes
// are not re-pointed (drivers cache child pointers), so a node that is the
// child of another named node is refused.
#include <sys/time.h>

#include <cstring>

#include "transaction.h"
#include "vblk/image_format.h"
#include "vblk/node_ref.h"
#include "vblk/open.h"
#include "vblk/snapshot_info_json.h"

namespace vblk::qmp {

const std::vector<Arg> kBlockdevSnapshotArgs = {{"node", ArgType::Str, true}, {"overlay", ArgType::Str, true}};
const std::vector<Arg> kBlockdevSnapshotSyncArgs = {{"device", ArgType::Str},
                                                    {"node-name", ArgType::Str},
                                                    {"snapshot-file", ArgType::Str, true},
                                                    {"snapshot-node-name", ArgType::Str},
                                                    {"format", ArgType::Str},
                                                    {"mode", ArgType::Enum, false, {"existing", "absolute-paths"}}};
const std::vector<Arg> kInternalSnapshotArgs = {{"device", ArgType::Str, true}, {"name", ArgType::Str, true}};

namespace {

std::string str_arg(const OJson& a, const char* k) { return str_or(a, k, ""); }

class ExternalSnapshot final : public TxAction {
 public:
  ExternalSnapshot(const OJson& a, bool sync) : a_(a), sync_(sync) {}
  const char* name() const override { return sync_ ? "blockdev-snapshot-sync" : "blockdev-snapshot"; }

  Task<Status> prepare(TxContext& tx) override {
    Daemon& d = tx.d;
    std::string device, node_name;
    if (sync_) {
      device = str_arg(a_, "device");
      node_name = str_arg(a_, "node-name");
    } else {
      device = node_name = str_arg(a_, "node");
    }
    auto old = lookup_node(d, device, node_name);
    if (!old) co_return old.take_error();
    old_ = *old;
    co_await old_->drain();
    VBLK_CO_TRY(d.jobs.check_not_busy(old_.get(), old_->node_name()));
    if (auto p = backing_parent(d, *old_))
      co_return Error(
          EBUSY, "Node '" + old_->node_name() + "' is busy: node is used as backing hd of '" + p->node_name() + "'");
    if (!old_->read_only())
      if (auto st = co_await old_->flush(); !st) co_return Error(EIO, "An IO error has occurred");
    if (sync_) {
      std::string format = str_or(a_, "format", "qcow2");
      std::string snn = str_arg(a_, "snapshot-node-name");
      std::string file = a_["snapshot-file"].get<std::string>();
      if (!node_name.empty() && snn.empty()) co_return Error(EINVAL, "New overlay node-name missing");
      if (!snn.empty() && d.graph.find(snn)) co_return Error(EEXIST, "New overlay node-name already in use");
      std::string mode = str_or(a_, "mode", "absolute-paths");
      if (mode != "existing")
        VBLK_CO_TRY(co_await create_image(d, file, format, old_->length(), old_->filename(), old_->driver()));
      Json opts = image_options(format, snn, file);
      if (format == "qcow2") opts["backing"] = nullptr;  // QEMU's BDRV_O_NO_BACKING
      auto n = d.blockdev_add(opts);
      if (!n) co_return n.take_error();
      // Opened by the action, not by blockdev-add: not the monitor's.
      d.monitor_owned.erase(snn);
      new_ = *n;
      opened_ = snn;
    } else {
      std::string overlay = str_arg(a_, "overlay");
      auto n = lookup_node(d, overlay, overlay);
      if (!n) co_return n.take_error();
      new_ = *n;
    }
    if (!new_->refs().empty()) co_return Error(EBUSY, "The overlay is already in use");
    VBLK_CO_TRY(d.jobs.check_not_busy(new_.get(), new_->node_name()));
    if (new_->child("backing")) co_return Error(EINVAL, "The overlay already has a backing image");
    if (!new_->caps().supports_backing) co_return Error(EINVAL, "The overlay does not support backing images");
    if (new_ == old_ || d.graph.parent_of(*old_, new_.get()))
      co_return Error(EBUSY,
                      "Node '" + old_->node_name() + "' has parent nodes: vblk cannot put an overlay under them");
    VBLK_CO_TRY(new_->attach_backing(old_));
    // The old node's users go to the overlay (exports write to it now).
    std::vector<NodeRef*> refs = old_->refs();
    for (NodeRef* r : refs) {
      r->reset(new_);
      moved_.push_back(r);
    }
    appended_ = true;
    co_return Status{};
  }

  Task<void> commit(TxContext&) override {
    // QEMU reopens the old top read-only and ignores a failure.
    (void)co_await old_->reopen_read_only();
    committed_ = true;
  }

  Task<void> clean(TxContext& tx) override {
    // An overlay the action opened lives only as long as something uses
    // it: on a node without users QEMU's last reference goes here.
    if (committed_ && !opened_.empty() && new_->refs().empty() && !tx.d.graph.parent_of(*new_)) {
      new_.reset();
      co_await tx.d.drop_node(opened_);
    }
  }

  Task<void> abort(TxContext& tx) override {
    if (appended_) {
      for (NodeRef* r : moved_) r->reset(old_);
      (void)new_->attach_backing(nullptr);
    }
    if (!opened_.empty()) {
      new_.reset();
      co_await tx.d.drop_node(opened_);
    }
  }

 private:
  OJson a_;
  bool sync_;
  std::shared_ptr<Node> old_, new_;
  std::string opened_;  // blockdev-snapshot-sync: the node the action opened
  bool appended_ = false;
  bool committed_ = false;
  std::vector<NodeRef*> moved_;
};

class InternalSnapshot final : public TxAction {
 public:
  explicit InternalSnapshot(const OJson& a) : a_(a) {}
  const char* name() const override { return "blockdev-snapshot-internal-sync"; }

  Task<Status> prepare(TxContext& tx) override {
    Daemon& d = tx.d;
    std::string device = a_["device"].get<std::string>();
    std::string name = a_["name"].get<std::string>();
    auto n = lookup_node(d, device, device);
    if (!n) co_return n.take_error();
    if (d.graph.parent_of(**n)) co_return Error(EINVAL, "Need a root block node");
    bs_ = *n;
    co_await bs_->drain();
    VBLK_CO_TRY(d.jobs.check_not_busy(bs_.get(), bs_->node_name()));
    if (bs_->read_only()) co_return Error(EROFS, "Device '" + device + "' is read only");
    if (!image::supports_snapshots(*bs_))
      co_return Error(ENOTSUP, "Block format '" + bs_->driver() + "' used by device '" + device +
                                   "' does not support internal snapshots");
    if (name.empty()) co_return Error(EINVAL, "Name is empty");
    // A named list: a range-for over a temporary in a coroutine frame is
    // what GCC 12 gets wrong.
    const std::vector<SnapshotInfo> list = image::snapshots(*bs_);
    for (const auto& s : list)
      if (s.name == name)
        co_return Error(EEXIST, "Snapshot with name '" + name + "' already exists on device '" + device + "'");
    struct timeval tv;
    ::gettimeofday(&tv, nullptr);
    sn_.name = name;
    sn_.date_sec = static_cast<uint32_t>(tv.tv_sec);
    sn_.date_nsec = static_cast<uint32_t>(tv.tv_usec * 1000);
    // A storage daemon has no VM: QEMU's virtual clock is the host's.
    sn_.vm_clock_nsec = uint64_t(tv.tv_sec) * 1000000000u + uint64_t(tv.tv_usec) * 1000u;
    sn_.icount = UINT64_MAX;
    auto st = co_await image::snapshot_create(*bs_, sn_);
    if (!st)
      co_return Error(st.error().code, "Failed to create snapshot '" + name + "' on device '" + device +
                                           "': " + std::strerror(st.error().code));
    created_ = true;
    co_return Status{};
  }

  Task<void> abort(TxContext&) override {
    if (created_) (void)co_await image::snapshot_delete(*bs_, sn_.id, sn_.name);
  }

 private:
  OJson a_;
  std::shared_ptr<Node> bs_;
  SnapshotInfo sn_;
  bool created_ = false;
};

Task<Reply> delete_internal_snapshot(Daemon& d, const OJson& a) {
  std::string device = a["device"].get<std::string>();
  auto n = lookup_node(d, device, device);
  if (!n) co_return Reply::fail(n.error().what());
  if (d.graph.parent_of(**n)) co_return Reply::fail("Need a root block node");
  bool has_id = a.contains("id"), has_name = a.contains("name");
  if (!has_id && !has_name) co_return Reply::fail("Name or id must be provided");
  std::string id = str_arg(a, "id"), name = str_arg(a, "name");
  Node& bs = **n;
  if (auto st = d.jobs.check_not_busy(&bs, bs.node_name()); !st) co_return Reply::fail(st.error().what());
  std::optional<SnapshotInfo> found;
  const std::vector<SnapshotInfo> list = image::snapshots(bs);
  for (const auto& s : list)
    if ((!has_id || s.id == id) && (!has_name || s.name == name)) {
      found = s;
      break;
    }
  if (!found)
    co_return Reply::fail("Snapshot with id '" + str_or(a, "id", "null") + "' and name '" + str_or(a, "name", "null") +
                          "' does not exist on device '" + device + "'");
  co_await bs.drain();
  auto st = co_await image::snapshot_delete(bs, found->id, found->name);
  if (!st)
    co_return Reply::fail("Failed to delete snapshot '" + found->id + "' on device '" + device +
                          "': " + std::strerror(st.error().code));
  co_return Reply::ok(snapshot_info_json(*found));
}

}  // namespace

std::unique_ptr<TxAction> make_blockdev_snapshot(const OJson& args) {
  return std::make_unique<ExternalSnapshot>(args, false);
}
std::unique_ptr<TxAction> make_blockdev_snapshot_sync(const OJson& args) {
  return std::make_unique<ExternalSnapshot>(args, true);
}
std::unique_ptr<TxAction> make_internal_snapshot(const OJson& args) { return std::make_unique<InternalSnapshot>(args); }

void register_snapshot_commands(Daemon& d) {
  d.registry.add({"blockdev-snapshot-sync", {kBlockdevSnapshotSyncArgs}, [&d](const OJson& a) {
                    return run_single_action(d, make_blockdev_snapshot_sync(a));
                  }});
  d.registry.add({"blockdev-snapshot", {kBlockdevSnapshotArgs}, [&d](const OJson& a) {
                    return run_single_action(d, make_blockdev_snapshot(a));
                  }});
  d.registry.add({"blockdev-snapshot-internal-sync", {kInternalSnapshotArgs}, [&d](const OJson& a) {
                    return run_single_action(d, make_internal_snapshot(a));
                  }});
  d.registry.add({"blockdev-snapshot-delete-internal-sync",
                  {{{"device", ArgType::Str, true}, {"id", ArgType::Str}, {"name", ArgType::Str}}},
                  [&d](const OJson& a) { return delete_internal_snapshot(d, a); }});
}

}  // namespace vblk::qmp
