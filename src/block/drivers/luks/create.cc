// LUKS1 image creation: see create.h.
#include "drivers/luks/create.h"

#include <openssl/rand.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "drivers/luks/luks.h"
#include "vblk/buffer.h"
#include "vblk/crypto_names.h"

namespace vblk::luks {

namespace {

uint64_t thread_cpu_ms() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return static_cast<uint64_t>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000 +
         static_cast<uint64_t>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000;
}

// PBKDF2 iterations per second of CPU for this key, salt and output length
// (QEMU's qcrypto_pbkdf2_count_iters: grow the count until one run takes
// over half a second, then scale). A run too short to measure counts as
// too short (QEMU fails then, "Unable to get accurate CPU usage").
// Unlike QEMU, a short iter-time is measured over a shorter run (at least
// 50 ms, well above the clock's resolution): a key meant to take 10 ms
// need not cost two seconds of calibration.
Result<uint64_t> count_iters(const std::string& hash, std::span<const uint8_t> key, std::span<const uint8_t> salt,
                             size_t nout, int64_t iter_time) {
  const auto enough = static_cast<uint64_t>(std::clamp<int64_t>(iter_time, 50, 500));
  KeyBuffer out(nout);
  uint64_t iterations = 1 << 15, delta = 0;
  for (;;) {
    if (iterations > INT32_MAX) return Error(ERANGE, "PBKDF iterations too large to measure");
    uint64_t start = thread_cpu_ms();
    VBLK_TRY(pbkdf2(hash, key, salt, static_cast<uint32_t>(iterations), out.span()));
    delta = thread_cpu_ms() - start;
    if (delta > enough) break;
    iterations = delta < 100 ? iterations * 10 : iterations * 1000 / delta;
  }
  return iterations * 1000 / delta;
}

// Iterations for `iter_time` ms, QEMU's scaling and limits; `divisor` 8
// for the master key digest (cryptsetup's choice, which QEMU follows).
Result<uint32_t> scale_iters(uint64_t per_sec, int64_t iter_time, uint64_t divisor, uint32_t min) {
  auto t = static_cast<uint64_t>(iter_time);
  if (t && per_sec > ULLONG_MAX / t)
    return Error(ERANGE,
                 "PBKDF iterations " + std::to_string(per_sec) + " too large to scale: Numerical result out of range");
  uint64_t iters = per_sec * t / 1000 / divisor;
  if (iters > UINT32_MAX)
    return Error(ERANGE, "PBKDF iterations " + std::to_string(iters) + " larger than " + std::to_string(UINT32_MAX) +
                             ": Numerical result out of range");
  return static_cast<uint32_t>(std::max<uint64_t>(iters, min));
}

std::string random_uuid() {
  uint8_t u[16];
  RAND_bytes(u, sizeof u);
  u[6] = (u[6] & 0x0F) | 0x40;  // version 4
  u[8] = (u[8] & 0x3F) | 0x80;  // RFC 4122 variant
  char s[37];
  std::snprintf(s, sizeof s, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
                u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return s;
}

Task<Status> write_at(Node& file, uint64_t offset, std::span<const uint8_t> data) {
  AlignedBuffer buf(align_up(data.size(), kSectorSize), 4096);
  buf.zero();
  std::memcpy(buf.data(), data.data(), data.size());
  co_return co_await file.write(offset, buf.span());
}

}  // namespace

Status parse_create_options(const std::map<std::string, std::string>& opts, const std::string& prefix,
                            CreateOptions& o) {
  auto get = [&](const char* key) -> const std::string* {
    auto it = opts.find(prefix + key);
    return it == opts.end() ? nullptr : &it->second;
  };
  auto pick = [&](const char* key, std::span<const char* const> allowed, std::string& out) -> Status {
    const std::string* v = get(key);
    if (!v) return {};
    for (const char* a : allowed)
      if (*v == a) {
        out = *v;
        return {};
      }
    return Error(EINVAL, std::string("Parameter '") + key + "' does not accept value '" + *v + "'");
  };
  if (const std::string* v = get("key-secret")) o.key_secret = *v;
  VBLK_TRY(pick("cipher-alg", crypto_names::kCipherAlgs, o.cipher_alg));
  VBLK_TRY(pick("cipher-mode", crypto_names::kCipherModes, o.cipher_mode));
  VBLK_TRY(pick("ivgen-alg", crypto_names::kIvgenAlgs, o.ivgen_alg));
  std::string ivhash;
  VBLK_TRY(pick("ivgen-hash-alg", crypto_names::kHashAlgs, ivhash));
  if (!ivhash.empty()) o.ivgen_hash_alg = ivhash;
  VBLK_TRY(pick("hash-alg", crypto_names::kHashAlgs, o.hash_alg));
  if (const std::string* v = get("iter-time")) {
    errno = 0;
    char* end = nullptr;
    long long t = std::strtoll(v->c_str(), &end, 0);
    if (errno || v->empty() || *end) return Error(EINVAL, "Parameter '" + prefix + "iter-time' expects a number");
    o.iter_time = t;
  }
  return {};
}

Result<Formatted> format(const CreateOptions& o, const std::string& prefix) {
  if (!o.key_secret) return Error(EINVAL, "Parameter '" + prefix + "key-secret' is required for cipher");
  auto password = lookup_password(*o.key_secret);
  if (!password) return password.take_error();
  KeyBuffer pw(password->size());
  std::memcpy(pw.data(), password->data(), pw.size());
  explicit_bzero(password->data(), password->size());

  uint32_t alg_key = cipher_key_len(o.cipher_alg);
  if (!alg_key) return Error(ENOTSUP, "Algorithm '" + o.cipher_alg + "' not supported");
  Formatted f;
  Algorithms& a = f.v.algs;
  a.cipher_alg = o.cipher_alg;
  a.cipher_mode = o.cipher_mode;
  a.ivgen_alg = o.ivgen_alg;
  a.hash_alg = o.hash_alg;
  a.ivgen_hash_alg = o.ivgen_hash_alg.value_or(o.ivgen_alg == "essiv" ? "sha256" : "");
  a.key_bytes = o.cipher_mode == "xts" ? alg_key * 2 : alg_key;

  Header& h = f.v.h;
  h.cipher_name = cipher_family(o.cipher_alg);
  h.cipher_mode = a.cipher_mode + "-" + a.ivgen_alg + (a.ivgen_hash_alg.empty() ? "" : ":" + a.ivgen_hash_alg);
  h.hash_spec = a.hash_alg;
  h.master_key_len = a.key_bytes;
  h.uuid = random_uuid();
  if (RAND_bytes(h.master_key_salt.data(), static_cast<int>(kSaltLen)) != 1)
    return Error(EIO, "Unable to read random bytes");
  KeyBuffer master(a.key_bytes);
  if (RAND_bytes(master.data(), static_cast<int>(master.size())) != 1) return Error(EIO, "Unable to read random bytes");
  // The payload cipher, built now so an algorithm vblk cannot run is
  // refused before anything is written.
  auto payload_cipher = SectorCipher::create(a, master.span());
  if (!payload_cipher) return payload_cipher.take_error();
  f.v.cipher = std::move(*payload_cipher);

  auto mk_rate = count_iters(a.hash_alg, master.span(), h.master_key_salt, kDigestLen, o.iter_time);
  if (!mk_rate) return mk_rate.take_error();
  auto mk_iters = scale_iters(*mk_rate, o.iter_time, 8, 1000);
  if (!mk_iters) return mk_iters.take_error();
  h.master_key_iterations = *mk_iters;
  VBLK_TRY(pbkdf2(a.hash_alg, master.span(), h.master_key_salt, h.master_key_iterations, h.master_key_digest));

  // Slot areas follow the 4 KiB header, each rounded to 4 KiB (cryptsetup's
  // layout); only slot 0 is used.
  const uint64_t slot_sectors = key_material_sectors(h.master_key_len, kStripes);
  for (size_t i = 0; i < kNumKeySlots; ++i) {
    h.slots[i].active = kSlotDisabled;
    h.slots[i].stripes = kStripes;
    h.slots[i].key_offset_sector = static_cast<uint32_t>(kKeySlotOffset / kSectorSize + slot_sectors * i);
  }
  h.payload_offset_sector = static_cast<uint32_t>(kKeySlotOffset / kSectorSize + slot_sectors * kNumKeySlots);
  KeySlot& s0 = h.slots[0];
  if (RAND_bytes(s0.salt.data(), static_cast<int>(kSaltLen)) != 1) return Error(EIO, "Unable to read random bytes");
  auto slot_rate = count_iters(a.hash_alg, pw.span(), s0.salt, a.key_bytes, o.iter_time);
  if (!slot_rate) return slot_rate.take_error();
  auto slot_iters = scale_iters(*slot_rate, o.iter_time, 1, 1000);
  if (!slot_iters) return slot_iters.take_error();
  auto material = make_slot(h, a, s0, pw.span(), *slot_iters, master.span());
  if (!material) return material.take_error();
  f.material = std::move(*material);
  f.header = serialize_header(h);
  return f;
}

Task<Status> write_volume(Node& file, uint64_t base, const Formatted& f) {
  VBLK_CO_TRY(co_await write_at(file, base, f.header));
  co_return co_await write_at(file, base + uint64_t{f.v.h.slots[0].key_offset_sector} * kSectorSize, f.material);
}

Task<Status> create(Node& file, const CreateOptions& o) {
  auto f = format(o);
  if (!f) co_return f.take_error();
  co_return co_await write(file, o, *f);
}

Task<Status> write(Node& file, const CreateOptions& o, const Formatted& f) {
  // Room for the header and the payload, then the header and key material.
  VBLK_CO_TRY(co_await file.truncate(f.area() + o.size, false, o.preallocation));
  VBLK_CO_TRY(co_await write_volume(file, 0, f));
  co_return co_await file.flush();
}

}  // namespace vblk::luks
