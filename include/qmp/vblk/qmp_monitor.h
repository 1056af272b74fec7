// QmpServer: QMP monitors on unix sockets, wire-compatible with QEMU 7.2.
//
// Each monitor (a listening socket, QEMU's `--chardev socket,server=on` +
// `--monitor`) serves one client at a time, as QEMU's socket chardev does:
// a second client is accepted by the kernel and waits until the first has
// gone. A client gets the greeting, must negotiate with qmp_capabilities,
// then sends commands that run one after another (each awaited before the
// next is read); replies and events go out through a per-client queue and
// writer coroutine, so an event never interleaves with a reply. Events are
// broadcast to every negotiated client of every monitor.
//
// Ownership: the server owns its listeners and client sessions; the
// Registry is borrowed and must outlive it. One loop; nothing blocks it.
#pragma once

#include <list>
#include <memory>
#include <string>

#include "vblk/net.h"
#include "vblk/qmp_registry.h"
#include "vblk/sync.h"

namespace vblk::qmp {

class QmpServer {
 public:
  QmpServer(Loop& loop, Registry& registry, OJson greeting_version);
  ~QmpServer();

  // Starts a monitor on an already listening socket; `path` is unlinked
  // when the monitor stops (empty: nothing to unlink).
  void add_monitor(Fd listener, std::string path);
  // Serves one client on an already connected socket, as a monitor's
  // client (QEMU's add_client with protocol qmp; the fuzz target's
  // socketpair). stop() ends it like the others.
  void add_client(Fd fd);
  // While held, monitors accept no client (they wait in the listen
  // backlog): qemu-storage-daemon answers nothing before its command line
  // has been processed. Not held unless asked.
  void hold() { open_.reset(); }
  void open() { open_.set(); }

  // {"event": name, "data": data, "timestamp": {...}} to every negotiated
  // client; data null: no "data" member.
  void emit_event(const std::string& name, OJson data = nullptr);

  // Stops accepting and ends every client once its queued output is sent.
  void stop();
  // Waits until every monitor and client has finished (after stop()).
  Task<void> wait();

 private:
  struct Session;
  Task<void> run_monitor(Fd listener, std::string path);
  Task<void> run_session(Fd fd);
  Task<void> run_writer(Session& s);
  Task<void> handle(Session& s, JsonMessage msg);
  Task<OJson> dispatch(Session& s, const OJson& req);

  Loop& loop_;
  Registry& registry_;
  OJson version_;
  std::list<Session*> sessions_;
  std::vector<int> listeners_;
  WaitGroup running_;
  CoEvent open_;
  bool stopping_ = false;
};

}  // namespace vblk::qmp
