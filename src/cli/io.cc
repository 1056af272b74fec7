// vblk io: a qemu-io compatible subset, so tests and operators can drive
// workloads through vblk exactly as through qemu-io. Options, command words,
// output lines, message texts (and whether they go to stdout or stderr) and
// the exit code follow qemu-io 7.2; only the timing line differs in value.
//
//   vblk io [-f fmt] [-r] [-n] [-t cache] [-i aio] [--image-opts] [-c cmd]... file
//
// Commands: read [-Cqv] [-P pat [-s off] [-l len]] off len,
//           write [-cCfnquz] [-P pat] off len (-c: compressed, -z: zeroes,
//           -u: may unmap, -n: no slow fallback, -f: FUA),
//           discard [-Cq] off len, flush, map.
// Without -c, commands are read from standard input, one per line.
#include <getopt.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <string>
#include <vector>

#include "common.h"
#include "vblk/buffer.h"
#include "vblk/image_format.h"
#include "vblk/options.h"

namespace vblk::cli {

namespace {

// QEMU's BDRV_REQUEST_MAX_BYTES.
constexpr int64_t kRequestMax = 0x7ffffe00;

void usage(const char* prog) {
  std::printf(
      "Usage: %s io [OPTIONS]... [-c STRING]... [file]\n"
      "vblk disk exerciser (qemu-io compatible)\n"
      "\n"
      "  --image-opts         treat file as option string\n"
      "  -c, --cmd STRING     execute command with its arguments\n"
      "                       from the given string\n"
      "  -f, --format FMT     specifies the block driver to use\n"
      "  -r, --read-only      export read-only\n"
      "  -n, --nocache        disable host cache, short for -t none\n"
      "  -i, --aio=MODE       use AIO mode (threads, native or io_uring)\n"
      "  -t, --cache=MODE     use the given cache mode for the image\n"
      "  -U, --force-share    force shared permissions\n"
      "  -h, --help           display this help and exit\n"
      "\n"
      "Commands: read, write, discard, flush, map (qemu-io's words and options).\n",
      prog);
}

// qemu-io's cvtstr: "64 KiB", "1.500 KiB", "32 bytes".
std::string cvtstr(double value) {
  static const struct {
    double scale;
    const char* suffix;
  } units[] = {{1152921504606846976.0, " EiB"}, {1125899906842624.0, " PiB"}, {1099511627776.0, " TiB"},
               {1073741824.0, " GiB"},          {1048576.0, " MiB"},          {1024.0, " KiB"}};
  char buf[64];
  const char* suffix = " bytes";
  bool scaled = false;
  for (const auto& u : units) {
    if (value >= u.scale) {
      std::snprintf(buf, sizeof buf, "%.3f", value / u.scale);
      suffix = u.suffix;
      scaled = true;
      break;
    }
  }
  if (!scaled) std::snprintf(buf, sizeof buf, "%f", value);
  std::string s = buf;
  auto pos = s.find(".000");
  if (pos != std::string::npos) s.erase(pos);
  return s + suffix;
}

std::string timestr(const timespec& t, bool verbose) {
  char buf[64];
  double frac = static_cast<double>(t.tv_nsec) / 1e9;
  auto sec = static_cast<unsigned>(t.tv_sec);
  if (verbose || t.tv_sec) {
    std::snprintf(buf, sizeof buf, "%u:%02u:%05.2f", sec / 3600, sec % 3600 / 60, (sec % 60) + frac);
  } else {
    std::snprintf(buf, sizeof buf, "%05.2f sec", frac);
  }
  return buf;
}

timespec now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t;
}

timespec tsub(timespec a, const timespec& b) {
  a.tv_nsec -= b.tv_nsec;
  if (a.tv_nsec < 0) {
    a.tv_nsec += 1000000000;
    a.tv_sec--;
  }
  a.tv_sec -= b.tv_sec;
  return a;
}

double tdiv(double v, const timespec& t) { return v / (static_cast<double>(t.tv_sec) + t.tv_nsec / 1e9); }

void print_report(const char* op, const timespec& t, int64_t offset, int64_t count, int64_t total, int cnt,
                  bool machine) {
  std::string ts = timestr(t, machine);
  if (!machine) {
    std::printf("%s %" PRId64 "/%" PRId64 " bytes at offset %" PRId64 "\n", op, total, count, offset);
    std::printf("%s, %d ops; %s (%s/sec and %.4f ops/sec)\n", cvtstr(static_cast<double>(total)).c_str(), cnt,
                ts.c_str(), cvtstr(tdiv(static_cast<double>(total), t)).c_str(), tdiv(cnt, t));
  } else {
    std::printf("%" PRId64 ",%d,%s,%.3f,%.3f\n", total, cnt, ts.c_str(), tdiv(static_cast<double>(total), t),
                tdiv(cnt, t));
  }
}

// qemu-io's cvtnum (qemu_strtosz, default unit bytes) with its messages.
bool cvtnum(const char* s, int64_t& out) {
  auto r = parse_size(s);
  if (!r || *r > static_cast<uint64_t>(INT64_MAX)) {
    if (!r && r.error().code != ERANGE)
      std::printf("Parsing error: non-numeric argument, or extraneous/unrecognized suffix -- %s\n", s);
    else
      std::printf("Parsing error: argument too large -- %s\n", s);
    return false;
  }
  out = static_cast<int64_t>(*r);
  return true;
}

int parse_pattern(const char* arg) {
  char* end = nullptr;
  long p = std::strtol(arg, &end, 0);
  if (p < 0 || p > 255 || *end != '\0') {
    std::printf("%s is not a valid pattern byte\n", arg);
    return -1;
  }
  return static_cast<int>(p);
}

void dump_buffer(const uint8_t* p, int64_t offset, int64_t len) {
  for (int64_t i = 0; i < len; i += 16) {
    std::printf("%08" PRIx64 ":  ", static_cast<uint64_t>(offset + i));
    for (int64_t j = 0; j < 16 && i + j < len; ++j) std::printf("%02x ", p[i + j]);
    std::printf(" ");
    for (int64_t j = 0; j < 16 && i + j < len; ++j) std::putchar(std::isalnum(p[i + j]) ? p[i + j] : '.');
    std::printf("\n");
  }
}

struct Cmd {
  const char* name;
  const char* alt;
  int argmin, argmax;  // -1: unlimited
  bool needs_write;
  const char* args;
  const char* oneline;
};

const Cmd kCmds[] = {
    {"discard", "d", 2, -1, true, "[-Cq] off len", "discards a number of bytes at a specified offset"},
    {"flush", "f", 0, 0, false, "", "flush all in-core file state to disk"},
    {"map", nullptr, 0, 0, false, "", "prints the allocated areas of a file"},
    {"read", "r", 2, -1, false, "[-abCqv] [-P pattern [-s off] [-l len]] off len",
     "reads a number of bytes at a specified offset"},
    {"write", "w", 2, -1, true, "[-bcCfnquz] [-P pattern | -s source_file] off len",
     "writes a number of bytes at a specified offset"},
};

int command_usage(const Cmd& c) {
  std::printf("%s %s -- %s\n", c.name, c.args, c.oneline);
  return -EINVAL;
}

// Command-level getopt: errors worded as glibc words them for argv[0] = the
// command name (qemu-io passes its split command line to getopt).
struct CmdOpts {
  int argc;
  char** argv;
  int next(const char* spec) {
    int c = getopt(argc, argv, spec);
    if (c == '?') {
      if (std::strchr(spec, optopt) && optopt)
        std::fprintf(stderr, "%s: option requires an argument -- '%c'\n", argv[0], optopt);
      else
        std::fprintf(stderr, "%s: invalid option -- '%c'\n", argv[0], optopt);
    }
    return c;
  }
};

class Io {
 public:
  Io(Loop& loop, Node* node) : loop_(loop), node_(node) {}

