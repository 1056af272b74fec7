// MigrationStreamCheck (include/block/vblk/migration_stream.h).
#include "vblk/migration_stream.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace vblk {

namespace {

// migration/savevm.c
constexpr uint8_t kEof = 0x00, kStart = 0x01, kPart = 0x02, kEnd = 0x03, kFull = 0x04, kSubsection = 0x05,
                  kVmdesc = 0x06, kConfiguration = 0x07, kCommand = 0x08, kFooter = 0x7e;
constexpr uint16_t kCmdOpenReturnPath = 1, kCmdPing = 2;
// migration/ram.c
constexpr uint64_t kFlagFull = 0x01, kFlagZero = 0x02, kFlagMemSize = 0x04, kFlagPage = 0x08, kFlagEos = 0x10,
                   kFlagContinue = 0x20, kFlagXbzrle = 0x40, kFlagHook = 0x80, kFlagCompressPage = 0x100;
constexpr uint8_t kEncodingXbzrle = 0x01;

bool printable(const std::string& s) {
  if (s.empty()) return false;
  for (unsigned char c : s)
    if (c < 0x20 || c > 0x7e) return false;
  return true;
}

}  // namespace

bool MigrationStreamCheck::has_magic(std::span<const uint8_t> head) {
  return head.size() >= 4 &&
         (uint32_t{head[0]} << 24 | uint32_t{head[1]} << 16 | uint32_t{head[2]} << 8 | head[3]) == kMagic;
}

uint16_t MigrationStreamCheck::be16(size_t at) const { return static_cast<uint16_t>(u8(at) << 8 | u8(at + 1)); }
uint32_t MigrationStreamCheck::be32(size_t at) const { return uint32_t{be16(at)} << 16 | be16(at + 2); }
uint64_t MigrationStreamCheck::be64(size_t at) const { return uint64_t{be32(at)} << 32 | be32(at + 4); }
std::string MigrationStreamCheck::str(size_t at, size_t n) const {
  return std::string(reinterpret_cast<const char*>(buf_.data() + pos_ + at), n);
}

MigrationStreamCheck::Step MigrationStreamCheck::fail(const std::string& why) {
  error_ = Error(EINVAL, fmt::format("Invalid VM state stream at offset {}: {}", base_ + pos_, why));
  return Step::Fail;
}

Status MigrationStreamCheck::feed(std::span<const uint8_t> data) {
  if (error_) return *error_;
  if (data.empty()) return Status{};
  if (state_ == State::Done) {
    pos_ = buf_.size();
    fail("data after the end of the VM state (its vmdescription)");
    return *error_;
  }
  // Parsed bytes go (once they are half the buffer: fed byte by byte, a
  // long item is not moved again for each byte); what is left is one
  // unfinished item.
  if (pos_ && pos_ >= buf_.size() / 2) {
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(pos_));
    base_ += pos_;
    pos_ = 0;
  }
  buf_.insert(buf_.end(), data.begin(), data.end());
  for (;;) {
    const Step s = step();
    if (s == Step::Fail) return *error_;
    if (s == Step::More) break;
  }
  if (state_ == State::Done && avail()) {
    pos_ = buf_.size() - avail();
    fail("data after the end of the VM state (its vmdescription)");
    return *error_;
  }
  return Status{};
}

Status MigrationStreamCheck::finish() {
  if (error_) return *error_;
  if (state_ == State::Done) return Status{};
  const char* where = "in its header";
  switch (state_) {
    case State::Header: where = "in its header"; break;
    case State::Top: where = "between sections"; break;
    case State::ConfigSub:
    case State::ConfigCaps: where = "in its configuration"; break;
    case State::RamBlocks:
    case State::Ram: where = "in a RAM section"; break;
    case State::Footer: where = "before a section footer"; break;
    case State::Device: where = "in a device section"; break;
    case State::AfterEof: where = "after QEMU_VM_EOF, without its vmdescription"; break;
    case State::Vmdesc: where = "in its vmdescription"; break;
    case State::Done: break;
  }
  error_ = Error(EINVAL,
                 fmt::format("Invalid VM state stream: it ends early, at offset {} {} (truncated?)", offset(), where));
  return *error_;
}

MigrationStreamCheck::Step MigrationStreamCheck::step() {
  switch (state_) {
    case State::Header: return header();
    case State::Top: return top();
    case State::ConfigSub:
    case State::ConfigCaps: return config_sub();
    case State::RamBlocks: return ram_blocks();
    case State::Ram: return ram();
    case State::Footer: return footer();
    case State::Device: return device();
    case State::AfterEof:
    case State::Vmdesc: return vmdesc();
    case State::Done: return Step::More;
  }
  return Step::More;
}

