#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "vblk/qmp_json.h"

namespace vblk::qmp {

namespace {

// QEMU's limits per message (json-streamer.c): they keep a hostile client
// from making the daemon allocate without bound.
constexpr uint64_t kMaxTokenSize = 64ull << 20;
constexpr size_t kMaxTokenCount = 2ull << 20;
constexpr int kMaxNesting = 1024;

bool is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

// QEMU's is_valid_codepoint: no surrogates, no noncharacters.
bool valid_codepoint(long cp) {
  if (cp < 0 || cp > 0x10FFFF) return false;
  if ((cp & 0xFFFFF800) == 0xD800) return false;
  if ((cp >= 0xFDD0 && cp <= 0xFDEF) || (cp & 0xFFFE) == 0xFFFE) return false;
  return true;
}

void utf8_append(std::string& s, long cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Decodes one (modified) UTF-8 sequence at s[i]; returns the code point or
// -1 (and how many bytes to skip either way), as QEMU's mod_utf8_codepoint.
long utf8_next(const std::string& s, size_t i, size_t& len) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  len = 1;
  if (c < 0x80) return c;
  int n;
  long cp;
  if (c >= 0xC0 && c < 0xE0) {
    n = 1;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c < 0xF0) {
    n = 2;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c < 0xF8) {
    n = 3;
    cp = c & 0x07;
  } else {
    return -1;
  }
  for (int k = 1; k <= n; ++k) {
    if (i + k >= s.size()) return -1;
    unsigned char d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) return -1;
    cp = (cp << 6) | (d & 0x3F);
    len = k + 1;
  }
  if (n == 1 && cp == 0) return 0;  // modified UTF-8's NUL (C0 80)
  static const long kMin[] = {0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || !valid_codepoint(cp)) return -1;
  return cp;
}

int hex4(const std::string& s, size_t i) {
  int cp = 0;
  for (size_t k = 0; k < 4; ++k) {
    if (i + k >= s.size()) return -1;
    char c = s[i + k];
    int d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if (c >= 'a' && c <= 'f')
      d = 10 + c - 'a';
    else if (c >= 'A' && c <= 'F')
      d = 10 + c - 'A';
    else
      return -1;
    cp = (cp << 4) | d;
  }
  return cp;
}

}  // namespace

// ---------------------------------------------------------------- parser

namespace {

struct Parser {
  const std::vector<std::pair<int, std::string>>& toks;
  size_t pos = 0;
  std::string err;  // the first error wins, as in QEMU

  void error(const std::string& m) {
    if (err.empty()) err = "JSON parse error, " + m;
  }
  const std::pair<int, std::string>* peek() const { return pos < toks.size() ? &toks[pos] : nullptr; }
  const std::pair<int, std::string>* pop() { return pos < toks.size() ? &toks[pos++] : nullptr; }

  std::optional<OJson> value();
  std::optional<OJson> object();
  std::optional<bool> opened(int closer);
  std::optional<bool> separator(int closer, const char* container);
  std::optional<OJson> array();
  std::optional<OJson> literal(const std::pair<int, std::string>& t);
  std::optional<std::string> string(const std::string& text);
};

enum : int { kLCurly, kRCurly, kLSquare, kRSquare, kColon, kComma, kInteger, kFloat, kKeyword, kString };

std::optional<std::string> Parser::string(const std::string& s) {
  std::string out;
  char quote = s[0];
  size_t i = 1;
  while (i < s.size() && s[i] != quote) {
    if (s[i] == '\\') {
      size_t beg = i++;
      char c = i < s.size() ? s[i++] : 0;
      switch (c) {
        case '"': out += '"'; break;
        case '\'': out += '\''; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          long cp = hex4(s, i);
          i += 4;
          if (cp >= 0xD800 && cp <= 0xDBFF && i + 1 < s.size() && s[i] == '\\' && s[i + 1] == 'u') {
            cp = 0x10000 + ((cp & 0x3FF) << 10);
            int trailing = hex4(s, i + 2);
            if (trailing >= 0xDC00 && trailing <= 0xDFFF) {
              cp |= trailing & 0x3FF;
              i += 6;
            } else {
              cp = -1;
            }
          }
          if (cp != 0 && !valid_codepoint(cp)) {
            error(s.substr(beg, std::min(i, s.size()) - beg) + " is not a valid Unicode character");
            return std::nullopt;
          }
          utf8_append(out, cp);
          break;
        }
        default: error("invalid escape sequence in string"); return std::nullopt;
      }
      continue;
    }
    size_t len;
    long cp = utf8_next(s, i, len);
    if (cp < 0) {
      error("invalid UTF-8 sequence in string");
      return std::nullopt;
    }
    utf8_append(out, cp);
    i += len;
  }
  return out;
}

