// Shared pieces of the qemu-img compatible command line: message style,
// option parsing helpers, size formatting, cache modes and image opening.
//
// Messages follow qemu-img: "<prog>: <message>" on stderr; usage errors add
// "Try '<prog> --help' for more information" and exit 1.
#pragma once

#include <getopt.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>

#include "vblk/image_format.h"
#include "vblk/loop.h"
#include "vblk/node.h"
#include "vblk/open.h"
#include "vblk/qdict_order.h"

namespace vblk::cli {

extern std::string g_prog;  // basename of argv[0]

void error_report(const std::string& msg);
[[noreturn]] void error_exit(const std::string& msg);
// getopt's unknown/missing-argument reports, worded as qemu-img words them.
[[noreturn]] void unrecognized_option(char** argv, int optind);
[[noreturn]] void missing_argument(char** argv, int optind);

// The getopt loop every command shares, as qemu-img's commands all run it:
// `optind` reset, a missing argument or an unknown option reported in
// qemu-img's words (exit 1), -h/--help printing `usage` (exit 0); every
// other option goes to `on_option(c)` (optarg as getopt left it), which
// returns kNextOption or an exit code to stop with. `shortopts` starts with
// ':' and lists 'h'. Returns kNextOption once the options are taken,
// else the exit code.
inline constexpr int kNextOption = -1;
// What a command's parse step gives its run step: the arguments, or the
// exit code to stop with (the error is reported, or -h printed its usage).
template <class Args>
using Parsed = std::variant<Args, int>;
int for_each_option(int argc, char** argv, const char* shortopts, const struct option* longopts,
                    const std::function<void()>& usage, const std::function<int(int c)>& on_option);

// -T / --trace PATTERN (vblk/trace.h): switches the matching categories
// on; a bad option exits 1, a pattern that matches nothing warns.
void enable_trace(const std::string& spec);

// --object of the qemu-img style tools (qemu-img's user_creatable_process_
// cmdline): a `secret` goes to the process's SecretStore, where rbd's
// key-secret finds it; an invalid one prints QEMU's error and exits 1.
// Other object types are accepted and ignored (no tool uses them) but
// their ids are kept, as QEMU's are.
// exit_code: compare's is 2.
void cli_object(const std::string& arg, int exit_code = 1);
// keyval gives "loaded=on" as a string; the object's schema wants a bool.
// Returns QEMU's error for a value that is not a bool.
std::optional<std::string> keyval_object_bools(nlohmann::ordered_json& o);

// qemu-img's human size: "10 MiB", "1.5 KiB", "0.977 MiB".
std::string size_to_str(uint64_t val);

// qemu-img's cvtnum: a size with suffix; prints qemu-img's error and returns
// nullopt when invalid or above max.
std::optional<int64_t> cvtnum(const std::string& name, const std::string& value, int64_t max = INT64_MAX);
// qemu_strtoul base 0 within [0, max]; nullopt when invalid.
std::optional<unsigned long> parse_ulong(const std::string& value, unsigned long max);

struct CacheMode {
  bool direct = false;
  bool writethrough = false;
  bool no_flush = false;
};
// none/off, writeback, writethrough, directsync, unsafe.
bool parse_cache_mode(const std::string& mode, CacheMode& out);

// QEMU's bdrv_find_backing_image, one step: whether `name` names the backing
// file `recorded` of the image `overlay_file` (both relative to that image's
// directory, compared as real paths; protocol names compared as written).
// rebase and commit find their base in the chain with it.
bool names_backing(const std::string& overlay_file, const std::string& recorded, const std::string& name);

// QEMU's JSON pretty printer (4-space indent, uppercase \u escapes), over
// ordered JSON so key order is ours to choose.
std::string qemu_json_pretty(const nlohmann::ordered_json& j);

struct ImageArgs {
  std::string filename;
  std::string format;       // -f ("" probes)
  bool image_opts = false;  // --image-opts: filename is key=value options
  bool read_only = true;
  CacheMode cache;
  std::string aio;          // -i
  bool check = false;       // opening for `check`: corrupt/dirty images may be repaired
  bool no_backing = false;  // leave backing files closed (info)
  bool no_io = false;       // opened only to be described (info)
  // Image locks (perm.h): what the command needs beyond reading (and
  // writing unless read_only) and whether others may write meanwhile.
  bool resize = false;       // the command changes the length (resize)
  uint32_t unshare = 0;      // what others must not do meanwhile (convert's source: write, resize)
  bool force_share = false;  // -U: share everything, whatever the command needs
  // Prefix of the open error; "" gives qemu-img's "Could not open '<file>': "
  // (qemu-io words it "can't open device <file>: ").
  std::string open_error_prefix;
  // Set: a failed open stores its error here instead of reporting it
  // (savevm waits for a lock to come free).
  Error* open_error = nullptr;
};

// Opens an image as qemu-img does and reports "Could not open 'X': ..." on
// failure (returns nullptr). Prints the raw-probing warning for writable opens.
std::shared_ptr<Node> open_cli_image(Loop& loop, const ImageArgs& a);
// error_report() of msg, then the error's hint on a line of its own
// ("Is another process using the image [x]?"), as QEMU's tools print it.
void error_report_hint(const std::string& msg, const Error& e);
// The warning for a writable image whose format was probed as raw.
void warn_probed_raw(const std::string& filename);

int cmd_create(int argc, char** argv);
// Put between "<file>: " and create's error message (convert sets it to
// "error while converting <fmt>: ", as qemu-img words it).
extern std::string g_create_error_context;
// Creates an image through `vblk create` (qemu-img create's options, checks
// and messages), its errors prefixed with `error_context`; "" options and
// backing for none (backing_fmt "" probes). Returns create's exit code.
int create_target(const std::string& filename, const std::string& fmt, const std::string& options,
                  const std::string& backing, const std::string& backing_fmt, uint64_t size,
                  const std::string& error_context);
int cmd_convert(int argc, char** argv);
int cmd_info(int argc, char** argv);
int cmd_map(int argc, char** argv);
int cmd_compare(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_check(int argc, char** argv);
int cmd_serve(int argc, char** argv);
int cmd_backup(int argc, char** argv);
int cmd_bitmap(int argc, char** argv);
int cmd_resize(int argc, char** argv);
int cmd_rebase(int argc, char** argv);
int cmd_commit(int argc, char** argv);
int cmd_io(int argc, char** argv);
int cmd_nbd(int argc, char** argv);
int cmd_snapshot(int argc, char** argv);
int cmd_savevm(int argc, char** argv);
int cmd_loadvm(int argc, char** argv);

// qemu-img's snapshot table printing (bdrv_snapshot_dump): nothing when empty.
void dump_snapshots(const std::vector<SnapshotInfo>& list);

}  // namespace vblk::cli