  // One command line; < 0 means it failed (the exit code becomes 1).
  int command(const std::string& line) {
    std::vector<std::string> words;
    size_t pos = 0;
    while (pos <= line.size()) {
      size_t sp = line.find(' ', pos);
      if (sp == std::string::npos) sp = line.size();
      if (sp > pos) words.push_back(line.substr(pos, sp - pos));
      pos = sp + 1;
    }
    if (words.empty()) return 0;
    const Cmd* ct = nullptr;
    for (const auto& c : kCmds)
      if (words[0] == c.name || (c.alt && words[0] == c.alt)) ct = &c;
    if (!ct) {
      std::fprintf(stderr, "command \"%s\" not found\n", words[0].c_str());
      return -EINVAL;
    }
    if (!node_) {
      std::fprintf(stderr, "no file open, try 'help open'\n");
      return -EINVAL;
    }
    if (ct->needs_write && node_->read_only()) {
      std::fflush(stdout);
      error_report("Block node is read-only");
      return -EPERM;
    }
    int argc = static_cast<int>(words.size()) - 1;
    if (argc < ct->argmin || (ct->argmax != -1 && argc > ct->argmax)) {
      if (ct->argmax == -1)
        std::fprintf(stderr, "bad argument count %d to %s, expected at least %d arguments\n", argc, words[0].c_str(),
                     ct->argmin);
      else if (ct->argmin == ct->argmax)
        std::fprintf(stderr, "bad argument count %d to %s, expected %d arguments\n", argc, words[0].c_str(),
                     ct->argmin);
      else
        std::fprintf(stderr, "bad argument count %d to %s, expected between %d and %d arguments\n", argc,
                     words[0].c_str(), ct->argmin, ct->argmax);
      return -EINVAL;
    }
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    optind = 0;
    opterr = 0;
    std::fflush(stdout);
    int ret;
    std::string name = ct->name;
    if (name == "read")
      ret = read_f(*ct, static_cast<int>(words.size()), argv.data());
    else if (name == "write")
      ret = write_f(*ct, static_cast<int>(words.size()), argv.data());
    else if (name == "discard")
      ret = discard_f(*ct, static_cast<int>(words.size()), argv.data());
    else if (name == "map")
      ret = map_f();
    else
      ret = flush_f();
    std::fflush(stdout);
    return ret;
  }

