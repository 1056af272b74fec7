// QMP's JSON dialect, as QEMU 7.2 speaks it on the wire.
//
// Input: a streaming lexer + parser that cuts a byte stream into messages
// the way QEMU's json-lexer/json-streamer/json-parser do (a message ends
// when its braces and brackets balance; single-quoted strings are allowed;
// lexical errors resynchronise at the next structural or control
// character), and that reports errors with QEMU's exact descriptions
// ("JSON parse error, expecting value", "... stray '@'", ...). Values come
// out as nlohmann::ordered_json.
//
// Output: to_qmp_text() writes a value the way QEMU's qobject_to_json()
// does: ", " and ": " separators, non-ASCII and control characters as
// \uXXXX, and object members in QDict order (QEMU's dict is a hash table
// of 512 buckets iterated in bucket order, newest entry first within a
// bucket), so replies are byte-for-byte those of qemu-storage-daemon.
//
// Thread-safety: plain values; a JsonStreamer belongs to one connection.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace vblk::qmp {

using OJson = nlohmann::ordered_json;

// One message cut from the stream: a value, or the error QEMU reports.
struct JsonMessage {
  bool ok = false;
  OJson value;
  std::string error;  // "JSON parse error, ..." when !ok
};

class JsonStreamer {
 public:
  // Feeds bytes; every message completed by them is appended to `out`.
  void feed(std::string_view bytes, std::vector<JsonMessage>& out);
  // End of input: completes a pending token and parses what is left
  // (QEMU's json_message_parser_flush: "premature EOI" for a torn value).
  void finish(std::vector<JsonMessage>& out);

 private:
  enum class Tok : uint8_t { LCurly, RCurly, LSquare, RSquare, Colon, Comma, Integer, Float, Keyword, String };
  struct Token {
    Tok type;
    std::string text;
  };
  enum class St : uint8_t {
    Start,
    Recovery,
    DqString,
    DqEscape,
    SqString,
    SqEscape,
    Zero,
    ExpDigits,
    ExpSign,
    ExpE,
    Mantissa,
    MantissaDigits,
    Digits,
    Sign,
    Keyword
  };
  void feed_char(char c, std::vector<JsonMessage>& out);
  void token(Tok t, std::vector<JsonMessage>& out);
  void lex_error(std::vector<JsonMessage>& out);
  void reset_message();

  St state_ = St::Start;
  std::string text_;  // the token being lexed
  std::vector<Token> tokens_;
  int braces_ = 0, brackets_ = 0;
  uint64_t token_bytes_ = 0;
};

// The keys of an object in the order QEMU iterates a QDict with them.
std::vector<std::string> qdict_key_order(const OJson& obj);

// Parses one whole value as QEMU's qobject_from_json does (--blockdev JSON).
JsonMessage parse_json_value(std::string_view text);

// QEMU's qobject_to_json (compact form).
std::string to_qmp_text(const OJson& v);

}  // namespace vblk::qmp
