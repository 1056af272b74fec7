// What the luks driver's files share (src/block/drivers/luks/): the header,
// algorithms, cipher and key slots, and the helpers of the node and create.
// qcow2's encryption (src/block/drivers/qcow2/crypt.cc) keeps a LUKS volume
// in clusters of its image and opens it with the same Volume calls.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "drivers/luks/algorithms.h"
#include "drivers/luks/cipher.h"
#include "drivers/luks/header.h"
#include "drivers/luks/keyslot.h"
#include "vblk/format_info.h"
#include "vblk/node.h"
#include "vblk/options.h"
#include "vblk/task.h"

namespace vblk::luks {

// A LUKS volume as opened: its header and algorithms, and the payload
// cipher once a password unlocked the master key.
struct Volume {
  Header h;
  Algorithms algs;
  std::unique_ptr<SectorCipher> cipher;  // null until unlocked
};

// The header (the first kHeaderSize bytes of `head`) parsed and checked and
// its algorithms known: QEMU's qcrypto_block_luks_open up to the key slots.
Result<Volume> parse_volume(std::span<const uint8_t> head);

// Reads `buf.size()` bytes at `offset` of the area holding the header and
// the key material (the start of a luks image; clusters of a qcow2 image).
using ReadAt = std::function<Task<Status>(uint64_t offset, std::span<uint8_t> buf)>;

// Reads each active slot's key material through `read`, unlocks the master
// key with `password` ("Invalid password, cannot unlock any keyslot") and
// makes v.cipher.
Task<Status> unlock_volume(Volume& v, const ReadAt& read, std::string_view password);

// Reads `out.size()` bytes at any `offset` of `file` through a sector-aligned
// bounce buffer (files opened with O_DIRECT take only aligned requests).
Task<Status> read_bytes(Node& file, uint64_t offset, std::span<uint8_t> out);

// The passphrase in secret `id`, as QEMU's qcrypto_secret_lookup_as_utf8
// gives it: "No secret with id 'x'", "Data from secret x is not valid
// UTF-8"; it ends at the first NUL (QEMU passes it on as a C string).
Result<std::string> lookup_password(const std::string& id);

// QCryptoBlockInfoLUKS: QEMU's ImageInfoSpecific for luks, and a qcow2
// image's encryption info.
LuksInfo info(const Header& h, const Algorithms& a);

}  // namespace vblk::luks

namespace vblk {
struct OpenContext;
namespace drivers {
// luks.cc: opening and probing (driver.cc registers them).
int probe_luks(std::span<const uint8_t> head);
Result<std::shared_ptr<Node>> open_luks(OpenContext& ctx, Json& opts);
}  // namespace drivers
}  // namespace vblk
