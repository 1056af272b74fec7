// vblk serve: a qemu-storage-daemon compatible daemon. The options are
// qemu-storage-daemon's and take effect in command-line order, so the same
// command line starts either daemon:
//   --blockdev JSON|key=val,...   --chardev socket,path=P,server=on,wait=off,id=ID
//   --monitor chardev=ID          --nbd-server addr.type=unix,addr.path=P
//   --export type=nbd|vhost-user-blk|fuse,id=..,node-name=..,...
//   --object TYPE,id=..           --pidfile PATH   --daemonize
//   --mlock (vblk's own: lock the daemon's memory)
// SIGTERM, SIGINT and SIGHUP (and QMP `quit`) shut down cleanly: monitors
// and exports end, every node is drained and closed.
#include <fcntl.h>
#include <getopt.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "common.h"
#include "server_process.h"
#include "vblk/qmp_daemon.h"

namespace vblk::cli {

namespace {

using qmp::OJson;

void serve_help() {
  std::printf(
      "Usage: vblk serve [options]\n"
      "vblk's storage daemon (qemu-storage-daemon compatible)\n"
      "\n"
      "  -h, --help             display this help and exit\n"
      "  -V, --version          output version information and exit\n"
      "\n"
      "  --blockdev [driver=]<driver>[,node-name=<N>][,discard=ignore|unmap]\n"
      "             [,cache.direct=on|off][,cache.no-flush=on|off]\n"
      "             [,read-only=on|off][,auto-read-only=on|off]\n"
      "             [,force-share=on|off][,detect-zeroes=on|off|unmap]\n"
      "             [,driver specific parameters...]\n"
      "                         configure a block backend (or a JSON object)\n"
      "  --chardev socket,path=<path>,server=on,wait=off,id=<id>\n"
      "                         a unix socket for a QMP monitor\n"
      "  --export [type=]nbd,id=<id>,node-name=<node-name>[,name=<export-name>]\n"
      "           [,writable=on|off][,description=<text>]\n"
      "                         export the specified block node over NBD\n"
      "  --export [type=]fuse,id=<id>,node-name=<node-name>,mountpoint=<file>\n"
      "           [,growable=on|off][,writable=on|off][,allow-other=on|off|auto][,io-uring=on|off]\n"
      "                         export the specified block node over FUSE\n"
      "  --export [type=]ublk,id=<id>,node-name=<node-name>[,writable=on|off]\n"
      "           [,num-queues=<n>][,queue-depth=<n>][,logical-block-size=<n>][,dev-id=<n>]\n"
      "           [,recovery=on|off]\n"
      "                         export the specified block node as /dev/ublkbN (ublk_drv)\n"
      "  --export [type=]vduse-blk,id=<id>,node-name=<node-name>\n"
      "           ,name=<vduse-name>[,writable=on|off]\n"
      "           [,num-queues=<num-queues>][,queue-size=<queue-size>]\n"
      "           [,logical-block-size=<logical-block-size>]\n"
      "           [,serial=<serial-number>]\n"
      "                         export the specified block node as a\n"
      "                         vduse-blk device\n"
      "  --export [type=]vhost-user-blk,id=<id>,node-name=<node-name>,\n"
      "           addr.type=unix,addr.path=<socket-path>[,writable=on|off]\n"
      "           [,logical-block-size=<block-size>][,num-queues=<num-queues>]\n"
      "                         export the specified block node as a\n"
      "                         vhost-user-blk device over UNIX domain socket\n"
      "  --export [type=]vhost-user-blk,id=<id>,node-name=<node-name>,\n"
      "           addr.type=fd,addr.str=<fd>[,writable=on|off]\n"
      "           [,logical-block-size=<block-size>][,num-queues=<num-queues>]\n"
      "                         export the specified block node as a\n"
      "                         vhost-user-blk device over file descriptor\n"
      "  --monitor [chardev=]name[,mode=control]\n"
      "                         configure a QMP monitor\n"
      "  --nbd-server addr.type=inet,addr.host=<host>,addr.port=<port>\n"
      "               [,max-connections=<n>]\n"
      "  --nbd-server addr.type=unix,addr.path=<path>[,max-connections=<n>]\n"
      "                         start an NBD server for exporting block nodes\n"
      "  --object iothread,id=<id>\n"
      "                         accepted (vblk serves from one event loop)\n"
      "  --object throttle-group,id=<id>[,x-bps-total=<n>,...][,limits.bps-write=<n>,...]\n"
      "                         an I/O limit for `throttle` nodes (QEMU's ThrottleLimits)\n"
      "  --pidfile <path>       write process ID to a file after startup\n"
      "  --mlock                lock the daemon's memory as it is touched (vblk only;\n"
      "                         a daemon serving the host's own kernel (FUSE) cannot\n"
      "                         then wait for reclaim that writes to its own export)\n"
      "  --daemonize            daemonize the process, and close the parent once\n"
      "                         startup is complete\n");
}

// qemu-storage-daemon reports errors on one line, without a --help hint.
[[noreturn]] void serve_fail(const std::string& msg) {
  error_report(msg);
  std::exit(1);
}

[[noreturn]] void opt_fail(const std::string& opt, const std::string& arg, const std::string& msg) {
  serve_fail("--" + opt + " " + arg + ": " + msg);
}

struct Chardev {
  Fd fd;
  std::string path;
};

// key=val strings from the command line -> typed JSON for the QMP checks.
bool to_bool(OJson& o, const std::string& key, std::string& err) {
  if (!o.contains(key) || !o[key].is_string()) return true;
  std::string v = o[key];
  if (v == "on" || v == "yes" || v == "true" || v == "y") {
    o[key] = true;
  } else if (v == "off" || v == "no" || v == "false" || v == "n") {
    o[key] = false;
  } else {
    err = "Parameter '" + key + "' expects 'on' or 'off'";
    return false;
  }
  return true;
}

OJson keyval(const std::string& opt, const std::string& arg, const std::string& implied = {}) {
  auto kv = parse_keyval(arg, implied);
  if (!kv) opt_fail(opt, arg, kv.error().what());
  return OJson::parse(kv->dump());
}

void do_blockdev(qmp::Daemon& d, const std::string& arg) {
  Json opts;
  if (!arg.empty() && arg[0] == '{') {
    auto m = qmp::parse_json_value(arg);
    if (!m.ok) opt_fail("blockdev", arg, m.error);
    opts = Json::parse(m.value.dump());
  } else {
    auto kv = parse_keyval(arg, "driver");
    if (!kv) opt_fail("blockdev", arg, kv.error().what());
    opts = *kv;
  }
  auto n = d.blockdev_add(opts);
  if (!n) {
    std::string msg = n.error().what();
    if (msg.rfind("Unknown driver '", 0) == 0)
      msg = "Parameter 'driver' does not accept value '" + msg.substr(16, msg.size() - 17) + "'";
    if (!n.error().hint.empty()) msg += "\n" + n.error().hint;  // "Is another process using the image [x]?"
    opt_fail("blockdev", arg, msg);
  }
}

void do_chardev(std::map<std::string, Chardev>& chardevs, Loop& loop, const std::string& arg) {
  OJson o = keyval("chardev", arg, "backend");
  std::string backend = o.value("backend", "");
  std::string id = o.value("id", "");
  if (id.empty()) opt_fail("chardev", arg, "Parameter 'id' is missing");
  if (chardevs.count(id)) opt_fail("chardev", arg, "duplicate yank instance");
  if (backend != "socket") opt_fail("chardev", arg, "chardev backend '" + backend + "' is not supported by vblk");
  std::string err;
  if (!to_bool(o, "server", err) || !to_bool(o, "wait", err)) opt_fail("chardev", arg, err);
  if (!o.value("server", false)) opt_fail("chardev", arg, "only server=on sockets are supported by vblk");
  if (!o.contains("path")) opt_fail("chardev", arg, "chardev: socket: no host given");
  std::string path = o["path"];
  auto fd = listen_unix(loop, path);
  if (!fd) opt_fail("chardev", arg, fd.error().what());
  chardevs[id] = Chardev{std::move(*fd), path};
}

void do_monitor(qmp::Daemon& d, std::map<std::string, Chardev>& chardevs, const std::string& arg) {
  OJson o = keyval("monitor", arg, "chardev");
  std::string id = o.value("chardev", "");
  std::string mode = o.value("mode", "control");
  if (mode != "control") opt_fail("monitor", arg, "Only QMP is supported");
  std::string err;
  if (!to_bool(o, "pretty", err)) opt_fail("monitor", arg, err);
  if (o.value("pretty", false)) opt_fail("monitor", arg, "pretty=on is not supported by vblk");
  auto it = chardevs.find(id);
  if (it == chardevs.end()) opt_fail("monitor", arg, "chardev \"" + id + "\" not found");
  if (!it->second.fd.valid()) opt_fail("monitor", arg, "Device '" + id + "' is in use");
  d.monitors.add_monitor(std::move(it->second.fd), it->second.path);
}

void do_nbd_server(qmp::Daemon& d, const std::string& arg) {
  OJson o = keyval("nbd-server", arg);
  static const std::vector<qmp::Arg> kUnix = {{"type", qmp::ArgType::Enum, true, {"inet", "unix", "vsock", "fd"}},
                                              {"path", qmp::ArgType::Str, true}};
  static const std::vector<qmp::Arg> kInet = {{"type", qmp::ArgType::Enum, true, {"inet", "unix", "vsock", "fd"}},
                                              {"host", qmp::ArgType::Str, true},
                                              {"port", qmp::ArgType::Str, true}};
  if (!o.contains("addr") || !o["addr"].is_object()) opt_fail("nbd-server", arg, "Parameter 'addr' is missing");
  OJson& addr = o["addr"];
  std::string type = addr.value("type", "");
  if (type.empty()) opt_fail("nbd-server", arg, "Parameter 'addr.type' is missing");
  if (auto e = qmp::check_args(type == "inet" ? kInet : kUnix, true, addr, "addr")) opt_fail("nbd-server", arg, *e);
  unsigned maxc = nbd::Server::kDefaultMaxConnections;
  if (o.contains("max-connections")) {
    auto v = parse_ulong(o["max-connections"].get<std::string>(), UINT32_MAX);
    if (!v) opt_fail("nbd-server", arg, "Parameter 'max-connections' expects uint32_t");
    maxc = static_cast<unsigned>(*v);
  }
  for (auto it = o.begin(); it != o.end(); ++it)
    if (it.key() != "addr" && it.key() != "max-connections")
      opt_fail("nbd-server", arg, "Parameter '" + it.key() + "' is unexpected");
  auto st = qmp::start_nbd_server(d, addr, maxc);
  if (!st) opt_fail("nbd-server", arg, st.error().what());
}

void do_export(qmp::Daemon& d, const std::string& arg) {
  OJson o = keyval("export", arg, "type");
  std::string err;
  for (const char* k :
       {"writable", "writethrough", "fixed-iothread", "allocation-depth", "growable", "io-uring", "recovery"})
    if (!to_bool(o, k, err)) opt_fail("export", arg, err);
  // keyval gives strings; the vhost-user-blk numbers are integers.
  for (const char* k : {"logical-block-size", "num-queues", "queue-depth", "queue-size", "dev-id"}) {
    if (!o.contains(k) || !o[k].is_string()) continue;
    auto v = parse_ulong(o[k].get<std::string>(), UINT64_MAX);
    if (!v)
      opt_fail("export", arg,
               std::string("Parameter '") + k + "' expects " + (k[0] == 'l' ? "a size value" : "uint16_t"));
    o[k] = *v;
  }
  if (auto e = qmp::check_export_args(o)) opt_fail("export", arg, *e);
  auto st = qmp::add_block_export(d, o);
  if (!st) opt_fail("export", arg, st.error().what());
  // A ublk device is up once its disk is added, which the loop serves.
  st = d.loop.run(qmp::export_ready(d, o.at("id")));
  if (!st) opt_fail("export", arg, st.error().what());
}

// keyval gives every value as a string; the object properties vblk knows
// are integers (throttle limits), so numeric strings become numbers, as
// QEMU's keyval input visitor reads them.
void keyval_numbers(OJson& o) {
  for (auto& [k, v] : o.items()) {
    if (v.is_object()) {
      keyval_numbers(v);
    } else if (v.is_string() && k != "id" && k != "qom-type") {
      const std::string& s = v.get_ref<const std::string&>();
      char* end = nullptr;
      errno = 0;
      long long x = std::strtoll(s.c_str(), &end, 10);
      if (!s.empty() && !errno && !*end) v = static_cast<int64_t>(x);
    }
  }
}

// The --object text with a secret's `data` value masked: qemu-storage-daemon
// echoes the whole option in its error, vblk never prints a secret (the one
// deliberate difference in these messages). ",," is keyval's escaped comma.
std::string mask_secret_data(const std::string& arg) {
  std::string out;
  size_t i = 0;
  bool first = true;
  while (i <= arg.size()) {
    size_t end = i;
    while (end < arg.size() && !(arg[end] == ',' && !(end + 1 < arg.size() && arg[end + 1] == ','))) {
      end += (arg[end] == ',') ? 2 : 1;
    }
    std::string item = arg.substr(i, end - i);
    if (!first) out += ',';
    first = false;
    out += item.rfind("data=", 0) == 0 ? std::string("data=******") : item;
    i = end + 1;
  }
  return out;
}

void do_object(qmp::Daemon& d, const std::string& arg) {
  OJson o = keyval("object", arg, "qom-type");
  if (o.value("qom-type", "") == "secret") {
    // From here on errors echo the option, its secret masked.
    const std::string shown = mask_secret_data(arg);
    auto bad = keyval_object_bools(o);
    auto st = bad ? Status(Error(EINVAL, *bad)) : qmp::add_object(d, o);
    if (!st) {
      std::string msg = st.error().what();
      if (msg == "Parameter 'id' expects an identifier")
        msg += "\nIdentifiers consist of letters, digits, '-', '.', '_', starting with a letter.";
      opt_fail("object", shown, msg);
    }
    return;
  }
  keyval_numbers(o);
  auto st = qmp::add_object(d, o);
  if (!st) {
    std::string msg = st.error().what();
    // QEMU's error_append_hint, shown on the command line only.
    if (msg == "Parameter 'id' expects an identifier")
      msg += "\nIdentifiers consist of letters, digits, '-', '.', '_', starting with a letter.";
    opt_fail("object", arg, msg);
  }
}

// MCL_ONFAULT: pages are locked as they are touched, so a vhost-user
// front end's guest memory mapped later is not populated and pinned whole
// (MCL_FUTURE alone would fault in all of it at SET_MEM_TABLE).
void lock_memory() {
  if (::mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT) == 0) return;
  int e = errno;
  std::string msg = "--mlock: cannot lock memory: " + std::string(std::strerror(e));
  rlimit rl{};
  if ((e == ENOMEM || e == EPERM) && ::getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    msg += " (RLIMIT_MEMLOCK is " + std::to_string(rl.rlim_cur) + " bytes; raise it or grant CAP_IPC_LOCK)";
  serve_fail(msg);
}

Task<void> run_daemon(qmp::Daemon& d) {
  co_await d.quit.wait();
  co_await d.shutdown();
}

}  // namespace

int cmd_serve(int argc, char** argv) {
  enum { kBlockdev = 256, kChardev, kDaemonize, kExport, kMlock, kMonitor, kNbdServer, kObject, kPidfile };
  static const option longopts[] = {{"help", no_argument, nullptr, 'h'},
                                    {"version", no_argument, nullptr, 'V'},
                                    {"trace", required_argument, nullptr, 'T'},
                                    {"blockdev", required_argument, nullptr, kBlockdev},
                                    {"chardev", required_argument, nullptr, kChardev},
                                    {"daemonize", no_argument, nullptr, kDaemonize},
                                    {"export", required_argument, nullptr, kExport},
                                    {"mlock", no_argument, nullptr, kMlock},
                                    {"monitor", required_argument, nullptr, kMonitor},
                                    {"nbd-server", required_argument, nullptr, kNbdServer},
                                    {"object", required_argument, nullptr, kObject},
                                    {"pidfile", required_argument, nullptr, kPidfile},
                                    {nullptr, 0, nullptr, 0}};
  // First pass: everything that must be known before the loop exists.
  std::vector<std::pair<int, std::string>> opts;
  bool daemonize = false;
  bool mlock = false;
  std::string pidfile;
  opterr = 0;
  optind = 1;
  int c;
  while ((c = getopt_long(argc, argv, "-:hT:V", longopts, nullptr)) != -1) {
    switch (c) {
      case 'h': serve_help(); return 0;
      case 'V': std::printf("vblk serve version " VBLK_VERSION "\n"); return 0;
      case 'T': enable_trace(optarg); break;
      case 1: serve_fail(std::string(optarg) + ": Unexpected argument");
      case kDaemonize: daemonize = true; break;
      case kPidfile: pidfile = optarg; break;
      case kMlock: mlock = true; break;
      // getopt's words, without qemu-img's "Try --help" line (as qsd).
      case ':':
        if (optopt > 0 && optopt < 256)
          serve_fail(std::string("option requires an argument -- '") + static_cast<char>(optopt) + "'");
        serve_fail(std::string("option '") + argv[optind - 1] + "' requires an argument");
      case '?':
        if (optopt > 0 && optopt < 256)
          serve_fail(std::string("invalid option -- '") + static_cast<char>(optopt) + "'");
        serve_fail(std::string("unrecognized option '") + argv[optind - 1] + "'");
      default: opts.emplace_back(c, optarg); break;
    }
  }

  // --daemonize: the parent waits until the child is serving (or failed)
  // and exits with its verdict, as qemu-storage-daemon does.
  Background bg;
  if (daemonize) {
    int status = bg.fork_and_wait([](const std::string& m) { serve_fail(m); });
    if (status >= 0) return status;
  }
  // In the process that serves (locks are not inherited over fork), before
  // any image is opened or thread started.
  if (mlock) lock_memory();
  sigset_t sigs = block_stop_signals();

  Loop loop;
  qmp::Daemon d(loop);
  qmp::register_all_commands(d);
  std::map<std::string, Chardev> chardevs;
  // As qemu-storage-daemon: the command line is processed in order before
  // any client is answered (opening a qcow2 runs the loop).
  d.hold_clients();
  for (auto& [opt, arg] : opts) {
    switch (opt) {
      case kBlockdev: do_blockdev(d, arg); break;
      case kChardev: do_chardev(chardevs, loop, arg); break;
      case kMonitor: do_monitor(d, chardevs, arg); break;
      case kNbdServer: do_nbd_server(d, arg); break;
      case kExport: do_export(d, arg); break;
      case kObject: do_object(d, arg); break;
      default: break;
    }
  }
  if (!pidfile.empty() && !write_pid_file(pidfile))
    serve_fail("Cannot open pid file: " + std::string(std::strerror(errno)));
  // A stop signal is a quit request, as QMP's quit.
  StopSignalThread stop_signal(loop, sigs, [&d] { d.quit.set(); });
  d.open_clients();
  bg.ready();

  loop.run(run_daemon(d));
  for (auto& [id, ch] : chardevs)
    if (ch.fd.valid()) ::unlink(ch.path.c_str());
  if (!pidfile.empty()) ::unlink(pidfile.c_str());
  // Joined before _exit, so that its last post to the loop is over. _exit
  // then skips tearing down the daemon's graph, done with already.
  stop_signal.join();
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(0);
}

}  // namespace vblk::cli
