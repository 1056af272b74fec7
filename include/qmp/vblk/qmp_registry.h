// The QMP command registry: command name -> coroutine handler, with the
// argument checking QEMU's QAPI input visitor does, so handlers stay short.
//
// How to add commands (the job and backup commands are added this way):
//
//   void register_job_commands(Daemon& d) {
//     d.registry.add({"block-job-pause",
//                     {{"device", ArgType::Str, true}},          // schema order
//                     [&d](const OJson& a) { return job_pause(d, a); }});
//   }
//
// The handler is a plain (non-coroutine) lambda that calls a coroutine free
// function with explicit parameters: a capturing lambda that is itself a
// coroutine would dangle (the registry copies it). Before the handler runs,
// the arguments were checked against the schema in QEMU's order: members in
// declaration order ("Parameter 'x' is missing", "Invalid parameter type
// for 'x', expected: string", "Parameter 'x' does not accept value 'v'"),
// then members nobody declared ("Parameter 'x' is unexpected"). Unions and
// free-form options (blockdev-add) declare `open = true` and check the rest
// themselves, with check_args() on a sub-schema where that helps.
//
// A handler returns Reply::ok(value) (the "return" member; {} by default)
// or Reply::fail(desc, cls) with QEMU's class: GenericError, CommandNotFound,
// DeviceNotFound, ... Events are sent with QmpServer::emit_event (see
// monitor.h), which Daemon::emit forwards.
//
// Thread-safety: loop thread only.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "vblk/qmp_json.h"
#include "vblk/result.h"
#include "vblk/task.h"

namespace vblk::qmp {

struct QmpError {
  std::string cls = "GenericError";
  std::string desc;
};

struct Reply {
  OJson value = OJson::object();
  std::optional<QmpError> error;

  static Reply ok(OJson v = OJson::object()) { return Reply{std::move(v), std::nullopt}; }
  static Reply fail(std::string desc, std::string cls = "GenericError") {
    return Reply{nullptr, QmpError{std::move(cls), std::move(desc)}};
  }
  static Reply fail(const Error& e, std::string cls = "GenericError") { return fail(e.what(), std::move(cls)); }
};

// UInt64: QAPI's uint64 and size (a negative number is taken as its uint64
// cast, as QEMU's visitor does).
enum class ArgType { Str, Bool, Int, UInt32, UInt64, Number, Enum, Struct, Object, List, Any };

struct Arg {
  std::string name;
  ArgType type = ArgType::Any;
  bool required = false;
  std::vector<std::string> values;  // Enum: the accepted values
  std::vector<Arg> members;         // Struct: its members (checked recursively)
  bool open = false;                // Struct: undeclared members are allowed
};

struct Schema {
  std::vector<Arg> members;
  bool open = false;  // undeclared members are the handler's business
};

// Checks `obj` (a JSON object, or null for "no arguments") against `schema`;
// returns QEMU's description of the first problem. `prefix` names the
// enclosing member for nested structs ("addr" -> "addr.path").
std::optional<std::string> check_args(const std::vector<Arg>& members, bool open, const OJson& obj,
                                      const std::string& prefix = {});

using Handler = std::function<Task<Reply>(const OJson& args)>;

struct Command {
  std::string name;
  Schema args;
  Handler fn;
};

class Registry {
 public:
  // Adds or replaces a command.
  void add(Command c);
  const Command* find(const std::string& name) const;
  // In registration order (query-commands).
  std::vector<std::string> names() const { return order_; }

 private:
  std::map<std::string, Command> cmds_;
  std::vector<std::string> order_;
};

}  // namespace vblk::qmp
