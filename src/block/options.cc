#include "vblk/options.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace vblk {

namespace {
Error type_error(const std::string& key, const char* what) {
  return Error(EINVAL, "Parameter '" + key + "' expects " + what);
}
}  // namespace

Result<std::optional<bool>> take_bool(Json& opts, const std::string& key) {
  auto it = opts.find(key);
  if (it == opts.end()) return std::optional<bool>();
  Json v = *it;
  opts.erase(it);
  if (v.is_boolean()) return std::optional<bool>(v.get<bool>());
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s == "on" || s == "true" || s == "yes") return std::optional<bool>(true);
    if (s == "off" || s == "false" || s == "no") return std::optional<bool>(false);
  }
  return type_error(key, "'on' or 'off'");
}

Result<std::optional<uint64_t>> take_size(Json& opts, const std::string& key) {
  auto it = opts.find(key);
  if (it == opts.end()) return std::optional<uint64_t>();
  Json v = *it;
  opts.erase(it);
  if (v.is_number_unsigned()) return std::optional<uint64_t>(v.get<uint64_t>());
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return std::optional<uint64_t>(v.get<uint64_t>());
  if (v.is_string()) {
    auto r = parse_size(v.get<std::string>());
    if (r) return std::optional<uint64_t>(*r);
  }
  return type_error(key, "a non-negative number below 2^64");
}

Result<std::optional<uint64_t>> take_number(Json& opts, const std::string& key) {
  auto it = opts.find(key);
  if (it == opts.end()) return std::optional<uint64_t>();
  Json v = *it;
  opts.erase(it);
  if (v.is_number_unsigned()) return std::optional<uint64_t>(v.get<uint64_t>());
  if (v.is_number_integer()) return std::optional<uint64_t>(static_cast<uint64_t>(v.get<int64_t>()));
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    const char* p = s.c_str();
    while (std::isspace(static_cast<unsigned char>(*p))) ++p;
    if (*p != '\0') {
      char* end = nullptr;
      errno = 0;
      const unsigned long long n = std::strtoull(p, &end, 0);  // "-5" wraps, as qemu_strtou64's does
      if (errno == 0 && end && *end == '\0') return std::optional<uint64_t>(n);
    }
  }
  return type_error(key, "a number");
}

Result<std::optional<std::string>> take_string(Json& opts, const std::string& key) {
  auto it = opts.find(key);
  if (it == opts.end()) return std::optional<std::string>();
  Json v = *it;
  opts.erase(it);
  if (v.is_string()) return std::optional<std::string>(v.get<std::string>());
  if (v.is_number()) return std::optional<std::string>(v.dump());
  return Error(EINVAL, "Invalid parameter type for '" + key + "', expected: string");
}

std::optional<Json> take_dict(Json& opts, const std::string& key) {
  std::optional<Json> out;
  auto it = opts.find(key);
  if (it != opts.end() && it->is_object()) {
    out = *it;
    opts.erase(it);
  }
  // Flattened members ("key.x": json:{} filenames as QEMU writes them).
  const std::string prefix = key + ".";
  for (auto m = opts.begin(); m != opts.end();) {
    if (m.key().size() > prefix.size() && m.key().compare(0, prefix.size(), prefix) == 0) {
      if (!out) out = Json::object();
      (*out)[m.key().substr(prefix.size())] = m.value();
      m = opts.erase(m);
    } else {
      ++m;
    }
  }
  return out;
}

