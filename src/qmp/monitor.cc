#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "vblk/qmp_monitor.h"
#include "vblk/trace.h"

namespace vblk::qmp {

// What a client that does not read its replies can make the daemon hold.
// QEMU's monitor stops reading requests while its queue is full (8
// requests, QMP_REQ_QUEUE_LEN_MAX); here the measure is the output itself:
// no further command is read while more than kMaxQueuedOutput bytes wait
// to be sent (so at most one command's reply beyond it). Events are not
// the client's doing and cannot wait, so a client with more than
// kMaxEventBacklog bytes unread is cut off rather than let grow memory
// without bound (QEMU 7.2 buffers them without limit).
constexpr size_t kMaxQueuedOutput = 1u << 20;
constexpr size_t kMaxEventBacklog = 16u << 20;
constexpr std::chrono::seconds kLingerLimit{5};

struct QmpServer::Session {
  Session(Loop& loop, int fd) : fd(fd), out(loop), writer_done(loop), drained(loop) { drained.set(); }
  int fd;
  bool negotiated = false;
  bool oob = false;
  CoQueue<std::string> out;
  CoEvent writer_done;
  size_t queued = 0;  // bytes in `out` and being sent
  CoEvent drained;    // set while queued <= kMaxQueuedOutput

  bool writer_gone = false;

  void push(std::string line) {
    queued += line.size();
    if (queued > kMaxQueuedOutput && !writer_gone) drained.reset();
    // Unbounded queue: push completes at once.
    spawn_detached([](Session* s, std::string l) -> Task<void> { (void)co_await s->out.push(std::move(l)); }(
                                                     this, std::move(line)));
  }
  void sent(size_t n) {
    queued -= n;
    if (queued <= kMaxQueuedOutput) drained.set();
  }
};

QmpServer::QmpServer(Loop& loop, Registry& registry, OJson version)
    : loop_(loop), registry_(registry), version_(std::move(version)), running_(loop), open_(loop) {
  open_.set();
}

QmpServer::~QmpServer() = default;

void QmpServer::add_monitor(Fd listener, std::string path) {
  running_.add();
  listeners_.push_back(listener.get());
  spawn_detached(run_monitor(std::move(listener), std::move(path)));
}

void QmpServer::add_client(Fd fd) {
  running_.add();
  spawn_detached(run_session(std::move(fd)));
}

Task<void> QmpServer::run_monitor(Fd listener, std::string path) {
  co_await open_.wait();
  while (!stopping_) {
    auto c = co_await accept_socket(loop_, listener.get());
    if (!c) {
      if (stopping_) break;
      int e = c.error().code;
      if (e == ECONNABORTED || e == EINTR || e == EAGAIN) continue;
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        co_await loop_.sleep(std::chrono::milliseconds(10));
        continue;
      }
      break;
    }
    if (stopping_) break;
    // One client at a time per monitor, as QEMU's socket chardev.
    running_.add();
    co_await run_session(std::move(*c));
  }
  std::erase(listeners_, listener.get());
  if (!path.empty()) ::unlink(path.c_str());
  running_.done();
}

Task<void> QmpServer::run_writer(Session& s) {
  for (;;) {
    auto line = co_await s.out.pop();
    if (!line) break;
    auto st = co_await send_all(loop_, s.fd, std::span(reinterpret_cast<const uint8_t*>(line->data()), line->size()));
    s.sent(line->size());
    if (!st) break;  // the client went away; the reader notices too
  }
  // Nothing more will be sent: the reader must not wait for it.
  s.writer_gone = true;
  s.drained.set();
  s.writer_done.set();
}

Task<void> QmpServer::run_session(Fd fd) {
  Session s(loop_, fd.get());
  sessions_.push_back(&s);
  spawn_detached(run_writer(s));
  OJson greeting = OJson::object();
  greeting["QMP"]["version"] = version_;
  greeting["QMP"]["capabilities"] = OJson::array({"oob"});
  s.push(to_qmp_text(greeting) + "\r\n");
  JsonStreamer streamer;
  std::vector<char> buf(64 * 1024);
  std::vector<JsonMessage> msgs;
  while (!stopping_) {
    co_await s.drained.wait();
    if (stopping_) break;
    long n = co_await loop_.recv(s.fd, buf.data(), buf.size());
    if (n <= 0) break;
    msgs.clear();
    streamer.feed(std::string_view(buf.data(), static_cast<size_t>(n)), msgs);
    for (auto& m : msgs) {
      if (!stopping_) co_await s.drained.wait();
      if (stopping_) break;
      co_await handle(s, std::move(m));
    }
  }
  sessions_.remove(&s);
  s.out.close();
  // The queued replies (quit's among them) go out first, but a client that
  // does not read them gets kLingerLimit, not forever: the shutdown
  // fails the writer's send.
  std::stop_source sent;
  running_.add();
  spawn_detached([](QmpServer* self, int fd, std::stop_token done) -> Task<void> {
    bool expired = co_await self->loop_.sleep(kLingerLimit, done);
    if (expired && !done.stop_requested()) ::shutdown(fd, SHUT_RDWR);
    self->running_.done();
  }(this, s.fd, sent.get_token()));
  co_await s.writer_done.wait();
  sent.request_stop();
  fd.reset();
  running_.done();
}

Task<void> QmpServer::handle(Session& s, JsonMessage msg) {
  OJson rsp;
  if (!msg.ok) {
    rsp["error"] = {{"class", "GenericError"}, {"desc", msg.error}};
  } else {
    rsp = co_await dispatch(s, msg.value);
  }
  s.push(to_qmp_text(rsp) + "\r\n");
}

