// ImageInfoSpecific JSON from the block layer's FormatInfo: members in the
// schema's order, optional ones only when present (the interop tests
// compare whole `info` outputs with qemu-img; these pin the renderer down).
#include "vblk/format_info_json.h"

#include <gtest/gtest.h>

namespace vblk {
namespace {

LuksInfo luks() {
  LuksInfo l;
  l.cipher_alg = "aes-256";
  l.cipher_mode = "cbc";
  l.ivgen_alg = "essiv";
  l.ivgen_hash_alg = "sha256";
  l.hash_alg = "sha256";
  l.payload_offset = 16777216;
  l.master_key_iters = 1000;
  l.uuid = "u";
  l.slots = {{.active = true, .iters = 2000, .stripes = 4000, .key_offset = 32768}, {.key_offset = 290816}};
  return l;
}

const char* kLuksData =
    R"("cipher-alg":"aes-256","cipher-mode":"cbc","ivgen-alg":"essiv","ivgen-hash-alg":"sha256",)"
    R"("hash-alg":"sha256","payload-offset":16777216,"master-key-iters":1000,"uuid":"u","slots":)"
    R"([{"active":true,"iters":2000,"stripes":4000,"key-offset":32768},{"active":false,"key-offset":290816}])";

TEST(FormatInfoJson, Qcow2V3WithEverything) {
  Qcow2Info q;
  q.compat = "1.1";
  q.lazy_refcounts = false;
  q.corrupt = false;
  q.refcount_bits = 16;
  q.encrypt = luks();
  q.bitmaps = {{.name = "b1", .granularity = 65536, .in_use = true, .autoload = true},
               {.name = "b2", .granularity = 512}};
  q.compression_type = "zlib";
  q.extended_l2 = true;
  EXPECT_EQ(format_info_json(q).dump(),
            std::string(R"({"type":"qcow2","data":{"compat":"1.1","lazy-refcounts":false,"corrupt":false,)") +
                R"("refcount-bits":16,"encrypt":{"format":"luks",)" + kLuksData +
                R"(},"bitmaps":[{"flags":["in-use","auto"],"name":"b1","granularity":65536},)" +
                R"({"flags":[],"name":"b2","granularity":512}],"compression-type":"zlib","extended-l2":true}})");
}

TEST(FormatInfoJson, Qcow2V2LeavesOutTheV3Members) {
  Qcow2Info q;
  q.compat = "0.10";
  q.compression_type = "zlib";
  EXPECT_EQ(format_info_json(q).dump(),
            R"({"type":"qcow2","data":{"compat":"0.10","refcount-bits":16,"compression-type":"zlib"}})");
}

TEST(FormatInfoJson, LuksAndRbd) {
  EXPECT_EQ(format_info_json(luks()).dump(), std::string(R"({"type":"luks","data":{)") + kLuksData + "}}");
  LuksInfo plain = luks();
  plain.ivgen_alg = "plain64";
  plain.ivgen_hash_alg.reset();
  EXPECT_EQ(format_info_json(plain)["data"].dump().find("ivgen-hash-alg"), std::string::npos);
  EXPECT_EQ(format_info_json(RbdInfo{}).dump(), R"({"type":"rbd","data":{}})");
  EXPECT_EQ(format_info_json(RbdInfo{.encryption_format = "luks2"}).dump(),
            R"({"type":"rbd","data":{"encryption-format":"luks2"}})");
}

}  // namespace
}  // namespace vblk