MigrationStreamCheck::Step MigrationStreamCheck::header() {
  if (avail() < 8) return Step::More;
  if (be32(0) != kMagic) return fail("not a QEMU migration stream (no QEVM magic)");
  if (be32(4) != 3) return fail(fmt::format("unsupported stream version {} (QEMU writes 3)", be32(4)));
  pos_ += 8;
  state_ = State::Top;
  return Step::Ok;
}

MigrationStreamCheck::Step MigrationStreamCheck::top() {
  if (avail() < 1) return Step::More;
  const uint8_t t = u8(0);
  if (!any_section_ && t != kConfiguration)
    return fail("no configuration section (a machine type older than 2.4 is not supported)");
  switch (t) {
    case kConfiguration: {
      if (any_section_) return fail("a configuration section after the first section");
      if (avail() < 5) return Step::More;
      const uint32_t len = be32(1);
      if (len == 0 || len > 255) return fail(fmt::format("machine name of {} bytes", len));
      if (avail() < 5 + len) return Step::More;
      if (!printable(str(5, len))) return fail("machine name not printable");
      pos_ += 5 + len;
      any_section_ = true;
      state_ = State::ConfigSub;
      return Step::Ok;
    }
    case kStart:
    case kFull: {
      if (avail() < 6) return Step::More;
      const uint32_t id = be32(1);
      const uint8_t n = u8(5);
      if (avail() < 6 + size_t{n} + 8) return Step::More;
      const std::string name = str(6, n);
      if (!printable(name)) return fail("section name not printable");
      if (used_ids_.count(id)) return fail(fmt::format("section id {} ('{}') used twice", id, name));
      used_ids_.insert(id);
      cur_id_ = id;
      if (t == kFull) full_.emplace_back(name, be32(6 + n));
      pos_ += 6 + size_t{n} + 8;
      if (t == kStart && name == "ram") {
        if (!ram_ids_.empty()) return fail("a second RAM section");
        ram_ids_.insert(id);
        open_ram_.insert(id);
        ram_start_ = true;
        state_ = State::Ram;
      } else {
        if (t == kStart) open_other_.insert(id);
        scan_ = 0;
        state_ = State::Device;
      }
      return Step::Ok;
    }
    case kPart:
    case kEnd: {
      if (avail() < 5) return Step::More;
      const uint32_t id = be32(1);
      const bool ram = open_ram_.count(id) > 0;
      if (!ram && !open_other_.count(id)) return fail(fmt::format("a part of section {}, which is not open", id));
      if (t == kEnd) (ram ? open_ram_ : open_other_).erase(id);
      cur_id_ = id;
      pos_ += 5;
      scan_ = 0;
      state_ = ram ? State::Ram : State::Device;
      return Step::Ok;
    }
    case kCommand: {
      if (avail() < 5) return Step::More;
      const uint16_t cmd = be16(1), len = be16(3);
      if (!(cmd == kCmdOpenReturnPath && len == 0) && !(cmd == kCmdPing && len == 4))
        return fail(fmt::format("command {} (postcopy and COLO streams are not supported)", cmd));
      if (avail() < 5 + size_t{len}) return Step::More;
      pos_ += 5 + size_t{len};
      return Step::Ok;
    }
    case kEof:
      if (!open_ram_.empty() || !open_other_.empty()) return fail("QEMU_VM_EOF with an iterative section not ended");
      if (ram_ids_.empty()) return fail("QEMU_VM_EOF without a RAM section");
      pos_ += 1;
      state_ = State::AfterEof;
      return Step::Ok;
    case kFooter: return fail("a section footer outside a section");
    default: return fail(fmt::format("unknown section type 0x{:02x}", t));
  }
}

