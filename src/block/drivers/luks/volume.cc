// Opening a LUKS volume wherever its header lies: see luks.h.
#include <cstring>

#include "drivers/luks/luks.h"
#include "vblk/buffer.h"

namespace vblk::luks {

Result<Volume> parse_volume(std::span<const uint8_t> head) {
  auto h = parse_header(head);
  if (!h) return h.take_error();
  auto a = parse_algorithms(*h);
  if (!a) return a.take_error();
  Volume v;
  v.h = std::move(*h);
  v.algs = std::move(*a);
  return v;
}

Task<Status> unlock_volume(Volume& v, const ReadAt& read, std::string_view password) {
  // The key material of every active slot (parse_header checked that it
  // lies below the payload offset).
  std::vector<std::vector<uint8_t>> material(kNumKeySlots);
  for (size_t i = 0; i < kNumKeySlots; ++i) {
    const auto& s = v.h.slots[i];
    if (s.active != kSlotEnabled) continue;
    material[i].resize(key_material_bytes(v.h, s));
    VBLK_CO_TRY(co_await read(uint64_t{s.key_offset_sector} * kSectorSize, material[i]));
  }
  std::span<const uint8_t> pw(reinterpret_cast<const uint8_t*>(password.data()), password.size());
  auto master = unlock(v.h, v.algs, pw, material);
  if (!master) co_return master.take_error();
  auto c = SectorCipher::create(v.algs, master->span());
  if (!c) co_return c.take_error();
  v.cipher = std::move(*c);
  co_return Status{};
}

Task<Status> read_bytes(Node& file, uint64_t offset, std::span<uint8_t> out) {
  if (out.empty()) co_return Status{};
  const uint64_t from = align_down(offset, kSectorSize);
  AlignedBuffer buf(align_up(offset + out.size(), kSectorSize) - from, 4096);
  VBLK_CO_TRY(co_await file.read(from, buf.span()));
  std::memcpy(out.data(), buf.data() + (offset - from), out.size());
  co_return Status{};
}

}  // namespace vblk::luks
