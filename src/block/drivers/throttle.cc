// The `throttle` filter (QEMU's block/throttle.c): every read, write,
// write-zeroes and discard of its `file` child first passes its throttle
// group (include/block/vblk/throttle.h); flush and block status go straight
// through. Options: `throttle-group` (the id of a throttle-group object,
// required) and `file`.
#include "vblk/throttle.h"

#include <cerrno>

#include "vblk/filter_node.h"
#include "vblk/open.h"

namespace vblk {
namespace {

class ThrottleNode final : public FilterNode {
 public:
  ThrottleNode(Loop& loop, std::shared_ptr<Node> file, std::shared_ptr<ThrottleGroup> group)
      : FilterNode(loop, "throttle", std::move(file)), group_(std::move(group)) {}

  // The group is a strong option, so QEMU names the node by its options:
  // json:{"throttle-group": "tg", "driver": "throttle", "file": {...}}, the
  // child as its own json: name or {"driver": ..., "filename": ...}.
  std::string filename() const override {
    std::string child = filtered().filename();
    if (child.rfind("json:", 0) == 0) {
      child = child.substr(5);
    } else {
      child = "{\"driver\": " + nlohmann::json(filtered().driver()).dump() +
              ", \"filename\": " + nlohmann::json(child).dump() + "}";
    }
    return "json:{\"throttle-group\": " + nlohmann::json(group_->id()).dump() +
           ", \"driver\": \"throttle\", \"file\": " + child + "}";
  }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) override {
    co_await group_->intercept(false, buf.size());
    co_return co_await FilterNode::do_read(offset, buf, flags);
  }
  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) override {
    co_await group_->intercept(true, buf.size());
    co_return co_await FilterNode::do_write(offset, buf, flags);
  }
  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    co_await group_->intercept(true, bytes);
    co_return co_await FilterNode::do_write_zeroes(offset, bytes, flags);
  }
  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    co_await group_->intercept(true, bytes);
    co_return co_await FilterNode::do_discard(offset, bytes);
  }

 private:
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

extern const DriverInfo throttle_driver = {.name = "throttle", .kind = DriverKind::Filter, .open = open_throttle};

}  // namespace drivers
}  // namespace vblk