 private:
  // qemu-io's check for -b and -c: whole sectors, or a message and EINVAL.
  static bool sector_aligned(int64_t offset, int64_t count) {
    if (offset % 512) {
      std::printf("%" PRId64 " is not a sector-aligned value for 'offset'\n", offset);
      return false;
    }
    if (count % 512) {
      std::printf("%" PRId64 " is not a sector-aligned value for 'count'\n", count);
      return false;
    }
    return true;
  }

  int read_f(const Cmd& ct, int argc, char** argv) {
    bool machine = false, pflag = false, qflag = false, vflag = false, lflag = false, sflag = false, bflag = false;
    int64_t pattern_offset = 0, pattern_count = 0;
    int pattern = 0;
    CmdOpts o{argc, argv};
    int c;
    while ((c = o.next("bCl:pP:qs:v")) != -1) {
      switch (c) {
        case 'C': machine = true; break;
        case 'l':
          lflag = true;
          if (!cvtnum(optarg, pattern_count)) return -EINVAL;
          break;
        case 'p': break;  // ignored, as in qemu-io
        case 'P':
          pflag = true;
          pattern = parse_pattern(optarg);
          if (pattern < 0) return -EINVAL;
          break;
        case 'q': qflag = true; break;
        case 's':
          sflag = true;
          if (!cvtnum(optarg, pattern_offset)) return -EINVAL;
          break;
        case 'v': vflag = true; break;
        case 'b': bflag = true; break;
        default: return command_usage(ct);
      }
    }
    if (optind != argc - 2) return command_usage(ct);
    int64_t offset, count;
    if (!cvtnum(argv[optind], offset)) return -EINVAL;
    if (!cvtnum(argv[optind + 1], count)) return -EINVAL;
    if (count > kRequestMax) {
      std::printf("length cannot exceed %" PRId64 ", given %s\n", kRequestMax, argv[optind + 1]);
      return -EINVAL;
    }
    // -b: the VM state area (qemu-io's do_load_vmstate), whole sectors only.
    if (bflag && !sector_aligned(offset, count)) return -EINVAL;
    if (!pflag && (lflag || sflag)) return command_usage(ct);
    if (!lflag) pattern_count = count - pattern_offset;
    if (pattern_count < 0 || pattern_count + pattern_offset > count) {
      std::printf("pattern verification range exceeds end of read data\n");
      return -EINVAL;
    }
    AlignedBuffer buf(static_cast<size_t>(count), 4096);
    if (count) std::memset(buf.data(), 0xab, static_cast<size_t>(count));  // (no memory when empty)
    timespec t1 = now();
    Status st = bflag ? loop_.run(image::read_vmstate(*node_, static_cast<uint64_t>(offset), buf.span()))
                      : loop_.run(node_->read(static_cast<uint64_t>(offset), buf.span()));
    timespec t2 = now();
    if (!st) {
      std::printf("read failed: %s\n", std::strerror(st.error().code));
      return -st.error().code;
    }
    int ret = 0;
    if (pflag) {
      const uint8_t* p = buf.data() + pattern_offset;
      for (int64_t i = 0; i < pattern_count; ++i) {
        if (p[i] != pattern) {
          std::printf("Pattern verification failed at offset %" PRId64 ", %" PRId64 " bytes\n", offset + pattern_offset,
                      pattern_count);
          ret = -EINVAL;
          break;
        }
      }
    }
    if (qflag) return ret;
    if (vflag) dump_buffer(buf.data(), offset, count);
    print_report("read", tsub(t2, t1), offset, count, count, 1, machine);
    return ret;
  }

