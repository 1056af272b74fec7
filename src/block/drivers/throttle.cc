// The `throttle` filter (QEMU's block/throttle.c): every read, write,
// write-zeroes and discard of its `file` child first passes its throttle
// group (include/vblk/throttle.h); flush and block status go straight
// through. Options: `throttle-group` (the id of a throttle-group object,
// required) and `file`.
#include <cerrno>

#include "block/drivers/drivers.h"
#include "vblk/throttle.h"

namespace vblk {
namespace {

class ThrottleNode final : public Node {
 public:
  ThrottleNode(Loop& loop, std::shared_ptr<Node> file, std::shared_ptr<ThrottleGroup> group)
      : Node(loop, "throttle"), file_(file.get()), group_(std::move(group)) {
    limits_ = file_->limits();
    caps_ = file_->caps();
    caps_.native_fua = true;   // passed down; the child emulates it
    caps_.copy_range = false;  // an offloaded copy would bypass the limits
    caps_.supports_backing = false;
    set_length(file_->length());
    set_read_only(file_->read_only());
    add_child("file", std::move(file));
  }

  bool reports_dirty_flag() const override { return file_child()->reports_dirty_flag(); }
  // The group is a strong option, so QEMU names the node by its options:
  // json:{"throttle-group": "tg", "driver": "throttle", "file": {...}}, the
  // child as its own json: name or {"driver": ..., "filename": ...}.
  std::string filename() const override {
    std::string child = file_->filename();
    if (child.rfind("json:", 0) == 0) {
      child = child.substr(5);
    } else {
      child = "{\"driver\": " + nlohmann::json(file_->driver()).dump() + ", \"filename\": " +
              nlohmann::json(child).dump() + "}";
    }
    return "json:{\"throttle-group\": " + nlohmann::json(group_->id()).dump() +
           ", \"driver\": \"throttle\", \"file\": " + child + "}";
  }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override {
    co_await group_->intercept(false, buf.size());
    co_return co_await file_->read(offset, buf, flags);
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    co_await group_->intercept(true, buf.size());
    co_return co_await file_->write(offset, buf, flags);
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    co_await group_->intercept(true, bytes);
    co_return co_await file_->write_zeroes(offset, bytes, flags | kReqNoFallback);
  }
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    co_await group_->intercept(true, bytes);
    co_return co_await file_->discard(offset, bytes);
  }
  Task<Status> do_flush() override { co_return co_await file_->flush(); }
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override {
    co_return BlockStatus{.flags = kStatusRaw | kStatusOffsetValid, .bytes = bytes, .map = offset, .file = file_};
  }
  Task<Status> do_truncate(uint64_t length, bool exact) override {
    VBLK_CO_TRY(co_await file_->truncate(length, exact));
    set_length(file_->length());
    co_return Status{};
  }

 private:
  Node* file_;
  std::shared_ptr<ThrottleGroup> group_;
};

}  // namespace

namespace drivers {

Result<std::shared_ptr<Node>> open_throttle(OpenContext& ctx, Json& opts) {
  if (opts.contains("throttle-group") && !opts["throttle-group"].is_string())
    return Error(EINVAL, "Invalid parameter type for 'throttle-group', expected: string");
  auto group_id = take_string(opts, "throttle-group");
  VBLK_TRY(group_id);
  if (!*group_id) return Error(EINVAL, "Parameter 'throttle-group' is missing");
  std::shared_ptr<ThrottleGroup> group = ctx.throttle_groups ? ctx.throttle_groups->find(**group_id) : nullptr;
  if (!group) return Error(ENOENT, "Throttle group '" + **group_id + "' does not exist");
  auto file = open_child(ctx, opts, "file", true);
  VBLK_TRY(file);
  return std::shared_ptr<Node>(std::make_shared<ThrottleNode>(ctx.loop, *file, std::move(group)));
}

}  // namespace drivers
}  // namespace vblk
