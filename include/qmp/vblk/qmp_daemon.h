// Daemon: the state QMP commands act on in `vblk serve` (QEMU's
// qemu-storage-daemon): the node graph, the QMP monitors, the NBD server
// and its exports, and the shutdown request.
//
// Commands are registered per area by register_*_commands(Daemon&) (core,
// block, nbd); later areas (jobs, backup) add their own function and their
// own fields here. Anything that keeps a node in use the way a QEMU
// BlockBackend does (an export, a job) registers a check in `node_users`
// so blockdev-del refuses the node with QEMU's "Node 'x' is in use".
//
// Ownership: the daemon owns everything it names; nodes are shared with
// their users. One loop.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "vblk/block_export.h"
#include "vblk/graph.h"
#include "vblk/job.h"
#include "vblk/nbd_server.h"
#include "vblk/qmp_monitor.h"
#include "vblk/qmp_registry.h"
#include "vblk/throttle.h"

namespace vblk::qmp {

// Per-node settings QEMU reports in query-named-block-nodes.
struct NodeSettings {
  bool direct = false;
  bool no_flush = false;
  std::string detect_zeroes = "off";
};

struct Daemon {
  explicit Daemon(Loop& l);
  ~Daemon();

  Loop& loop;
  Graph graph;
  // throttle-group objects (object-add / --object), used by `throttle` nodes.
  ThrottleGroups throttle_groups{loop};
  std::set<std::string> iothreads;  // accepted iothread objects (one loop runs everything)
  // Jobs (blockdev-backup, job-*, block-job-*): see src/qmp/commands_job.cc.
  JobManager jobs{loop};
  Registry registry;
  QmpServer monitors;

  // Nodes in the order QEMU lists them (newest first); children come
  // before their parents in creation order.
  std::vector<std::weak_ptr<Node>> node_order;
  std::map<const Node*, NodeSettings> settings;
  std::set<std::string> monitor_owned;  // node names given by the user

  // NBD server (nbd-server-start / --nbd-server) and exports by id.
  nbd::Server* nbd = nullptr;  // owned by its serve task (freed when it ends)
  std::string nbd_unix_path;   // unlinked when the server stops
  WaitGroup nbd_running;
  // Every export (block-export-add, nbd-server-add, --export) by id.
  std::map<std::string, std::unique_ptr<BlockExport>> exports;
  std::vector<std::string> export_order;  // ids, oldest first

  // Nodes opened by a job's command for the job alone (drive-backup's
  // target, QEMU's anonymous #blockNNN): closed when the job concludes.
  std::map<std::string, std::vector<std::string>> job_nodes;

  // True if something other than the graph and parents holds `n` (export,
  // job): blockdev-del answers "Node x is in use".
  std::vector<std::function<bool(const Node&)>> node_users;

  // `quit`, SIGTERM, SIGINT: set once; `vblk serve` then shuts down.
  CoEvent quit;
  // Clients (QMP, NBD) are served once this is set (at once unless
  // hold_clients() was called): a client that connects during startup
  // waits until every command-line node, object and export exists.
  CoEvent clients_open;
  void hold_clients() {
    clients_open.reset();
    monitors.hold();
  }
  void open_clients() {
    clients_open.set();
    monitors.open();
  }

  void emit(const std::string& event, OJson data = nullptr) { monitors.emit_event(event, std::move(data)); }

  // Adds a node tree opened from blockdev options to the bookkeeping.
  void note_new_nodes(const std::shared_ptr<Node>& top);
  // Drops node_order's entries of nodes that are gone: each weak_ptr keeps
  // its node's whole allocation (make_shared: one block with the control
  // block), so a daemon that adds and deletes nodes for days would keep
  // every node it ever had. Also drops their settings.
  void forget_dead_nodes();
  // Opens blockdev options (QMP blockdev-add, --blockdev) into the graph.
  Result<std::shared_ptr<Node>> blockdev_add(const nlohmann::json& opts);
  // Closes and forgets a node nobody else holds (a transaction's overlay
  // that was not installed), with the implicit children it leaves unused.
  Task<void> drop_node(const std::string& name);
  // Stops the NBD server (exports removed, BLOCK_EXPORT_DELETED each).
  Task<void> nbd_stop();
  // Removes export `id` (its clients disconnected, its node let go), then
  // emits BLOCK_EXPORT_DELETED.
  Task<void> delete_export(std::string id);
  // Everything down: monitors, exports, server, nodes closed.
  Task<void> shutdown();
};

void register_core_commands(Daemon& d);
void register_block_commands(Daemon& d);
void register_nbd_commands(Daemon& d);
void register_export_commands(Daemon& d);
void register_job_commands(Daemon& d);
void register_object_commands(Daemon& d);
void register_bitmap_commands(Daemon& d);
void register_create_commands(Daemon& d);
void register_snapshot_commands(Daemon& d);
void register_transaction_commands(Daemon& d);
void register_vmstate_commands(Daemon& d);
inline void register_all_commands(Daemon& d) {
  register_core_commands(d);
  register_block_commands(d);
  register_nbd_commands(d);
  register_export_commands(d);
  register_job_commands(d);
  register_object_commands(d);
  register_bitmap_commands(d);
  register_create_commands(d);
  register_snapshot_commands(d);
  register_transaction_commands(d);
  register_vmstate_commands(d);
}

// The named node that has `n` as its backing file, if any (QEMU's op
// blocker "node is used as backing hd of 'x'").
std::shared_ptr<Node> backing_parent(Daemon& d, const Node& n);

// query-named-block-nodes' "dirty-bitmaps" of a node (QEMU's BlockDirtyInfo
// list, newest first); empty if the node has none.
OJson dirty_bitmaps_info(const Node& n);

// QEMU's SocketAddress (flat: {"type":"unix","path":...} or
// {"type":"inet","host":...,"port":...}) -> listening socket.
Result<Fd> listen_socket_address(Loop& loop, const OJson& addr, std::string* unix_path);
// nbd-server-start for QMP and --nbd-server: `addr` flat, max_connections 0 = no limit.
Status start_nbd_server(Daemon& d, const OJson& addr, unsigned max_connections);
// block-export-add for QMP and --export: `opts` checked against the
// members of its type (check_export_args), then the export made.
std::optional<std::string> check_export_args(const OJson& opts);
Status add_block_export(Daemon& d, const OJson& opts);
// Then waits until the export serves (BlockExport::ready); one that never
// will is removed again, without an event, and its error returned.
Task<Status> export_ready(Daemon& d, std::string id);
// The NBD type's part of it: the export on the running server.
Result<std::unique_ptr<BlockExport>> add_nbd_export(Daemon& d, const OJson& opts, const std::shared_ptr<Node>& node);
// QEMU's id_wellformed (export and object ids): a letter, then letters,
// digits, '-', '.', '_'.
bool id_wellformed(const std::string& id);
// object-add for QMP and --object: {"qom-type", "id", properties...}.
Status add_object(Daemon& d, const OJson& opts);
// --object secret,... for the tools without a daemon (convert, info, map,
// ...): checked as object-add checks it, kept in the process's SecretStore.
Status add_secret_object(const OJson& opts);

}  // namespace vblk::qmp
