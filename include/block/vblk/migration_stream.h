// MigrationStreamCheck: is a byte stream a whole QEMU migration stream (a VM
// state as QEMU's savevm / migrate writes it), checked as it goes by?
//
// A VM state taken through a socket or a pipe ends where its sender stops:
// a QEMU killed mid-migration, a sender that closes early, or anything
// else that connects first would otherwise become a "good" snapshot that
// fails only when loaded. The checker follows the format of QEMU 7.2's
// migration/savevm.c and migration/ram.c (as scripts/analyze-migration.py
// reads it):
//
//   header      be32 QEMU_VM_FILE_MAGIC 'QEVM', be32 version 3
//   [0x07 QEMU_VM_CONFIGURATION: be32 len, machine name, subsections
//        (target-page-bits, capabilities, uuid)]
//   sections    START/FULL 0x01/0x04: be32 id, u8 len, idstr, be32
//               instance, be32 version; PART/END 0x02/0x03: be32 id; each
//               with its payload and a footer 0x7e be32 id;
//               0x08 QEMU_VM_COMMAND (only OPEN_RETURN_PATH, PING)
//   0x00 QEMU_VM_EOF
//   0x06 QEMU_VM_VMDESCRIPTION: be32 len, JSON {page_size, devices}
//   nothing after it
//
// RAM sections ("ram") are parsed record by record (ram_load's format:
// be64 addr|flags, block names, ZERO / PAGE / COMPRESS_PAGE / XBZRLE
// payloads, EOS), each page inside a block the START section announced.
// Device sections are not length-prefixed and are read by their formats
// only QEMU knows: the checker finds their end by the footer, and accepts a
// footer only when what follows is a plausible next section; the vmdesc
// at the end then lists every FULL section by (name, instance_id), and the
// stream's FULL sections must be exactly those, in order. So a stream cut
// at any byte lacks its end (or its vmdesc, or part of it), and random
// bytes fail the magic.
//
// Not accepted (refused with a message): streams without section footers
// or configuration (machine types older than 2.4), without a vmdesc
// (machines with suppress-vmdesc), postcopy and RDMA streams, and RAM
// pages other than 4 KiB unless the configuration says so
// (target-page-bits).
//
// Memory: bounded: one record (<= one page), one device section (at most
// kMaxDeviceSection) and the vmdesc (at most kMaxVmdesc), whatever the
// stream's length. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "vblk/result.h"

namespace vblk {

class MigrationStreamCheck {
 public:
  static constexpr uint32_t kMagic = 0x5145564d;  // 'QEVM'
  static constexpr size_t kMaxDeviceSection = 64 << 20;
  static constexpr size_t kMaxVmdesc = 64 << 20;

  // Whether the stream's first bytes (at least 4) are QEMU's magic.
  static bool has_magic(std::span<const uint8_t> head);

  // The next bytes of the stream. Returns the error as soon as the stream
  // cannot be a valid one any more (and from then on always).
  Status feed(std::span<const uint8_t> data);
  // The stream has ended: OK only if it ended exactly after its vmdesc.
  Status finish();
  // Bytes fed so far.
  uint64_t offset() const { return base_ + buf_.size(); }

 private:
  enum class State { Header, Top, ConfigSub, ConfigCaps, RamBlocks, Ram, Footer, Device, AfterEof, Vmdesc, Done };
  enum class Step { Ok, More, Fail };

  Step step();
  Step header();
  Step top();
  Step config_sub();
  Step ram_blocks();
  Step ram();
  Step footer();
  Step device();
  Step vmdesc();
  // Whether a section header (or EOF, or a command) plausibly starts at
  // buf_[at]: 1 yes, 0 no, -1 not enough bytes yet.
  int plausible_next(size_t at) const;
  Step fail(const std::string& why);

  size_t avail() const { return buf_.size() - pos_; }
  uint8_t u8(size_t at) const { return buf_[pos_ + at]; }
  uint16_t be16(size_t at) const;
  uint32_t be32(size_t at) const;
  uint64_t be64(size_t at) const;
  std::string str(size_t at, size_t n) const;

  struct Block {
    uint64_t length = 0;
  };

  State state_ = State::Header;
  std::vector<uint8_t> buf_;
  size_t pos_ = 0;     // parsed up to here in buf_
  uint64_t base_ = 0;  // stream offset of buf_[0]
  std::optional<Error> error_;

  uint64_t page_ = 4096;
  bool ignore_shared_ = false;  // capability x-ignore-shared: blocks carry an address
  uint32_t caps_left_ = 0;
  bool any_section_ = false;
  uint32_t cur_id_ = 0;  // the section being read
  std::set<uint32_t> used_ids_;
  std::set<uint32_t> open_ram_, open_other_;  // START seen, END not yet
  std::set<uint32_t> ram_ids_;
  uint64_t ram_left_ = 0;   // MEM_SIZE bytes not yet given to blocks
  bool ram_start_ = false;  // the next RAM record must be MEM_SIZE
  std::map<std::string, Block> blocks_;
  const Block* cur_block_ = nullptr;
  size_t scan_ = 0;  // Device: payload bytes searched for a footer
  uint32_t vmdesc_len_ = 0;
  std::vector<std::pair<std::string, uint32_t>> full_;  // FULL sections, in order
};

}  // namespace vblk