  int write_f(const Cmd& ct, int argc, char** argv) {
    bool machine = false, pflag = false, qflag = false, zflag = false, compressed = false, fua = false,
         no_fallback = false, unmap = false, bflag = false;
    int pattern = 0xcd;
    CmdOpts o{argc, argv};
    int c;
    while ((c = o.next("bcCfnpP:qs:uz")) != -1) {
      switch (c) {
        case 'c': compressed = true; break;
        case 'C': machine = true; break;
        case 'f': fua = true; break;
        case 'n': no_fallback = true; break;
        case 'p': break;  // ignored, as in qemu-io
        case 'P':
          pflag = true;
          pattern = parse_pattern(optarg);
          if (pattern < 0) return -EINVAL;
          break;
        case 'q': qflag = true; break;
        case 'u': unmap = true; break;
        case 'z': zflag = true; break;
        case 'b': bflag = true; break;
        default: return command_usage(ct);  // includes -s (source file): not supported
      }
    }
    if (optind != argc - 2) return command_usage(ct);
    if (bflag && zflag) {
      std::printf("-b and -z cannot be specified at the same time\n");
      return -EINVAL;
    }
    if (fua && (compressed || bflag)) {
      std::printf("-f and -b or -c cannot be specified at the same time\n");
      return -EINVAL;
    }
    if (no_fallback && !zflag) {
      std::printf("-n requires -z to be specified\n");
      return -EINVAL;
    }
    if (unmap && !zflag) {
      std::printf("-u requires -z to be specified\n");
      return -EINVAL;
    }
    if (zflag && pflag) {
      std::printf("Only one of -z, -P, and -s can be specified at the same time\n");
      return -EINVAL;
    }
    int64_t offset, count;
    if (!cvtnum(argv[optind], offset)) return -EINVAL;
    if (!cvtnum(argv[optind + 1], count)) return -EINVAL;
    if (count > kRequestMax && !no_fallback) {
      std::printf("length cannot exceed %" PRId64 " without -n, given %s\n", kRequestMax, argv[optind + 1]);
      return -EINVAL;
    }
    if ((compressed || bflag) && !sector_aligned(offset, count)) return -EINVAL;
    uint32_t flags = (fua ? kReqFua : 0u) | (compressed ? kReqCompressed : 0u);
    timespec t1 = now();
    Status st;
    if (zflag) {
      flags |= (unmap ? kReqMayUnmap : 0u) | (no_fallback ? kReqNoFallback : 0u);
      st = loop_.run(node_->write_zeroes(static_cast<uint64_t>(offset), static_cast<uint64_t>(count), flags));
    } else {
      AlignedBuffer buf(static_cast<size_t>(count), 4096);
      if (count) std::memset(buf.data(), pattern, static_cast<size_t>(count));
      // -b: the VM state area (qemu-io's do_save_vmstate; -c does not apply).
      if (bflag)
        st = loop_.run(image::write_vmstate(*node_, static_cast<uint64_t>(offset), buf.span()));
      else
        st = loop_.run(node_->write(static_cast<uint64_t>(offset), buf.span(), flags));
    }
    if (st && fua && zflag) st = loop_.run(node_->flush());
    timespec t2 = now();
    if (!st) {
      std::printf("write failed: %s\n", std::strerror(st.error().code));
      return -st.error().code;
    }
    if (!qflag) print_report("wrote", tsub(t2, t1), offset, count, count, 1, machine);
    return 0;
  }

