// QMP JSON: message cutting, QEMU's error texts and recovery, and output
// in QEMU's byte format (the interop test compares whole reply lines with
// qemu-storage-daemon; these pin the pieces down without a daemon).
#include <gtest/gtest.h>

#include "vblk/qmp_json.h"
#include "vblk/qmp_registry.h"

namespace vblk::qmp {
namespace {

std::vector<JsonMessage> feed(const std::string& s) {
  JsonStreamer js;
  std::vector<JsonMessage> out;
  js.feed(s, out);
  return out;
}

std::vector<std::string> texts(const std::string& s) {
  std::vector<std::string> r;
  for (auto& m : feed(s)) r.push_back(m.ok ? to_qmp_text(m.value) : "ERR " + m.error);
  return r;
}

TEST(QmpJson, CutsMessagesWhereBracesBalance) {
  EXPECT_EQ(texts("{\"a\": 1}{\"b\": [1, 2]}\n  3 "), (std::vector<std::string>{"{\"a\": 1}", "{\"b\": [1, 2]}", "3"}));
  // A number at the end of the input is not complete until something follows it.
  EXPECT_EQ(texts("3 "), (std::vector<std::string>{"3"}));
  JsonStreamer js;
  std::vector<JsonMessage> out;
  js.feed("{\"execute\": \"q", out);
  EXPECT_TRUE(out.empty());
  js.feed("\"}", out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].value["execute"], "q");
}

TEST(QmpJson, ErrorsAreQemus) {
  EXPECT_EQ(texts("{\"a\" 1}"), (std::vector<std::string>{"ERR JSON parse error, missing : in object pair"}));
  EXPECT_EQ(texts("{1: 2}"), (std::vector<std::string>{"ERR JSON parse error, key is not a string in object"}));
  EXPECT_EQ(texts("[1 2]"), (std::vector<std::string>{"ERR JSON parse error, expected separator in list"}));
  EXPECT_EQ(texts("{\"a\":1,\"a\":2}"), (std::vector<std::string>{"ERR JSON parse error, duplicate key"}));
  EXPECT_EQ(texts("garbage "), (std::vector<std::string>{"ERR JSON parse error, invalid keyword 'garbage'"}));
  EXPECT_EQ(texts("\"\\ud800\""),
            (std::vector<std::string>{"ERR JSON parse error, \\ud800 is not a valid Unicode character"}));
  // A stray character: the error, then recovery at the next structural one.
  EXPECT_EQ(texts("{\"a\": @}"),
            (std::vector<std::string>{"ERR JSON parse error, stray '@'", "ERR JSON parse error, expecting value"}));
  EXPECT_EQ(texts("01 "), (std::vector<std::string>{"ERR JSON parse error, stray '01'"}));
  EXPECT_EQ(texts("Abc\n{}"), (std::vector<std::string>{"ERR JSON parse error, stray 'A'", "{}"}));
  // Single quotes are QEMU's extension.
  EXPECT_EQ(texts("{'a': 'b\"'}"), (std::vector<std::string>{"{\"a\": \"b\\\"\"}"}));
}

TEST(QmpJson, NestingIsBounded) {
  std::string deep(2000, '[');
  auto out = feed(deep);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out[0].error, "JSON nesting depth limit exceeded");
}

TEST(QmpJson, OutputMatchesQemu) {
  // QDict order (hash buckets), not insertion order.
  OJson v = OJson::object();
  v["major"] = 7;
  v["minor"] = 2;
  v["micro"] = 22;
  EXPECT_EQ(to_qmp_text(v), "{\"micro\": 22, \"minor\": 2, \"major\": 7}");
  OJson ev = {{"event", "X"}, {"data", OJson::object()}, {"timestamp", 1}};
  EXPECT_EQ(to_qmp_text(ev), "{\"timestamp\": 1, \"event\": \"X\", \"data\": {}}");
  EXPECT_EQ(to_qmp_text(OJson("a\xc3\xa9\n\"\\/\x01\xf0\x9f\x98\x80")),
            "\"a\\u00E9\\n\\\"\\\\/\\u0001\\uD83D\\uDE00\"");
  EXPECT_EQ(to_qmp_text(OJson::array({1, -2, 1.5, nullptr, true})), "[1, -2, 1.5, null, true]");
  EXPECT_EQ(to_qmp_text(OJson(18446744073709551615ull)), "18446744073709551615");
}

TEST(QmpArgs, CheckedInSchemaOrderThenUnexpected) {
  std::vector<Arg> s = {{"a", ArgType::Str, true}, {"b", ArgType::Bool}, {"t", ArgType::Enum, false, {"x", "y"}}};
  EXPECT_EQ(check_args(s, false, OJson::object()), "Parameter 'a' is missing");
  EXPECT_EQ(check_args(s, false, OJson{{"a", 1}}), "Invalid parameter type for 'a', expected: string");
  EXPECT_EQ(check_args(s, false, OJson{{"a", "v"}, {"b", "on"}}), "Invalid parameter type for 'b', expected: boolean");
  EXPECT_EQ(check_args(s, false, OJson{{"a", "v"}, {"t", "z"}}), "Parameter 't' does not accept value 'z'");
  EXPECT_EQ(check_args(s, false, OJson{{"a", "v"}, {"zz", 1}}), "Parameter 'zz' is unexpected");
  EXPECT_EQ(check_args(s, true, OJson{{"a", "v"}, {"zz", 1}}), std::nullopt);
  std::vector<Arg> nested = {{"addr", ArgType::Struct, true, {}, {{"path", ArgType::Str, true}}}};
  EXPECT_EQ(check_args(nested, false, OJson{{"addr", OJson::object()}}), "Parameter 'addr.path' is missing");
}

}  // namespace
}  // namespace vblk::qmp
