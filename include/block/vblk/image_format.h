// ImageFormat: the facet of a node that is an image format (qcow2, luks,
// raw, rbd): what qemu-img info shows beyond the generic fields, the
// backing file as the image records it, consistency checks, persistent
// bitmaps, internal snapshots and the VM state stored with them.
//
// Node stays the request path and the graph; a driver that is an image
// format also derives from ImageFormat and registers itself with
// Node::set_format(this), so node.format() reaches it. FilterNode has the
// facet for the cluster size it looks through to, MemNode (tests) for its
// VM state area; the rest answer as the defaults. Nodes that are no image
// format (file, nbd, null-co, snapshot-access) have no facet: format() is
// nullptr.
// The free functions in `vblk::image` below ask any node and answer for one
// without the facet as the defaults here do, so callers need not repeat the
// null check.
//
// Ownership: the facet is the node itself (one object); it is never owned
// separately. Thread-safety: loop thread only, like every node.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "vblk/format_info.h"
#include "vblk/node.h"

namespace vblk {

// Consistency checks (qemu-img check): QEMU's BdrvCheckMode bits and its
// BdrvCheckResult with BlockFragInfo folded in.
enum CheckMode : uint32_t {
  kCheckReport = 0,           // only report
  kCheckFixLeaks = 1u << 0,   // -r leaks: drop refcounts nothing references
  kCheckFixErrors = 1u << 1,  // -r all (with kCheckFixLeaks): fix everything fixable
};

struct CheckResult {
  int64_t corruptions = 0;
  int64_t leaks = 0;
  int64_t check_errors = 0;  // the check itself could not complete some step
  int64_t corruptions_fixed = 0;
  int64_t leaks_fixed = 0;
  int64_t image_end_offset = 0;
  int64_t total_clusters = 0;
  int64_t allocated_clusters = 0;
  int64_t fragmented_clusters = 0;
  int64_t compressed_clusters = 0;
};

// An internal snapshot as the block layer sees it (QEMU's QEMUSnapshotInfo).
struct SnapshotInfo {
  std::string id;
  std::string name;
  uint64_t vm_state_size = 0;
  uint32_t date_sec = 0;
  uint32_t date_nsec = 0;
  uint64_t vm_clock_nsec = 0;
  uint64_t icount = UINT64_MAX;  // UINT64_MAX: not recorded
};

class ImageFormat {
 public:
  ImageFormat() = default;
  virtual ~ImageFormat() = default;
  ImageFormat(const ImageFormat&) = delete;
  ImageFormat& operator=(const ImageFormat&) = delete;

  // What `info` shows beyond the generic fields (qemu-img's ImageInfo).
  virtual uint64_t cluster_size() const { return 0; }
  // The backing file name as stored in the image, and its format ("" if none).
  virtual std::string backing_file_name() const { return {}; }
  virtual std::string backing_file_format() const { return {}; }
  // Points the backing file at `backing` (nullptr: none) and records `file`
  // and `fmt` in the image as its backing file name and format (QEMU's
  // bdrv_set_backing_hd + bdrv_change_backing_file, for block-stream and
  // block-commit). ENOTSUP for drivers without backing files.
  virtual Task<Status> set_backing(std::shared_ptr<Node> backing, const std::string& file, const std::string& fmt);
  // Records `file` and `fmt` in the image as its backing file name and
  // format ("" file: none), leaving the open backing child as it is (QEMU's
  // bdrv_change_backing_file, for qemu-img rebase: its data copy already
  // made the image read the same over either chain, or -u asked for the
  // header alone). ENOTSUP for drivers without backing files.
  virtual Task<Status> change_backing_file(const std::string& file, const std::string& fmt);
  // Drops everything the image itself stores for its virtual disk, so that
  // every range reads from the backing file again (QEMU's bdrv_make_empty,
  // for qemu-img commit without -d). Internal snapshots keep their data.
  // ENOTSUP for drivers that cannot (raw: qemu-img commit leaves it).
  virtual Task<Status> make_empty();
  // QAPI's ImageInfoSpecific as data (format_info.h), or nullopt; the layer
  // that shows it renders it.
  virtual std::optional<FormatInfo> format_info() const { return std::nullopt; }
  // The image's data is encrypted (luks): info says "encrypted: yes".
  virtual bool encrypted() const { return false; }
  // The image was not closed cleanly (qcow2's dirty bit: lazy refcounts).
  // Whether `info` shows it at all is NodeCaps::reports_dirty_flag.
  virtual bool dirty_flag() const { return false; }