MigrationStreamCheck::Step MigrationStreamCheck::config_sub() {
  if (state_ == State::ConfigCaps) {
    if (!caps_left_) {
      state_ = State::ConfigSub;
      return Step::Ok;
    }
    if (avail() < 1) return Step::More;
    const uint8_t n = u8(0);
    if (avail() < 1 + size_t{n}) return Step::More;
    const std::string cap = str(1, n);
    if (!printable(cap)) return fail("capability name not printable");
    if (cap == "x-ignore-shared") ignore_shared_ = true;
    if (cap == "postcopy-ram" || cap == "rdma-pin-all" || cap == "multifd")
      return fail("a stream with capability '" + cap + "' is not supported");
    pos_ += 1 + size_t{n};
    --caps_left_;
    return Step::Ok;
  }
  if (avail() < 1) return Step::More;
  if (u8(0) != kSubsection) {
    state_ = State::Top;
    return Step::Ok;
  }
  if (avail() < 2) return Step::More;
  const uint8_t n = u8(1);
  if (avail() < 2 + size_t{n} + 4) return Step::More;
  const std::string name = str(2, n);
  const size_t h = 2 + size_t{n} + 4;
  if (name == "configuration/target-page-bits") {
    if (avail() < h + 4) return Step::More;
    const uint32_t bits = be32(h);
    if (bits < 10 || bits > 20) return fail(fmt::format("target page bits {}", bits));
    page_ = uint64_t{1} << bits;
    pos_ += h + 4;
  } else if (name == "configuration/capabilities") {
    if (avail() < h + 4) return Step::More;
    caps_left_ = be32(h);
    if (caps_left_ > 256) return fail(fmt::format("{} capabilities", caps_left_));
    pos_ += h + 4;
    state_ = State::ConfigCaps;
  } else if (name == "configuration/uuid") {
    if (avail() < h + 16) return Step::More;
    pos_ += h + 16;
  } else {
    return fail("unknown configuration subsection '" + name + "'");
  }
  return Step::Ok;
}

MigrationStreamCheck::Step MigrationStreamCheck::ram_blocks() {
  if (!ram_left_) {
    state_ = State::Ram;
    return Step::Ok;
  }
  if (avail() < 1) return Step::More;
  const uint8_t n = u8(0);
  const size_t need = 1 + size_t{n} + 8 + (ignore_shared_ ? 8 : 0);
  if (avail() < need) return Step::More;
  const std::string name = str(1, n);
  const uint64_t len = be64(1 + n);
  if (!printable(name)) return fail("RAM block name not printable");
  if (blocks_.count(name)) return fail("RAM block '" + name + "' announced twice");
  if (len == 0 || len > ram_left_) return fail(fmt::format("RAM block '{}' of {} bytes", name, len));
  blocks_[name].length = len;
  ram_left_ -= len;
  pos_ += need;
  return Step::Ok;
}

MigrationStreamCheck::Step MigrationStreamCheck::ram() {
  if (avail() < 8) return Step::More;
  const uint64_t v = be64(0);
  uint64_t flags = v & (page_ - 1);
  const uint64_t addr = v & ~(page_ - 1);
  if (ram_start_) {
    if (flags != kFlagMemSize || addr == 0) return fail("a RAM section that does not start with its size");
    ram_start_ = false;
    ram_left_ = addr;
    pos_ += 8;
    state_ = State::RamBlocks;
    return Step::Ok;
  }
  if (flags == kFlagEos) {
    pos_ += 8;
    state_ = State::Footer;
    return Step::Ok;
  }
  if (flags & (kFlagMemSize | kFlagFull | kFlagEos)) return fail(fmt::format("RAM record flags 0x{:x}", flags));
  if (flags & kFlagHook) return fail("a RAM hook (RDMA streams are not supported)");
  size_t h = 8;
  const Block* block = cur_block_;
  if (flags & kFlagContinue) {
    if (!block) return fail("a RAM page continuing no block");
    flags &= ~kFlagContinue;
  } else {
    if (avail() < 9) return Step::More;
    const uint8_t n = u8(8);
    if (avail() < 9 + size_t{n}) return Step::More;
    auto it = blocks_.find(str(9, n));
    if (it == blocks_.end()) return fail("a RAM page of block '" + str(9, n) + "', which the stream did not announce");
    block = &it->second;
    h = 9 + size_t{n};
  }
  if (addr >= block->length) return fail(fmt::format("a RAM page at 0x{:x}, past its block", addr));
  size_t len = 0;
  if (flags == kFlagZero) {
    len = 1;
  } else if (flags == kFlagPage) {
    len = page_;
  } else if (flags == kFlagCompressPage) {
    if (avail() < h + 4) return Step::More;
    const uint32_t n = be32(h);
    if (n == 0 || n > page_ + page_ / 16 + 64) return fail(fmt::format("a compressed RAM page of {} bytes", n));
    len = 4 + size_t{n};
  } else if (flags == kFlagXbzrle) {
    if (avail() < h + 3) return Step::More;
    if (u8(h) != kEncodingXbzrle) return fail("an XBZRLE page of unknown encoding");
    const uint16_t n = be16(h + 1);
    if (n > page_) return fail(fmt::format("an XBZRLE page of {} bytes", n));
    len = 3 + size_t{n};
  } else {
    return fail(fmt::format("RAM record flags 0x{:x}", v & (page_ - 1)));
  }
  if (avail() < h + len) return Step::More;
  cur_block_ = block;
  pos_ += h + len;
  return Step::Ok;
}

