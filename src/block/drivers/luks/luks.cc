// The `luks` format driver (QEMU's block/crypto.c over crypto/block-luks.c):
// a LUKS1 header and key slots, then the payload, encrypted per 512-byte
// sector with the sector's number in the virtual disk as its IV. The node's
// size is the file's minus the payload offset.
//
// Opening needs `key-secret` (a `secret` object's id) except to describe the
// image (info: no_io), which parses the header only, as QEMU does. Reads
// decrypt in place; writes encrypt into a bounce buffer (the caller's buffer
// stays untouched), at most 1 MiB at a time as QEMU's block_crypto does.
#include "drivers/luks/luks.h"

#include <algorithm>
#include <cstring>

#include "perm_rules.h"
#include "vblk/buffer.h"
#include "vblk/image_format.h"
#include "vblk/open.h"

namespace vblk {
namespace {

using luks::kSectorSize;

constexpr uint64_t kMaxBounce = 1 << 20;

class LuksNode final : public Node, public ImageFormat {
 public:
  LuksNode(Loop& loop, std::shared_ptr<Node> file) : Node(loop, "luks"), file_(file.get()) {
    limits_ = file_->limits();
    limits_.request_alignment = std::max<uint32_t>(limits_.request_alignment, kSectorSize);
    caps_ = NodeCaps{};
    caps_.native_fua = true;  // passed to the file
    add_child("file", std::move(file));
    set_format(this);
  }

  // `password` null: describe only (no_io).
  Task<Status> load(const std::string* password);

  bool encrypted() const override { return true; }
  // key-secret is an option beyond driver and file: QEMU's
  // bdrv_refresh_filename names the node by its options then (members in
  // QEMU's dict order: driver, file, key-secret).
  std::string filename() const override {
    std::string f = file_->filename();
    if (key_secret_.empty()) return f;
    return "json:{\"driver\": \"luks\", \"file\": " + child_filename_json(*file_) +
           ", \"key-secret\": " + nlohmann::json(key_secret_).dump() + "}";
  }
  PermPair child_perm(const Child&, PermPair self) const override {
    return perm_rules::storage(self, true, true, !read_only(), no_io_);
  }
  std::optional<FormatInfo> format_info() const override { return luks::info(vol_.h, vol_.algs); }

  bool no_io_ = false;
  std::string key_secret_;

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override {
    if (!vol_.cipher) co_return Error(EIO, "The LUKS image was opened without its key");
    VBLK_CO_TRY(co_await file_->read(payload_ + offset, buf, flags));
    co_return vol_.cipher->decrypt(offset / kSectorSize, buf);
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    if (!vol_.cipher) co_return Error(EIO, "The LUKS image was opened without its key");
    AlignedBuffer bounce(std::min<uint64_t>(buf.size(), kMaxBounce), std::max<size_t>(limits_.buffer_alignment, 64));
    for (uint64_t done = 0; done < buf.size();) {
      uint64_t n = std::min<uint64_t>(bounce.size(), buf.size() - done);
      auto chunk = bounce.span().subspan(0, n);
      std::memcpy(chunk.data(), buf.data() + done, n);
      VBLK_CO_TRY(vol_.cipher->encrypt((offset + done) / kSectorSize, chunk));
      VBLK_CO_TRY(co_await file_->write(payload_ + offset + done, chunk, flags));
      done += n;
    }
    co_return Status{};
  }
  // Everything is data written here: QEMU's crypto driver has no block
  // status, so the generic answer (data, allocated, no offset) stands.
  Task<Result<BlockStatus>> do_block_status(uint64_t, uint64_t bytes) override {
    co_return BlockStatus{.flags = kStatusData | kStatusAllocated, .bytes = bytes};
  }
  Task<Status> do_truncate(uint64_t length, bool exact) override {
    VBLK_CO_TRY(co_await file_->truncate(length + payload_, exact));
    set_length(file_->length() - payload_);
    co_return Status{};
  }
  Task<Status> do_truncate_prealloc(uint64_t length, bool exact, Prealloc p) override {
    VBLK_CO_TRY(co_await file_->truncate(length + payload_, exact, p));
    set_length(file_->length() - payload_);
    co_return Status{};
  }

 private:
  Node* file_;
  luks::Volume vol_;
  uint64_t payload_ = 0;
};

Task<Status> LuksNode::load(const std::string* password) {
  const uint64_t flen = file_->length();
  AlignedBuffer head(luks::kHeaderSize < 4096 ? 4096 : luks::kHeaderSize, 4096);
  head.zero();
  if (uint64_t n = std::min<uint64_t>(head.size(), flen) / kSectorSize * kSectorSize)
    VBLK_CO_TRY(co_await file_->read(0, head.span().subspan(0, n)));
  else if (flen)
    co_return Error(EINVAL, "Volume is not in LUKS format");
  auto v = luks::parse_volume(head.span());
  if (!v) co_return v.take_error();
  vol_ = std::move(*v);
  payload_ = vol_.h.payload_offset();
  // The header may promise more than the file holds (a truncated or
  // hostile image): nothing is read past the end.
  if (payload_ > flen)
    co_return Error(EINVAL, "LUKS payload offset " + std::to_string(payload_) + " is beyond the end of the file (" +
                                std::to_string(flen) + " bytes)");
  set_length(flen - payload_);
  if (!password) co_return Status{};
  // The key material lies below the payload offset, so inside the file.
  luks::ReadAt read = [this](uint64_t offset, std::span<uint8_t> buf) { return luks::read_bytes(*file_, offset, buf); };
  co_return co_await luks::unlock_volume(vol_, read, *password);
}

}  // namespace

namespace drivers {

int probe_luks(std::span<const uint8_t> head) { return luks::has_luks_magic(head) ? 100 : 0; }

Result<std::shared_ptr<Node>> open_luks(OpenContext& ctx, Json& opts) {
  auto key_secret = take_string(opts, "key-secret");
  VBLK_TRY(key_secret);
  auto ro = take_bool(opts, "read-only");
  VBLK_TRY(ro);
  OpenContext cctx = ctx;
  cctx.read_only = ro->value_or(ctx.read_only);
  auto file = open_child(cctx, opts, "file", true);
  VBLK_TRY(file);
  // The passphrase first, as QEMU's qcrypto_block_luks_open: without it
  // nothing but a description (no_io) may come of the image.
  std::optional<std::string> password;
  if (!ctx.no_io) {
    if (!*key_secret) return Error(EINVAL, "Parameter 'key-secret' is required for cipher");
    auto pw = luks::lookup_password(**key_secret);
    VBLK_TRY(pw);
    password = std::move(*pw);
  }
  auto node = std::make_shared<LuksNode>(ctx.loop, *file);
  node->set_read_only(cctx.read_only || (*file)->read_only());
  node->no_io_ = ctx.no_io;
  if (*key_secret) node->key_secret_ = **key_secret;
  auto st = ctx.loop.run(node->load(password ? &*password : nullptr));
  if (password) explicit_bzero(password->data(), password->size());
  VBLK_TRY(st);
  return std::shared_ptr<Node>(node);
}

}  // namespace drivers
}  // namespace vblk
