// QOM objects: object-add / object-del and `vblk serve --object`.
//
// vblk has the objects a storage daemon's block layer uses: throttle-group
// (include/block/vblk/throttle.h, for `throttle` nodes), secret (util/secret_store.h,
// for rbd's key-secret) and iothread (accepted and kept by id: one event loop
// serves everything). Other QEMU object types are refused by name, so a
// script learns at once what vblk lacks. Every id is also noted in the
// process's SecretStore, which is how ids stay unique across types and how a
// key-secret naming a throttle group hears "is not a secret".
#include <cctype>
#include <cerrno>

#include "vblk/qmp_daemon.h"
#include "vblk/secret_store.h"

namespace vblk::qmp {

namespace {

// QEMU 7.2's ObjectType values a storage daemon accepts (query-qmp-schema).
const std::vector<std::string>& object_types() {
  static const std::vector<std::string> kTypes = {"authz-list",
                                                  "authz-listfile",
                                                  "authz-pam",
                                                  "authz-simple",
                                                  "iothread",
                                                  "memory-backend-file",
                                                  "memory-backend-memfd",
                                                  "memory-backend-ram",
                                                  "rng-egd",
                                                  "rng-random",
                                                  "secret",
                                                  "secret_keyring",
                                                  "throttle-group",
                                                  "tls-cipher-suites",
                                                  "tls-creds-anon",
                                                  "tls-creds-psk",
                                                  "tls-creds-x509"};
  return kTypes;
}

// throttle-group's properties: `limits` (ThrottleLimits) and the legacy
// "x-" spelling of each limit.
const std::vector<Arg>& throttle_group_schema() {
  static const std::vector<Arg> kSchema = [] {
    std::vector<Arg> limits;
    for (const char* n : throttle_limit_names()) limits.push_back({n, ArgType::Int});
    std::vector<Arg> s = {{"limits", ArgType::Struct, false, {}, limits}};
    for (const char* n : throttle_limit_names()) s.push_back({std::string("x-") + n, ArgType::Int});
    return s;
  }();
  return kSchema;
}

// SecretProperties and SecretCommonProperties (qapi/qom.json). `loaded` is
// in the schema but read-only in 7.2: setting it fails (secret_props_error).
const std::vector<Arg>& secret_schema() {
  static const std::vector<Arg> kSchema = {
      {"data", ArgType::Str},  {"file", ArgType::Str}, {"format", ArgType::Enum, false, {"raw", "base64"}},
      {"keyid", ArgType::Str}, {"iv", ArgType::Str},   {"loaded", ArgType::Bool}};
  return kSchema;
}

SecretSpec secret_spec(const OJson& props) {
  SecretSpec spec;
  if (props.contains("data")) spec.data = props["data"].get<std::string>();
  if (props.contains("file")) spec.file = props["file"].get<std::string>();
  if (props.contains("keyid")) spec.keyid = props["keyid"].get<std::string>();
  if (props.contains("iv")) spec.iv = props["iv"].get<std::string>();
  if (props.contains("format") && props["format"] == "base64") spec.format = SecretFormat::kBase64;
  return spec;
}

// What QEMU refuses once the schema is satisfied.
std::optional<std::string> secret_props_error(const OJson& props) {
  if (props.contains("loaded")) return std::string("Property 'secret.loaded' is not writable");
  return std::nullopt;
}

Task<Reply> object_add(Daemon& d, const OJson& args) {
  auto st = add_object(d, args);
  if (!st) co_return Reply::fail(st.error().what());
  co_return Reply::ok();
}

Task<Reply> object_del(Daemon& d, const OJson& args) {
  const std::string id = args["id"];
  // A secret may go while an rbd node that used it stays open, as in QEMU
  // (the key was read when the node connected).
  if (SecretStore::process().is_secret(id)) {
    SecretStore::process().remove(id);
    co_return Reply::ok();
  }
  if (d.iothreads.erase(id)) {
    SecretStore::process().remove(id);
    co_return Reply::ok();
  }
  auto st = d.throttle_groups.remove(id);
  if (!st) co_return Reply::fail(st.error().what());
  SecretStore::process().remove(id);
  co_return Reply::ok();
}

}  // namespace

bool id_wellformed(const std::string& id) {
  if (id.empty() || !std::isalpha(static_cast<unsigned char>(id[0]))) return false;
  for (char c : id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' && c != '_') return false;
  return true;
}

Status add_object(Daemon& d, const OJson& opts) {
  static const std::vector<Arg> kBase = {{"qom-type", ArgType::Enum, true, object_types()}, {"id", ArgType::Str, true}};
  if (auto e = check_args(kBase, true, opts)) return Error(EINVAL, *e);
  const std::string type = opts["qom-type"], id = opts["id"];
  if (!id_wellformed(id)) return Error(EINVAL, "Parameter 'id' expects an identifier");
  OJson props = opts;
  props.erase("qom-type");
  props.erase("id");
  auto duplicate = [&] {
    return Error(EEXIST, "attempt to add duplicate property '" + id + "' to object (type 'container')");
  };
  SecretStore& objects = SecretStore::process();
  if (type == "secret") {
    if (auto e = check_args(secret_schema(), false, props)) return Error(EINVAL, *e);
    if (auto e = secret_props_error(props)) return Error(EINVAL, *e);
    if (d.iothreads.count(id) || d.throttle_groups.contains(id)) return duplicate();
    return objects.add(id, secret_spec(props));
  }
  if (type == "iothread") {
    // Its tuning properties (poll-max-ns, ...) mean nothing to one loop.
    if (d.iothreads.count(id) || d.throttle_groups.contains(id) || objects.contains(id)) return duplicate();
    d.iothreads.insert(id);
    (void)objects.add_other(id);
    return {};
  }
  if (type != "throttle-group") return Error(ENOTSUP, "object type '" + type + "' is not supported by vblk");
  if (auto e = check_args(throttle_group_schema(), false, props)) return Error(EINVAL, *e);
  if (d.iothreads.count(id) || objects.is_secret(id)) return duplicate();
  ThrottleLimits limits;
  VBLK_TRY(parse_throttle_limits(props, limits));
  VBLK_TRY(d.throttle_groups.add(id, limits));
  (void)objects.add_other(id);
  return {};
}

Status add_secret_object(const OJson& opts) {
  static const std::vector<Arg> kBase = {{"qom-type", ArgType::Enum, true, {"secret"}}, {"id", ArgType::Str, true}};
  if (auto e = check_args(kBase, true, opts)) return Error(EINVAL, *e);
  const std::string id = opts["id"];
  if (!id_wellformed(id)) return Error(EINVAL, "Parameter 'id' expects an identifier");
  OJson props = opts;
  props.erase("qom-type");
  props.erase("id");
  if (auto e = check_args(secret_schema(), false, props)) return Error(EINVAL, *e);
  if (auto e = secret_props_error(props)) return Error(EINVAL, *e);
  return SecretStore::process().add(id, secret_spec(props));
}

void register_object_commands(Daemon& d) {
  d.registry.add({"object-add",
                  {{{"qom-type", ArgType::Enum, true, object_types()}, {"id", ArgType::Str, true}}, true},
                  [&d](const OJson& a) { return object_add(d, a); }});
  d.registry.add({"object-del", {{{"id", ArgType::Str, true}}}, [&d](const OJson& a) { return object_del(d, a); }});
}

}  // namespace vblk::qmp