std::optional<OJson> Parser::literal(const std::pair<int, std::string>& t) {
  if (t.first == kString) {
    auto s = string(t.second);
    if (!s) return std::nullopt;
    return OJson(std::move(*s));
  }
  const char* p = t.second.c_str();
  if (t.first == kInteger) {
    errno = 0;
    char* end;
    long long v = std::strtoll(p, &end, 10);
    if (errno == 0) return OJson(static_cast<int64_t>(v));
    if (p[0] != '-') {
      errno = 0;
      unsigned long long u = std::strtoull(p, &end, 10);
      if (errno == 0) return OJson(static_cast<uint64_t>(u));
    }
  }
  return OJson(std::strtod(p, nullptr));
}

// Just after `{` or `[`: is the container empty (its closer is taken)?
std::optional<bool> Parser::opened(int closer) {
  auto* t = peek();
  if (!t) {
    error("premature EOI");
    return std::nullopt;
  }
  if (t->first != closer) return false;
  pop();
  return true;
}

// The token after a member: `closer` ends the container (true), a comma asks
// for another member (false); anything else is an error in QEMU's words.
std::optional<bool> Parser::separator(int closer, const char* container) {
  auto* sep = pop();
  if (!sep) {
    error("premature EOI");
    return std::nullopt;
  }
  if (sep->first == closer) return true;
  if (sep->first != kComma) {
    error(std::string("expected separator in ") + container);
    return std::nullopt;
  }
  return false;
}

std::optional<OJson> Parser::object() {
  pop();  // {
  OJson obj = OJson::object();
  auto empty = opened(kRCurly);
  if (!empty) return std::nullopt;
  if (*empty) return obj;
  for (;;) {
    auto* kt = peek();
    if (!kt) {
      error("premature EOI");
      return std::nullopt;
    }
    auto key = value();
    if (!key || !key->is_string()) {
      error("key is not a string in object");
      return std::nullopt;
    }
    auto* colon = pop();
    if (!colon) {
      error("premature EOI");
      return std::nullopt;
    }
    if (colon->first != kColon) {
      error("missing : in object pair");
      return std::nullopt;
    }
    auto v = value();
    if (!v) {
      error("Missing value in dict");
      return std::nullopt;
    }
    std::string k = key->get<std::string>();
    if (obj.contains(k)) {
      error("duplicate key");
      return std::nullopt;
    }
    obj[k] = std::move(*v);
    auto closed = separator(kRCurly, "dict");
    if (!closed) return std::nullopt;
    if (*closed) return obj;
  }
}

std::optional<OJson> Parser::array() {
  pop();  // [
  OJson arr = OJson::array();
  auto empty = opened(kRSquare);
  if (!empty) return std::nullopt;
  if (*empty) return arr;
  for (;;) {
    auto v = value();
    if (!v) {
      error("expecting value");
      return std::nullopt;
    }
    arr.push_back(std::move(*v));
    auto closed = separator(kRSquare, "list");
    if (!closed) return std::nullopt;
    if (*closed) return arr;
  }
}

