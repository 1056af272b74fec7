// vblk nbd: serve one image over NBD, a qemu-nbd compatible subset
// (-f -r -x -k -p -b -t -e -D -B -n --cache --aio --image-opts --fork
// --pid-file). Unlike qemu-nbd, TCP binds loopback unless -b names another
// address. Without -t the server exits once its last client has gone.
#include <getopt.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "server_process.h"
#include "vblk/nbd_server.h"

namespace vblk::cli {

namespace {

[[noreturn]] void nbd_usage_error(const std::string& msg) {
  std::fprintf(stderr, "%s: %s\n", g_prog.c_str(), msg.c_str());
  std::fprintf(stderr, "Try `%s --help' for more information.\n", g_prog.c_str());
  std::exit(EXIT_FAILURE);
}

[[noreturn]] void nbd_fail(const std::string& msg) {
  std::fprintf(stderr, "%s: %s\n", g_prog.c_str(), msg.c_str());
  std::exit(EXIT_FAILURE);
}

void nbd_help() {
  std::printf(
      "Usage: vblk nbd [OPTIONS] FILE\n"
      "Serve FILE over the Network Block Device protocol (qemu-nbd compatible)\n"
      "\n"
      "  -h, --help                display this help and exit\n"
      "  -V, --version             output version information and exit\n"
      "  -v, --verbose             accepted for qemu-nbd scripts (vblk nbd serves no\n"
      "                            kernel device, the only thing -v changes there)\n"
      "  -T, --trace [[enable=]<pattern>]\n"
      "                            switch on the trace categories matching pattern\n"
      "\n"
      "Connection properties:\n"
      "  -p, --port=PORT           port to listen on (default `10809')\n"
      "  -b, --bind=IFACE          interface to bind to (default `127.0.0.1')\n"
      "  -k, --socket=PATH         path to the unix socket\n"
      "  -e, --shared=NUM          device can be shared by NUM clients (default '1', 0: no limit)\n"
      "  -t, --persistent          don't exit on the last connection\n"
      "  -x, --export-name=NAME    expose export by name (default is empty string)\n"
      "  -D, --description=TEXT    export a human-readable description\n"
      "\n"
      "Block device options:\n"
      "  -f, --format=FORMAT       set image format (raw, qcow2, ...)\n"
      "  -r, --read-only           export read-only\n"
      "  -n, --nocache             disable host cache\n"
      "      --cache=MODE          set cache mode used to access the disk image, the\n"
      "                            valid options are: 'none', 'writeback' (default),\n"
      "                            'writethrough', 'directsync' and 'unsafe'\n"
      "      --aio=MODE            set AIO mode (native, io_uring or threads)\n"
      "      --image-opts          treat FILE as a full set of image options\n"
      "  -B, --bitmap=NAME         expose a persistent dirty bitmap\n"
      "\n"
      "General purpose options:\n"
      "  --object type,id=ID,...   define an object such as 'secret' for providing\n"
      "                            passwords and/or encryption keys\n"
      "      --fork                fork off the server process and exit the parent\n"
      "                            once the server is running\n"
      "      --pid-file=PATH       store the server's process ID in the given file\n");
}

enum { kOptCache = 256, kOptAio, kOptImageOpts, kOptFork, kOptPidFile, kOptObject };

struct NbdArgs {
  ImageArgs image;
  std::string port, bind = "127.0.0.1", socket, name, description, pid_file;
  std::vector<std::string> bitmaps;  // -B, last given first
  unsigned shared = 1;
  bool persistent = false, fork = false;
};

NbdArgs parse(int argc, char** argv) {
  static const option longopts[] = {{"help", no_argument, nullptr, 'h'},
                                    {"version", no_argument, nullptr, 'V'},
                                    {"verbose", no_argument, nullptr, 'v'},
                                    {"trace", required_argument, nullptr, 'T'},
                                    {"port", required_argument, nullptr, 'p'},
                                    {"bind", required_argument, nullptr, 'b'},
                                    {"socket", required_argument, nullptr, 'k'},
                                    {"shared", required_argument, nullptr, 'e'},
                                    {"persistent", no_argument, nullptr, 't'},
                                    {"export-name", required_argument, nullptr, 'x'},
                                    {"description", required_argument, nullptr, 'D'},
                                    {"format", required_argument, nullptr, 'f'},
                                    {"read-only", no_argument, nullptr, 'r'},
                                    {"nocache", no_argument, nullptr, 'n'},
                                    {"cache", required_argument, nullptr, kOptCache},
                                    {"aio", required_argument, nullptr, kOptAio},
                                    {"image-opts", no_argument, nullptr, kOptImageOpts},
                                    {"bitmap", required_argument, nullptr, 'B'},
                                    {"fork", no_argument, nullptr, kOptFork},
                                    {"pid-file", required_argument, nullptr, kOptPidFile},
                                    {"object", required_argument, nullptr, kOptObject},
                                    {nullptr, 0, nullptr, 0}};
  NbdArgs a;
  a.image.read_only = false;
  bool cache_set = false;
  opterr = 0;
  optind = 1;
  int c;
  while ((c = getopt_long(argc, argv, ":hVvp:b:k:e:tx:D:f:rnB:T:", longopts, nullptr)) != -1) {
    switch (c) {
      case 'h': nbd_help(); std::exit(0);
      case 'V': std::printf("vblk nbd version " VBLK_VERSION "\n"); std::exit(0);
      // qemu-nbd's -v keeps a kernel device's client in the foreground and
      // its stderr open; vblk nbd has no device mode and never closes stderr.
      case 'v': break;
      case 'T': enable_trace(optarg); break;
      case 'p': {
        auto v = parse_ulong(optarg, 65535);
        if (!v) nbd_usage_error(std::string("Invalid port '") + optarg + "'");
        a.port = optarg;
        break;
      }
      case 'b': a.bind = optarg; break;
      case 'k': a.socket = optarg; break;
      case 'e': {
        auto v = parse_ulong(optarg, 0x7fffffff);
        if (!v) nbd_usage_error(std::string("Invalid shared device number '") + optarg + "'");
        a.shared = static_cast<unsigned>(*v);
        break;
      }
      case 't': a.persistent = true; break;
      case 'x':
        if (std::strlen(optarg) > 4096) nbd_usage_error(std::string("export name '") + optarg + "' too long");
        a.name = optarg;
        break;
      case 'D':
        if (std::strlen(optarg) > 4096) nbd_usage_error(std::string("export description '") + optarg + "' too long");
        a.description = optarg;
        break;
      case 'f': a.image.format = optarg; break;
      case 'r': a.image.read_only = true; break;
      case 'n':
        if (cache_set) nbd_usage_error("-n and --cache can only be specified once");
        cache_set = true;
        a.image.cache = CacheMode{.direct = true};
        break;
      case kOptCache:
        if (cache_set) nbd_usage_error("-n and --cache can only be specified once");
        cache_set = true;
        if (!parse_cache_mode(optarg, a.image.cache))
          nbd_usage_error(std::string("Invalid cache mode '") + optarg + "'");
        break;
      case kOptAio:
        if (std::strcmp(optarg, "threads") && std::strcmp(optarg, "native") && std::strcmp(optarg, "io_uring"))
          nbd_usage_error(std::string("invalid aio mode '") + optarg + "'");
        a.image.aio = optarg;
        break;
      case kOptImageOpts: a.image.image_opts = true; break;
      // qemu-nbd prepends each -B: the last one given is the first context.
      case 'B': a.bitmaps.insert(a.bitmaps.begin(), optarg); break;
      case kOptFork: a.fork = true; break;
      case kOptPidFile: a.pid_file = optarg; break;
      case kOptObject: cli_object(optarg); break;
      case ':': nbd_usage_error(std::string("option requires an argument -- '") + static_cast<char>(optopt) + "'");
      default:
        if (optopt) nbd_usage_error(std::string("invalid option -- '") + static_cast<char>(optopt) + "'");
        nbd_usage_error(std::string("unrecognized option '") + argv[optind - 1] + "'");
    }
  }
  if (argc - optind != 1) nbd_usage_error("Invalid number of arguments");
  if (!a.socket.empty() && !a.port.empty()) nbd_usage_error("-p and -k are mutually exclusive");
  if (a.image.image_opts && !a.image.format.empty()) nbd_fail("--image-opts and --format are mutually exclusive");
  a.image.filename = argv[optind];
  return a;
}

}  // namespace

int cmd_nbd(int argc, char** argv) {
  NbdArgs a = parse(argc, argv);

  // --fork: the parent waits until the child listens (or fails) and exits
  // with its verdict, as qemu-nbd does; the loop is made after the fork.
  Background bg;
  if (a.fork) {
    int status = bg.fork_and_wait([](const std::string& m) { nbd_fail(m); });
    if (status >= 0) return status;
  }
  // SIGTERM, SIGINT and SIGHUP end the server cleanly (in-flight requests
  // finish, the image is flushed and closed).
  sigset_t sigs = block_stop_signals();

  Loop loop;
  // qemu-nbd's export: the size it announced must not change under it.
  a.image.unshare = kPermResize;
  auto node = open_cli_image(loop, a.image);
  if (!node) return 1;
  // -B: a bitmap of the image or of a backing file (QEMU's nbd_export_create).
  std::vector<std::pair<std::shared_ptr<Node>, std::string>> bitmaps;
  for (const auto& name : a.bitmaps) {
    std::shared_ptr<Node> owner = node;
    NamedBitmap* bm = nbd::find_bitmap_in_chain(owner, name);
    if (!bm) nbd_fail("Bitmap '" + name + "' is not found");
    if (auto st = check_bitmap(*bm, kBitmapAllowRo); !st) nbd_fail(st.error().what());
    bitmaps.push_back({owner, name});
  }

  Result<Fd> listener = Error(EINVAL);
  if (!a.socket.empty()) {
    listener = listen_unix(loop, a.socket);
  } else {
    auto port = parse_ulong(a.port.empty() ? "10809" : a.port, 65535);
    listener = listen_tcp(loop, a.bind, static_cast<uint16_t>(*port));
  }
  if (!listener) nbd_fail(listener.error().what());

  nbd::Server server(loop, nbd::Server::Options{.max_connections = a.shared});
  nbd::Export e{a.name, a.description, node, !a.image.read_only, std::move(bitmaps)};
  if (auto st = server.add_export(std::move(e)); !st) nbd_fail(st.error().what());
  bool had_client = false;
  server.on_connect = [&] { had_client = true; };
  server.on_disconnect = [&](size_t open) {
    if (!a.persistent && had_client && open == 0) server.stop();
  };

  if (!a.pid_file.empty() && !write_pid_file(a.pid_file))
    nbd_fail("Failed to write pid file '" + a.pid_file + "': " + std::strerror(errno));
  StopSignalThread stop_signal(loop, sigs, [&server] { server.stop(); });
  bg.ready();

  loop.run(server.serve(std::move(*listener)));
  stop_signal.join();
  Status st = loop.run(node->flush());
  if (!a.socket.empty()) ::unlink(a.socket.c_str());
  if (!a.pid_file.empty()) ::unlink(a.pid_file.c_str());
  if (!st) nbd_fail("Failed to flush the image: " + st.error().what());
  return 0;
}

}  // namespace vblk::cli
