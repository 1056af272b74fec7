// The NBD server: named exports of nodes, served to many clients at once on
// one loop. Each connection negotiates (fixed newstyle: export name, info/go,
// list, structured replies, meta contexts), then serves requests
// concurrently, replying out of order as the protocol allows.
//
// Ownership: the server holds its exports (shared with the node graph) and
// its connections; stop() ends accepting and closes every connection, and
// the serve task returns once all of them have finished. One loop.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <stop_token>
#include <string>

#include "vblk/block_export.h"
#include "vblk/net.h"
#include "vblk/node.h"
#include "vblk/node_ref.h"
#include "vblk/sync.h"

namespace vblk::nbd {

struct Export {
  std::string name;
  std::string description;
  // Re-pointable: a backup's copy-before-write filter inserted above the
  // node takes the export's writes from then on.
  NodeRef node;
  bool writable = false;
  // Named dirty bitmaps offered as "qemu:dirty-bitmap:NAME" contexts: the
  // node that has each one, and its name (looked up per request, so a
  // removed bitmap answers an error rather than dangling).
  std::vector<std::pair<std::shared_ptr<Node>, std::string>> bitmaps;
};

// The bitmap `name` on `node` or the nearest backing file that has one (how
// QEMU's nbd_export_create finds a bitmap given by name, for qemu-nbd -B and
// block-export-add); `node` is left at the node that has it. nullptr if none.
NamedBitmap* find_bitmap_in_chain(std::shared_ptr<Node>& node, const std::string& name);

struct Session;

class Server {
 public:
  struct Options {
    unsigned max_connections = 0;  // 0: no limit; more wait in the listen backlog
    unsigned max_requests = 64;    // requests in flight per connection
    // Request data all connections together may hold in flight or as
    // queued replies (each connection also has its own bound; see
    // transmission.cc). At least two requests of NBD's maximum size.
    uint64_t max_inflight_bytes = kDefaultInflightBytes;
  };
  static constexpr uint64_t kDefaultInflightBytes = 256u << 20;
  // nbd-server-start's max-connections when not given: QEMU's since the
  // fix of CVE-2024-7409 (7.2 had no limit); 0 given explicitly still means
  // no limit.
  static constexpr unsigned kDefaultMaxConnections = 100;
  // Idle data buffers all connections together keep for reuse.
  static constexpr size_t kMaxPooledBytes = 64u << 20;
  Server(Loop& loop, Options opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  Status add_export(Export e);  // EEXIST if the name is taken
  bool remove_export(const std::string& name);
  std::shared_ptr<const Export> find_export(const std::string& name) const;
  const std::map<std::string, std::shared_ptr<const Export>>& exports() const { return exports_; }

  // Accepts clients on `listener` until stop(); returns when the listener is
  // done and every connection has closed.
  Task<void> serve(Fd listener);
  // Ends the connections that chose export `name` (in-flight requests
  // finish first); returns how many there were.
  size_t disconnect_clients(const std::string& name);
  // Stops accepting and shuts every connection down (they finish their
  // in-flight requests first).
  void stop();

  // Called after each connection closes, with the number still open.
  std::function<void(size_t)> on_disconnect;
  // Called after a connection is accepted (before negotiation).
  std::function<void()> on_connect;

  size_t connections() const { return conns_.size(); }
  // The server-wide budget of request data (Options::max_inflight_bytes).
  CoSemaphore& inflight_budget() { return inflight_budget_; }
  // Bytes of idle buffers the connections' pools hold, against kMaxPooledBytes.
  size_t& pooled_bytes() { return pooled_bytes_; }
  Loop& loop() const { return loop_; }
  const Options& options() const { return opts_; }

 private:
  Task<void> run_connection(Fd fd);
  Task<void> handshake_watchdog(int fd, std::stop_token negotiated);

  static constexpr std::chrono::seconds kHandshakeLimit{10};

  Loop& loop_;
  Options opts_;
  std::map<std::string, std::shared_ptr<const Export>> exports_;
  std::map<int, const Session*> conns_;  // open connections by fd (for stop)
  std::vector<int> listeners_;
  WaitGroup running_;
  CoEvent slot_free_;  // a connection ended (or stop): the accept loop may go on
  CoSemaphore inflight_budget_;
  size_t pooled_bytes_ = 0;
  bool stopping_ = false;
};

// Server `s`'s export `name` as a block export (block-export-add type=nbd);
// its remove() takes the entry off the server and ends its clients. The
// server must outlive it, or have removed it first.
std::unique_ptr<BlockExport> make_block_export(Server& s, std::string name);

}  // namespace vblk::nbd