std::optional<OJson> Parser::value() {
  auto* t = peek();
  if (!t) {
    error("premature EOI");
    return std::nullopt;
  }
  switch (t->first) {
    case kLCurly: return object();
    case kLSquare: return array();
    case kInteger:
    case kFloat:
    case kString: return literal(*pop());
    case kKeyword: {
      auto* k = pop();
      if (k->second == "true") return OJson(true);
      if (k->second == "false") return OJson(false);
      if (k->second == "null") return OJson(nullptr);
      error("invalid keyword '" + k->second + "'");
      return std::nullopt;
    }
    default: error("expecting value"); return std::nullopt;
  }
}

}  // namespace

// ---------------------------------------------------------------- streamer

void JsonStreamer::reset_message() {
  tokens_.clear();
  braces_ = brackets_ = 0;
  token_bytes_ = 0;
}

void JsonStreamer::lex_error(std::vector<JsonMessage>& out) {
  // QEMU prints the token text as a C string.
  std::string shown = text_.substr(0, text_.find('\0'));
  out.push_back({false, nullptr, "JSON parse error, stray '" + shown + "'"});
  reset_message();
  text_.clear();
  state_ = St::Recovery;
}

void JsonStreamer::token(Tok t, std::vector<JsonMessage>& out) {
  switch (t) {
    case Tok::LCurly: ++braces_; break;
    case Tok::RCurly: --braces_; break;
    case Tok::LSquare: ++brackets_; break;
    case Tok::RSquare: --brackets_; break;
    default: break;
  }
  std::string limit;
  if (token_bytes_ + text_.size() + 1 > kMaxTokenSize)
    limit = "JSON token size limit exceeded";
  else if (tokens_.size() + 1 > kMaxTokenCount)
    limit = "JSON token count limit exceeded";
  else if (braces_ + brackets_ > kMaxNesting)
    limit = "JSON nesting depth limit exceeded";
  if (!limit.empty()) {
    out.push_back({false, nullptr, limit});
    reset_message();
    text_.clear();
    return;
  }
  token_bytes_ += text_.size();
  tokens_.push_back({t, std::move(text_)});
  text_.clear();
  if ((braces_ > 0 || brackets_ > 0) && braces_ >= 0 && brackets_ >= 0) return;
  std::vector<std::pair<int, std::string>> toks;
  toks.reserve(tokens_.size());
  for (auto& tk : tokens_) toks.emplace_back(static_cast<int>(tk.type), std::move(tk.text));
  reset_message();
  Parser p{toks};
  auto v = p.value();
  if (v && p.err.empty()) {
    out.push_back({true, std::move(*v), {}});
  } else {
    out.push_back({false, nullptr, p.err.empty() ? "JSON parse error, expecting value" : p.err});
  }
}

