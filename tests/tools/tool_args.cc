#include "tool_args.h"

#include <getopt.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

namespace vblk::power {

bool parse_tool_args(int argc, char** argv, ToolArgs& a, const char* prefix) {
  static const option longopts[] = {{"points", required_argument, nullptr, 'n'},
                                    {"seed", required_argument, nullptr, 's'},
                                    {"scenario", required_argument, nullptr, 'c'},
                                    {"qemu-img", required_argument, nullptr, 'q'},
                                    {"keep", required_argument, nullptr, 'k'},
                                    {"list", no_argument, nullptr, 'l'},
                                    {nullptr, 0, nullptr, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, nullptr)) != -1) {
    switch (c) {
      case 'n': a.points = std::strtoull(optarg, nullptr, 10); break;
      case 's': a.seed = std::strtoull(optarg, nullptr, 10); break;
      case 'c': a.only = optarg; break;
      case 'q': a.qemu_img = optarg; break;
      case 'k': a.keep_dir = optarg; break;
      case 'l': a.list = true; break;
      default: return false;
    }
  }
  if (a.list) return true;
  a.dir = a.keep_dir;
  if (a.dir.empty()) {
    std::string t = std::string("/tmp/") + prefix + "-XXXXXX";
    std::vector<char> tmpl(t.begin(), t.end());
    tmpl.push_back('\0');
    if (!::mkdtemp(tmpl.data())) return false;
    a.dir = tmpl.data();
  } else {
    ::mkdir(a.dir.c_str(), 0755);
  }
  return true;
}

}  // namespace vblk::power
