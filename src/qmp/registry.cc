#include <algorithm>

#include "vblk/qmp_registry.h"

namespace vblk::qmp {

namespace {

const char* type_word(ArgType t) {
  switch (t) {
    case ArgType::Str:
    case ArgType::Enum: return "string";
    case ArgType::Bool: return "boolean";
    case ArgType::Int:
    case ArgType::UInt32:
    case ArgType::UInt64: return "integer";
    case ArgType::Number: return "number";
    case ArgType::Struct:
    case ArgType::Object: return "object";
    case ArgType::List: return "array";
    case ArgType::Any: return "any";
  }
  return "any";
}

bool type_ok(ArgType t, const OJson& v) {
  switch (t) {
    case ArgType::Str:
    case ArgType::Enum: return v.is_string();
    case ArgType::Bool: return v.is_boolean();
    case ArgType::Int:
    case ArgType::UInt32:
    case ArgType::UInt64: return v.is_number_integer();
    case ArgType::Number: return v.is_number();
    case ArgType::Struct:
    case ArgType::Object: return v.is_object();
    case ArgType::List: return v.is_array();
    case ArgType::Any: return true;
  }
  return true;
}

}  // namespace

std::optional<std::string> check_args(const std::vector<Arg>& members, bool open, const OJson& obj,
                                      const std::string& prefix) {
  static const OJson kEmpty = OJson::object();
  const OJson& o = obj.is_object() ? obj : kEmpty;
  for (const auto& m : members) {
    std::string full = prefix.empty() ? m.name : prefix + "." + m.name;
    auto it = o.find(m.name);
    if (it == o.end()) {
      if (m.required) return "Parameter '" + full + "' is missing";
      continue;
    }
    // QEMU's unsigned visitor words its errors differently.
    if (m.type == ArgType::UInt64) {
      if (!it->is_number_integer()) return "Parameter '" + full + "' expects uint64";
      continue;
    }
    if (m.type == ArgType::UInt32) {
      if (!it->is_number_integer()) return "Parameter '" + full + "' expects uint64";
      // (QEMU takes a negative number as the uint64 it casts to: too big.)
      if (it->is_number_unsigned() ? it->get<uint64_t>() > UINT32_MAX
                                   : it->get<int64_t>() < 0 || it->get<int64_t>() > int64_t{UINT32_MAX})
        return "Parameter '" + full + "' expects uint32_t";
      continue;
    }
    if (!type_ok(m.type, *it)) return "Invalid parameter type for '" + full + "', expected: " + type_word(m.type);
    if (m.type == ArgType::Enum &&
        std::find(m.values.begin(), m.values.end(), it->get<std::string>()) == m.values.end())
      // QEMU names only the member itself here, not its path.
      return "Parameter '" + m.name + "' does not accept value '" + it->get<std::string>() + "'";
    if (m.type == ArgType::Struct) {
      if (auto e = check_args(m.members, m.open, *it, full)) return e;
    }
  }
  if (!open) {
    for (auto it = o.begin(); it != o.end(); ++it) {
      bool known = std::any_of(members.begin(), members.end(), [&](const Arg& a) { return a.name == it.key(); });
      if (!known) return "Parameter '" + (prefix.empty() ? it.key() : prefix + "." + it.key()) + "' is unexpected";
    }
  }
  return std::nullopt;
}

void Registry::add(Command c) {
  std::string name = c.name;
  if (!cmds_.count(name)) order_.push_back(name);
  cmds_[name] = std::move(c);
}

const Command* Registry::find(const std::string& name) const {
  auto it = cmds_.find(name);
  return it == cmds_.end() ? nullptr : &it->second;
}

}  // namespace vblk::qmp
