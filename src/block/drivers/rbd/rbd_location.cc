#include "drivers/rbd/rbd_location.h"

#include <array>

#include "vblk/qdict_order.h"

namespace vblk::rbd {

namespace {

// Position of the first unescaped `delim` in s from `from`, or npos.
size_t find_unescaped(const std::string& s, char delim, size_t from = 0) {
  for (size_t i = from; i < s.size(); ++i) {
    if (s[i] == delim) return i;
    if (s[i] == '\\' && i + 1 < s.size()) ++i;
  }
  return std::string::npos;
}

// Splits at the first unescaped delim: returns the head, leaves the rest in
// `s` and sets `more` when there was a delimiter (QEMU's qemu_rbd_next_tok).
std::string next_tok(std::string& s, char delim, bool& more) {
  size_t p = find_unescaped(s, delim);
  if (p == std::string::npos) {
    more = false;
    std::string head = std::move(s);
    s.clear();
    return head;
  }
  more = true;
  std::string head = s.substr(0, p);
  s.erase(0, p + 1);
  return head;
}

std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) ++i;
    out += s[i];
  }
  return out;
}

}  // namespace

// QEMU 7.2's QCryptoCipherAlgorithm, in order (its number shows in errors).
static const std::array<const char*, 12> kCipherAlgs = {"aes-128",     "aes-192",     "aes-256",     "des",
                                                        "3des",        "cast5-128",   "serpent-128", "serpent-192",
                                                        "serpent-256", "twofish-128", "twofish-192", "twofish-256"};

int cipher_alg_number(const std::string& name) {
  for (size_t i = 0; i < kCipherAlgs.size(); ++i)
    if (name == kCipherAlgs[i]) return static_cast<int>(i);
  return -1;
}

Result<RbdEncryption> parse_encryption(const Json& dict, const std::string& prefix, bool create) {
  RbdEncryption enc;
  auto member = [&](const char* key) -> const Json* {
    auto it = dict.find(key);
    return it == dict.end() ? nullptr : &*it;
  };
  const Json* format = member("format");
  if (!format) return Error(EINVAL, "Parameter '" + prefix + "format' is missing");
  std::string f = format->is_string() ? format->get<std::string>() : format->dump();
  if (f != "luks" && f != "luks2") return Error(EINVAL, "Parameter 'format' does not accept value '" + f + "'");
  enc.format = f;
  const Json* key = member("key-secret");
  if (!key) return Error(EINVAL, "Parameter '" + prefix + "key-secret' is missing");
  if (!key->is_string()) {
    return Error(EINVAL, "Invalid parameter type for '" + prefix + "key-secret', expected: string");
  }
  enc.key_secret = key->get<std::string>();
  if (create) {
    if (const Json* alg = member("cipher-alg")) {
      std::string a = alg->is_string() ? alg->get<std::string>() : alg->dump();
      if (cipher_alg_number(a) < 0) return Error(EINVAL, "Parameter 'cipher-alg' does not accept value '" + a + "'");
      enc.cipher_alg = a;
    }
  }
  for (const auto& [k, v] : dict.items()) {
    if (k == "format" || k == "key-secret" || (create && k == "cipher-alg")) continue;
    return Error(EINVAL, "Parameter '" + prefix + k + "' is unexpected");
  }
  return enc;
}

Result<RbdLocation> parse_rbd_filename(const std::string& filename) {
  if (filename.rfind("rbd:", 0) != 0) return Error(EINVAL, "File name must start with 'rbd:'");
  std::string rest = filename.substr(4);
  RbdLocation loc;
  bool more = false;
  std::string pool = next_tok(rest, '/', more);
  if (!more) return Error(EINVAL, "Pool name is required");
  loc.pool = unescape(pool);
  std::string image;
  if (find_unescaped(rest, '@') != std::string::npos) {
    image = next_tok(rest, '@', more);
    loc.snapshot = unescape(next_tok(rest, ':', more));
  } else {
    image = next_tok(rest, ':', more);
  }
  // A '/' left in the image part names a namespace first.
  size_t slash = find_unescaped(image, '/');
  if (slash != std::string::npos) {
    loc.ns = unescape(image.substr(0, slash));
    image = image.substr(slash + 1);
  } else {
    loc.ns = "";
  }
  loc.image = unescape(image);
  while (more) {
    bool has_value = false;
    std::string name = next_tok(rest, '=', has_value);
    if (!has_value) return Error(EINVAL, "conf option " + name + " has no value");
    name = unescape(name);
    std::string value = unescape(next_tok(rest, ':', more));
    if (name == "conf") {
      loc.conf = value;
    } else if (name == "id") {
      loc.user = value;
    } else {
      loc.keypairs.emplace_back(name, value);
    }
  }
  return loc;
}

