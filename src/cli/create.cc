// vblk create: make a new image (qemu-img create). raw for now; qcow2 joins
// with its driver.
#include "drivers/luks/create.h"

#include <getopt.h>

#include <cstdio>
#include <map>
#include <span>
#include <vector>

#include "common.h"
#include "drivers/drivers.h"
#include "drivers/qcow2/qcow2.h"
#include "vblk/options.h"

namespace vblk::cli {

std::string g_create_error_context;

namespace {

// The message and, on its own line, QEMU's hint ("Is another process using
// the image [x]?"), as qemu-img create prints them.
std::string with_hint(const Error& e) { return e.hint.empty() ? e.what() : e.what() + "\n" + e.hint; }

enum class OptKind { Size, Bool, String, Number };
struct OptSpec {
  const char* name;
  OptKind kind;
  const char* def;  // printed (and used) when not given; nullptr: printed only if given
};

// Creation options in qemu-img's print order: the format's, then the
// protocol's (`file`) that the format does not have.
const OptSpec kRawOptions[] = {
    {"size", OptKind::Size, nullptr},
    {"nocow", OptKind::Bool, nullptr},
    {"preallocation", OptKind::String, nullptr},
    {"extent_size_hint", OptKind::Size, nullptr},
};
// raw on an rbd: target: the rbd protocol's options (qemu_rbd_create_opts,
// in its order: the "Formatting" line lists them so).
const OptSpec kRawRbdOptions[] = {
    {"size", OptKind::Size, nullptr},
    {"cluster_size", OptKind::Size, nullptr},
    {"password-secret", OptKind::String, nullptr},
    {"encrypt.format", OptKind::String, nullptr},
    {"encrypt.cipher-alg", OptKind::String, nullptr},
    {"encrypt.key-secret", OptKind::String, nullptr},
};
const OptSpec kQcow2Options[] = {
    {"encrypt", OptKind::Bool, nullptr},
    {"encrypt.format", OptKind::String, nullptr},
    {"encrypt.key-secret", OptKind::String, nullptr},
    {"encrypt.cipher-alg", OptKind::String, nullptr},
    {"encrypt.cipher-mode", OptKind::String, nullptr},
    {"encrypt.ivgen-alg", OptKind::String, nullptr},
    {"encrypt.ivgen-hash-alg", OptKind::String, nullptr},
    {"encrypt.hash-alg", OptKind::String, nullptr},
    {"encrypt.iter-time", OptKind::Number, nullptr},
    {"cluster_size", OptKind::Size, "65536"},
    {"extended_l2", OptKind::Bool, "off"},
    {"preallocation", OptKind::String, nullptr},
    {"compression_type", OptKind::String, "zlib"},
    {"size", OptKind::Size, nullptr},
    {"compat", OptKind::String, nullptr},
    {"backing_file", OptKind::String, nullptr},
    {"backing_fmt", OptKind::String, nullptr},
    {"data_file", OptKind::String, nullptr},
    {"data_file_raw", OptKind::Bool, nullptr},
    {"lazy_refcounts", OptKind::Bool, "off"},
    {"refcount_bits", OptKind::Number, "16"},
    {"nocow", OptKind::Bool, nullptr},
    {"extent_size_hint", OptKind::Size, nullptr},
};

// luks's own options, then the file protocol's (qemu-img's print order).
const OptSpec kLuksOptions[] = {
    {"size", OptKind::Size, nullptr},
    {"key-secret", OptKind::String, nullptr},
    {"cipher-alg", OptKind::String, nullptr},
    {"cipher-mode", OptKind::String, nullptr},
    {"ivgen-alg", OptKind::String, nullptr},
    {"ivgen-hash-alg", OptKind::String, nullptr},
    {"hash-alg", OptKind::String, nullptr},
    {"iter-time", OptKind::Number, nullptr},
    {"nocow", OptKind::Bool, nullptr},
    {"preallocation", OptKind::String, nullptr},
    {"extent_size_hint", OptKind::Size, nullptr},
};

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

void print_luks_help() {
  std::printf(
      "Supported options:\n"
      "  cipher-alg=<str>       - Name of encryption cipher algorithm\n"
      "  cipher-mode=<str>      - Name of encryption cipher mode\n"
      "  extent_size_hint=<size> - Extent size hint for the image file, 0 to disable\n"
      "  hash-alg=<str>         - Name of encryption hash algorithm\n"
      "  iter-time=<num>        - Time to spend in PBKDF in milliseconds\n"
      "  ivgen-alg=<str>        - Name of IV generator algorithm\n"
      "  ivgen-hash-alg=<str>   - Name of IV generator hash algorithm\n"
      "  key-secret=<str>       - ID of the secret that provides the keyslot passphrase\n"
      "  nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on btrfs)\n"
      "  preallocation=<str>    - Preallocation mode (allowed values: off, falloc, full)\n"
      "  size=<size>            - Virtual disk size\n");
}

// Validates luks creation options (QEMU's enum checks, in its member
// order), then makes the file and formats it; a failed format removes the
// file again, as qemu-img create does.
template <class Fail>
int create_luks(const std::string& filename, uint64_t size, std::map<std::string, std::string>& opts, Fail fail) {
  luks::CreateOptions o;
  o.size = size;
  if (auto st = luks::parse_create_options(opts, "", o); !st) return fail(st.error().what());
  std::string prealloc = opts.count("preallocation") ? opts["preallocation"] : "off";
  auto pm = parse_prealloc(prealloc);
  // block/crypto.c parses it with qapi_enum_parse: its own words.
  if (!pm) return fail("invalid parameter value: " + prealloc);
  o.preallocation = *pm;
  auto st = drivers::create_file(filename, 0, "off");
  if (!st) return fail(with_hint(st.error()));
  auto remove_and_fail = [&](const std::string& msg) {
    ::unlink(filename.c_str());
    return fail(msg);
  };
  Loop loop;
  OpenContext ctx{loop};
  ctx.read_only = false;
  auto file = open_node(ctx, Json{{"driver", "file"}, {"filename", filename}});
  if (!file) return remove_and_fail(with_hint(file.error()));
  (*file)->set_claim(PermPair{kPermWrite | kPermResize, kPermAll});
  if (Status lk = (*file)->refresh_perms(); !lk) return fail(with_hint(lk.error()));
  auto cr = loop.run(luks::create(**file, o));
  if (!cr) return remove_and_fail(cr.error().what());
  return 0;
}

// Validates qcow2 creation options (QEMU's wording) and creates the image.
template <class Fail>
int create_qcow2(const std::string& filename, uint64_t size, std::map<std::string, std::string>& opts,
                 std::map<std::string, uint64_t>& sizes, Fail fail) {
  qcow2::Qcow2Node::CreateOptions o;
  o.size = align_up(size, 512);
  std::string compat = opts.count("compat") ? opts["compat"] : "1.1";
  if (compat == "0.10" || compat == "v2") {
    o.version = 2;
  } else if (compat == "1.1" || compat == "v3") {
    o.version = 3;
  } else {
    return fail("Parameter 'version' does not accept value '" + compat + "'");
  }
  // encrypt.*: QCryptoBlockCreateOptions, format first.
  std::optional<luks::CreateOptions> enc;
  bool any_encrypt = false;
  for (const auto& [k, v] : opts) any_encrypt |= k.rfind("encrypt.", 0) == 0;
  if (any_encrypt) {
    if (!opts.count("encrypt.format")) return fail("Parameter 'encrypt.format' is missing");
    const std::string& ef = opts["encrypt.format"];
    if (ef == "aes" || ef == "qcow")
      return fail("AES-encrypted qcow2 images (encrypt.format=" + ef + ") are not supported by vblk");
    if (ef != "luks") return fail("Parameter 'format' does not accept value '" + ef + "'");
    enc.emplace();
    if (auto st = luks::parse_create_options(opts, "encrypt.", *enc); !st) return fail(st.error().what());
  }
  if (opts.count("data_file")) return fail("External data files are not supported by vblk");
  // Option values are parsed first (QEMU's QAPI visitor, in the schema's
  // member order), then qcow2_co_create's checks run on the whole set.
  std::string prealloc = opts.count("preallocation") ? opts["preallocation"] : "off";
  if (prealloc != "off" && prealloc != "metadata" && prealloc != "falloc" && prealloc != "full")
    return fail("Parameter 'preallocation' does not accept value '" + prealloc + "'");
  auto bits = parse_ulong(opts.count("refcount_bits") ? opts["refcount_bits"] : "16", 64);
  if (!bits) return fail("Refcount width must be a power of two and may not exceed 64 bits");
  std::string ct = opts.count("compression_type") ? opts["compression_type"] : "zlib";
  if (ct == "zstd") {
    o.compression_type = qcow2::kCompressionZstd;
  } else if (ct != "zlib") {
    return fail("Parameter 'compression-type' does not accept value '" + ct + "'");
  }
  o.cluster_size = static_cast<uint32_t>(std::min<uint64_t>(sizes["cluster_size"], UINT32_MAX));
  if (sizes["cluster_size"] > UINT32_MAX) o.cluster_size = 1000;  // refused below as QEMU refuses it
  o.extended_l2 = opts.count("extended_l2") && opts["extended_l2"] == "on";
  o.lazy_refcounts = opts.count("lazy_refcounts") && opts["lazy_refcounts"] == "on";
  if (opts.count("backing_file")) o.backing_file = opts["backing_file"];
  if (opts.count("backing_fmt")) o.backing_format = opts["backing_fmt"];
  o.preallocation = prealloc;
  if (auto st = qcow2::Qcow2Node::check_create_options(o, static_cast<int64_t>(std::min<uint64_t>(*bits, 128))); !st)
    return fail(st.error().what());
  o.refcount_bits = static_cast<uint32_t>(*bits);
  if (auto st = qcow2::Qcow2Node::check_create_size(o.size, o.cluster_size, o.extended_l2); !st)
    return fail(st.error().what());
  if (enc) {
    // The volume (secret, algorithms, PBKDF2) before the file is touched;
    // QEMU fails after creating it, and removes the file then.
    auto f = luks::format(*enc, "encrypt.");
    if (!f) {
      ::unlink(filename.c_str());
      return fail(f.error().what());
    }
    o.encrypt = std::make_shared<const luks::Formatted>(std::move(*f));
  }
  auto st = drivers::create_file(filename, 0, "off");
  if (!st) return fail(with_hint(st.error()));
  Loop loop;
  OpenContext ctx{loop};
  ctx.read_only = false;
  auto file = open_node(ctx, Json{{"driver", "file"}, {"filename", filename}});
  if (!file) return fail(with_hint(file.error()));
  // Written while being formatted: held for writing and resizing.
  (*file)->set_claim(PermPair{kPermWrite | kPermResize, kPermAll});
  if (Status lk = (*file)->refresh_perms(); !lk) return fail(with_hint(lk.error()));
  auto cr = loop.run(qcow2::Qcow2Node::create(loop, *file, o));
  if (!cr) return fail("Could not create image: " + cr.error().what());
  return 0;
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
  bool quiet = false, unsafe = false, backing_given = false;
  int c;
  while ((c = getopt_long(argc, argv, ":F:b:f:ho:qu", longopts, nullptr)) != -1) {
    switch (c) {
      case ':': missing_argument(argv, optind);
      case '?': unrecognized_option(argv, optind);
      case 'h': std::printf("usage: %s create [-q] [-f fmt] [-o options] filename [size]\n", g_prog.c_str()); return 0;
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
    if (fmt == "luks") {
      print_luks_help();
      return 0;
    }
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
    error_report(filename + ": " + g_create_error_context + msg);
    return 1;
  };
  std::span<const OptSpec> specs;
  const bool rbd = filename.rfind("rbd:", 0) == 0;
  if (rbd && (fmt == "raw" || fmt == "rbd")) {
    specs = kRawRbdOptions;
  } else if (rbd) {
    return fail("vblk creates only raw images on rbd");
  } else if (fmt == "raw" || fmt == "file") {
    specs = kRawOptions;
  } else if (fmt == "qcow2") {
    specs = kQcow2Options;
  } else if (fmt == "luks") {
    specs = kLuksOptions;
  } else {
    return fail("Unknown file format '" + fmt + "'");
  }
  auto spec_of = [&](const std::string& k) -> const OptSpec* {
    for (const auto& o : specs)
      if (k == o.name) return &o;
    return nullptr;
  };

  // Parse -o the QemuOpts way: "key" alone means "key=on", ",," is a comma.
  std::map<std::string, std::string> opts;
  if (!options.empty()) {
    std::string item;
    auto add = [&](const std::string& it) -> bool {
      size_t eq = it.find('=');
      std::string k = eq == std::string::npos ? it : it.substr(0, eq);
      std::string v = eq == std::string::npos ? "on" : it.substr(eq + 1);
      const OptSpec* sp = spec_of(k);
      if (!sp) {
        fail("Invalid parameter '" + k + "'");
        return false;
      }
      if (sp->kind == OptKind::Bool && v != "on" && v != "off") {
        fail("Parameter '" + k + "' expects 'on' or 'off'");
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
  if (fmt == "qcow2") {
    // Refused while qemu-img parses the options, before "Formatting".
    if (opts.count("encrypt")) return fail("Invalid parameter 'encrypt'");
    if (opts.count("encrypt.iter-time")) {
      luks::CreateOptions probe;
      if (auto st = luks::parse_create_options({{"iter-time", opts["encrypt.iter-time"]}}, "", probe); !st)
        return fail("Parameter 'encrypt.iter-time' expects a number");
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
  std::map<std::string, uint64_t> sizes;
  for (const auto& sp : specs) {
    if (sp.kind != OptKind::Size || sp.name == std::string("size")) continue;
    std::string v = opts.count(sp.name) ? opts[sp.name] : (sp.def ? sp.def : "");
    if (v.empty()) continue;
    auto n = parse_size(v);
    if (!n) return fail(std::string("Parameter '") + sp.name + "' expects a non-negative number below 2^64");
    sizes[sp.name] = *n;
  }
  if (opts.count("extent_size_hint") && sizes["extent_size_hint"] > UINT32_MAX)
    return fail("Extent size hint is too large");

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
    auto b = open_image(ctx, ba.filename, io);
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

  if (!quiet) {
    std::string line = "Formatting '" + filename + "', fmt=" + fmt;
    for (const auto& sp : specs) {
      std::string v;
      if (sp.name == std::string("size")) {
        v = std::to_string(*size);
      } else if (opts.count(sp.name)) {
        v = sp.kind == OptKind::Size ? std::to_string(sizes[sp.name]) : opts[sp.name];
      } else if (sp.def) {
        v = sp.def;
      } else {
        continue;
      }
      line += std::string(" ") + sp.name + "=" + v;
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  if (rbd) {
    std::optional<std::string> password;
    if (opts.count("password-secret")) password = opts["password-secret"];
    // encrypt.* -> {format, cipher-alg, key-secret}: QEMU's encrypt.
    // sub-dictionary, absent when none is given.
    Json encrypt = Json::object();
    for (const char* k : {"format", "cipher-alg", "key-secret"})
      if (opts.count(std::string("encrypt.") + k)) encrypt[k] = opts[std::string("encrypt.") + k];
    // QEMU rounds the size up to whole sectors for rbd.
    auto st = drivers::create_rbd(filename, align_up(static_cast<uint64_t>(*size), 512), sizes["cluster_size"],
                                  password, encrypt.empty() ? nullptr : &encrypt);
    if (!st) return fail(st.error().what());
    return 0;
  }
  std::string prealloc = opts.count("preallocation") ? opts["preallocation"] : "off";
  if (fmt == "raw" || fmt == "file") {
    auto st = drivers::create_file(filename, static_cast<uint64_t>(*size), prealloc);
    if (!st) return fail(with_hint(st.error()));
    return 0;
  }
  if (fmt == "luks") return create_luks(filename, static_cast<uint64_t>(*size), opts, fail);
  return create_qcow2(filename, static_cast<uint64_t>(*size), opts, sizes, fail);
}

}  // namespace vblk::cli
