// libFuzzer target: the input is everything an NBD client sends to the
// server — the handshake (client flags, then options: EXPORT_NAME, GO,
// INFO, LIST, STRUCTURED_REPLY, LIST/SET_META_CONTEXT, STARTTLS, ABORT,
// unknown ones) and, once an export is chosen, requests of any type, flag,
// offset and length, write payloads included. It goes through a socketpair
// into one server session (src/export/handshake.cc, transmission.cc) over
// in-memory exports; the replies are read and dropped. When the input is
// used up the client side half-closes, so every input ends with its
// session. A refusal or a closed connection is fine; a crash, a sanitizer
// report, a leak or a hang is a bug.
#include <cstdint>
#include <memory>

#include "export/session.h"
#include "fuzz/peer.h"
#include "vblk/mem_node.h"
#include "vblk/nbd_server.h"

using namespace vblk;

namespace {

// Small enough to allocate per input (the node is made anew for each, and
// a 256 KiB one halved the inputs per second), odd-sized so that the last
// request of a 4 KiB-aligned client is short.
constexpr uint64_t kExportSize = (64u << 10) + 1536;

Loop& loop() {
  static Loop l;  // one ring for the whole run
  return l;
}

Task<void> session(std::span<const uint8_t> input) {
  MemNode::Options o;
  o.size = kExportSize;
  o.max_size = kExportSize;
  std::shared_ptr<Node> node = std::make_shared<MemNode>(loop(), o);
  node->set_node_name("disk");
  // A dirty bitmap offered as qemu:dirty-bitmap:b0, dirty in places.
  if (auto b = node->bitmaps().create("b0", kExportSize, 4096)) {
    (*b)->bits.set(0, 16 << 10);
    (*b)->bits.set(48 << 10, 8192);
  }
  nbd::Server server(loop(), nbd::Server::Options{});
  // The default export (empty name: qemu-nbd's, nbdinfo's), writable, and
  // a read-only one with a description.
  (void)server.add_export(nbd::Export{"", "", node, true, {{node, "b0"}}});
  (void)server.add_export(nbd::Export{"ro", "read-only view", node, false, {}});
  Fd mine, theirs;
  if (!fuzz::loop_socketpair(loop(), mine, theirs)) co_return;
  fuzz::Peer client(loop(), std::move(theirs), input);
  {
    nbd::Session s{server, loop(), mine.get()};
    if (co_await nbd::negotiate(s)) co_await nbd::transmit(s);
  }
  mine.reset();
  co_await client.done();
  co_await node->drain();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  loop().run(session(std::span(data, size)));
  return 0;
}
