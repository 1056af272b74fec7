// Transaction actions (QEMU 7.2's blockdev.c BlkActionOps): every action of
// `transaction` — and each of the commands that are one action run alone
// (blockdev-snapshot, blockdev-snapshot-sync, blockdev-snapshot-internal-
// sync, drive-backup, blockdev-backup) — is prepared in order; if every
// prepare succeeds all are committed in order, otherwise the prepared ones
// are aborted in reverse order; then all are cleaned in order.
//
// Jobs an action creates (backups) are made in prepare and started only in
// commit, so a failed transaction never starts one. With completion-mode
// `grouped` the backups of one transaction fail together: when one fails or
// is cancelled the others are cancelled (QEMU's JobTxn).
//
// Actions live in the qmp layer beside their commands; this header is the
// contract between them and commands_transaction.cc.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "vblk/options.h"
#include "vblk/qmp_daemon.h"

namespace vblk::qmp {

// What a transaction shares with its actions.
struct TxContext {
  Daemon& d;
  bool grouped = false;  // properties.completion-mode = grouped
  // Jobs the actions made (started at commit, in order), and, for grouped
  // mode, the group they form.
  std::vector<std::shared_ptr<Job>> jobs;
  std::shared_ptr<JobGroup> group = std::make_shared<JobGroup>();
};

class TxAction {
 public:
  virtual ~TxAction() = default;
  // The action's name in QEMU's texts ("blockdev-snapshot-sync").
  virtual const char* name() const = 0;
  // Whether the action may run with completion-mode=grouped (QEMU's
  // action_check_completion_mode: only the backups).
  virtual bool supports_grouped() const { return false; }
  virtual Task<Status> prepare(TxContext& tx) = 0;
  virtual Task<void> commit(TxContext& tx) {
    (void)tx;
    co_return;
  }
  virtual Task<void> abort(TxContext& tx) {
    (void)tx;
    co_return;
  }
  virtual Task<void> clean(TxContext& tx) {
    (void)tx;
    co_return;
  }
};

// Runs actions as one transaction; the first failing prepare's error is
// the result (commands reply with it).
Task<Status> run_transaction(Daemon& d, std::vector<std::unique_ptr<TxAction>> actions, bool grouped);
// One action alone (the command of the same name).
Task<Reply> run_single_action(Daemon& d, std::unique_ptr<TxAction> action);

// The actions, by command (arguments already schema-checked).
std::unique_ptr<TxAction> make_blockdev_snapshot(const OJson& args);
std::unique_ptr<TxAction> make_blockdev_snapshot_sync(const OJson& args);
std::unique_ptr<TxAction> make_internal_snapshot(const OJson& args);
// verb: add, remove, clear, enable, disable, merge.
std::unique_ptr<TxAction> make_bitmap_action(const std::string& verb, const OJson& args);
// blockdev-backup, and drive-backup (which creates or opens its target).
std::unique_ptr<TxAction> make_backup(const OJson& args, bool drive);
// abort: fails its prepare with "Transaction aborted using Abort action".
std::unique_ptr<TxAction> make_abort();

// bdrv_img_create for the formats vblk writes: a new image at `path` of
// `size` bytes, qcow2 with an optional backing file (name and format as
// written into the header) or raw; QEMU's messages ("Unknown file format
// 'x'", "Backing file not supported for file format 'raw'").
Task<Status> create_image(Daemon& d, const std::string& path, const std::string& format, uint64_t size,
                          const std::string& backing, const std::string& backing_fmt);
// QEMU's bdrv_lookup_bs: "Cannot find device='x' nor node-name='y'" (no
// BlockBackend names exist in a storage daemon, so `device` never matches).
Result<std::shared_ptr<Node>> lookup_node(Daemon& d, const std::string& device, const std::string& node_name);

// Blockdev options for an image file: {"driver": format, "node-name":
// name (if any), "file": {"driver": "file", "filename": path}}; without a
// format, the file node's own options. Built outside coroutines: GCC 12
// destroys brace-initialised temporaries in a coroutine frame twice.
Json image_options(const std::string& format, const std::string& node_name, const std::string& path);

// a[key] as a string, or `def` when absent (a function, so coroutines
// need no conditional expression over string temporaries).
std::string str_or(const OJson& a, const char* key, const std::string& def);

// Argument schemas the commands and the transaction actions share.
extern const std::vector<Arg> kBlockdevSnapshotArgs;
extern const std::vector<Arg> kBlockdevSnapshotSyncArgs;
extern const std::vector<Arg> kInternalSnapshotArgs;
extern const std::vector<Arg> kBlockdevBackupArgs;
extern const std::vector<Arg> kDriveBackupArgs;

}  // namespace vblk::qmp
