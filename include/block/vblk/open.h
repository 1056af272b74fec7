// Opening nodes from options, the driver registry and format probing.
//
// Options are QEMU's blockdev options as JSON: {"driver":"raw","file":
// {"driver":"file","filename":"a.img"}}. A child may be given inline (an
// object), as a node name (a string), or — for qemu-img style opening — as a
// plain file name that open_image() turns into a `file` node.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "vblk/create.h"
#include "vblk/node.h"
#include "vblk/options.h"

namespace vblk {

class Graph;
class ThrottleGroups;

struct OpenContext {
  Loop& loop;
  Graph* graph = nullptr;                     // for child references by node name (may be null)
  ThrottleGroups* throttle_groups = nullptr;  // the `throttle` driver's groups (vblk serve)
  bool read_only = false;                     // default for nodes that do not say
  // Generic cache options, inherited by children unless they set their own.
  bool cache_direct = false;
  bool cache_no_flush = false;
  // Opening for `check` (QEMU's BDRV_O_CHECK): formats accept images they
  // would otherwise refuse to open read-write (corrupt or dirty), so that
  // they can be repaired. Not inherited by backing files.
  bool check = false;
  // Real paths of the images already open in this backing chain: opening one
  // of them again would loop forever.
  std::shared_ptr<std::vector<std::string>> chain;
  // Opened only to describe it (qemu-img info; QEMU's BDRV_O_NO_IO): checks
  // that only matter for guest I/O are skipped.
  bool no_io = false;
  // force-share=on for the node being opened and the children it opens
  // itself (qemu-img -U; QEMU inherits the option the same way).
  bool force_share = false;
  // discard=unmap|on for the node being opened (QEMU's BDRV_O_UNMAP; QEMU
  // ignores discards without it). Only snapshot-access reads it so far:
  // the other drivers pass every discard on, as before.
  bool discard_unmap = false;
  // The node-name of the node being opened (not of its children): a driver
  // that checks its children's permissions while it opens names itself in
  // a conflict, as QEMU names a node before it opens the node's children.
  std::string node_name;
};

// A parent that writes to `file` without being allowed to resize it (raw, or
// a protocol node used as the image) needs its length to be a multiple of the
// request alignment, as QEMU's permission check demands; formats that grow
// their file (qcow2) take the resize permission and skip this.
Status check_write_without_resize(const Node& file);

using DriverOpenFn = Result<std::shared_ptr<Node>> (*)(OpenContext& ctx, Json& opts);
// Returns a score 0..100 that `head` (the first bytes of a file) is this format.
using DriverProbeFn = int (*)(std::span<const uint8_t> head);
// qemu-img create (create.h): makes the image; a format makes its file
// through create_protocol_file().
using DriverCreateFn = Task<Status> (*)(Loop& loop, const CreateRequest& req);
// blockdev-create (create.h): checks what QEMU checks before the job
// starts, then returns what the job runs.
using DriverBlockdevCreateFn = Result<CreateBody> (*)(const BlockdevCreateArgs& args);
// Removes the image a file name names (QEMU's bdrv_co_delete_file).
using DriverDeleteFn = Status (*)(const std::string& filename);

// Protocols hold bytes (file, nbd, null-co, rbd); formats give them a
// layout (raw, qcow2, luks); filters pass I/O to one child and change how
// (throttle, blkdebug, copy-before-write).
enum class DriverKind { Protocol, Format, Filter };

// A driver: one folder under src/<layer>/drivers/ defines one of these, and
// one line registers it (src/block/drivers/list.h for the block layer's own,
// register_driver() for a higher layer's). Everything the CLI and QMP know
// about a driver comes from here.
using DriverParseFilenameFn = Status (*)(const std::string& filename, Json& opts);

struct DriverInfo {
  const char* name;
  DriverKind kind;
  DriverOpenFn open;
  DriverProbeFn probe = nullptr;                // formats QEMU probes for; nullptr: never probed
  std::span<const CreateOpt> create_opts = {};  // qemu-img create's -o, in "Formatting" order
  DriverCreateFn create = nullptr;              // nullptr: "does not support image creation"
  DriverBlockdevCreateFn blockdev_create = nullptr;
  // Protocols whose file names say so ("rbd:", "nbd://"): the prefixes.
  std::span<const char* const> prefixes = {};
  // Turns a plain file name into options (QEMU's bdrv_parse_filename); nullptr:
  // the name is the "filename" option. Only a name given alone is parsed: an
  // explicit "filename" option is the driver's to take or refuse.
  DriverParseFilenameFn parse_filename = nullptr;
  DriverDeleteFn remove = nullptr;  // protocols that can remove what they created
  bool is_protocol() const { return kind == DriverKind::Protocol; }
};

const DriverInfo* find_driver(const std::string& name);
// Every registered driver: the block layer's own in probe order, then the
// ones higher layers added.
const std::vector<DriverInfo>& registered_drivers();
// Adds a driver of a higher layer (copy-before-write, snapshot-access: see
// vblk/copy_drivers.h); one already there by that name is kept. Formats
// with a probe are tried after the block layer's own, in this order.
void register_driver(const DriverInfo& d);
// The protocol driver a plain file name is for: the one whose prefix it
// starts with, else `file` (host_device for a device: see open_image).
const DriverInfo& protocol_for_filename(const std::string& filename);

// Creates `filename` empty through its protocol, for a format's create to
// open and format (QEMU's bdrv_create_file with size 0): a file is
// created or truncated; other protocols are refused ("vblk creates only raw
// images on rbd").
Task<Status> create_protocol_file(Loop& loop, const std::string& filename);

// Opens a node from blockdev options (consumes `opts`). Unknown leftover
// options are an error: "Block format 'raw' does not support the option 'x'".
Result<std::shared_ptr<Node>> open_node(OpenContext& ctx, Json opts);

// Opens a child: inline options, a node-name reference, or a file name.
Result<std::shared_ptr<Node>> open_child(OpenContext& ctx, Json& parent_opts, const std::string& role, bool required);

// qemu-img style: opens `filename` with `format` ("" = probe). Returns the
// top node; *probed_raw is set when probing fell back to raw.
struct ImageOpenOptions {
  std::string format;  // "" probes
  bool read_only = true;
  bool direct = false;    // cache.direct
  bool no_flush = false;  // cache=unsafe
  bool writethrough = false;
  std::string aio;          // "" default, "threads", "io_uring", "native"
  bool no_backing = false;  // do not open backing files (qemu-img info does not)
  bool no_io = false;       // see OpenContext::no_io
};
Result<std::shared_ptr<Node>> open_image(OpenContext& ctx, const std::string& filename, const ImageOpenOptions& o,
                                         bool* probed_raw = nullptr);

// QEMU's path_combine: a relative `name` is taken relative to the directory
// part of `base` ("dir/img" + "b" -> "dir/b"; "img" + "b" -> "b").
std::string path_combine(const std::string& base, const std::string& name);

// A child node as a member of its parent's json: filename (QEMU's
// bdrv_refresh_filename): its own json:{...} object, or {"driver": ...,
// "filename": ...} for a plain filename.
std::string child_filename_json(const Node& child);

// Probes the format of an already open protocol node.
Task<Result<std::string>> probe_format(Node& file);

}  // namespace vblk
