// Creating images through the driver registry (open.h's DriverInfo), in
// QEMU's two forms: qemu-img create's `-o key=value` options (each driver's
// QemuOpts list, QEMU's BlockDriver.create_opts and bdrv_co_create_opts) and
// QMP blockdev-create's typed options (BlockdevCreateOptions, QEMU's
// bdrv_co_create). The CLI and QMP know no driver: they ask the registry.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "vblk/node.h"
#include "vblk/options.h"
#include "vblk/task.h"

namespace vblk {

class Loop;

// One -o option of a driver (QEMU's QemuOptDesc).
enum class CreateOptKind { Size, Bool, String, Number };
struct CreateOpt {
  const char* name;
  CreateOptKind kind;
  const char* def;   // printed on the "Formatting" line and used when not given; nullptr: only if given
  const char* help;  // `-o help`
};

// A qemu-img create request, its options checked against create_options():
// every key is one of them, bools are on|off, numbers parse, and every
// Size option (given or defaulted) is in `sizes` as bytes.
struct CreateRequest {
  std::string filename;
  uint64_t size = 0;
  std::map<std::string, std::string> opts;
  std::map<std::string, uint64_t> sizes;
  const std::string* get(const std::string& key) const {
    auto it = opts.find(key);
    return it == opts.end() ? nullptr : &it->second;
  }
  std::string get_or(const std::string& key, const std::string& def) const {
    auto* v = get(key);
    return v ? *v : def;
  }
};

// The options qemu-img create takes for format `fmt` on `filename`: the
// format's own, then those of the protocol `filename` names (file, rbd:)
// that the format does not have, in the order of QEMU's "Formatting" line.
// With an empty filename, the format's own only. Errors in qemu-img's words
// ("Unknown file format 'x'", "Format driver 'x' does not support image
// creation").
Result<std::vector<CreateOpt>> create_options(const std::string& fmt, const std::string& filename);

// One -o item as QemuOpts parses it: "Parameter 'x' expects 'on' or 'off'",
// "Parameter 'x' expects a number", "Value 'v' is too large for parameter 'x'".
Status check_create_value(const CreateOpt& opt, const std::string& value);
// Fills req.sizes from req.opts and the defaults of `opts` (every Size
// option but `size` itself): "Parameter 'x' expects a non-negative number
// below 2^64".
Status fill_create_sizes(std::span<const CreateOpt> opts, CreateRequest& req);

// Creates the image: the format driver's create, which makes its file
// through the protocol's. Whatever it created is removed again when it
// fails after that (as qemu-img create does for luks and encrypted qcow2).
Task<Status> create_image(Loop& loop, const std::string& fmt, const CreateRequest& req);

// Removes the image a file name names (QEMU's bdrv_co_delete_file): a file
// is unlinked, an rbd: image removed.
Status delete_image(const std::string& filename);

// blockdev-create: the options (BlockdevCreateOptions without `driver`),
// already checked against the QAPI schema by the caller; `open_ref` opens a
// BlockdevRef (a node name, or inline blockdev options) in the caller's graph.
struct BlockdevCreateArgs {
  Loop& loop;
  Json options;
  std::function<Result<std::shared_ptr<Node>>(const Json& ref)> open_ref;
};
// What the create job runs; errors found before that fail the command.
using CreateBody = std::function<Task<Status>()>;

}  // namespace vblk