  int discard_f(const Cmd& ct, int argc, char** argv) {
    bool machine = false, qflag = false;
    CmdOpts o{argc, argv};
    int c;
    while ((c = o.next("Cq")) != -1) {
      switch (c) {
        case 'C': machine = true; break;
        case 'q': qflag = true; break;
        default: return command_usage(ct);
      }
    }
    if (optind != argc - 2) return command_usage(ct);
    int64_t offset, bytes;
    if (!cvtnum(argv[optind], offset)) return -EINVAL;
    if (!cvtnum(argv[optind + 1], bytes)) return -EINVAL;
    if (bytes > kRequestMax) {
      std::printf("length cannot exceed %" PRId64 ", given %s\n", kRequestMax, argv[optind + 1]);
      return -EINVAL;
    }
    timespec t1 = now();
    Status st = loop_.run(node_->discard(static_cast<uint64_t>(offset), static_cast<uint64_t>(bytes)));
    timespec t2 = now();
    if (!st) {
      std::printf("discard failed: %s\n", std::strerror(st.error().code));
      return -st.error().code;
    }
    if (!qflag) print_report("discard", tsub(t2, t1), offset, bytes, bytes, 1, machine);
    return 0;
  }

  int flush_f() {
    Status st = loop_.run(node_->flush());
    return st ? 0 : -st.error().code;
  }

  // qemu-io's map: runs of allocated / not allocated at the top layer.
  int map_f() {
    uint64_t offset = 0, bytes = node_->length();
    while (bytes) {
      uint64_t num = 0;
      bool allocated = false;
      for (bool first = true; num < bytes; first = false) {
        auto r = loop_.run(node_->block_status(offset + num, bytes - num));
        if (!r) {
          error_report(std::string("Failed to get allocation status: ") + std::strerror(r.error().code));
          return -r.error().code;
        }
        if (!r->bytes) break;
        bool a = r->flags & kStatusAllocated;
        if (first)
          allocated = a;
        else if (a != allocated)
          break;
        num += r->bytes;
      }
      if (!num) {
        error_report("Unexpected end of image");
        return -EIO;
      }
      std::printf("%s (0x%" PRIx64 ") bytes %s at offset %s (0x%" PRIx64 ")\n",
                  cvtstr(static_cast<double>(num)).c_str(), num, allocated ? "    allocated" : "not allocated",
                  cvtstr(static_cast<double>(offset)).c_str(), offset);
      offset += num;
      bytes -= num;
    }
    return 0;
  }

  Loop& loop_;
  Node* node_;
};

}  // namespace

