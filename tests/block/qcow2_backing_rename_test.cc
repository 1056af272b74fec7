// qcow2's header names a new backing file (an intermediate commit's or a
// stream's relink) with the power cut at every write of the change and the
// drive tearing writes at sector boundaries: the header always names the
// old file or the new one, never a mix ("base.qcow" from the old length over
// the new name: found by vblk_power_loss_jobs).
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "block/drivers/qcow2/format.h"
#include "block/drivers/qcow2/qcow2.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"
#include "vblk/mem_node.h"
#include "vblk/open.h"

using namespace vblk;

namespace {

std::vector<uint8_t> image(uint32_t cluster_size, const std::string& backing) {
  Loop loop;
  auto mem = std::make_shared<MemNode>(loop, MemNode::Options{});
  qcow2::Qcow2Node::CreateOptions o;
  o.size = 1 << 20;
  o.cluster_size = cluster_size;
  o.backing_file = backing;
  o.backing_format = "qcow2";
  EXPECT_TRUE(loop.run(qcow2::Qcow2Node::create(loop, mem, o)).ok());
  return mem->data();
}

std::string backing_name(const std::vector<uint8_t>& img) {
  auto h = qcow2::parse_header(img, img.size());
  if (!h) return "(unreadable: " + h.error().what() + ")";
  return h->backing_file;
}

// Renames the backing file of `base` from one name to the other with the
// power cut before write `cut` (0: not at all); the medium afterwards.
std::vector<uint8_t> rename(const std::vector<uint8_t>& base, const std::string& to, uint64_t cut, uint64_t seed,
                            uint64_t* writes) {
  Loop loop;
  auto mem = std::make_shared<MemNode>(loop, base);
  mem->set_node_name("m");
  Graph g;
  EXPECT_TRUE(g.add(mem).ok());
  OpenContext ctx{loop};
  ctx.graph = &g;
  auto n = open_node(ctx, {{"driver", "qcow2"}, {"file", "m"}, {"backing", nullptr}});
  EXPECT_TRUE(n.ok());
  if (!n) return {};
  const uint64_t before = mem->writes_submitted();
  if (cut) mem->cut_before(before + cut, MemNode::CutMode::Reorder, seed);
  auto other = std::make_shared<MemNode>(loop, MemNode::Options{.size = 1 << 20});
  (void)loop.run(image::set_backing(**n, other, to, "qcow2"));
  *writes = mem->writes_submitted() - before;
  if (mem->cut_image()) return *mem->cut_image();
  return mem->power_cut(MemNode::CutMode::Drop, 0);
}

void rename_under_cuts(uint32_t cluster_size, const std::string& from, const std::string& to) {
  auto base = image(cluster_size, from);
  ASSERT_EQ(backing_name(base), from);
  uint64_t writes = 0;
  auto done = rename(base, to, 0, 0, &writes);
  ASSERT_EQ(backing_name(done), to);
  ASSERT_GT(writes, 0u);
  // And again from there: the name moves back to where it started.
  uint64_t back_writes = 0;
  auto back = rename(done, from, 0, 0, &back_writes);
  ASSERT_EQ(backing_name(back), from);
  std::set<std::string> seen;
  for (const auto* start : {&base, &done}) {
    const std::string& old_name = start == &base ? from : to;
    const std::string& new_name = start == &base ? to : from;
    for (uint64_t cut = 1; cut <= writes + 1; ++cut) {
      for (uint64_t seed = 0; seed < 16; ++seed) {
        uint64_t w = 0;
        auto img = rename(*start, new_name, cut, seed, &w);
        const std::string got = backing_name(img);
        EXPECT_TRUE(got == old_name || got == new_name)
            << "cut before write " << cut << " seed " << seed << ": backing file '" << got << "'";
        seen.insert(got);
      }
    }
  }
  EXPECT_EQ(seen.size(), 2u);  // cuts before and after the switch both happened
}

TEST(Qcow2BackingRename, AtomicUnderTornWrites64k) { rename_under_cuts(65536, "mid.qcow2", "base.qcow2"); }

TEST(Qcow2BackingRename, AtomicUnderTornWrites4k) {
  rename_under_cuts(4096, "a-much-longer-name-of-the-middle-layer.qcow2", "b.qcow2");
}

}  // namespace
