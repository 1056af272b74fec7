// libFuzzer target: the input is what an NBD server sends to vblk's NBD
// client (src/proto/nbd_client.cc). Byte 0 picks the client's options (bit 0:
// ask for structured replies); the rest is the server's whole byte stream:
// the greeting, option replies (STRUCTURED_REPLY, SET_META_CONTEXT, GO with
// its INFO replies, or an EXPORT_NAME fallback), then simple and
// structured replies (data, holes, block status, errors) to the requests
// the client makes once connected. Those are all in flight at once, with
// cookies 1 to 7 in this order: read 4 KiB at 0, read 8 KiB at 60 KiB,
// block status over 1 MiB (only when negotiated), write 4 KiB at 0, write
// zeroes, trim, flush. The client's own bytes are read and dropped. Any
// error is fine; a crash, a sanitizer report, a leak or a hang is a bug.
#include <cstdint>
#include <memory>
#include <vector>

#include "fuzz/peer.h"
#include "fuzz/temp_socket.h"
#include "vblk/nbd_client.h"
#include "vblk/nbd_protocol.h"

using namespace vblk;

namespace {

Loop& loop() {
  static Loop l;  // one ring for the whole run
  return l;
}

// The "server": one listening socket for the whole run.
struct Listener {
  fuzz::TempSocketPath path;
  Fd fd;
  Listener() {
    if (auto l = listen_unix(loop(), path.path())) fd = std::move(*l);
  }
};

Listener& listener() {
  static Listener l;
  return l;
}

Task<void> serve(std::span<const uint8_t> stream, WaitGroup& wg) {
  auto c = co_await accept_socket(loop(), listener().fd.get());
  if (c) {
    fuzz::Peer server(loop(), std::move(*c), stream);
    co_await server.done();
  }
  wg.done();
}

// One request; its result does not matter, only that it completes.
Task<void> op(std::shared_ptr<nbd::Client> c, int which, WaitGroup& wg) {
  std::vector<uint8_t> buf(8192, 0x5a);
  switch (which) {
    case 0: (void)co_await c->read(0, std::span(buf).first(4096)); break;
    case 1: (void)co_await c->read(60 << 10, std::span(buf).first(8192)); break;
    case 2:
      if (c->has_block_status()) (void)co_await c->block_status(0, 1 << 20);
      break;
    case 3: (void)co_await c->write(0, std::span(buf).first(4096), false); break;
    case 4: (void)co_await c->write_zeroes(4096, 8192, nbd::kCmdFlagNoHole); break;
    case 5: (void)co_await c->trim(16384, 4096); break;
    case 6: (void)co_await c->flush(); break;
  }
  wg.done();
}

Task<void> run(std::span<const uint8_t> input) {
  if (input.empty() || !listener().fd.valid()) co_return;
  nbd::Client::Options opts;
  opts.structured = input[0] & 1;
  WaitGroup server_done(loop());
  server_done.add();
  spawn_detached(serve(input.subspan(1), server_done));
  nbd::Address addr;
  addr.unix_path = listener().path.path();
  auto c = co_await nbd::Client::connect(loop(), addr, "", opts);
  if (c) {
    WaitGroup ops(loop());
    for (int i = 0; i < 7; ++i) {
      ops.add();
      spawn_detached(op(*c, i, ops));
    }
    co_await ops.wait();
    co_await (*c)->close();
    c->reset();
  }
  co_await server_done.wait();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  loop().run(run(std::span(data, size)));
  return 0;
}
