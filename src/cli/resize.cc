// vblk resize: change an image's virtual size (qemu-img resize).
#include <getopt.h>

#include <cstdio>
#include <cstring>

#include "common.h"
#include "vblk/options.h"

namespace vblk::cli {

int cmd_resize(int argc, char** argv) {
  // The size is taken off the end first so that "-1G" is not an option.
  if (argc < 3) error_exit("Not enough arguments");
  std::string size = argv[--argc];
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS, OPT_PREALLOCATION, OPT_SHRINK };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"preallocation", required_argument, nullptr, OPT_PREALLOCATION},
      {"shrink", no_argument, nullptr, OPT_SHRINK},
      {nullptr, 0, nullptr, 0},
  };
  ImageArgs a;
  a.read_only = false;
  bool quiet = false, shrink = false;
  std::string prealloc = "off";
  if (int rc = for_each_option(
          argc, argv, ":f:hq", longopts,
          [&] {
            std::printf(
                "usage: %s resize [--image-opts] [-f fmt] [--preallocation=prealloc] [-q] [--shrink] filename [+ | "
                "-]size\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': a.format = optarg; break;
              case 'q': quiet = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
              case OPT_PREALLOCATION:
                if (std::strcmp(optarg, "off") && std::strcmp(optarg, "metadata") && std::strcmp(optarg, "falloc") &&
                    std::strcmp(optarg, "full")) {
                  error_report(std::string("Invalid preallocation mode '") + optarg + "'");
                  return 1;
                }
                prealloc = optarg;
                break;
              case OPT_SHRINK: shrink = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (optind != argc - 1) error_exit("Expecting image file name and size");
  a.filename = argv[optind];
  int relative = 0;
  if (!size.empty() && size[0] == '+') {
    relative = 1;
    size.erase(0, 1);
  } else if (!size.empty() && size[0] == '-') {
    relative = -1;
    size.erase(0, 1);
  }
  auto n = parse_size(size);
  if (!n) {
    if (n.error().code == ERANGE) {
      error_report("Value '" + size + "' is out of range for parameter 'size'");
    } else {
      error_report("Parameter 'size' expects a non-negative number below 2^64");
      std::fprintf(stderr, "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n");
      std::fprintf(stderr, "and exabytes, respectively.\n");
    }
    return 1;
  }
  Loop loop;
  a.resize = true;
  auto node = open_cli_image(loop, a);
  if (!node) return 1;
  int64_t current = static_cast<int64_t>(node->length());
  int64_t total = relative ? current + static_cast<int64_t>(*n) * relative : static_cast<int64_t>(*n);
  if (total <= 0) {
    error_report("New image size must be positive");
    return 1;
  }
  if (total <= current && prealloc != "off") {
    error_report("Preallocation can only be used for growing images");
    return 1;
  }
  if (total < current && !shrink) {
    error_report("Use the --shrink option to perform a shrink operation.");
    std::fprintf(stderr,
                 "%s: warning: Shrinking an image will delete all data beyond the shrunken image's end. "
                 "Before performing such an operation, make sure there is no important data there.\n",
                 g_prog.c_str());
    return 1;
  }
  auto st = loop.run(node->truncate(static_cast<uint64_t>(total), true, *parse_prealloc(prealloc)));
  if (st) st = loop.run(node->close());
  if (!st) {
    error_report(st.error().what());
    return 1;
  }
  if (!quiet) std::printf("Image resized.\n");
  return 0;
}

}  // namespace vblk::cli
