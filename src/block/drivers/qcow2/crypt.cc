// LUKS-encrypted qcow2 images (crypt_method 2), as QEMU 7.2 keeps them
// (docs/interop/qcow2.txt, "Full disk encryption header pointer"): the
// header extension 0x0537be77 points at clusters holding a LUKS1 header and
// its key material (the LUKS payload offset means nothing here); guest data
// clusters are encrypted per 512-byte sector with the sector's HOST offset
// as the IV's sector number (QEMU sets crypt_physical_offset for LUKS, so
// the same data in another cluster encrypts differently). The header,
// key slots and cipher are the luks driver's (src/block/drivers/luks/).
#include <fmt/format.h>

#include <cstring>

#include "drivers/qcow2/qcow2.h"
#include "vblk/buffer.h"

namespace vblk::qcow2 {

namespace {
constexpr uint64_t kMaxBounce = 1 << 20;  // bytes encrypted per write into the file
}  // namespace

Task<Status> Qcow2Node::open_crypto(OpenContext& ctx) {
  // QEMU's qcow2_update_options_prepare, then qcow2_read_extensions'
  // qcrypto_block_open (parse_header refused AES, method 1).
  if (h_.crypt_method == kCryptNone) {
    if (encrypt_format_)
      co_return Error(EINVAL, "No encryption in image header, but options specified format '" + *encrypt_format_ + "'");
    co_return Status{};
  }
  if (encrypt_format_ && *encrypt_format_ != "luks")
    co_return Error(EINVAL, "Header reported 'luks' encryption format but options specify '" + *encrypt_format_ + "'");
  // Encryption works on whole sectors (QEMU's qcow2_refresh_limits); a
  // compressed cluster would be stored in the clear.
  limits_.request_alignment = std::max<uint32_t>(limits_.request_alignment, luks::kSectorSize);
  caps_.compressed_writes = false;
  if (!h_.has_crypto_header) {
    if (ctx.no_io) co_return Status{};
    co_return Error(EINVAL, fmt::format("Missing CRYPTO header for crypt method {}", h_.crypt_method));
  }
  // The passphrase before the header, as qcrypto_block_luks_open.
  std::optional<std::string> password;
  if (!ctx.no_io) {
    if (!key_secret_) co_return Error(EINVAL, "Parameter 'encrypt.key-secret' is required for cipher");
    auto pw = luks::lookup_password(*key_secret_);
    if (!pw) co_return pw.take_error();
    password = std::move(*pw);
  }
  // QEMU's qcow2_crypto_hdr_read_func: nothing outside the extension's area.
  luks::ReadAt read = [this](uint64_t offset, std::span<uint8_t> buf) -> Task<Status> {
    if (offset + buf.size() > h_.crypto_length) co_return Error(EINVAL, "Request for data outside of extension header");
    auto st = co_await luks::read_bytes(*file_, h_.crypto_offset + offset, buf);
    if (!st) co_return st.error().prefixed("Could not read encryption header");
    co_return Status{};
  };
  std::vector<uint8_t> head(luks::kHeaderSize);
  Status st = co_await read(0, head);
  if (st) {
    auto v = luks::parse_volume(head);
    if (v) {
      crypt_ = std::make_unique<luks::Volume>(std::move(*v));
      if (password) st = co_await luks::unlock_volume(*crypt_, read, *password);
    } else {
      st = v.take_error();
    }
  }
  if (password) explicit_bzero(password->data(), password->size());
  co_return st;
}

Task<Status> Qcow2Node::set_up_encryption(const luks::Formatted& f) {
  // QEMU's qcow2_set_up_encryption through qcow2_crypto_hdr_init_func: the
  // area in new clusters, zero filled (the unused key slots stay zeroes),
  // the header and slot 0 written, then the header extension.
  const uint64_t len = f.area();
  const uint64_t clusters = (len + cs_ - 1) / cs_;
  auto g = co_await lock_.scoped();
  auto at = co_await alloc_clusters(clusters);
  if (!at) co_return at.error().prefixed(fmt::format("Cannot allocate cluster for LUKS header size {}", len));
  if (auto st = co_await file_->write_zeroes(*at, clusters * cs_); !st)
    co_return st.error().prefixed("Could not zero fill encryption header");
  VBLK_CO_TRY(co_await luks::write_volume(*file_, *at, f));
  Header h = h_;
  h.crypt_method = kCryptLuks;
  h.has_crypto_header = true;
  h.crypto_offset = *at;
  h.crypto_length = len;
  VBLK_CO_TRY(co_await rb_cache_->flush());
  if (auto st = co_await write_header_as(std::move(h)); !st)
    co_return st.error().prefixed("Could not write encryption header");
  co_return Status{};
}

Task<Status> Qcow2Node::read_data(uint64_t host, std::span<uint8_t> out) {
  VBLK_CO_TRY(co_await file_->read(host, out));
  if (!encrypted()) co_return Status{};
  if (!crypt_ || !crypt_->cipher) co_return Error(EIO, "The encrypted image was opened without its key");
  co_return crypt_->cipher->decrypt(host / luks::kSectorSize, out);
}

Status Qcow2Node::encrypt_for(uint64_t host, std::span<uint8_t> buf) {
  if (!encrypted()) return {};
  if (!crypt_ || !crypt_->cipher) return Error(EIO, "The encrypted image was opened without its key");
  return crypt_->cipher->encrypt(host / luks::kSectorSize, buf);
}

Task<Status> Qcow2Node::write_data(uint64_t host, std::span<const uint8_t> data, uint32_t flags) {
  if (!encrypted()) co_return co_await file_->write(host, data, flags);
  AlignedBuffer bounce(std::min<uint64_t>(data.size(), kMaxBounce), std::max<size_t>(limits_.buffer_alignment, 64));
  for (uint64_t done = 0; done < data.size();) {
    const uint64_t n = std::min<uint64_t>(bounce.size(), data.size() - done);
    auto chunk = bounce.span().subspan(0, n);
    std::memcpy(chunk.data(), data.data() + done, n);
    VBLK_CO_TRY(encrypt_for(host + done, chunk));
    VBLK_CO_TRY(co_await file_->write(host + done, chunk, flags));
    done += n;
  }
  co_return Status{};
}

std::optional<LuksInfo> Qcow2Node::encrypt_info() const {
  // ImageInfoSpecificQCow2Encryption: the format (luks, the only one), then
  // QCryptoBlockInfoLUKS.
  if (!crypt_) return std::nullopt;
  return luks::info(crypt_->h, crypt_->algs);
}

std::string Qcow2Node::filename() const {
  // key-secret is a strong option (qcow2_strong_runtime_opts): QEMU's
  // bdrv_refresh_filename names the node by its options, flattened, in its
  // dict's order.
  if (!key_secret_) return Node::filename();
  return "json:{\"encrypt.key-secret\": " + nlohmann::json(*key_secret_).dump() +
         ", \"driver\": \"qcow2\", \"file\": " + child_filename_json(*file_) + "}";
}

}  // namespace vblk::qcow2
