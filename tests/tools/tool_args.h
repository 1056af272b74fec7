// The power-loss tools' command line:
//   [--points N] [--seed S] [--scenario NAME] [--qemu-img PATH] [--keep DIR] [--list]
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

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

// The scenarios to run (each S has a `name`): with --list, prints their
// names and returns 0; an unknown --scenario is an error (2); else -1.
template <class S>
int choose_scenarios(const std::vector<S>& all, const ToolArgs& a, const char* tool, std::vector<const S*>& out) {
  if (a.list) {
    for (const auto& s : all) std::printf("%s\n", s.name.c_str());
    return 0;
  }
  for (const auto& s : all)
    if (a.only.empty() || s.name == a.only) out.push_back(&s);
  if (out.empty()) {
    std::fprintf(stderr, "%s: no scenario '%s' (--list)\n", tool, a.only.c_str());
    return 2;
  }
  return -1;
}

}  // namespace vblk::power
