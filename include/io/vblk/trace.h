// Trace categories: one line on stderr for each thing a switched-on
// category does (a qcow2 cluster allocated, a job changing state, an NBD
// option, a QMP command), in QEMU's "log" trace format:
//   PID@SECONDS.MICROSECONDS:category message
//
// Switched on at start with `--trace PATTERN` (vblk serve, vblk nbd; QEMU's
// syntax: [enable=]PATTERN, a glob over the category names) or
// VBLK_TRACE=block,qcow2, and at run time through QMP's
// trace-event-set-state. Off by default, where a trace point costs one
// relaxed atomic load and a branch: its arguments are not evaluated.
//
// Thread-safety: any thread may test and emit (one write(2) per line).
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "vblk/result.h"

namespace vblk::trace {

enum Category : uint32_t {
  kIo = 1u << 0,     // the event loop: backend chosen, thread-pool fallback
  kBlock = 1u << 1,  // nodes opened and closed, failed requests
  kQcow2 = 1u << 2,  // clusters and tables allocated, images marked corrupt
  kCopy = 1u << 3,   // block-copy chunks and claims
  kJob = 1u << 4,    // job state changes
  kNbd = 1u << 5,    // NBD connections, options, failed requests
  kQmp = 1u << 6,    // QMP commands and their outcome
};

struct CategoryName {
  const char* name;
  Category category;
};
// Every category, in the order above.
const std::vector<CategoryName>& categories();

extern std::atomic<uint32_t> g_enabled;

inline bool on(Category c) { return (g_enabled.load(std::memory_order_relaxed) & c) != 0; }

// Switches the categories whose name matches the glob `pattern` ('*', '?')
// on or off; the names that matched (none: the caller reports it).
std::vector<std::string> set_state(std::string_view pattern, bool enable);

// --trace's argument: [enable=]PATTERN; file= and events= are refused
// (lines go to stderr), other keys are "Invalid parameter". A pattern
// that matches no category is not an error (QEMU warns and goes on): the
// warning to print, in QEMU's words, is left in *warning.
Status enable_from_option(std::string_view spec, std::string* warning);

// VBLK_TRACE: comma-separated patterns; unknown ones are an error too.
Status enable_from_list(std::string_view list);

// Writes one line for `c` (callers test on(c) first: see VBLK_TRACE).
void emit(Category c, std::string_view text);

}  // namespace vblk::trace

// VBLK_TRACE(kQcow2, "alloc cluster {:#x}", offset): formats and writes only
// when the category is on.
#define VBLK_TRACE(cat, ...)                                                                                        \
  do {                                                                                                              \
    if (::vblk::trace::on(::vblk::trace::cat)) ::vblk::trace::emit(::vblk::trace::cat, ::fmt::format(__VA_ARGS__)); \
  } while (0)
