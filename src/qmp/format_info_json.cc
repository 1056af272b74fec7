#include "vblk/format_info_json.h"

namespace vblk {

namespace {

using OJson = nlohmann::ordered_json;

// QCryptoBlockInfoLUKS's members, appended to `d` (qcow2's encrypt puts
// them after its "format").
void luks_members(const LuksInfo& l, OJson& d) {
  d["cipher-alg"] = l.cipher_alg;
  d["cipher-mode"] = l.cipher_mode;
  d["ivgen-alg"] = l.ivgen_alg;
  if (l.ivgen_hash_alg) d["ivgen-hash-alg"] = *l.ivgen_hash_alg;
  d["hash-alg"] = l.hash_alg;
  d["payload-offset"] = l.payload_offset;
  d["master-key-iters"] = l.master_key_iters;
  d["uuid"] = l.uuid;
  OJson slots = OJson::array();
  for (const auto& s : l.slots) {
    OJson j;
    j["active"] = s.active;
    if (s.active) {
      j["iters"] = s.iters;
      j["stripes"] = s.stripes;
    }
    j["key-offset"] = s.key_offset;
    slots.push_back(std::move(j));
  }
  d["slots"] = std::move(slots);
}

OJson data(const Qcow2Info& q) {
  OJson d;
  d["compat"] = q.compat;
  if (q.lazy_refcounts) d["lazy-refcounts"] = *q.lazy_refcounts;
  if (q.corrupt) d["corrupt"] = *q.corrupt;
  d["refcount-bits"] = q.refcount_bits;
  if (q.encrypt) {
    // ImageInfoSpecificQCow2Encryption: the format, then its info.
    OJson e;
    e["format"] = "luks";
    luks_members(*q.encrypt, e);
    d["encrypt"] = std::move(e);
  }
  if (!q.bitmaps.empty()) {
    OJson list = OJson::array();
    for (const auto& b : q.bitmaps) {
      OJson flags = OJson::array();
      if (b.in_use) flags.push_back("in-use");
      if (b.autoload) flags.push_back("auto");
      OJson j;
      j["flags"] = std::move(flags);
      j["name"] = b.name;
      j["granularity"] = b.granularity;
      list.push_back(std::move(j));
    }
    d["bitmaps"] = std::move(list);
  }
  d["compression-type"] = q.compression_type;
  if (q.extended_l2) d["extended-l2"] = *q.extended_l2;
  return d;
}

OJson data(const LuksInfo& l) {
  OJson d;
  luks_members(l, d);
  return d;
}

OJson data(const RbdInfo& r) {
  OJson d = OJson::object();
  if (r.encryption_format) d["encryption-format"] = *r.encryption_format;
  return d;
}

const char* type_name(const Qcow2Info&) { return "qcow2"; }
const char* type_name(const LuksInfo&) { return "luks"; }
const char* type_name(const RbdInfo&) { return "rbd"; }

}  // namespace

nlohmann::ordered_json format_info_json(const FormatInfo& info) {
  return std::visit(
      [](const auto& i) {
        OJson j;
        j["type"] = type_name(i);
        j["data"] = data(i);
        return j;
      },
      info);
}

}  // namespace vblk
