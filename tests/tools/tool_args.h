// The power-loss tools' command line:
//   [--points N] [--seed S] [--scenario NAME] [--qemu-img PATH] [--keep DIR] [--list]
#pragma once

#include <cstdint>
#include <string>

namespace vblk::power {

struct ToolArgs {
  uint64_t points;
  uint64_t seed = 1;
  std::string only;  // --scenario
  std::string qemu_img = "qemu-img";
  std::string keep_dir;  // --keep: cut images kept here (and failures left)
  bool list = false;
  std::string dir;  // where images go: keep_dir, or a new temporary one
};

// Parses argv into `a` (points preset to the tool's default) and makes the
// work directory (`prefix`: its name in /tmp). False: exit with status 2.
bool parse_tool_args(int argc, char** argv, ToolArgs& a, const char* prefix);

}  // namespace vblk::power
