// LUKS key slots: the master key is stored in a slot anti-forensically split
// into `stripes` copies (AF split, cryptsetup's afsplit with the header's
// hash as diffuser), encrypted with a key derived from the passphrase by
// PBKDF2 (the slot's salt and iterations). A master key is right when its
// own PBKDF2 (header's salt and iterations, 20 bytes) equals the header's
// digest.
#pragma once

#include <array>
#include <span>
#include <string>
#include <vector>

#include "drivers/luks/cipher.h"

namespace vblk::luks {

// PBKDF2-HMAC with a QCryptoHashAlgorithm (OpenSSL's PKCS5_PBKDF2_HMAC).
Status pbkdf2(const std::string& hash, std::span<const uint8_t> password, std::span<const uint8_t> salt,
              uint32_t iterations, std::span<uint8_t> out);

// Joins `stripes` blocks of `out.size()` bytes back into the key.
Status af_merge(const std::string& hash, uint32_t stripes, std::span<const uint8_t> split, std::span<uint8_t> out);
// Splits `key` into `stripes` blocks (all but the last random) into `out`.
Status af_split(const std::string& hash, uint32_t stripes, std::span<const uint8_t> key, std::span<uint8_t> out);

// Bytes of key material of a slot: master key length * stripes.
inline uint64_t key_material_bytes(const Header& h, const KeySlot& s) { return uint64_t{h.master_key_len} * s.stripes; }

// The master key that `password` unlocks, trying the active slots in order;
// material[i] is slot i's key material as read from the image (empty for
// inactive slots). "Invalid password, cannot unlock any keyslot" when none.
Result<KeyBuffer> unlock(const Header& h, const Algorithms& a, std::span<const uint8_t> password,
                         std::span<const std::vector<uint8_t>> material);

// Fills slot `s` of `h` for `password`: random salt, `iterations`, and
// returns its key material (the encrypted split of `master_key`).
Result<std::vector<uint8_t>> make_slot(const Header& h, const Algorithms& a, KeySlot& s,
                                       std::span<const uint8_t> password, uint32_t iterations,
                                       std::span<const uint8_t> master_key);

}  // namespace vblk::luks
