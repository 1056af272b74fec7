// vblk create: make a new image (qemu-img create). raw for now; qcow2 joins
// with its driver.
#include <getopt.h>

#include <cstdio>
#include <map>
#include <vector>

#include "block/drivers/drivers.h"
#include "block/options.h"
#include "cli/common.h"

namespace vblk::cli {

namespace {

// The creation options of raw on `file`, in qemu-img's print order.
const char* const kRawOptions[] = {"size", "nocow", "preallocation", "extent_size_hint"};

bool valid_option_list(const std::string& s) {
  if (s.empty() || s[0] == ',') return false;
  size_t n = 0;
  for (size_t i = s.size(); i > 0 && s[i - 1] == ','; --i) ++n;
  return n % 2 == 0;
}

void print_raw_help(bool with_file) {
  if (with_file) {
    std::printf(
        "Supported options:\n"
        "  extent_size_hint=<size> - Extent size hint for the image file, 0 to disable\n"
        "  nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on btrfs)\n"
        "  preallocation=<str>    - Preallocation mode (allowed values: off, falloc, full)\n"
        "  size=<size>            - Virtual disk size\n");
  } else {
    std::printf(
        "Supported raw options:\n"
        "  size=<size>            - Virtual disk size\n"
        "\n"
        "The protocol level may support further options.\n"
        "Specify the target filename to include those options.\n");
  }
}

}  // namespace

int cmd_create(int argc, char** argv) {
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, 256},
      {nullptr, 0, nullptr, 0},
  };
  optind = 0;
  std::string fmt = "raw", backing, backing_fmt, options;
  bool quiet = false;
  int c;
  while ((c = getopt_long(argc, argv, ":F:b:f:ho:qu", longopts, nullptr)) != -1) {
    switch (c) {
      case ':': missing_argument(argv, optind);
      case '?': unrecognized_option(argv, optind);
      case 'h': std::printf("usage: %s create [-q] [-f fmt] [-o options] filename [size]\n", g_prog.c_str()); return 0;
      case 'F': backing_fmt = optarg; break;
      case 'b': backing = optarg; break;
      case 'f': fmt = optarg; break;
      case 'o':
        if (!valid_option_list(optarg)) {
          error_report(std::string("Invalid option list: ") + optarg);
          return 1;
        }
        options = options.empty() ? std::string(optarg) : options + "," + optarg;
        break;
      case 'q': quiet = true; break;
      case 'u': break;
      case 256: break;
    }
  }
  if (optind >= argc) {
    if (options.find("help") != std::string::npos || options.find('?') != std::string::npos) {
      print_raw_help(false);
      return 0;
    }
    error_exit("Expecting image file name");
  }
  std::string filename = argv[optind++];
  if (options.find("help") != std::string::npos || options.find('?') != std::string::npos) {
    print_raw_help(true);
    return 0;
  }
  std::optional<int64_t> size;
  if (optind < argc) {
    size = cvtnum("image size", argv[optind++]);
    if (!size) return 1;
  }
  if (optind != argc) error_exit("Unexpected argument: " + std::string(argv[optind]));

  auto fail = [&](const std::string& msg) {
    error_report(filename + ": " + msg);
    return 1;
  };
  if (fmt != "raw" && fmt != "file") return fail("Unknown file format '" + fmt + "'");
  if (!backing.empty()) return fail("Backing file not supported for file format '" + fmt + "'");
  if (!backing_fmt.empty()) return fail("Backing file format not supported for file format '" + fmt + "'");

  // Parse -o the QemuOpts way: "key" alone means "key=on", ",," is a comma.
  std::map<std::string, std::string> opts;
  if (!options.empty()) {
    std::string item;
    auto add = [&](const std::string& it) -> bool {
      size_t eq = it.find('=');
      std::string k = eq == std::string::npos ? it : it.substr(0, eq);
      std::string v = eq == std::string::npos ? "on" : it.substr(eq + 1);
      bool known = false;
      for (const char* name : kRawOptions) known |= k == name;
      if (!known) {
        fail("Invalid parameter '" + k + "'");
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
  if (opts.count("nocow") && opts["nocow"] != "on" && opts["nocow"] != "off")
    return fail("Parameter 'nocow' expects 'on' or 'off'");
  if (opts.count("size")) {
    if (size) return fail("The image size must be specified only once");
    auto s = parse_size(opts["size"]);
    if (!s) {
      if (s.error().code == ERANGE)
        return fail("Value '" + opts["size"] + "' is out of range for parameter 'size'");
      error_report(filename + ": Parameter 'size' expects a non-negative number below 2^64");
      std::fprintf(stderr, "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n");
      std::fprintf(stderr, "and exabytes, respectively.\n");
      return 1;
    }
    size = static_cast<int64_t>(*s);
  }
  if (!size) return fail("Image creation needs a size parameter");
  std::string prealloc = opts.count("preallocation") ? opts["preallocation"] : "off";
  uint64_t hint = 0;
  if (opts.count("extent_size_hint")) {
    auto h = parse_size(opts["extent_size_hint"]);
    if (!h) return fail("Parameter 'extent_size_hint' expects a non-negative number below 2^64");
    hint = *h;
    if (hint > UINT32_MAX) return fail("Extent size hint is too large");
  }

  if (!quiet) {
    std::string line = "Formatting '" + filename + "', fmt=" + fmt + " size=" + std::to_string(*size);
    if (opts.count("nocow")) line += " nocow=" + opts["nocow"];
    if (opts.count("preallocation")) line += " preallocation=" + prealloc;
    if (opts.count("extent_size_hint")) line += " extent_size_hint=" + std::to_string(hint);
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  auto st = drivers::create_file(filename, static_cast<uint64_t>(*size), prealloc);
  if (!st) return fail(st.error().what());
  return 0;
}

}  // namespace vblk::cli
