// The process's secret objects (util/secret_store.h) and their base64, as
// QEMU's crypto/secret*.c and util/base64.c behave.
#include "vblk/secret_store.h"

#include <gtest/gtest.h>

#include <vector>

#include "vblk/base64.h"

namespace vblk {
namespace {

TEST(Base64, RoundTripAndGlibLeniency) {
  for (const std::string& s : std::vector<std::string>{"", "a", "ab", "abc", "abcd", std::string("\0\xff\x10", 3)})
    EXPECT_EQ(*base64_decode(base64_encode(s)), s);
  EXPECT_EQ(base64_encode("ab"), "YWI=");
  EXPECT_EQ(*base64_decode("YW\nJj"), "abc");  // newlines are skipped
  EXPECT_EQ(*base64_decode("YWJ"), "");        // an incomplete group is dropped
  EXPECT_EQ(base64_decode("YW Jj").error().what(), "Base64 data contains invalid characters");
  EXPECT_EQ(base64_decode(std::string("YW\0J", 4)).error().what(), "Base64 data contains embedded NUL characters");
}

TEST(SecretStore, AddLookupRemoveAndQemuErrors) {
  SecretStore s;
  EXPECT_EQ(s.add("a", {}).error().what(), "Either 'file' or 'data' must be provided");
  EXPECT_EQ(s.add("a", {.data = "x", .file = "/f"}).error().what(), "'file' and 'data' are mutually exclusive");
  ASSERT_TRUE(s.add("a", {.data = "aGVsbG8=", .format = SecretFormat::kBase64}).ok());
  EXPECT_EQ(*s.lookup("a"), "hello");
  EXPECT_EQ(*s.lookup_base64("a"), "aGVsbG8=");
  EXPECT_EQ(s.add("a", {.data = "y"}).error().what(),
            "attempt to add duplicate property 'a' to object (type 'container')");
  ASSERT_TRUE(s.add_other("tg").ok());
  EXPECT_EQ(s.lookup("tg").error().what(), "Object with id 'tg' is not a secret");
  EXPECT_EQ(s.lookup("zz").error().what(), "No secret with id 'zz'");
  EXPECT_EQ(s.add("e", {.data = "x", .keyid = "a"}).error().what(), "Key should be 32 bytes in length");
  EXPECT_TRUE(s.remove("a"));
  EXPECT_FALSE(s.remove("a"));
  EXPECT_EQ(s.lookup("a").error().what(), "No secret with id 'a'");
}

}  // namespace
}  // namespace vblk
