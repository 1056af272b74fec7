#include "vblk/trace.h"

#include <fnmatch.h>
#include <sys/time.h>
#include <unistd.h>

namespace vblk::trace {

std::atomic<uint32_t> g_enabled{0};

const std::vector<CategoryName>& categories() {
  static const std::vector<CategoryName> k = {{"io", kIo},   {"block", kBlock}, {"qcow2", kQcow2}, {"copy", kCopy},
                                              {"job", kJob}, {"nbd", kNbd},     {"qmp", kQmp}};
  return k;
}

std::vector<std::string> set_state(std::string_view pattern, bool enable) {
  const std::string p(pattern);
  std::vector<std::string> matched;
  for (const auto& c : categories()) {
    if (fnmatch(p.c_str(), c.name, 0) != 0) continue;
    matched.emplace_back(c.name);
    if (enable)
      g_enabled.fetch_or(c.category, std::memory_order_relaxed);
    else
      g_enabled.fetch_and(~static_cast<uint32_t>(c.category), std::memory_order_relaxed);
  }
  return matched;
}

namespace {

// Calls f(item) for each comma-separated item of `list` (empty ones too),
// stopping at the first error.
template <typename F>
Status for_each_item(std::string_view list, F f) {
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    if (comma == std::string_view::npos) comma = list.size();
    VBLK_TRY(f(list.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return {};
}

}  // namespace

Status enable_from_option(std::string_view spec, std::string* warning) {
  std::string_view pattern;
  VBLK_TRY(for_each_item(spec, [&](std::string_view item) -> Status {
    const size_t eq = item.find('=');
    const std::string_view key = eq == std::string_view::npos ? std::string_view("enable") : item.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? item : item.substr(eq + 1);
    if (key == "enable") {
      pattern = value;
    } else if (key == "events" || key == "file") {
      return Error(EINVAL, "--trace " + std::string(key) + "= is not supported: trace lines go to stderr");
    } else {
      return Error(EINVAL, "Invalid parameter '" + std::string(key) + "'");
    }
    return {};
  }));
  if (set_state(pattern, true).empty() && warning)
    *warning = "trace event '" + std::string(pattern) + "' does not exist";
  return {};
}

Status enable_from_list(std::string_view list) {
  return for_each_item(list, [](std::string_view item) -> Status {
    if (!item.empty() && set_state(item, true).empty())
      return Error(EINVAL, "VBLK_TRACE: no trace category '" + std::string(item) + "'");
    return {};
  });
}

void emit(Category c, std::string_view text) {
  const char* name = "?";
  for (const auto& k : categories())
    if (k.category == c) name = k.name;
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  std::string line = fmt::format("{}@{}.{:06}:{} {}\n", getpid(), tv.tv_sec, tv.tv_usec, name, text);
  // One write per line, so that lines from threads do not interleave; a
  // short or failed write to stderr loses trace output only.
  (void)!::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace vblk::trace
