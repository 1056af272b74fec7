// The luks driver's parts: header validation (QEMU 7.2's checks and words),
// algorithm names, and known answers for PBKDF2 (RFC 7914 / RFC 6070), the
// sector cipher's IV generators and the anti-forensic merge (computed with
// Python's hashlib and cryptography, an independent implementation).
#include "block/drivers/luks/luks.h"

#include <gtest/gtest.h>

#include <functional>

#include "block/drivers/luks/create.h"
#include "vblk/loop.h"
#include "vblk/secret_store.h"

namespace vblk::luks {
namespace {

std::string hex(std::span<const uint8_t> b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t c : b) {
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

std::span<const uint8_t> bytes(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

// The header qemu-img create -f luks writes by default (aes-256 xts-plain64
// sha256: 64-byte key, slot areas of 250 sectors rounded to 256).
Header good_header() {
  Header h;
  h.cipher_name = "aes";
  h.cipher_mode = "xts-plain64";
  h.hash_spec = "sha256";
  h.master_key_len = 64;
  h.master_key_iterations = 1000;
  h.uuid = "0195fc95-8db2-45a4-8c25-628b996217cf";
  for (size_t i = 0; i < kNumKeySlots; ++i) h.slots[i].key_offset_sector = static_cast<uint32_t>(8 + 504 * i);
  h.payload_offset_sector = 8 + 504 * 8;
  h.slots[0].active = kSlotEnabled;
  h.slots[0].iterations = 1000;
  return h;
}

// Serializes, patches the raw bytes, parses: as a hostile file would be read.
Result<Header> parse_patched(const std::function<void(std::vector<uint8_t>&)>& patch) {
  auto b = serialize_header(good_header());
  patch(b);
  return parse_header(b);
}

void put32(std::vector<uint8_t>& b, size_t off, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[off + i] = static_cast<uint8_t>(v >> (24 - 8 * i));
}

std::string error_of(const std::function<void(std::vector<uint8_t>&)>& patch) {
  auto h = parse_patched(patch);
  return h ? "" : h.error().what();
}

constexpr size_t kSlot0 = 208, kSlotSize = 48;

TEST(LuksHeader, RoundTripAndProbe) {
  auto b = serialize_header(good_header());
  ASSERT_EQ(b.size(), kHeaderSize);
  EXPECT_TRUE(has_luks_magic(b));
  auto h = parse_header(b);
  ASSERT_TRUE(h.ok()) << h.error().what();
  EXPECT_EQ(h->cipher_mode, "xts-plain64");
  EXPECT_EQ(h->payload_offset(), 2068480u);  // qemu-img's for aes-256-xts
  EXPECT_EQ(h->uuid, "0195fc95-8db2-45a4-8c25-628b996217cf");
  auto a = parse_algorithms(*h);
  ASSERT_TRUE(a.ok()) << a.error().what();
  EXPECT_EQ(a->cipher_alg, "aes-256");
  EXPECT_EQ(a->cipher_mode, "xts");
  EXPECT_EQ(a->ivgen_alg, "plain64");
  // LUKS2 and short buffers are not LUKS1.
  b[7] = 2;
  EXPECT_FALSE(has_luks_magic(b));
  EXPECT_FALSE(has_luks_magic(std::span<const uint8_t>(b).subspan(0, 7)));
}

TEST(LuksHeader, HostileFieldsRefusedWithQemuWords) {
  EXPECT_EQ(error_of([](auto& b) { b[0] = 'X'; }), "Volume is not in LUKS format");
  EXPECT_EQ(error_of([](auto& b) { b[7] = 2; }), "LUKS version 2 is not supported");
  EXPECT_EQ(error_of([](auto& b) { std::fill(b.begin() + 8, b.begin() + 40, 'a'); }),
            "LUKS header cipher name is not NUL terminated");
  EXPECT_EQ(error_of([](auto& b) { std::fill(b.begin() + 40, b.begin() + 72, 'a'); }),
            "LUKS header cipher mode is not NUL terminated");
  EXPECT_EQ(error_of([](auto& b) { std::fill(b.begin() + 72, b.begin() + 104, 'a'); }),
            "LUKS header hash spec is not NUL terminated");
  EXPECT_EQ(error_of([](auto& b) { put32(b, 104, 1); }), "LUKS payload is overlapping with the header");
  EXPECT_EQ(error_of([](auto& b) { put32(b, 164, 0); }), "LUKS key iteration count is zero");
  EXPECT_EQ(error_of([](auto& b) { put32(b, kSlot0 + 3 * kSlotSize + 44, 0); }),
            "Keyslot 3 is corrupted (stripes 0 != 4000)");
  EXPECT_EQ(error_of([](auto& b) { put32(b, kSlot0 + 2 * kSlotSize, 1); }),
            "Keyslot 2 state (active/disable) is corrupted");
  EXPECT_EQ(error_of([](auto& b) { put32(b, kSlot0 + 4, 0); }), "Keyslot 0 iteration count is zero");
  EXPECT_EQ(error_of([](auto& b) { put32(b, kSlot0 + 40, 1); }), "Keyslot 0 is overlapping with the LUKS header");
  EXPECT_EQ(error_of([](auto& b) { put32(b, kSlot0 + 7 * kSlotSize + 40, 4000); }),
            "Keyslot 7 is overlapping with the encrypted payload");
  EXPECT_EQ(error_of([](auto& b) { put32(b, kSlot0 + 5 * kSlotSize + 40, 8 + 504 * 4); }),
            "Keyslots 4 and 5 are overlapping in the header");
  // Huge key bytes: slots then reach past the payload (64-bit sums, no wrap).
  EXPECT_EQ(error_of([](auto& b) { put32(b, 108, 0xFFFFFFFF); }),
            "Keyslot 0 is overlapping with the encrypted payload");
  // Offsets near 2^32 sectors do not wrap either.
  EXPECT_EQ(error_of([](auto& b) { put32(b, kSlot0 + 7 * kSlotSize + 40, 0xFFFFFFFF); }),
            "Keyslot 7 is overlapping with the encrypted payload");
}

TEST(LuksHeader, AlgorithmNames) {
  auto alg_error = [](const char* name, const char* mode, const char* hash, uint32_t key) {
    Header h = good_header();
    h.cipher_name = name;
    h.cipher_mode = mode;
    h.hash_spec = hash;
    h.master_key_len = key;
    auto a = parse_algorithms(h);
    return a ? std::string() : a.error().what();
  };
  EXPECT_EQ(alg_error("foo", "xts-plain64", "sha256", 64), "Algorithm 'foo' with key size 32 bytes not supported");
  EXPECT_EQ(alg_error("aes", "xts-plain64", "sha256", 4000000000u),
            "Algorithm 'aes' with key size 2000000000 bytes not supported");
  EXPECT_EQ(alg_error("aes", "xtsplain64", "sha256", 64), "Unexpected cipher mode string format 'xtsplain64'");
  EXPECT_EQ(alg_error("aes", "foo-plain64", "sha256", 64), "Cipher mode 'foo' not supported");
  EXPECT_EQ(alg_error("aes", "xts-plain65", "sha256", 64), "IV generator 'plain65' not supported");
  EXPECT_EQ(alg_error("aes", "xts-plain65:sha257", "sha256", 64), "Hash algorithm 'sha257' not supported");
  EXPECT_EQ(alg_error("aes", "xts-plain64", "sha2566", 64), "Hash algorithm 'sha2566' not supported");
  EXPECT_EQ(alg_error("aes", "cbc-essiv", "sha256", 32), "Missing IV generator hash specification");
  EXPECT_EQ(alg_error("aes", "cbc-essiv:sha256", "sha1", 16), "");
}

TEST(LuksCrypto, Pbkdf2KnownAnswers) {
  std::vector<uint8_t> out(64);
  ASSERT_TRUE(pbkdf2("sha256", bytes("passwd"), bytes("salt"), 1, out).ok());
  EXPECT_EQ(hex(out),
            "55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc"
            "49ca9cccf179b645991664b39d77ef317c71b845b1e30bd509112041d3a19783");
  out.resize(20);
  ASSERT_TRUE(pbkdf2("sha1", bytes("password"), bytes("salt"), 2, out).ok());
  EXPECT_EQ(hex(out), "ea6c014dc72d6f8ccd1ed92ace1d41f0d8de8957");
  EXPECT_FALSE(pbkdf2("sha256", bytes("p"), bytes("s"), 0, out).ok());
}

// One sector of 0,1,2,...,255,0,1... encrypted as sector `sector`: the first
// 48 bytes (three AES blocks: enough to pin the IV of the sector).
std::string encrypt_sector(const char* alg, const char* mode, const char* ivgen, const char* ivhash,
                           std::vector<uint8_t> key, uint64_t sector) {
  Algorithms a{alg, mode, ivgen, ivhash, "sha256", static_cast<uint32_t>(key.size())};
  auto c = SectorCipher::create(a, key);
  EXPECT_TRUE(c.ok()) << c.error().what();
  if (!c) return {};
  std::vector<uint8_t> buf(512), plain(512);
  for (size_t i = 0; i < buf.size(); ++i) plain[i] = buf[i] = static_cast<uint8_t>(i);
  EXPECT_TRUE((*c)->encrypt(sector, buf).ok());
  std::string head = hex(std::span<const uint8_t>(buf).subspan(0, 48));
  EXPECT_TRUE((*c)->decrypt(sector, buf).ok());
  EXPECT_EQ(buf, plain);
  return head;
}

std::vector<uint8_t> seq(uint8_t from, size_t n) {
  std::vector<uint8_t> k(n);
  for (size_t i = 0; i < n; ++i) k[i] = static_cast<uint8_t>(from + i);
  return k;
}

TEST(LuksCrypto, SectorCipherKnownAnswers) {
  EXPECT_EQ(encrypt_sector("aes-256", "xts", "plain64", "", seq(0, 64), 5),
            "f87ca2f29b117c1b024a6ec8e8c5994e76f7d16b43eed21e6936126969e00dab"
            "9d57dfb999d8d20535e3b2b7a51fab52");
  // essiv:sha256 over aes-128 uses aes-256 for the IV (dm-crypt's rule).
  EXPECT_EQ(encrypt_sector("aes-128", "cbc", "essiv", "sha256", seq(100, 16), 7),
            "ba5c60d2edeccdf6aeaf9ecaf2853edb6b415294c2f5a11739357cadcce609df"
            "17dd8afa81c4a2fd3e592d80b2f08d0f");
  // plain keeps the low 32 bits of the sector number.
  EXPECT_EQ(encrypt_sector("aes-256", "cbc", "plain", "", seq(200, 32), (1ull << 32) + 3),
            "d43d0b22b9a335a4f9775931203cfd5d607020154a74379318377283cb274fe0"
            "68807d89b8bc3cb1518a6b0b74af29f1");
}

TEST(LuksCrypto, UnsupportedCiphersRefused) {
  Algorithms a{"twofish-128", "xts", "plain64", "", "sha256", 32};
  auto c = SectorCipher::create(a, seq(0, 32));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().what(), "Cipher algorithm 'twofish-128' in mode 'xts' is not supported by vblk");
  Algorithms e{"aes-128", "cbc", "essiv", "sha1", "sha256", 16};
  auto d = SectorCipher::create(e, seq(0, 16));
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error().what(), "No AES cipher with key size 20 available");
}

TEST(LuksCrypto, AntiForensicMergeKnownAnswerAndSplit) {
  // 3 stripes of 40 bytes: the diffuser's last hash piece is short.
  std::vector<uint8_t> split(120), key(40);
  for (size_t i = 0; i < split.size(); ++i) split[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE(af_merge("sha256", 3, split, key).ok());
  EXPECT_EQ(hex(key), "6b49e3460a6aa5c2868a3487d4fc928968515ec8e69855571b53d364a1b8bfa0b78a323705a43b2b");
  std::vector<uint8_t> again(120), back(40);
  ASSERT_TRUE(af_split("sha1", 3, key, again).ok());
  ASSERT_TRUE(af_merge("sha1", 3, again, back).ok());
  EXPECT_EQ(back, key);
  EXPECT_FALSE(af_merge("sha256", 0, split, key).ok());
}

TEST(LuksCrypto, SlotUnlocksOnlyWithItsPassword) {
  Header h = good_header();
  auto a = parse_algorithms(h);
  ASSERT_TRUE(a.ok());
  std::vector<uint8_t> master = seq(9, 64);
  ASSERT_TRUE(pbkdf2(a->hash_alg, master, h.master_key_salt, h.master_key_iterations, h.master_key_digest).ok());
  auto m = make_slot(h, *a, h.slots[0], bytes("pw"), 1000, master);
  ASSERT_TRUE(m.ok()) << m.error().what();
  std::vector<std::vector<uint8_t>> material(kNumKeySlots);
  material[0] = *m;
  auto k = unlock(h, *a, bytes("pw"), material);
  ASSERT_TRUE(k.ok()) << k.error().what();
  EXPECT_EQ(std::vector<uint8_t>(k->data(), k->data() + k->size()), master);
  auto bad = unlock(h, *a, bytes("pW"), material);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().what(), "Invalid password, cannot unlock any keyslot");
}

// What qcow2's encryption relies on: a volume formatted in memory opens
// again through parse_volume and unlock_volume from wherever its bytes are
// kept (here a vector, as clusters of an image), with its password only, and
// its cipher is the payload cipher format made.
TEST(LuksVolume, FormatThenOpenFromAnyPlace) {
  ASSERT_TRUE(SecretStore::process().add("luks-vol-test", SecretSpec{.data = "pw"}).ok());
  CreateOptions o;
  o.key_secret = "luks-vol-test";
  o.iter_time = 10;
  auto f = format(o, "encrypt.");
  ASSERT_TRUE(f) << f.error().what();
  std::vector<uint8_t> area(f->area(), 0);
  std::copy(f->header.begin(), f->header.end(), area.begin());
  std::copy(f->material.begin(), f->material.end(),
            area.begin() + uint64_t{f->v.h.slots[0].key_offset_sector} * kSectorSize);
  Loop loop;
  ReadAt read = [&](uint64_t off, std::span<uint8_t> buf) -> Task<Status> {
    std::copy(area.begin() + static_cast<ptrdiff_t>(off), area.begin() + static_cast<ptrdiff_t>(off + buf.size()),
              buf.begin());
    co_return Status{};
  };
  auto v = parse_volume(area);
  ASSERT_TRUE(v) << v.error().what();
  EXPECT_FALSE(v->cipher);
  EXPECT_FALSE(loop.run(unlock_volume(*v, read, "wrong")).ok());
  auto st = loop.run(unlock_volume(*v, read, "pw"));
  ASSERT_TRUE(st.ok()) << st.error().what();
  std::vector<uint8_t> a(1024, 0x5a), b = a;
  ASSERT_TRUE(f->v.cipher->encrypt(4096, a).ok());
  ASSERT_TRUE(v->cipher->encrypt(4096, b).ok());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, std::vector<uint8_t>(1024, 0x5a));
  ASSERT_TRUE(v->cipher->decrypt(4096, b).ok());
  EXPECT_EQ(b, std::vector<uint8_t>(1024, 0x5a));
  SecretStore::process().remove("luks-vol-test");
  // Without a key-secret the error names the caller's option prefix.
  auto none = format(CreateOptions{}, "encrypt.");
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().what(), "Parameter 'encrypt.key-secret' is required for cipher");
}

TEST(LuksVolume, CreateOptionsFromStrings) {
  CreateOptions o;
  ASSERT_TRUE(parse_create_options({{"encrypt.cipher-alg", "aes-128"},
                                    {"encrypt.iter-time", "0x10"},
                                    {"encrypt.ivgen-alg", "essiv"},
                                    {"cipher-mode", "ecb"}},
                                   "encrypt.", o)
                  .ok());
  EXPECT_EQ(o.cipher_alg, "aes-128");
  EXPECT_EQ(o.iter_time, 16);
  EXPECT_EQ(o.ivgen_alg, "essiv");
  EXPECT_EQ(o.cipher_mode, "xts");  // unprefixed: not this caller's option
  auto st = parse_create_options({{"encrypt.hash-alg", "md4"}}, "encrypt.", o);
  EXPECT_EQ(st.error().what(), "Parameter 'hash-alg' does not accept value 'md4'");
  st = parse_create_options({{"encrypt.iter-time", "x"}}, "encrypt.", o);
  EXPECT_EQ(st.error().what(), "Parameter 'encrypt.iter-time' expects a number");
}

}  // namespace
}  // namespace vblk::luks
