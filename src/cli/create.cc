// vblk create: make a new image (qemu-img create). The options each
// format and protocol take, and the creating itself, come from the driver
// registry (vblk/create.h); this file is QemuOpts parsing and qemu-img's
// order of checks and messages.
#include "vblk/create.h"

#include <getopt.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

#include "common.h"
#include "vblk/open.h"
#include "vblk/options.h"

namespace vblk::cli {

std::string g_create_error_context;

namespace {

// The message and, on its own line, QEMU's hint ("Is another process using
// the image [x]?"), as qemu-img create prints them.
std::string with_hint(const Error& e) { return e.hint.empty() ? e.what() : e.what() + "\n" + e.hint; }

bool valid_option_list(const std::string& s) {
  if (s.empty() || s[0] == ',') return false;
  size_t n = 0;
  for (size_t i = s.size(); i > 0 && s[i - 1] == ','; --i) ++n;
  return n % 2 == 0;
}

// `-o help` (QEMU's qemu_opts_print_help): sorted by name, the help column
// at 24 characters.
void print_create_help(std::vector<CreateOpt> opts, const std::string& caption) {
  std::sort(opts.begin(), opts.end(),
            [](const CreateOpt& a, const CreateOpt& b) { return std::string(a.name) < b.name; });
  std::printf("%s\n", caption.c_str());
  for (const CreateOpt& o : opts) {
    const char* type = o.kind == CreateOptKind::Size     ? "size"
                       : o.kind == CreateOptKind::Bool   ? "bool (on/off)"
                       : o.kind == CreateOptKind::Number ? "num"
                                                         : "str";
    std::string item = std::string("  ") + o.name + "=<" + type + ">";
    if (item.size() < 24) item.resize(24, ' ');
    std::printf("%s - %s\n", item.c_str(), o.help);
  }
}

}  // namespace

int cmd_create(int argc, char** argv) {
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, 256},
      {nullptr, 0, nullptr, 0},
  };
  std::string fmt = "raw", backing, backing_fmt, options;
  bool quiet = false, unsafe = false, backing_given = false;
  if (int rc = for_each_option(
          argc, argv, ":F:b:f:ho:qu", longopts,
          [&] { std::printf("usage: %s create [-q] [-f fmt] [-o options] filename [size]\n", g_prog.c_str()); },
          [&](int c) {
            switch (c) {
              case 'F': backing_fmt = optarg; break;
              case 'b':
                backing = optarg;
                backing_given = true;
                break;
              case 'f': fmt = optarg; break;
              case 'o':
                if (!valid_option_list(optarg)) {
                  error_report(std::string("Invalid option list: ") + optarg);
                  return 1;
                }
                options = options.empty() ? std::string(optarg) : options + "," + optarg;
                break;
              case 'q': quiet = true; break;
              case 'u': unsafe = true; break;
              case 256: cli_object(optarg); break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  const bool want_help = options.find("help") != std::string::npos || options.find('?') != std::string::npos;
  auto print_help = [&](const std::string& filename) {
    auto specs = create_options(fmt, filename);
    if (!specs) {
      error_report(specs.error().what());
      return 1;
    }
    if (filename.empty()) {
      print_create_help(*specs, "Supported " + fmt + " options:");
      std::printf(
          "\nThe protocol level may support further options.\n"
          "Specify the target filename to include those options.\n");
    } else {
      print_create_help(*specs, "Supported options:");
    }
    return 0;
  };
  if (optind >= argc) {
    if (want_help) return print_help("");
    error_exit("Expecting image file name");
  }
  std::string filename = argv[optind++];
  if (want_help) return print_help(filename);
  std::optional<int64_t> size;
  if (optind < argc) {
    size = cvtnum("image size", argv[optind++]);
    if (!size) return 1;
  }
  if (optind != argc) error_exit("Unexpected argument: " + std::string(argv[optind]));

  auto fail = [&](const std::string& msg) {
    error_report(filename + ": " + g_create_error_context + msg);
    return 1;
  };
  auto specs = create_options(fmt, filename);
  if (!specs) return fail(specs.error().what());
  auto spec_of = [&](const std::string& k) -> const CreateOpt* {
    for (const auto& o : *specs)
      if (k == o.name) return &o;
    return nullptr;
  };

  // Parse -o the QemuOpts way: "key" alone means "key=on", ",," is a comma.
  CreateRequest req;
  req.filename = filename;
  std::map<std::string, std::string>& opts = req.opts;
  if (!options.empty()) {
    std::string item;
    auto add = [&](const std::string& it) -> bool {
      size_t eq = it.find('=');
      std::string k = eq == std::string::npos ? it : it.substr(0, eq);
      std::string v = eq == std::string::npos ? "on" : it.substr(eq + 1);
      const CreateOpt* sp = spec_of(k);
      if (!sp) {
        fail("Invalid parameter '" + k + "'");
        return false;
      }
      if (auto st = check_create_value(*sp, v); !st) {
        fail(st.error().what());
        return false;
      }
      opts[k] = v;
      return true;
    };
    for (size_t i = 0; i <= options.size(); ++i) {
      if (i == options.size() || options[i] == ',') {
        if (i + 1 < options.size() && options[i + 1] == ',') {
          item += ',';
          ++i;
          continue;
        }
        if (!add(item)) return 1;
        item.clear();
        continue;
      }
      item += options[i];
    }
  }
  if (backing_given) {
    if (!spec_of("backing_file")) return fail("Backing file not supported for file format '" + fmt + "'");
    opts["backing_file"] = backing;
  }
  if (!backing_fmt.empty()) {
    if (!spec_of("backing_fmt")) return fail("Backing file format not supported for file format '" + fmt + "'");
    opts["backing_fmt"] = backing_fmt;
  }
  if (opts.count("size")) {
    if (size) return fail("The image size must be specified only once");
    auto s = parse_size(opts["size"]);
    if (!s) {
      if (s.error().code == ERANGE) return fail("Value '" + opts["size"] + "' is out of range for parameter 'size'");
      error_report(filename + ": Parameter 'size' expects a non-negative number below 2^64");
      std::fprintf(stderr, "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n");
      std::fprintf(stderr, "and exabytes, respectively.\n");
      return 1;
    }
    size = static_cast<int64_t>(*s);
  }
  // Size-typed options are printed (and used) as numbers.
  if (auto st = fill_create_sizes(*specs, req); !st) return fail(st.error().what());

  // QEMU's bdrv_img_create: the backing file is opened (unless -u) whether
  // or not a size was given, before anything is created: a create over an
  // existing image whose backing file is missing or unnamed in format
  // leaves that image as it was.
  if (opts.count("backing_file")) {
    if (opts["backing_file"] == filename)
      return fail("Error: Trying to create an image with the same filename as the backing file");
    if (opts["backing_file"].empty()) return fail("Expected backing file name, got empty string");
  }
  if (opts.count("backing_file") && !unsafe) {
    Loop probe_loop;
    ImageArgs ba;
    ba.filename = path_combine(filename, opts["backing_file"]);
    if (opts.count("backing_fmt")) ba.format = opts["backing_fmt"];
    OpenContext ctx{probe_loop};
    ctx.force_share = true;  // QEMU opens it with force-share=on
    ImageOpenOptions io;
    io.format = ba.format;
    Result<std::shared_ptr<Node>> b = Error(EINVAL);
    if (ba.filename.rfind("json:", 0) == 0) {
      // QEMU's json: pseudo-protocol (the object names the driver and its
      // children: iotest 020 makes a blkdebug chain so), opened as the
      // commands open one.
      Error err;
      ba.force_share = true;
      ba.open_error = &err;
      std::shared_ptr<Node> n = open_cli_image(probe_loop, ba);
      b = n ? Result<std::shared_ptr<Node>>(n) : Result<std::shared_ptr<Node>>(err);
    } else {
      b = open_image(ctx, ba.filename, io);
    }
    if (!b) {
      error_report(filename + ": " + b.error().what());
      std::fprintf(stderr, "Could not open backing image.\n");
      return 1;
    }
    if (!opts.count("backing_fmt")) {
      error_report(filename + ": Backing file specified without backing format");
      std::fprintf(stderr, "Detected format of %s.", (*b)->driver().c_str());
      return 1;
    }
    if (!size) size = static_cast<int64_t>((*b)->length());
  }
  if (!size) return fail("Image creation needs a size parameter");
  req.size = static_cast<uint64_t>(*size);

  if (!quiet) {
    std::string line = "Formatting '" + filename + "', fmt=" + fmt;
    for (const auto& sp : *specs) {
      std::string v;
      if (sp.name == std::string("size")) {
        v = std::to_string(*size);
      } else if (opts.count(sp.name)) {
        v = sp.kind == CreateOptKind::Size ? std::to_string(req.sizes[sp.name]) : opts[sp.name];
      } else if (sp.def) {
        v = sp.def;
      } else {
        continue;
      }
      // qemu_opts_print's escaped_print: a string's commas doubled.
      if (sp.kind == CreateOptKind::String) {
        std::string esc;
        for (char ch : v) esc += ch == ',' ? std::string(",,") : std::string(1, ch);
        v = std::move(esc);
      }
      line += std::string(" ") + sp.name + "=" + v;
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  Loop loop;
  auto st = loop.run(create_image(loop, fmt, req));
  if (!st) return fail(with_hint(st.error()));
  return 0;
}

}  // namespace vblk::cli
