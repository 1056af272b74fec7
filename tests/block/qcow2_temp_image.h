// Qcow2TempImage: a qcow2 image in /var/tmp (a real file system, so O_DIRECT
// works) created once per test and removed after it, opened as
// qcow2-over-file as often as a test needs.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "block/drivers/qcow2/qcow2.h"
#include "vblk/open.h"

namespace vblk::testing {

class Qcow2TempImage {
 public:
  // Creates the image; check with ASSERT_NO_FATAL_FAILURE.
  void create(const qcow2::Qcow2Node::CreateOptions& o) {
    char tmpl[] = "/var/tmp/vblk-qcow2-XXXXXX";
    int fd = mkstemp(tmpl);
    ASSERT_GE(fd, 0);
    close(fd);
    path_ = tmpl;
    Loop loop;
    OpenContext ctx{loop};
    auto file = open_node(ctx, Json{{"driver", "file"}, {"filename", path_}});
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE(loop.run(qcow2::Qcow2Node::create(loop, *file, o)).ok());
    ASSERT_TRUE(loop.run((*file)->close()).ok());
  }
  ~Qcow2TempImage() {
    if (!path_.empty()) unlink(path_.c_str());
  }
  std::shared_ptr<Node> open(Loop& loop, bool ro = false) const {
    OpenContext ctx{loop};
    ctx.read_only = ro;
    auto n = open_node(ctx, Json{{"driver", "qcow2"}, {"file", {{"driver", "file"}, {"filename", path_}}}});
    EXPECT_TRUE(n.ok()) << (n.ok() ? "" : n.error().what());
    return n.ok() ? *n : nullptr;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace vblk::testing
