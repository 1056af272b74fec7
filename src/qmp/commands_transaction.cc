// `transaction` and the runner every action command goes through
// (transaction.h): QEMU 7.2's qmp_transaction — prepare each action in
// order; on the first failure abort the prepared ones (the failing one
// included, as QEMU does) in reverse order; otherwise commit them in order;
// then clean them all in order.
#include "transaction.h"

namespace vblk::qmp {

Task<Status> run_transaction(Daemon& d, std::vector<std::unique_ptr<TxAction>> actions, bool grouped) {
  TxContext tx{d, grouped, {}, std::make_shared<JobGroup>()};
  Status st;
  size_t prepared = 0;
  for (auto& a : actions) {
    ++prepared;
    if (grouped && !a->supports_grouped()) {
      st = Error(EINVAL, std::string("Action '") + a->name() +
                             "' does not support Transaction property completion-mode = grouped");
      break;
    }
    st = co_await a->prepare(tx);
    if (!st) break;
  }
  if (st) {
    for (auto& a : actions) co_await a->commit(tx);
  } else {
    for (size_t i = prepared; i-- > 0;) co_await actions[i]->abort(tx);
  }
  for (size_t i = 0; i < prepared; ++i) co_await actions[i]->clean(tx);
  co_return st;
}

Task<Reply> run_single_action(Daemon& d, std::unique_ptr<TxAction> action) {
  std::vector<std::unique_ptr<TxAction>> list;
  list.push_back(std::move(action));
  Status st = co_await run_transaction(d, std::move(list), false);
  if (!st) co_return Reply::fail(st.error().what());
  co_return Reply::ok();
}

}  // namespace vblk::qmp

namespace vblk::qmp {

namespace {

class AbortAction final : public TxAction {
 public:
  const char* name() const override { return "abort"; }
  bool supports_grouped() const override { return true; }
  Task<Status> prepare(TxContext&) override { co_return Error(ECANCELED, "Transaction aborted using Abort action"); }
};

const std::vector<Arg> kBitmapArgs = {{"node", ArgType::Str, true}, {"name", ArgType::Str, true}};
const std::vector<Arg> kBitmapAddArgs = {{"node", ArgType::Str, true},
                                         {"name", ArgType::Str, true},
                                         {"granularity", ArgType::UInt32},
                                         {"persistent", ArgType::Bool},
                                         {"disabled", ArgType::Bool}};
const std::vector<Arg> kBitmapMergeArgs = {
    {"node", ArgType::Str, true}, {"target", ArgType::Str, true}, {"bitmaps", ArgType::List, true}};

// QEMU 7.2's TransactionActionKind, with each action's data schema.
const std::vector<std::pair<std::string, const std::vector<Arg>*>>& action_kinds() {
  static const std::vector<Arg> kNone;
  static const std::vector<std::pair<std::string, const std::vector<Arg>*>> kinds = {
      {"abort", &kNone},
      {"block-dirty-bitmap-add", &kBitmapAddArgs},
      {"block-dirty-bitmap-remove", &kBitmapArgs},
      {"block-dirty-bitmap-clear", &kBitmapArgs},
      {"block-dirty-bitmap-enable", &kBitmapArgs},
      {"block-dirty-bitmap-disable", &kBitmapArgs},
      {"block-dirty-bitmap-merge", &kBitmapMergeArgs},
      {"blockdev-backup", &kBlockdevBackupArgs},
      {"blockdev-snapshot", &kBlockdevSnapshotArgs},
      {"blockdev-snapshot-internal-sync", &kInternalSnapshotArgs},
      {"blockdev-snapshot-sync", &kBlockdevSnapshotSyncArgs},
      {"drive-backup", &kDriveBackupArgs},
  };
  return kinds;
}

std::unique_ptr<TxAction> make_action(const std::string& type, const OJson& data) {
  if (type == "abort") return std::make_unique<AbortAction>();
  if (type.rfind("block-dirty-bitmap-", 0) == 0) return make_bitmap_action(type.substr(19), data);
  if (type == "blockdev-backup") return make_backup(data, false);
  if (type == "drive-backup") return make_backup(data, true);
  if (type == "blockdev-snapshot") return make_blockdev_snapshot(data);
  if (type == "blockdev-snapshot-sync") return make_blockdev_snapshot_sync(data);
  return make_internal_snapshot(data);
}

// TransactionAction: a simple union {type, data}.
std::vector<Arg> action_shape(const std::vector<std::string>& types) {
  return {{"type", ArgType::Enum, true, types}, {"data", ArgType::Object, true}};
}

Task<Reply> transaction(Daemon& d, const OJson& a) {
  // The whole input is checked before any action runs (QAPI's visitor).
  const OJson& list = a["actions"];
  std::vector<std::unique_ptr<TxAction>> actions;
  std::vector<std::string> type_names;
  for (const auto& [k, v] : action_kinds()) type_names.push_back(k);
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = "actions[" + std::to_string(i) + "]";
    const OJson& e = list[i];
    if (!e.is_object()) co_return Reply::fail("Invalid parameter type for '" + at + "', expected: object");
    std::vector<Arg> shape = action_shape(type_names);
    if (auto err = check_args(shape, false, e, at)) co_return Reply::fail(*err);
    const std::string type = e["type"].get<std::string>();
    const std::vector<Arg>* schema = nullptr;
    for (const auto& [k, v] : action_kinds())
      if (k == type) schema = v;
    if (auto err = check_args(*schema, false, e["data"], at + ".data")) co_return Reply::fail(*err);
    actions.push_back(make_action(type, e["data"]));
  }
  bool grouped = false;
  if (a.contains("properties") && a["properties"].contains("completion-mode"))
    grouped = a["properties"]["completion-mode"] == "grouped";
  Status st = co_await run_transaction(d, std::move(actions), grouped);
  if (!st) co_return Reply::fail(st.error().what());
  co_return Reply::ok();
}

}  // namespace

void register_transaction_commands(Daemon& d) {
  d.registry.add({"transaction",
                  {{{"actions", ArgType::List, true},
                    {"properties",
                     ArgType::Struct,
                     false,
                     {},
                     {{"completion-mode", ArgType::Enum, false, {"individual", "grouped"}}}}}},
                  [&d](const OJson& a) { return transaction(d, a); }});
}

}  // namespace vblk::qmp