Result<RbdLocation> take_rbd_location(Json& opts) {
  auto filename = take_string(opts, "filename");
  VBLK_TRY(filename);
  RbdLocation loc;
  if (*filename) {
    auto parsed = parse_rbd_filename(**filename);
    VBLK_TRY(parsed);
    loc = std::move(*parsed);
  }
  auto str = [&](const char* key, std::optional<std::string>& out) -> Status {
    auto v = take_string(opts, key);
    VBLK_TRY(v);
    if (*v) out = **v;
    return {};
  };
  std::optional<std::string> pool, image;
  VBLK_TRY(str("pool", pool));
  VBLK_TRY(str("image", image));
  VBLK_TRY(str("namespace", loc.ns));
  VBLK_TRY(str("snapshot", loc.snapshot));
  VBLK_TRY(str("conf", loc.conf));
  VBLK_TRY(str("user", loc.user));
  VBLK_TRY(str("key-secret", loc.key_secret));
  if (pool) loc.pool = *pool;
  if (image) loc.image = *image;
  if (!*filename) {
    if (!pool) return Error(EINVAL, "Parameter 'pool' is missing");
    if (!image) return Error(EINVAL, "Parameter 'image' is missing");
  }
  // Dotted keys (--image-opts auth-client-required.0=none, server.0.host=)
  // arrive as objects keyed "0", "1", ...: the list they spell.
  for (const char* key : {"auth-client-required", "server"}) {
    auto it = opts.find(key);
    if (it == opts.end() || !it->is_object()) continue;
    Json list = Json::array();
    for (size_t i = 0; i < it->size(); ++i) {
      auto m = it->find(std::to_string(i));
      if (m == it->end()) {
        list = nullptr;
        break;
      }
      list.push_back(*m);
    }
    if (!list.is_null()) *it = std::move(list);
  }
  auto acr = opts.find("auth-client-required");
  if (acr != opts.end()) {
    if (!acr->is_array()) return Error(EINVAL, "Invalid parameter type for 'auth-client-required', expected: array");
    for (const auto& m : *acr) {
      std::string v = m.is_string() ? m.get<std::string>() : "";
      if (v != "cephx" && v != "none")
        return Error(EINVAL, "Parameter 'auth-client-required' does not accept value '" + v + "'");
      loc.auth_client_required.push_back(v);
    }
    opts.erase(acr);
  }
  auto enc = opts.find("encrypt");
  if (enc != opts.end()) {
    if (!enc->is_object()) return Error(EINVAL, "Invalid parameter type for 'encrypt', expected: object");
    auto e = parse_encryption(*enc, "encrypt.", false);
    VBLK_TRY(e);
    loc.encrypt = std::move(*e);
    opts.erase(enc);
  }
  auto srv = opts.find("server");
  if (srv != opts.end()) {
    if (!srv->is_array()) return Error(EINVAL, "Invalid parameter type for 'server', expected: array");
    for (auto& s : *srv) {
      if (!s.is_object() || !s.contains("host") || !s.contains("port"))
        return Error(EINVAL, "Parameter 'server' expects host and port");
      const auto& p = s["port"];
      loc.servers.push_back({s["host"].get<std::string>(), p.is_string() ? p.get<std::string>() : p.dump()});
    }
    opts.erase(srv);
  }
  return loc;
}

nlohmann::ordered_json location_json(const RbdLocation& loc) {
  // Built in QAPI member order; qdict_order gives QEMU's output order.
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  j["driver"] = "rbd";
  j["pool"] = loc.pool;
  if (loc.ns) j["namespace"] = *loc.ns;
  j["image"] = loc.image;
  if (loc.conf) j["conf"] = *loc.conf;
  if (loc.snapshot) j["snapshot"] = *loc.snapshot;
  if (loc.user) j["user"] = *loc.user;
  // key-secret is not among QEMU's strong runtime options: json: filenames
  // leave it out (the secret's id names nothing outside this process).
  return qdict_order(j);
}

}  // namespace vblk::rbd