// qmp_dispatch() of QEMU: checks the request's shape, finds the command
// (only qmp_capabilities before negotiation), checks its arguments and runs
// it; the reply echoes "id".
Task<OJson> QmpServer::dispatch(Session& s, const OJson& req) {
  OJson rsp = OJson::object();
  auto fail = [&](const std::string& cls, const std::string& desc) {
    rsp["error"] = {{"class", cls}, {"desc", desc}};
    return rsp;
  };
  if (!req.is_object()) co_return fail("GenericError", "QMP input must be a JSON object");
  // The id is echoed even when the request is refused.
  const OJson* id = nullptr;
  if (auto it = req.find("id"); it != req.end()) id = &*it;
  auto with_id = [&](OJson r) {
    if (id) r["id"] = *id;
    return r;
  };
  // Members are checked in QEMU's dict order: the first bad one is reported.
  std::vector<std::string> keys = qdict_key_order(req);
  for (const auto& k : keys) {
    const OJson& v = req.at(k);
    if (k == "execute" || (k == "exec-oob" && s.oob)) {
      if (!v.is_string()) co_return with_id(fail("GenericError", "QMP input member '" + k + "' must be a string"));
    } else if (k == "arguments") {
      if (!v.is_object()) co_return with_id(fail("GenericError", "QMP input member 'arguments' must be an object"));
    } else if (k != "id") {
      co_return with_id(fail("GenericError", "QMP input member '" + k + "' is unexpected"));
    }
  }
  bool has_exec = req.contains("execute"), has_oob = s.oob && req.contains("exec-oob");
  if (has_exec && has_oob)
    co_return with_id(fail("GenericError", "QMP input must not contain both 'execute' and 'exec-oob'"));
  if (!has_exec && !has_oob) co_return with_id(fail("GenericError", "QMP input lacks member 'execute'"));
  std::string name = req.at(has_exec ? "execute" : "exec-oob").get<std::string>();
  static const OJson kNoArgs = OJson::object();
  const OJson& args = req.contains("arguments") ? req.at("arguments") : kNoArgs;

  if (!s.negotiated) {
    if (name != "qmp_capabilities")
      co_return with_id(fail("CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'"));
    // qmp_capabilities: enable is a list of QMPCapability ("oob").
    static const std::vector<Arg> kCaps = {{"enable", ArgType::List, false}};
    if (auto e = check_args(kCaps, false, args)) co_return with_id(fail("GenericError", *e));
    bool oob = false;
    if (args.contains("enable")) {
      for (const auto& c : args.at("enable")) {
        // QEMU names list elements 'null' in this message.
        if (!c.is_string())
          co_return with_id(fail("GenericError", "Invalid parameter type for 'null', expected: string"));
        if (c.get<std::string>() != "oob")
          co_return with_id(
              fail("GenericError", "Parameter 'null' does not accept value '" + c.get<std::string>() + "'"));
        oob = true;
      }
    }
    s.negotiated = true;
    s.oob = oob;
    rsp["return"] = OJson::object();
    co_return with_id(rsp);
  }
  if (name == "qmp_capabilities")
    co_return with_id(fail("CommandNotFound", "Capabilities negotiation is already complete, command ignored"));
  const Command* cmd = registry_.find(name);
  if (!cmd) co_return with_id(fail("CommandNotFound", "The command " + name + " has not been found"));
  if (has_oob) co_return with_id(fail("GenericError", "The command " + name + " does not support OOB"));
  if (auto e = check_args(cmd->args.members, cmd->args.open, args)) co_return with_id(fail("GenericError", *e));
  Handler fn = cmd->fn;  // the registry may change while the command runs
  VBLK_TRACE(kQmp, "command {} {}", name, to_qmp_text(args));
  Reply r;
  // A handler bug must not take the daemon (and every VM disk) down.
  try {
    r = co_await fn(args);
  } catch (const std::exception& e) {
    r = Reply::fail(std::string("internal error: ") + e.what());
  }
  VBLK_TRACE(kQmp, "command {}: {}", name, r.error ? r.error->cls + ": " + r.error->desc : "ok");
  if (r.error) co_return with_id(fail(r.error->cls, r.error->desc));
  rsp["return"] = std::move(r.value);
  co_return with_id(rsp);
}

void QmpServer::emit_event(const std::string& name, OJson data) {
  timeval tv;
  ::gettimeofday(&tv, nullptr);
  OJson ev = OJson::object();
  ev["event"] = name;
  if (!data.is_null()) ev["data"] = std::move(data);
  ev["timestamp"] = {{"seconds", static_cast<int64_t>(tv.tv_sec)}, {"microseconds", static_cast<int64_t>(tv.tv_usec)}};
  std::string line = to_qmp_text(ev) + "\r\n";
  for (Session* s : sessions_) {
    if (!s->negotiated) continue;
    if (s->queued > kMaxEventBacklog) {
      ::shutdown(s->fd, SHUT_RDWR);  // ends its reader and writer
      continue;
    }
    s->push(line);
  }
}

void QmpServer::stop() {
  if (stopping_) return;
  stopping_ = true;
  for (int fd : listeners_) ::shutdown(fd, SHUT_RDWR);
  // Readers end; writers send what is queued (the reply to quit) first.
  for (Session* s : sessions_) {
    ::shutdown(s->fd, SHUT_RD);
    s->drained.set();  // a reader held back by unread output ends too
  }
}

Task<void> QmpServer::wait() { co_await running_.wait(); }

}  // namespace vblk::qmp