int cmd_io(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"version", no_argument, nullptr, 'V'},
      {"cmd", required_argument, nullptr, 'c'},
      {"format", required_argument, nullptr, 'f'},
      {"read-only", no_argument, nullptr, 'r'},
      {"snapshot", no_argument, nullptr, 's'},
      {"nocache", no_argument, nullptr, 'n'},
      {"copy-on-read", no_argument, nullptr, 'C'},
      {"misalign", no_argument, nullptr, 'm'},
      {"native-aio", no_argument, nullptr, 'k'},
      {"aio", required_argument, nullptr, 'i'},
      {"discard", required_argument, nullptr, 'd'},
      {"cache", required_argument, nullptr, 't'},
      {"trace", required_argument, nullptr, 'T'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  optind = 0;
  opterr = 0;
  ImageArgs a;
  a.read_only = false;
  a.cache.writethrough = true;  // qemu-io's default
  a.open_error_prefix = "can't open device ";
  std::vector<std::string> cmds;
  const std::string prog = g_prog + " io";
  bool force_share = false;
  int c;
  while ((c = getopt_long(argc, argv, ":hVc:d:f:rsnCmkt:T:Ui:", longopts, nullptr)) != -1) {
    switch (c) {
      case ':':
        error_report(std::string("option requires an argument -- '") + static_cast<char>(optopt) + "'");
        usage(g_prog.c_str());
        return 1;
      case '?':
        if (optopt)
          error_report(std::string("invalid option -- '") + static_cast<char>(optopt) + "'");
        else
          error_report(std::string("unrecognized option '") + argv[optind - 1] + "'");
        usage(g_prog.c_str());
        return 1;
      case 'h': usage(g_prog.c_str()); return 0;
      case 'V': std::printf("vblk io version " VBLK_VERSION "\n"); return 0;
      case 'c': cmds.emplace_back(optarg); break;
      case 'f': a.format = optarg; break;
      case 'r': a.read_only = true; break;
      case 'n':
        a.cache.direct = true;
        a.cache.writethrough = false;
        break;
      case 't':
        if (!parse_cache_mode(optarg, a.cache)) {
          error_report(std::string("Invalid cache option: ") + optarg);
          return 1;
        }
        break;
      case 'i':
        if (std::strcmp(optarg, "threads") && std::strcmp(optarg, "native") && std::strcmp(optarg, "io_uring")) {
          error_report(std::string("Invalid aio option: ") + optarg);
          return 1;
        }
        a.aio = optarg;
        break;
      case 'd':
        if (std::strcmp(optarg, "ignore") && std::strcmp(optarg, "off") && std::strcmp(optarg, "unmap") &&
            std::strcmp(optarg, "on")) {
          error_report(std::string("Invalid discard option: ") + optarg);
          return 1;
        }
        break;
      case 's': error_report("-s (snapshot) is not supported by vblk io"); return 1;
      case 'U': force_share = true; break;
      case 'C':
      case 'm':
      case 'k':
      case 'T': break;
      case OPT_OBJECT: cli_object(optarg); break;
      case OPT_IMAGE_OPTS: a.image_opts = true; break;
    }
  }
  if (argc - optind > 1) {
    usage(g_prog.c_str());
    return 1;
  }
  Loop loop;
  std::shared_ptr<Node> node;
  if (optind < argc) {
    a.filename = argv[optind];
    if (force_share && !a.read_only) {
      error_report(a.open_error_prefix + a.filename + ": force-share=on can only be used with read-only images");
      return 1;
    }
    a.force_share = force_share;
    node = open_cli_image(loop, a);
    if (!node) return 1;
  }
  Io io(loop, node.get());
  int last_error = 0;
  if (!cmds.empty()) {
    for (const auto& cmd : cmds) {
      int r = io.command(cmd);
      if (r < 0) last_error = r;
    }
  } else {
    const bool tty = isatty(0);
    std::string line;
    for (;;) {
      if (tty) {
        std::printf("%s> ", prog.c_str());
        std::fflush(stdout);
      }
      if (!std::getline(std::cin, line)) break;
      if (line == "quit" || line == "q") break;
      int r = io.command(line);
      if (r < 0) last_error = r;
    }
  }
  if (node) {
    // qemu-io closes the image at exit, which flushes it.
    Status st = loop.run(node->flush());
    if (!st && !last_error) last_error = -st.error().code;
    node.reset();
  }
  std::fflush(stdout);
  return last_error < 0 ? 1 : 0;
}

}  // namespace vblk::cli