void JsonStreamer::feed_char(char ch, std::vector<JsonMessage>& out) {
  unsigned char c = static_cast<unsigned char>(ch);
  for (;;) {
    switch (state_) {
      case St::Recovery:
        if ((c < 0x20 && c != '\t') || c >= 0xFE || c == '[' || c == ']' || c == '{' || c == '}' || c == ':' ||
            c == ',') {
          state_ = St::Start;
          continue;  // look at c again
        }
        return;
      case St::Start:
        if (is_ws(c)) return;
        text_ += ch;
        switch (c) {
          case '"': state_ = St::DqString; return;
          case '\'': state_ = St::SqString; return;
          case '0': state_ = St::Zero; return;
          case '-': state_ = St::Sign; return;
          case '{': token(Tok::LCurly, out); return;
          case '}': token(Tok::RCurly, out); return;
          case '[': token(Tok::LSquare, out); return;
          case ']': token(Tok::RSquare, out); return;
          case ',': token(Tok::Comma, out); return;
          case ':': token(Tok::Colon, out); return;
          default: break;
        }
        if (c >= '1' && c <= '9') {
          state_ = St::Digits;
          return;
        }
        if (c >= 'a' && c <= 'z') {
          state_ = St::Keyword;
          return;
        }
        lex_error(out);
        return;
      case St::DqString:
      case St::SqString: {
        char quote = state_ == St::DqString ? '"' : '\'';
        text_ += ch;
        if (c < 0x20 || c > 0xFD) {
          lex_error(out);
        } else if (ch == '\\') {
          state_ = state_ == St::DqString ? St::DqEscape : St::SqEscape;
        } else if (ch == quote) {
          state_ = St::Start;
          token(Tok::String, out);
        }
        if (text_.size() > kMaxTokenSize) {
          out.push_back({false, nullptr, "JSON token size limit exceeded"});
          reset_message();
          text_.clear();
          state_ = St::Recovery;
        }
        return;
      }
      case St::DqEscape:
      case St::SqEscape:
        text_ += ch;
        if (c < 0x20 || c > 0xFD) {
          lex_error(out);
          return;
        }
        state_ = state_ == St::DqEscape ? St::DqString : St::SqString;
        return;
      case St::Zero:
        if (is_digit(c)) {
          text_ += ch;
          lex_error(out);
          return;
        }
        if (c == '.') {
          text_ += ch;
          state_ = St::Mantissa;
          return;
        }
        state_ = St::Start;
        token(Tok::Integer, out);
        continue;
      case St::Digits:
        if (is_digit(c)) {
          text_ += ch;
          return;
        }
        if (c == 'e' || c == 'E') {
          text_ += ch;
          state_ = St::ExpE;
          return;
        }
        if (c == '.') {
          text_ += ch;
          state_ = St::Mantissa;
          return;
        }
        state_ = St::Start;
        token(Tok::Integer, out);
        continue;
      case St::Sign:
        text_ += ch;
        if (c == '0')
          state_ = St::Zero;
        else if (c >= '1' && c <= '9')
          state_ = St::Digits;
        else
          lex_error(out);
        return;
      case St::Mantissa:
        text_ += ch;
        if (is_digit(c))
          state_ = St::MantissaDigits;
        else
          lex_error(out);
        return;
      case St::MantissaDigits:
        if (is_digit(c)) {
          text_ += ch;
          return;
        }
        if (c == 'e' || c == 'E') {
          text_ += ch;
          state_ = St::ExpE;
          return;
        }
        state_ = St::Start;
        token(Tok::Float, out);
        continue;
      case St::ExpE:
        text_ += ch;
        if (c == '-' || c == '+')
          state_ = St::ExpSign;
        else if (is_digit(c))
          state_ = St::ExpDigits;
        else
          lex_error(out);
        return;
      case St::ExpSign:
        text_ += ch;
        if (is_digit(c))
          state_ = St::ExpDigits;
        else
          lex_error(out);
        return;
      case St::ExpDigits:
        if (is_digit(c)) {
          text_ += ch;
          return;
        }
        state_ = St::Start;
        token(Tok::Float, out);
        continue;
      case St::Keyword:
        if (c >= 'a' && c <= 'z') {
          text_ += ch;
          if (text_.size() > kMaxTokenSize) lex_error(out);
          return;
        }
        state_ = St::Start;
        token(Tok::Keyword, out);
        continue;
    }
  }
}

void JsonStreamer::feed(std::string_view bytes, std::vector<JsonMessage>& out) {
  for (char c : bytes) feed_char(c, out);
}

void JsonStreamer::finish(std::vector<JsonMessage>& out) {
  switch (state_) {
    case St::Start:
    case St::Recovery: break;
    case St::Zero:
    case St::Digits:
      state_ = St::Start;
      token(Tok::Integer, out);
      break;
    case St::MantissaDigits:
    case St::ExpDigits:
      state_ = St::Start;
      token(Tok::Float, out);
      break;
    case St::Keyword:
      state_ = St::Start;
      token(Tok::Keyword, out);
      break;
    default: lex_error(out); break;
  }
  state_ = St::Start;
  if (tokens_.empty()) return;
  std::vector<std::pair<int, std::string>> toks;
  for (auto& tk : tokens_) toks.emplace_back(static_cast<int>(tk.type), std::move(tk.text));
  reset_message();
  Parser p{toks};
  auto v = p.value();
  if (v && p.err.empty())
    out.push_back({true, std::move(*v), {}});
  else
    out.push_back({false, nullptr, p.err.empty() ? "JSON parse error, expecting value" : p.err});
}

