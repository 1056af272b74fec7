// vblk: the command-line entry point. Subcommands follow qemu-img's words,
// options, output and exit codes (see docs/qemu-img-compat.md).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "vblk/copy_drivers.h"
#include "vblk/open.h"
#include "vblk/trace.h"

namespace {

struct Command {
  const char* name;
  int (*fn)(int, char**);
  const char* synopsis;
};

const Command kCommands[] = {
    {"bench", vblk::cli::cmd_bench,
     "bench [-c count] [-d depth] [-f fmt] [--flush-interval=flush_interval] [-i aio] [-n] [--no-drain] [-o "
     "offset] [--pattern=pattern] [-q] [-s buffer_size] [-S step_size] [-t cache] [-w] [-U] filename"},
    {"backup", vblk::cli::cmd_backup,
     "backup [-f fmt] [-O output_fmt] [--bitmap name [--incremental -B backing_file [-F backing_fmt]]] "
     "[--cow-buffer size] [-r rate_limit] [-p] [-q] source target"},
    {"bitmap", vblk::cli::cmd_bitmap,
     "bitmap (--merge SOURCE | --add | --remove | --clear | --enable | --disable)... [-b source_file [-F "
     "source_fmt]] [-g granularity] [--object objectdef] [--image-opts | -f fmt] filename bitmap"},
    {"check", vblk::cli::cmd_check,
     "check [--image-opts] [-q] [-f fmt] [--output=ofmt] [-r [leaks | all]] [-T src_cache] [-U] filename"},
    {"compare", vblk::cli::cmd_compare,
     "compare [--image-opts] [-f fmt] [-F fmt] [-T src_cache] [-p] [-q] [-s] [-U] filename1 filename2"},
    {"convert", vblk::cli::cmd_convert,
     "convert [--image-opts] [--target-is-zero] [-U] [-C] [-c] [-p] [-q] [-n] [-f fmt] [-t cache] [-T src_cache] "
     "[-O output_fmt] [-B backing_file [-F backing_fmt]] [-o options] [-S sparse_size] [-r rate_limit] "
     "[-m num_coroutines] [-W] filename output_filename"},
    {"commit", vblk::cli::cmd_commit,
     "commit [--object objectdef] [--image-opts] [-q] [-f fmt] [-t cache] [-b base] [-r rate_limit] [-d] [-p] "
     "filename"},
    {"create", vblk::cli::cmd_create, "create [-q] [-f fmt] [-o options] filename [size]"},
    {"info", vblk::cli::cmd_info, "info [--image-opts] [-f fmt] [--output=ofmt] [--backing-chain] [-U] filename"},
    {"io", vblk::cli::cmd_io,
     "io [-f fmt] [-r] [-n] [-t cache] [-i aio] [--image-opts] [-c 'command']... filename (qemu-io compatible)"},
    {"nbd", vblk::cli::cmd_nbd,
     "nbd [-f fmt] [-r] [-x name] [-D text] [-k path | -p port [-b addr]] [-t] [-e shared] [-n | --cache=mode] "
     "[--aio=mode] [--image-opts] [--fork] [--pid-file=path] filename"},
    {"rebase", vblk::cli::cmd_rebase,
     "rebase [--object objectdef] [--image-opts] [-U] [-q] [-f fmt] [-t cache] [-T src_cache] [-p] [-u] [-c] -b "
     "backing_file [-F backing_fmt] filename"},
    {"resize", vblk::cli::cmd_resize,
     "resize [--image-opts] [-f fmt] [--preallocation=prealloc] [-q] [--shrink] filename [+ | -]size"},
    {"serve", vblk::cli::cmd_serve,
     "serve [--blockdev options] [--chardev socket,path=path,server=on,wait=off,id=id] [--monitor chardev=id] "
     "[--nbd-server addr.type=unix,addr.path=path] [--export type=nbd,id=id,node-name=node] [--object type,id=id] "
     "[--pidfile path] [--daemonize]"},
    {"snapshot", vblk::cli::cmd_snapshot,
     "snapshot [--image-opts] [-U] [-q] [-l | -a snapshot | -c snapshot | -d snapshot] filename"},
    {"savevm", vblk::cli::cmd_savevm,
     "savevm [--image-opts] [-f fmt] [-t cache] [-q] [--workers n] [--buffer-size size] [--vm-clock ns] "
     "--vmstate file|- filename tag"},
    {"loadvm", vblk::cli::cmd_loadvm,
     "loadvm [--image-opts] [-f fmt] [-t cache] [-q] [-U] [--state-only] [--workers n] --vmstate-out file|- "
     "filename tag"},
    {"map", vblk::cli::cmd_map,
     "map [--image-opts] [-f fmt] [--start-offset=offset] [--max-length=len] [--output=ofmt] [-U] filename"},
};

std::string trace_category_list() {
  std::string out;
  for (const auto& c : vblk::trace::categories()) out += (out.empty() ? "" : ", ") + std::string(c.name);
  return out;
}

void help() {
  std::printf("vblk version " VBLK_VERSION
              " - a userspace block-storage engine for VM disk images\n"
              "usage: vblk [standard options] command [command options]\n"
              "\n"
              "Command syntax (qemu-img compatible):\n");
  for (const auto& c : kCommands) std::printf("  %s\n", c.synopsis);
  std::vector<std::string> names;
  for (const auto& d : vblk::registered_drivers()) names.emplace_back(d.name);
  std::sort(names.begin(), names.end());
  std::printf("\nSupported formats:");
  for (const auto& n : names) std::printf(" %s", n.c_str());
  std::printf(
      "\n\nStandard options:\n  -T, --trace [[enable=]<pattern>]  switch on the trace categories matching "
      "pattern\n                                    (%s; also VBLK_TRACE=a,b)\n",
      trace_category_list().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const char* slash = std::strrchr(argv[0], '/');
  vblk::cli::g_prog = slash ? slash + 1 : argv[0];
  vblk::register_copy_drivers();  // --blockdev / json: filenames may name them
  // A bad VBLK_TRACE is no usage error: no "Try --help" line.
  if (const char* env = std::getenv("VBLK_TRACE"); env && *env) {
    if (auto st = vblk::trace::enable_from_list(env); !st) {
      vblk::cli::error_report(st.error().what());
      return 1;
    }
  }
  // Standard options before the command (qemu-img's -T / --trace).
  int first = 1;
  while (first < argc) {
    const std::string a = argv[first];
    if (a == "-T" || a == "--trace") {
      if (first + 1 >= argc) vblk::cli::missing_argument(argv, first + 1);
      vblk::cli::enable_trace(argv[first + 1]);
      first += 2;
    } else if (a.rfind("--trace=", 0) == 0) {
      vblk::cli::enable_trace(a.substr(8));
      first += 1;
    } else {
      break;
    }
  }
  if (first >= argc) vblk::cli::error_exit("Not enough arguments");
  std::string cmd = argv[first];
  if (cmd == "-h" || cmd == "--help") {
    help();
    return 0;
  }
  if (cmd == "-V" || cmd == "--version") {
    std::printf("vblk version " VBLK_VERSION "\n");
    return 0;
  }
  if (!cmd.empty() && cmd[0] == '-') vblk::cli::error_exit("unrecognized option '" + cmd + "'");
  for (const auto& c : kCommands) {
    if (cmd == c.name) return c.fn(argc - first, argv + first);
  }
  vblk::cli::error_exit("Command not found: " + cmd);
}
