// vblk info: what an image is (qemu-img info).
#include <getopt.h>

#include <cstdio>

#include "cli/common.h"

namespace vblk::cli {

namespace {
nlohmann::ordered_json info_json(Node& top) {
  nlohmann::ordered_json j;
  // qemu-img prints its QDict in hash order; for these keys that order is:
  j["virtual-size"] = top.length();
  j["filename"] = top.filename();
  j["format"] = top.driver();
  if (auto sz = top.allocated_size()) j["actual-size"] = *sz;
  j["dirty-flag"] = false;
  return j;
}

void info_human(Node& top) {
  std::printf("image: %s\n", top.filename().c_str());
  std::printf("file format: %s\n", top.driver().c_str());
  std::printf("virtual size: %s (%llu bytes)\n", size_to_str(top.length()).c_str(),
              static_cast<unsigned long long>(top.length()));
  auto sz = top.allocated_size();
  std::printf("disk size: %s\n", sz ? size_to_str(*sz).c_str() : "unavailable");
}
}  // namespace

int cmd_info(int argc, char** argv) {
  ImageArgs a;
  bool json = false, chain = false;
  enum { OPT_OUTPUT = 256, OPT_BACKING_CHAIN, OPT_IMAGE_OPTS, OPT_OBJECT };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"format", required_argument, nullptr, 'f'},
      {"output", required_argument, nullptr, OPT_OUTPUT},
      {"backing-chain", no_argument, nullptr, OPT_BACKING_CHAIN},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  optind = 0;
  std::string output = "human";
  int c;
  while ((c = getopt_long(argc, argv, ":f:hU", longopts, nullptr)) != -1) {
    switch (c) {
      case ':': missing_argument(argv, optind);
      case '?': unrecognized_option(argv, optind);
      case 'h': std::printf("usage: %s info [--image-opts] [-f fmt] [--output=ofmt] [--backing-chain] [-U] filename\n", g_prog.c_str()); return 0;
      case 'f': a.format = optarg; break;
      case 'U': break;
      case OPT_OUTPUT: output = optarg; break;
      case OPT_BACKING_CHAIN: chain = true; break;
      case OPT_IMAGE_OPTS: a.image_opts = true; break;
      case OPT_OBJECT: break;
    }
  }
  if (optind != argc - 1) error_exit("Expecting one image file name");
  a.filename = argv[optind];
  if (output == "json") {
    json = true;
  } else if (output != "human") {
    error_report("--output must be used with human or json as argument.");
    return 1;
  }
  if (a.image_opts && !a.format.empty()) {
    error_report("--image-opts and --format are mutually exclusive");
    return 1;
  }
  Loop loop;
  auto top = open_cli_image(loop, a);
  if (!top) return 1;
  if (json) {
    auto j = info_json(*top);
    if (chain) {
      nlohmann::ordered_json arr = nlohmann::ordered_json::array();
      arr.push_back(j);
      j = arr;
    }
    std::printf("%s\n", qemu_json_pretty(j).c_str());
  } else {
    info_human(*top);
  }
  return 0;
}

}  // namespace vblk::cli
