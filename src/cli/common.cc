#include "common.h"

#include <fmt/format.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "vblk/options.h"
#include "vblk/qmp_daemon.h"
#include "vblk/secret_store.h"
#include "vblk/trace.h"

namespace vblk::cli {

std::string g_prog = "vblk";

void enable_trace(const std::string& spec) {
  std::string warning;
  // As qemu-img: the error alone (no "Try --help" line), exit status 1.
  if (auto st = trace::enable_from_option(spec, &warning); !st) {
    error_report(st.error().what());
    std::exit(1);
  }
  if (!warning.empty()) error_report("warning: " + warning);
}

void error_report(const std::string& msg) { std::fprintf(stderr, "%s: %s\n", g_prog.c_str(), msg.c_str()); }

void error_exit(const std::string& msg) {
  error_report(msg);
  std::fprintf(stderr, "Try '%s --help' for more information\n", g_prog.c_str());
  std::exit(1);
}

std::optional<std::string> keyval_object_bools(nlohmann::ordered_json& o) {
  if (!o.contains("loaded") || !o["loaded"].is_string()) return std::nullopt;
  const std::string v = o["loaded"];
  if (v == "on" || v == "yes" || v == "true" || v == "y") {
    o["loaded"] = true;
  } else if (v == "off" || v == "no" || v == "false" || v == "n") {
    o["loaded"] = false;
  } else {
    return std::string("Parameter 'loaded' expects 'on' or 'off'");
  }
  return std::nullopt;
}

void cli_object(const std::string& arg, int exit_code) {
  auto kv = parse_keyval(arg, "qom-type");
  if (!kv) {
    error_report(kv.error().what());
    std::exit(exit_code);
  }
  if (!kv->contains("qom-type") || (*kv)["qom-type"] != "secret") {
    // Not used by any tool, but its id is taken: a key-secret naming it
    // hears "is not a secret", a second object with it is a duplicate.
    if (kv->contains("id") && (*kv)["id"].is_string()) {
      auto st = SecretStore::process().add_other((*kv)["id"].get<std::string>());
      if (!st) {
        error_report(st.error().what());
        std::exit(exit_code);
      }
    }
    return;
  }
  auto o = nlohmann::ordered_json::parse(kv->dump());
  auto bad = keyval_object_bools(o);
  auto st = bad ? Status(Error(EINVAL, *bad)) : qmp::add_secret_object(o);
  if (!st) {
    std::string msg = st.error().what();
    if (msg == "Parameter 'id' expects an identifier")
      msg += "\nIdentifiers consist of letters, digits, '-', '.', '_', starting with a letter.";
    error_report(msg);
    std::exit(exit_code);
  }
}

void unrecognized_option(char** argv, int optind) {
  error_exit("unrecognized option '" + std::string(argv[optind - 1]) + "'");
}

void missing_argument(char** argv, int optind) {
  error_exit("missing argument for option '" + std::string(argv[optind - 1]) + "'");
}

int for_each_option(int argc, char** argv, const char* shortopts, const struct option* longopts,
                    const std::function<void()>& usage, const std::function<int(int c)>& on_option) {
  optind = 0;
  int c;
  while ((c = getopt_long(argc, argv, shortopts, longopts, nullptr)) != -1) {
    switch (c) {
      case ':': missing_argument(argv, optind);
      case '?': unrecognized_option(argv, optind);
      case 'h': usage(); return 0;
      default:
        if (int rc = on_option(c); rc != kNextOption) return rc;
    }
  }
  return kNextOption;
}

std::string size_to_str(uint64_t val) {
  static const char* suffixes[] = {"", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"};
  int e = 0;
  std::frexp(static_cast<double>(val) / (1000.0 / 1024.0), &e);
  int i = (e - 1) / 10 * 10;
  if (i < 0) i = 0;
  double div = static_cast<double>(1ull << i);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%0.3g %sB", static_cast<double>(val) / div, suffixes[i / 10]);
  return buf;
}

std::optional<int64_t> cvtnum(const std::string& name, const std::string& value, int64_t max) {
  auto r = parse_size(value);
  if (!r) {
    if (r.error().code == ERANGE) {
      error_report("Invalid " + name + " specified. Must be between 0 and " + std::to_string(max) + ".");
    } else {
      error_report("Invalid " + name + " specified. You may use k, M, G, T, P or E suffixes for");
      error_report("kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.");
    }
    return std::nullopt;
  }
  if (*r > static_cast<uint64_t>(max)) {
    error_report("Invalid " + name + " specified. Must be between 0 and " + std::to_string(max) + ".");
    return std::nullopt;
  }
  return static_cast<int64_t>(*r);
}

std::optional<unsigned long> parse_ulong(const std::string& value, unsigned long max) {
  if (value.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  unsigned long v = std::strtoul(value.c_str(), &end, 0);
  if (errno || *end || end == value.c_str() || v > max) return std::nullopt;
  return v;
}

bool parse_cache_mode(const std::string& mode, CacheMode& out) {
  out = CacheMode{};
  if (mode == "none" || mode == "off") {
    out.direct = true;
  } else if (mode == "directsync") {
    out.direct = true;
    out.writethrough = true;
  } else if (mode == "writeback") {
  } else if (mode == "unsafe") {
    out.no_flush = true;
  } else if (mode == "writethrough") {
    out.writethrough = true;
  } else {
    return false;
  }
  return true;
}

namespace {
void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"':
        out += "\\\"";
        ++i;
        continue;
      case '\\':
        out += "\\\\";
        ++i;
        continue;
      case '\b':
        out += "\\b";
        ++i;
        continue;
      case '\f':
        out += "\\f";
        ++i;
        continue;
      case '\n':
        out += "\\n";
        ++i;
        continue;
      case '\r':
        out += "\\r";
        ++i;
        continue;
      case '\t':
        out += "\\t";
        ++i;
        continue;
      default: break;
    }
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // Decode UTF-8; invalid sequences become U+FFFD, like QEMU.
    uint32_t cp = 0xFFFD;
    size_t len = 1;
    if (c >= 0xC2 && c <= 0xDF && i + 1 < s.size()) {
      cp = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F);
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF && i + 2 < s.size()) {
      cp = ((c & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
      len = 3;
    } else if (c >= 0xF0 && c <= 0xF4 && i + 3 < s.size()) {
      cp = ((c & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
      len = 4;
    } else if (c < 0x80) {
      cp = c;
    }
    char buf[16];
    if (cp >= 0x10000) {
      cp -= 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04X\\u%04X", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
    } else {
      std::snprintf(buf, sizeof buf, "\\u%04X", cp);
    }
    out += buf;
    i += len;
  }
  out += '"';
}

void json_pretty(std::string& out, const nlohmann::ordered_json& j, int indent) {
  std::string pad(static_cast<size_t>(indent) * 4, ' ');
  if (j.is_object()) {
    out += "{\n";
    size_t n = 0;
    for (auto it = j.begin(); it != j.end(); ++it) {
      out += pad + "    ";
      json_string(out, it.key());
      out += ": ";
      json_pretty(out, it.value(), indent + 1);
      out += ++n < j.size() ? ",\n" : "\n";
    }
    out += pad + "}";
  } else if (j.is_array()) {
    out += "[\n";
    size_t n = 0;
    for (const auto& v : j) {
      out += pad + "    ";
      json_pretty(out, v, indent + 1);
      out += ++n < j.size() ? ",\n" : "\n";
    }
    out += pad + "]";
  } else if (j.is_string()) {
    json_string(out, j.get<std::string>());
  } else {
    out += j.dump();
  }
}
}  // namespace

std::string qemu_json_pretty(const nlohmann::ordered_json& j) {
  std::string out;
  json_pretty(out, j, 0);
  return out;
}

void warn_probed_raw(const std::string& filename) {
  std::fprintf(stderr,
               "WARNING: Image format was not specified for '%s' and probing guessed raw.\n"
               "         Automatically detecting the format is dangerous for raw images, write operations on "
               "block 0 will be restricted.\n"
               "         Specify the 'raw' format explicitly to remove the restrictions.\n",
               filename.c_str());
}

void error_report_hint(const std::string& msg, const Error& e) {
  error_report(msg);
  if (!e.hint.empty()) std::fprintf(stderr, "%s\n", e.hint.c_str());
}

std::shared_ptr<Node> open_cli_image(Loop& loop, const ImageArgs& a) {
  OpenContext ctx{loop};
  ctx.read_only = a.read_only;
  ctx.check = a.check;
  ctx.force_share = a.force_share;
  Result<std::shared_ptr<Node>> node = Error(EINVAL);
  bool probed_raw = false;
  // QEMU's json: pseudo-protocol, where the object names its driver (say
  // json:{"driver": "rbd", ...}, the names `info` prints): opened as
  // --image-opts would be, with QEMU's parse errors; -f names the driver
  // over the object's, as in QEMU. Without either it stays a file name
  // (vblk does not probe json: objects).
  bool json_opened = false;
  if (!a.image_opts && a.filename.rfind("json:", 0) == 0) {
    auto m = qmp::parse_json_value(std::string_view(a.filename).substr(5));
    std::string err;
    if (!m.ok) {
      err = "Could not parse the JSON options: " + m.error;
    } else if (!m.value.is_object()) {
      err = "Invalid JSON object given";
    } else if (m.value.contains("driver") || !a.format.empty()) {
      Json o = Json::parse(m.value.dump());
      if (!a.format.empty()) o["driver"] = a.format;
      if (a.cache.direct) o["cache"]["direct"] = "on";
      node = open_node(ctx, o);
      json_opened = true;
    }
    if (!err.empty()) {
      error_report("Could not open '" + a.filename + "': " + err);
      return nullptr;
    }
  }
  if (json_opened) {
  } else if (a.image_opts) {
    auto opts = parse_keyval(a.filename, "file");
    if (!opts) {
      error_report("Could not open '" + a.filename + "': " + opts.error().what());
      return nullptr;
    }
    Json o = *opts;
    if (!o.contains("driver")) {
      error_report("Could not open '" + a.filename + "': Parameter 'driver' is missing");
      return nullptr;
    }
    if (a.cache.direct) o["cache"]["direct"] = "on";
    // QEMU's BDRV_O_NO_BACKING reaches --image-opts too (rebase -u).
    if (a.no_backing && o["driver"] == "qcow2" && !o.contains("backing")) o["backing"] = nullptr;
    node = open_node(ctx, o);
  } else {
    ImageOpenOptions io;
    io.format = a.format;
    io.read_only = a.read_only;
    io.direct = a.cache.direct;
    io.no_flush = a.cache.no_flush;
    io.writethrough = a.cache.writethrough;
    io.aio = a.aio;
    io.no_backing = a.no_backing;
    io.no_io = a.no_io;
    node = open_image(ctx, a.filename, io, &probed_raw);
  }
  // What the command itself needs (qemu-img's BlockBackend): reads that
  // stay consistent unless it only describes the image, writes unless
  // read-only; others may do anything meanwhile unless told otherwise.
  if (node) {
    PermPair claim;
    claim.perm = (a.no_io ? 0u : uint32_t{kPermConsistentRead}) | (a.read_only ? 0u : uint32_t{kPermWrite}) |
                 (a.resize ? uint32_t{kPermResize} : 0u);
    claim.shared = kPermAll & ~a.unshare;
    (*node)->set_claim(claim);
    if (Status st = (*node)->refresh_perms(); !st) node = st.take_error();
  }
  if (!node && a.open_error) {
    *a.open_error = node.take_error();
    return nullptr;
  }
  if (!node) {
    std::string prefix =
        a.open_error_prefix.empty() ? "Could not open '" + a.filename + "': " : a.open_error_prefix + a.filename + ": ";
    error_report_hint(prefix + node.error().what(), node.error());
    return nullptr;
  }
  // QEMU names the probed file (for rbd its json: name, not raw's).
  if (probed_raw && !a.read_only) {
    Node* f = (*node)->file_child();
    warn_probed_raw(f ? f->filename() : (*node)->filename());
  }
  // QEMU names the nodes a tool opens itself "#blockNNN", and its errors
  // quote them ("Can't store persistent bitmaps to #block173: ...").
  if ((*node)->node_name().empty()) {
    static unsigned next_id = 0;
    (*node)->set_node_name(fmt::format("#block{:03d}", next_id++));
  }
  (*node)->set_writethrough(a.cache.writethrough);
  // The image is closed cleanly (Node::close: caches written, qcow2's dirty
  // bit cleared, NBD connections ended) when the command lets go of it. The
  // loop outlives the node in every command (declared first).
  std::shared_ptr<Node> inner = *node;
  Node* raw = inner.get();
  return std::shared_ptr<Node>(raw, [inner, &loop](Node*) mutable {
    Status st = loop.run(inner->close());
    if (!st) error_report("Failed to close '" + inner->filename() + "': " + st.error().what());
    inner.reset();
  });
}

int create_target(const std::string& filename, const std::string& fmt, const std::string& options,
                  const std::string& backing, const std::string& backing_fmt, uint64_t size,
                  const std::string& error_context) {
  // -u: the caller opens the backing chain itself (convert -B and backup
  // -B, as QEMU's convert, create without opening it).
  std::vector<std::string> args = {"create", "-q", "-u", "-f", fmt};
  if (!options.empty()) args.insert(args.end(), {"-o", options});
  if (!backing.empty()) {
    args.insert(args.end(), {"-b", backing});
    if (!backing_fmt.empty()) args.insert(args.end(), {"-F", backing_fmt});
  }
  args.push_back(filename);
  args.push_back(std::to_string(size));
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  g_create_error_context = error_context;
  int rc = cmd_create(static_cast<int>(args.size()), argv.data());
  g_create_error_context.clear();
  return rc;
}

namespace {

std::string canonical(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : std::string();
}

bool path_has_protocol(const std::string& p) {
  size_t colon = p.find(':');
  return colon != std::string::npos && p.find('/') > colon;
}

}  // namespace

bool names_backing(const std::string& overlay_file, const std::string& recorded, const std::string& name) {
  if (path_has_protocol(name) || path_has_protocol(recorded)) return name == recorded;
  std::string want = canonical(path_combine(overlay_file, recorded));
  return !want.empty() && want == canonical(path_combine(overlay_file, name));
}

}  // namespace vblk::cli
