// The ImageFormat facet (image_format.h): a node without it and a facet
// that overrides nothing answer alike, with the defaults' values and
// messages; Node calls the facet's hooks.
#include "vblk/image_format.h"

#include <gtest/gtest.h>

#include "vblk/mem_node.h"

using namespace vblk;

namespace {

// A node that is no image format: reads zeroes, flushes are counted.
class PlainNode final : public Node {
 public:
  explicit PlainNode(Loop& loop) : Node(loop, "plain") { set_length(1 << 20); }
  int flushes = 0;

 protected:
  Task<Status> do_read(uint64_t, std::span<uint8_t> buf, uint32_t) override {
    std::fill(buf.begin(), buf.end(), 0);
    co_return Status{};
  }
  Task<Status> do_flush() override {
    ++flushes;
    co_return Status{};
  }
};

// A format that caches its backing child and writes back on read-only.
class HookedFormat final : public Node, public ImageFormat {
 public:
  explicit HookedFormat(Loop& loop) : Node(loop, "hooked") {
    caps_.supports_backing = true;
    set_length(1 << 20);
    set_format(this);
  }
  Node* backing = nullptr;
  int prepared = 0;

 protected:
  Task<Status> do_read(uint64_t, std::span<uint8_t> buf, uint32_t) override {
    std::fill(buf.begin(), buf.end(), 0);
    co_return Status{};
  }
  void backing_changed(Node* b) override { backing = b; }
  Task<Status> prepare_read_only() override {
    ++prepared;
    co_return Status{};
  }
};

std::string what(const Status& st) { return st ? std::string("ok") : st.error().what(); }

// The answers image:: gives for `n`, as one string per question.
std::vector<std::string> answers(Loop& loop, Node& n) {
  SnapshotInfo sn;
  std::vector<uint8_t> buf(16);
  auto ck = loop.run(image::check(n, kCheckReport));
  return {
      std::to_string(image::cluster_size(n)),
      image::backing_file_name(n) + "|" + image::backing_file_format(n),
      what(loop.run(image::set_backing(n, nullptr, "x", "raw"))),
      ck ? std::string("ok") : ck.error().what(),
      what(image::can_store_new_bitmap(n, "b", 65536)),
      what(loop.run(image::remove_persistent_bitmap(n, "b"))),
      std::to_string(image::supports_snapshots(n)) + std::to_string(image::snapshots(n).size()),
      what(loop.run(image::snapshot_create(n, sn))),
      what(loop.run(image::snapshot_goto(n, "s"))),
      what(loop.run(image::snapshot_delete(n, "1", "s"))),
      std::to_string(image::supports_vmstate(n)),
      what(loop.run(image::write_vmstate(n, 0, buf))),
      what(loop.run(image::read_vmstate(n, 0, buf))),
      what(loop.run(image::discard_vmstate(n, 1))),
  };
}

}  // namespace

TEST(ImageFormatTest, NoFacetAnswersAsTheDefaults) {
  Loop loop;
  PlainNode plain(loop);
  plain.set_node_name("p0");
  MemNode mem(loop, std::vector<uint8_t>(4096));  // a facet overriding nothing it is asked here
  mem.set_node_name("p0");
  EXPECT_EQ(plain.format(), nullptr);
  ASSERT_NE(mem.format(), nullptr);
  const std::string no_snapshots = "Block driver does not support snapshots";
  const std::string no_vmstate = "Block driver does not support VM state";
  const std::vector<std::string> expect{
      "0",
      "|",
      std::strerror(ENOTSUP),
      "This image format does not support checks",
      "Can't store persistent bitmaps to p0: Operation not supported",
      "ok",
      "00",
      std::strerror(ENOTSUP),
      no_snapshots,
      no_snapshots,
      "0",
      no_vmstate,
      no_vmstate,
      no_vmstate,
  };
  EXPECT_EQ(answers(loop, plain), expect);
  EXPECT_EQ(answers(loop, mem), expect);
  EXPECT_TRUE(plain.caps().reports_dirty_flag);
}

TEST(ImageFormatTest, NodeCallsTheFacetHooks) {
  Loop loop;
  HookedFormat top(loop);
  auto base = std::make_shared<PlainNode>(loop);
  ASSERT_TRUE(top.attach_backing(base).ok());
  EXPECT_EQ(top.backing, base.get());
  ASSERT_TRUE(loop.run(top.reopen_read_only()).ok());
  EXPECT_EQ(top.prepared, 1);
  EXPECT_TRUE(top.read_only());

  // Without a facet, becoming read-only flushes.
  PlainNode plain(loop);
  ASSERT_TRUE(loop.run(plain.reopen_read_only()).ok());
  EXPECT_EQ(plain.flushes, 1);
  EXPECT_TRUE(plain.read_only());
}