namespace {

// QEMU's keyval rules for a key (util/keyval.c): dot-separated fragments,
// each a QAPI name (a letter, then letters, digits, '-' and '_') or, after
// the first, a list index (digits), shorter than 128 characters. Beyond
// QEMU: at most kMaxKeyvalDepth fragments, since every consumer of the
// nested options walks them recursively and a command-line argument of
// 128 KiB could otherwise nest 65,536 levels deep.
constexpr size_t kMaxKeyvalDepth = 1024;

Status check_keyval_key(const std::string& key) {
  size_t start = 0, depth = 0;
  for (;;) {
    size_t dot = key.find('.', start);
    const size_t end = dot == std::string::npos ? key.size() : dot;
    const std::string_view frag(key.data() + start, end - start);
    bool ok = !frag.empty();
    if (ok && start != 0 && std::all_of(frag.begin(), frag.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      // a list index
    } else if (ok) {
      ok = std::isalpha(static_cast<unsigned char>(frag[0]));
      for (char c : frag) ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_');
    }
    if (!ok) return Error(EINVAL, "Invalid parameter '" + key + "'");
    if (frag.size() >= 128)
      return Error(EINVAL, std::string("Parameter") + (frag.size() != key.size() ? " fragment" : "") + " '" +
                               std::string(frag) + "' is too long");
    if (++depth > kMaxKeyvalDepth)
      return Error(EINVAL, "Parameter '" + key.substr(0, 64) + "...' nests deeper than " +
                               std::to_string(kMaxKeyvalDepth) + " levels");
    if (dot == std::string::npos) return Status{};
    start = dot + 1;
  }
}

}  // namespace

Result<Json> parse_keyval(const std::string& text, const std::string& implied_key) {
  Json out = Json::object();
  if (text.empty()) return out;
  // Split at single commas; ",," is a literal comma.
  std::vector<std::string> items;
  std::string cur;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ',') {
      if (i + 1 < text.size() && text[i + 1] == ',') {
        cur += ',';
        ++i;
        continue;
      }
      items.push_back(std::move(cur));
      cur.clear();
      continue;
    }
    cur += text[i];
  }
  items.push_back(std::move(cur));
  for (size_t n = 0; n < items.size(); ++n) {
    const std::string& item = items[n];
    size_t eq = item.find('=');
    std::string key, value;
    if (eq != std::string::npos) {
      key = item.substr(0, eq);
      value = item.substr(eq + 1);
    } else if (n == 0 && !implied_key.empty()) {
      key = implied_key;
      value = item;
    } else {
      return Error(EINVAL, "Expected '=' after parameter '" + item + "'");
    }
    if (key.empty()) return Error(EINVAL, "Invalid parameter ''");
    VBLK_TRY(check_keyval_key(key));
    // Nest dotted keys: file.filename=x -> {"file":{"filename":"x"}}.
    Json* node = &out;
    size_t start = 0;
    for (;;) {
      size_t dot = key.find('.', start);
      std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (dot == std::string::npos) {
        if (node->contains(part) && (*node)[part].is_object())
          return Error(EINVAL, "Parameter '" + key + "' conflicts with its sub-keys");
        (*node)[part] = value;
        break;
      }
      Json& next = (*node)[part];
      if (next.is_null()) next = Json::object();
      if (!next.is_object()) return Error(EINVAL, "Parameter '" + key.substr(0, dot) + "' is not a dictionary");
      node = &next;
      start = dot + 1;
    }
  }
  return out;
}

Result<uint64_t> parse_size(const std::string& text) {
  const char* nptr = text.c_str();
  char* end = nullptr;
  errno = 0;
  unsigned long long val = std::strtoull(nptr, &end, 10);
  if (end == nptr) return Error(EINVAL);
  if (errno == ERANGE) return Error(ERANGE);
  for (const char* p = nptr; p < end; ++p)
    if (*p == '-') return Error(EINVAL);
  bool hex = false;
  uint64_t valf = 0;  // fraction as a 0.64 fixed-point number
  if (val == 0 && (*end == 'x' || *end == 'X')) {
    errno = 0;
    val = std::strtoull(nptr, &end, 16);
    if (errno == ERANGE) return Error(ERANGE);
    if (*end == '.') return Error(EINVAL);
    hex = true;
  } else if (*end == '.') {
    char* fend = nullptr;
    double frac = std::strtod(end, &fend);
    if (fend == end) {
      ++end;  // a bare "." : fraction 0
    } else {
      for (const char* p = end; p < fend; ++p)
        if (*p == 'e' || *p == 'E') return Error(EINVAL);
      // Same rounding as QEMU: a fraction that rounds to 1.0 becomes 0
      // (tested before the conversion: 2^64 does not fit in valf).
      valf = frac >= 1.0 ? 0 : static_cast<uint64_t>(std::ldexp(frac, 64));
      end = fend;
    }
  }
  (void)hex;
  uint64_t mul = 1;
  switch (*end) {
    case 'b':
    case 'B':
      mul = 1;
      ++end;
      break;
    case 'k':
    case 'K':
      mul = 1ull << 10;
      ++end;
      break;
    case 'm':
    case 'M':
      mul = 1ull << 20;
      ++end;
      break;
    case 'g':
    case 'G':
      mul = 1ull << 30;
      ++end;
      break;
    case 't':
    case 'T':
      mul = 1ull << 40;
      ++end;
      break;
    case 'p':
    case 'P':
      mul = 1ull << 50;
      ++end;
      break;
    case 'e':
    case 'E':
      mul = 1ull << 60;
      ++end;
      break;
    default: break;
  }
  if (mul == 1 && valf != 0) return Error(EINVAL);
  if (*end != '\0') return Error(EINVAL);
  unsigned __int128 whole = static_cast<unsigned __int128>(val) * mul;
  unsigned __int128 fracmul = static_cast<unsigned __int128>(valf) * mul;
  unsigned __int128 res = whole + (fracmul >> 64);
  if (static_cast<uint64_t>(fracmul) & (1ull << 63)) res += 1;  // round half up
  if (res >> 64) return Error(ERANGE);
  return static_cast<uint64_t>(res);
}

}  // namespace vblk