  // Checks (and with `fix`, a CheckMode mask, repairs) the format's metadata.
  // ENOTSUP: the format has no checks (qemu-img's exit code 63). Messages
  // about what was found go to stderr, worded as QEMU words them.
  virtual Task<Result<CheckResult>> check(uint32_t fix);

  // Whether a new persistent bitmap `name` could be stored in this image
  // (QEMU's bdrv_can_store_new_dirty_bitmap, with its messages). The
  // default: "Can't store persistent bitmaps to NODE: Operation not supported".
  virtual Status can_store_new_bitmap(const std::string& name, uint64_t granularity) const;
  // Drops the stored copy of persistent bitmap `name` (block-dirty-bitmap-
  // remove); the caller then removes it from the node's bitmaps(). The
  // default: nothing stored.
  virtual Task<Status> remove_persistent_bitmap(const std::string& name);

  // Internal snapshots (qemu-img snapshot). The defaults: none, ENOTSUP.
  virtual bool supports_snapshots() const { return false; }
  virtual std::vector<SnapshotInfo> snapshots() const { return {}; }
  // Creates a snapshot of the current state; its id is chosen by the driver
  // and stored back into `sn`.
  virtual Task<Status> snapshot_create(SnapshotInfo& sn);
  // Makes the snapshot with this id (or else this name) the current state.
  virtual Task<Status> snapshot_goto(const std::string& id_or_name);
  // Deletes the snapshot with exactly this id and name.
  virtual Task<Status> snapshot_delete(const std::string& id, const std::string& name);

  // The VM state of internal snapshots (qcow2: a byte stream stored after
  // the virtual disk end, QEMU's bdrv_save_vmstate/bdrv_load_vmstate).
  // Writes go to the active state, which snapshot_create() then carries
  // when SnapshotInfo::vm_state_size says so. These bypass the request
  // path (the area lies beyond length()) and are not tracked by drain():
  // their one writer (VmstateWriter, vmstate.h) flushes before anything
  // else happens. Any offset and length. The defaults: ENOTSUP.
  virtual bool supports_vmstate() const { return false; }
  virtual Task<Status> write_vmstate(uint64_t pos, std::span<const uint8_t> buf);
  // Reads the active state, or with a snapshot id that snapshot's. Never
  // written bytes read as zeroes.
  virtual Task<Status> read_vmstate(uint64_t pos, std::span<uint8_t> buf, const std::string& snapshot_id = {});
  // Drops the active state's first `bytes` (a savevm that failed).
  virtual Task<Status> discard_vmstate(uint64_t bytes);

 protected:
  // Hooks Node calls on its facet.
  // The backing child changed (Node::attach_backing): drivers that cache it update.
  virtual void backing_changed(Node* b) { (void)b; }
  // Before the node becomes read-only (Node::reopen_read_only): write back
  // what a close would. The default flushes, as for a node without the facet.
  virtual Task<Status> prepare_read_only();

 private:
  friend class Node;
  Node* node_ = nullptr;  // the node this is the facet of (set_format)
};

// The facet's questions asked of any node: one that is no image format
// answers as ImageFormat's defaults do (no cluster size, no backing file
// name, no snapshots, ENOTSUP with the same messages).
namespace image {

uint64_t cluster_size(const Node& n);
std::string backing_file_name(const Node& n);
std::string backing_file_format(const Node& n);
Task<Status> set_backing(Node& n, std::shared_ptr<Node> backing, const std::string& file, const std::string& fmt);
Task<Status> change_backing_file(Node& n, const std::string& file, const std::string& fmt);
Task<Status> make_empty(Node& n);
Task<Result<CheckResult>> check(Node& n, uint32_t fix);
Status can_store_new_bitmap(const Node& n, const std::string& name, uint64_t granularity);
Task<Status> remove_persistent_bitmap(Node& n, const std::string& name);
bool supports_snapshots(const Node& n);
std::vector<SnapshotInfo> snapshots(const Node& n);
Task<Status> snapshot_create(Node& n, SnapshotInfo& sn);
Task<Status> snapshot_goto(Node& n, const std::string& id_or_name);
Task<Status> snapshot_delete(Node& n, const std::string& id, const std::string& name);
bool supports_vmstate(const Node& n);
Task<Status> write_vmstate(Node& n, uint64_t pos, std::span<const uint8_t> buf);
Task<Status> read_vmstate(Node& n, uint64_t pos, std::span<uint8_t> buf, const std::string& snapshot_id = {});
Task<Status> discard_vmstate(Node& n, uint64_t bytes);

}  // namespace image

}  // namespace vblk