MigrationStreamCheck::Step MigrationStreamCheck::footer() {
  if (avail() < 5) return Step::More;
  if (u8(0) != kFooter || be32(1) != cur_id_) return fail(fmt::format("section {} without its footer", cur_id_));
  pos_ += 5;
  state_ = State::Top;
  return Step::Ok;
}

int MigrationStreamCheck::plausible_next(size_t at) const {
  auto have = [&](size_t n) { return avail() >= at + n; };
  if (!have(1)) return -1;
  switch (u8(at)) {
    case kEof:
      if (!have(2)) return -1;
      return u8(at + 1) == kVmdesc && open_ram_.empty() && open_other_.empty();
    case kStart:
    case kFull: {
      if (!have(6)) return -1;
      if (used_ids_.count(be32(at + 1))) return 0;
      const uint8_t n = u8(at + 5);
      if (!have(6 + size_t{n} + 8)) return -1;
      return printable(str(at + 6, n));
    }
    case kPart:
    case kEnd:
      if (!have(5)) return -1;
      return open_ram_.count(be32(at + 1)) || open_other_.count(be32(at + 1));
    case kCommand:
      if (!have(3)) return -1;
      return be16(at + 1) == kCmdOpenReturnPath || be16(at + 1) == kCmdPing;
    default: return 0;
  }
}

MigrationStreamCheck::Step MigrationStreamCheck::device() {
  // The payload's format is the device's; its end is the first footer of
  // this section followed by something that can come next.
  const uint8_t want[5] = {kFooter, static_cast<uint8_t>(cur_id_ >> 24), static_cast<uint8_t>(cur_id_ >> 16),
                           static_cast<uint8_t>(cur_id_ >> 8), static_cast<uint8_t>(cur_id_)};
  while (scan_ + 5 <= avail()) {
    const uint8_t* p = buf_.data() + pos_ + scan_;
    if (std::equal(want, want + 5, p)) {
      const int next = plausible_next(scan_ + 5);
      if (next < 0) return Step::More;
      if (next > 0) {
        pos_ += scan_ + 5;
        scan_ = 0;
        state_ = State::Top;
        return Step::Ok;
      }
    }
    ++scan_;
  }
  if (avail() > kMaxDeviceSection)
    return fail(fmt::format("section {} has no footer in its first {} bytes", cur_id_, kMaxDeviceSection));
  return Step::More;
}

MigrationStreamCheck::Step MigrationStreamCheck::vmdesc() {
  if (state_ == State::AfterEof) {
    if (avail() < 1) return Step::More;
    if (u8(0) != kVmdesc) return fail("QEMU_VM_EOF not followed by the vmdescription");
    if (avail() < 5) return Step::More;
    vmdesc_len_ = be32(1);
    if (vmdesc_len_ == 0 || vmdesc_len_ > kMaxVmdesc)
      return fail(fmt::format("vmdescription of {} bytes", vmdesc_len_));
    pos_ += 5;
    state_ = State::Vmdesc;
    return Step::Ok;
  }
  if (avail() < vmdesc_len_) return Step::More;
  const auto* p = reinterpret_cast<const char*>(buf_.data() + pos_);
  auto j = nlohmann::json::parse(p, p + vmdesc_len_, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return fail("the vmdescription is not JSON");
  if (!j.contains("page_size") || !j["page_size"].is_number_unsigned() || j["page_size"].get<uint64_t>() != page_)
    return fail(fmt::format("the vmdescription's page size is not the stream's {}", page_));
  if (!j.contains("devices") || !j["devices"].is_array()) return fail("the vmdescription has no device list");
  const auto& devs = j["devices"];
  bool same = devs.size() == full_.size();
  for (size_t i = 0; same && i < full_.size(); ++i) {
    const auto& d = devs[i];
    same = d.is_object() && d.contains("name") && d["name"].is_string() &&
           d["name"].get<std::string>() == full_[i].first && d.contains("instance_id") &&
           d["instance_id"].is_number_integer() && d["instance_id"].get<int64_t>() == full_[i].second;
  }
  if (!same)
    return fail(fmt::format("the stream's {} device sections are not the {} the vmdescription lists", full_.size(),
                            devs.size()));
  pos_ += vmdesc_len_;
  state_ = State::Done;
  return Step::More;
}

}  // namespace vblk