JsonMessage parse_json_value(std::string_view text) {
  JsonStreamer js;
  std::vector<JsonMessage> out;
  js.feed(text, out);
  js.finish(out);
  if (out.empty()) return {false, nullptr, "Expecting a JSON value"};
  if (out.size() > 1 && out[0].ok) return {false, nullptr, "JSON parse error, expecting value"};
  return out[0];
}

// ---------------------------------------------------------------- output

namespace {

// QEMU's qdict bucket of a key (tdb_hash modulo QDICT_BUCKET_MAX).
unsigned qdict_bucket(const std::string& key) {
  uint32_t v = 0x238F13AFu * static_cast<uint32_t>(key.size());
  for (size_t i = 0; i < key.size(); ++i)
    v = v + (static_cast<uint32_t>(static_cast<unsigned char>(key[i])) << (i * 5 % 24));
  return (1103515243u * v + 12345u) % 512;
}

void quoted(const std::string& s, std::string& out) {
  out += '"';
  size_t i = 0;
  char buf[32];
  while (i < s.size()) {
    size_t len;
    long cp = utf8_next(s, i, len);
    i += len;
    switch (cp) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      default: break;
    }
    if (cp < 0) cp = 0xFFFD;
    if (cp > 0xFFFF) {
      std::snprintf(buf, sizeof buf, "\\u%04lX\\u%04lX", 0xD800 + ((cp - 0x10000) >> 10),
                    0xDC00 + ((cp - 0x10000) & 0x3FF));
      out += buf;
    } else if (cp < 0x20 || cp >= 0x7F) {
      std::snprintf(buf, sizeof buf, "\\u%04lX", cp);
      out += buf;
    } else {
      out += static_cast<char>(cp);
    }
  }
  out += '"';
}

void write(const OJson& v, std::string& out) {
  char buf[64];
  switch (v.type()) {
    case OJson::value_t::null: out += "null"; return;
    case OJson::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
    case OJson::value_t::number_integer:
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v.get<int64_t>()));
      out += buf;
      return;
    case OJson::value_t::number_unsigned:
      std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(v.get<uint64_t>()));
      out += buf;
      return;
    case OJson::value_t::number_float:
      std::snprintf(buf, sizeof buf, "%.17g", v.get<double>());
      out += buf;
      return;
    case OJson::value_t::string: quoted(v.get_ref<const std::string&>(), out); return;
    case OJson::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& e : v) {
        if (!first) out += ", ";
        first = false;
        write(e, out);
      }
      out += ']';
      return;
    }
    case OJson::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& k : qdict_key_order(v)) {
        if (!first) out += ", ";
        first = false;
        quoted(k, out);
        out += ": ";
        write(v.at(k), out);
      }
      out += '}';
      return;
    }
    default: out += "null"; return;
  }
}

}  // namespace

std::vector<std::string> qdict_key_order(const OJson& obj) {
  // By bucket; within a bucket the newest entry first (QLIST_INSERT_HEAD).
  struct Ent {
    unsigned bucket;
    size_t idx;
    std::string key;
  };
  std::vector<Ent> ents;
  size_t idx = 0;
  for (auto it = obj.begin(); it != obj.end(); ++it, ++idx) ents.push_back({qdict_bucket(it.key()), idx, it.key()});
  std::sort(ents.begin(), ents.end(), [](const Ent& a, const Ent& b) {
    if (a.bucket != b.bucket) return a.bucket < b.bucket;
    return a.idx > b.idx;
  });
  std::vector<std::string> out;
  for (auto& e : ents) out.push_back(std::move(e.key));
  return out;
}

std::string to_qmp_text(const OJson& v) {
  std::string out;
  write(v, out);
  return out;
}

}  // namespace vblk::qmp
