// The `null-co` driver: a node of a given size that stores nothing. Writes
// succeed at once; reads return zeroes only with read-zeroes=on (otherwise the
// buffer is left as is, which is what makes it useful for benchmarks).
#include <cstdint>
#include <cstring>

#include "vblk/open.h"

namespace vblk {
namespace {

class NullNode final : public Node {
 public:
  NullNode(Loop& loop, uint64_t size, bool read_zeroes, uint64_t latency_ns)
      : Node(loop, "null-co"), read_zeroes_(read_zeroes), latency_ns_(latency_ns) {
    caps_.zeroes = true;
    caps_.discard = true;
    caps_.native_fua = true;
    // QEMU's null-co has no bdrv_get_info: no dirty-flag in info.
    caps_.reports_dirty_flag = false;
    set_length(size);
  }

  // QEMU names a null-co node with non-default options by those options
  // ("json:{...}", members in QEMU's dict order: read-zeroes, driver, size).
  std::string filename() const override {
    if (!given_read_zeroes_ && !given_size_) return "null-co://";
    std::string f = "json:{";
    if (given_read_zeroes_) f += std::string("\"read-zeroes\": ") + (read_zeroes_ ? "true" : "false") + ", ";
    f += "\"driver\": \"null-co\"";
    if (given_size_) f += ", \"size\": " + std::to_string(length());
    return f + "}";
  }
  bool given_read_zeroes_ = false;
  bool given_size_ = false;
  Result<uint64_t> allocated_size() const override { return uint64_t{0}; }

 protected:
  Task<void> delay() {
    if (latency_ns_) co_await loop().sleep(std::chrono::nanoseconds(latency_ns_));
  }
  Task<Status> do_read(uint64_t, std::span<uint8_t> buf, uint32_t) override {
    co_await delay();
    if (read_zeroes_) std::memset(buf.data(), 0, buf.size());
    co_return Status{};
  }
  Task<Status> do_write(uint64_t, std::span<const uint8_t>, uint32_t) override {
    co_await delay();
    co_return Status{};
  }
  Task<Status> do_write_zeroes(uint64_t, uint64_t, uint32_t) override {
    co_await delay();
    co_return Status{};
  }
  Task<Status> do_discard(uint64_t, uint64_t) override { co_return Status{}; }
  Task<Status> do_flush() override { co_return Status{}; }
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override {
    BlockStatus s{.flags = 0, .bytes = bytes, .map = offset, .file = this};
    if (read_zeroes_) s.flags = kStatusZero | kStatusOffsetValid;
    co_return s;
  }
  Task<Status> do_truncate(uint64_t length, bool) override {
    set_length(length);
    co_return Status{};
  }

 private:
  bool read_zeroes_;
  uint64_t latency_ns_;
};

}  // namespace

namespace drivers {

Result<std::shared_ptr<Node>> open_null(OpenContext& ctx, Json& opts) {
  // A JSON number beyond int64 (QMP, JSON --blockdev): the QObject input
  // visitor's words; a key=value string: the keyval visitor's (below).
  if (auto it = opts.find("size");
      it != opts.end() && it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    return Error(EINVAL, "Invalid parameter type for 'size', expected: integer");
  auto size = take_size(opts, "size");
  VBLK_TRY(size);
  // QEMU's size is an int64, and no node reaches past BDRV_MAX_LENGTH
  // (bdrv_refresh_total_sectors), so nothing exports a negative size.
  constexpr uint64_t kMaxLength = 0x7fffffffc0000000ull;
  if (*size && **size > static_cast<uint64_t>(INT64_MAX)) return Error(EINVAL, "Parameter 'size' expects integer");
  if (*size && (**size + 511) / 512 * 512 > kMaxLength)
    return Error(EFBIG, "Could not refresh total sector count: File too large");
  auto rz = take_bool(opts, "read-zeroes");
  VBLK_TRY(rz);
  auto lat = take_size(opts, "latency-ns");
  VBLK_TRY(lat);
  auto ro = take_bool(opts, "read-only");
  VBLK_TRY(ro);
  auto node = std::make_shared<NullNode>(ctx.loop, size->value_or(1ull << 30), rz->value_or(false), lat->value_or(0));
  node->set_read_only(ro->value_or(ctx.read_only));
  node->given_read_zeroes_ = rz->has_value();
  node->given_size_ = size->has_value();
  return std::shared_ptr<Node>(node);
}

namespace {
const char* const kNullCoPrefixes[] = {"null-co://"};

// "null-co://" alone names the driver (qemu-img info null-co://), as QEMU's
// null_co_parse_filename allows; it sets no option.
Status parse_null_co_filename(const std::string& filename, Json&) {
  if (filename != "null-co://") return Error(EINVAL, "The only allowed filename for this driver is 'null-co://'");
  return {};
}
}  // namespace

extern const DriverInfo null_co_driver = {.name = "null-co",
                                          .kind = DriverKind::Protocol,
                                          .open = open_null,
                                          .prefixes = kNullCoPrefixes,
                                          .parse_filename = parse_null_co_filename};

}  // namespace drivers
}  // namespace vblk
