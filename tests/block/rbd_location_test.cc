// QEMU's rbd: filename syntax (block/rbd.c qemu_rbd_parse_filename).
#include "block/drivers/rbd/rbd_location.h"

#include <gtest/gtest.h>

#include "vblk/qdict_order.h"

namespace vblk::rbd {
namespace {

TEST(RbdLocation, PoolImageSnapshotOptions) {
  auto l = parse_rbd_filename("rbd:pool/ns/img@snap:conf=/etc/c\\:x.conf:id=bob:rbd_cache=false");
  ASSERT_TRUE(l.ok()) << l.error().what();
  EXPECT_EQ(l->pool, "pool");
  EXPECT_EQ(*l->ns, "ns");
  EXPECT_EQ(l->image, "img");
  EXPECT_EQ(*l->snapshot, "snap");
  EXPECT_EQ(*l->conf, "/etc/c:x.conf");
  EXPECT_EQ(*l->user, "bob");
  ASSERT_EQ(l->keypairs.size(), 1u);
  EXPECT_EQ(l->keypairs[0].first, "rbd_cache");
  EXPECT_EQ(l->keypairs[0].second, "false");
}

TEST(RbdLocation, PlainAndEscapes) {
  auto l = parse_rbd_filename("rbd:p/im\\@age");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->image, "im@age");
  EXPECT_EQ(*l->ns, "");
  EXPECT_FALSE(l->snapshot);
  EXPECT_FALSE(l->conf);
}

TEST(RbdLocation, QemuErrors) {
  EXPECT_EQ(parse_rbd_filename("rbd:pool").error().what(), "Pool name is required");
  EXPECT_EQ(parse_rbd_filename("nbd:x").error().what(), "File name must start with 'rbd:'");
  EXPECT_EQ(parse_rbd_filename("rbd:p/i:foo").error().what(), "conf option foo has no value");
}

TEST(RbdLocation, JsonFilenameInQemuOrder) {
  auto l = parse_rbd_filename("rbd:rbd/a:conf=/c:id=bob");
  ASSERT_TRUE(l.ok());
  // As qemu-img info prints it for the same filename.
  EXPECT_EQ(qemu_json_compact(location_json(*l)),
            R"({"pool": "rbd", "image": "a", "conf": "/c", "driver": "rbd", "namespace": "", "user": "bob"})");
}

TEST(RbdLocation, BlockdevOptions) {
  Json o = {{"pool", "p"}, {"image", "i"}, {"auth-client-required", {"cephx", "none"}}};
  auto l = take_rbd_location(o);
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(o.empty());
  EXPECT_EQ(l->auth_client_required.size(), 2u);
  Json missing = {{"pool", "p"}};
  EXPECT_EQ(take_rbd_location(missing).error().what(), "Parameter 'image' is missing");
}

TEST(RbdLocation, ImageOptsListsKeySecretAndEncrypt) {
  // --image-opts spells lists with numbered keys; key-secret stays out of
  // the json: name, as in QEMU.
  Json o = {{"pool", "p"},
            {"image", "i"},
            {"key-secret", "s"},
            {"auth-client-required", {{"0", "none"}}},
            {"encrypt", {{"format", "luks2"}, {"key-secret", "pw"}}}};
  auto l = take_rbd_location(o);
  ASSERT_TRUE(l.ok()) << l.error().what();
  EXPECT_TRUE(o.empty());
  EXPECT_EQ(l->auth_client_required, std::vector<std::string>{"none"});
  EXPECT_EQ(*l->key_secret, "s");
  ASSERT_TRUE(l->encrypt.has_value());
  EXPECT_EQ(l->encrypt->format, "luks2");
  EXPECT_EQ(l->encrypt->key_secret, "pw");
  EXPECT_EQ(qemu_json_compact(location_json(*l)), R"({"pool": "p", "image": "i", "driver": "rbd"})");
}

TEST(RbdLocation, EncryptionErrorsAsQemu) {
  auto err = [](Json d, const std::string& prefix, bool create) {
    auto e = parse_encryption(d, prefix, create);
    return e.ok() ? std::string("ok") : e.error().what();
  };
  EXPECT_EQ(err({{"key-secret", "s"}}, "encrypt.", false), "Parameter 'encrypt.format' is missing");
  EXPECT_EQ(err({{"format", "luks"}}, "", true), "Parameter 'key-secret' is missing");
  EXPECT_EQ(err({{"format", "x"}, {"key-secret", "s"}}, "encrypt.", false),
            "Parameter 'format' does not accept value 'x'");
  EXPECT_EQ(err({{"format", "luks"}, {"key-secret", "s"}, {"cipher-alg", "sm4"}}, "", true),
            "Parameter 'cipher-alg' does not accept value 'sm4'");
  EXPECT_EQ(err({{"format", "luks"}, {"key-secret", "s"}, {"cipher-alg", "aes-128"}}, "", false),
            "Parameter 'cipher-alg' is unexpected");
  EXPECT_EQ(err({{"format", "luks"}, {"key-secret", "s"}, {"cipher-alg", "des"}}, "", true), "ok");
  EXPECT_EQ(cipher_alg_number("des"), 3);
  EXPECT_EQ(cipher_alg_number("twofish-256"), 11);
}

}  // namespace
}  // namespace vblk::rbd
