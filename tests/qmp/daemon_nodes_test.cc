// The daemon's record of its nodes stays as large as the nodes it has: a
// soak that added and deleted nodes (export churn) grew 2.3 KiB per node
// for ever, because node_order kept a weak_ptr to every node it ever had,
// and a weak_ptr keeps a make_shared node's whole allocation.
#include <gtest/gtest.h>

#include "vblk/qmp_daemon.h"

using namespace vblk;

TEST(DaemonNodes, DeletedNodesLeaveNothingBehind) {
  Loop loop;
  qmp::Daemon d(loop);
  qmp::register_all_commands(d);
  const qmp::Command* del = d.registry.find("blockdev-del");
  ASSERT_TRUE(del);
  std::weak_ptr<Node> first;
  for (int i = 0; i < 50; ++i) {
    {
      auto n = d.blockdev_add({{"driver", "null-co"}, {"node-name", "n"}, {"size", 1 << 20}});
      ASSERT_TRUE(n.ok()) << n.error().what();
      if (i == 0) first = *n;
    }
    auto r = loop.run(del->fn(qmp::OJson{{"node-name", "n"}}));
    ASSERT_FALSE(r.error.has_value()) << i << ": " << r.error->desc;
  }
  EXPECT_TRUE(first.expired());
  // One more add: the record holds the live node only.
  ASSERT_TRUE(d.blockdev_add({{"driver", "null-co"}, {"node-name", "n"}, {"size", 1 << 20}}).ok());
  EXPECT_EQ(d.node_order.size(), 1u);
  EXPECT_EQ(d.settings.size(), 1u);
  loop.run(d.shutdown());
}
