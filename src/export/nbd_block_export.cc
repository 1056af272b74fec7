// An NBD server's export as a BlockExport: the entry on the shared server
// (nbd-server-start's), removed with its clients.
#include "vblk/nbd_server.h"

namespace vblk::nbd {

namespace {

class NbdBlockExport final : public BlockExport {
 public:
  NbdBlockExport(Server& s, std::string name) : server_(&s), name_(std::move(name)) {}

  const char* type() const override { return "nbd"; }
  const Node* node() const override {
    if (!server_) return nullptr;
    auto e = server_->find_export(name_);
    return e ? e->node.get() : nullptr;
  }
  bool in_use() const override {
    // Connected clients hold the export (QEMU: its reference count): the
    // server's map, `e` here, and one per client.
    auto e = server_ ? server_->find_export(name_) : nullptr;
    return e && e.use_count() > 2;
  }
  Task<void> remove() override {
    if (!server_) co_return;
    Server& s = *std::exchange(server_, nullptr);
    std::weak_ptr<const Export> held = s.find_export(name_);
    // Its bitmaps are free again (QEMU clears busy when the export goes).
    if (auto e = held.lock())
      for (const auto& [owner, bname] : e->bitmaps)
        if (NamedBitmap* bm = owner->bitmaps().find(bname)) bm->busy = false;
    s.remove_export(name_);
    s.disconnect_clients(name_);
    // Until the last client has let go (QEMU sends BLOCK_EXPORT_DELETED
    // once its clients' coroutines have ended).
    for (int i = 0; i < 10000 && !held.expired(); ++i) co_await s.loop().sleep(std::chrono::milliseconds(1));
  }

 private:
  Server* server_;
  std::string name_;
};

}  // namespace

std::unique_ptr<BlockExport> make_block_export(Server& s, std::string name) {
  return std::make_unique<NbdBlockExport>(s, std::move(name));
}

}  // namespace vblk::nbd
