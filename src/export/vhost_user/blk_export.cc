// The virtio-blk device (virtio_blk.h) over a node, served by the
// vhost-user back end: what BlkExport is.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "vblk/vhost_user_blk.h"
#include "vhost_user/backend.h"
#include "vhost_user/virtio_blk.h"

namespace vblk::vhost {

namespace {

// BlkOptions::stall_seconds; the environment variable lets a test or an
// operator chasing a hung guest shorten (or, with 0, silence) the watch
// without a QMP option qemu-storage-daemon lacks.
double stall_seconds(double given) {
  if (given >= 0) return given;
  if (const char* e = std::getenv("VBLK_VHOST_STALL_SECONDS")) {
    char* end = nullptr;
    double v = std::strtod(e, &end);
    if (end != e && *end == 0 && v >= 0 && v < 1e6) return v;
  }
  return 60;
}

VirtioBlkOptions device_options(const BlkOptions& o) {
  VirtioBlkOptions v;
  v.writable = o.writable;
  v.writethrough = o.writethrough;
  v.logical_block_size = o.logical_block_size;
  v.num_queues = o.num_queues;
  // Not survive_kill: on a thin qcow2 it makes allocating writes wait for
  // the disk (4 KiB random writes at QD32: 3.0k against 87k IOPS,
  // bench/results/vhost_survive_kill_s24.txt). A reconnect after kill -9
  // replays the requests in flight, but writes the killed daemon answered
  // and no flush covered may be lost (docs/exports.md).
  return v;
}

class BlkDevice final : public BlkExport {
 public:
  BlkDevice(Loop& loop, BlkOptions o)
      : opts_(std::move(o)),
        node_(opts_.node),
        dev_(VirtioBlk::create(loop, node_, device_options(opts_))),
        backend_(loop, *dev_),
        served_(loop) {
    backend_.on_error = [](const std::string& why) { std::fprintf(stderr, "vblk: vhost-user-blk: %s\n", why.c_str()); };
    backend_.on_stall = [this](const std::string& what) {
      std::fprintf(stderr, "vblk: vhost-user-blk %s: %s\n", unix_path_.c_str(), what.c_str());
    };
    backend_.stall_limit = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(stall_seconds(opts_.stall_seconds)));
  }

  Status claim() {
    // As QEMU's blk_exp_add: consistent reads, writes if writable, and a
    // size nobody else changes under the driver.
    const uint32_t perm = kPermConsistentRead | (opts_.writable ? kPermWrite : 0u);
    VBLK_TRY(node_.set_perms(PermPair{perm, kPermAll}));
    return node_.set_perms(PermPair{perm, kPermAll & ~kPermResize});
  }

  void start(Fd listener, std::string unix_path) {
    unix_path_ = std::move(unix_path);
    spawn_detached(serve(std::move(listener)));
  }

  // ---- BlkExport
  const char* type() const override { return "vhost-user-blk"; }
  const Node* node() const override { return node_.get(); }
  bool in_use() const override { return backend_.connected(); }
  Task<void> remove() override {
    backend_.stop();
    co_await served_.wait();
    node_.reset();
  }
  void set_error_handler(std::function<void(const std::string&)> fn) override { backend_.on_error = std::move(fn); }

 private:
  Task<void> serve(Fd listener) {
    co_await backend_.serve(std::move(listener));
    if (!unix_path_.empty()) ::unlink(unix_path_.c_str());
    served_.set();
  }

  BlkOptions opts_;
  NodeRef node_;
  std::unique_ptr<VirtioBlk> dev_;
  Backend backend_;
  CoEvent served_;  // serve() has returned
  std::string unix_path_;
};

}  // namespace

Result<std::unique_ptr<BlkExport>> BlkExport::create(Loop& loop, BlkOptions o, Fd listener, std::string unix_path) {
  if (!o.node) return Error(EINVAL, "no node to export");
  const uint32_t lbs = o.logical_block_size;
  if (lbs < 512 || lbs > kMaxLogicalBlockSize || (lbs & (lbs - 1)))
    return Error(EINVAL, "logical-block-size must be a power of two between 512 and 2097152");
  if (o.num_queues == 0) return Error(EINVAL, "num-queues must be greater than 0");
  if (o.writable && o.node->read_only()) return Error(EACCES, "Block node is read-only");
  auto dev = std::make_unique<BlkDevice>(loop, std::move(o));
  VBLK_TRY(dev->claim());
  dev->start(std::move(listener), std::move(unix_path));
  return std::unique_ptr<BlkExport>(std::move(dev));
}

}  // namespace vblk::vhost
