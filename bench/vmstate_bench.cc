// vmstate_bench: the VmstateWriter API at full speed, as migration code
// drives it: a VM-state stream of SIZE bytes written in pieces of MIN to
// MAX bytes (uniformly random), into a qcow2 image's VM state area, then
// an internal snapshot carrying it. Prints one JSON line: bytes, seconds
// (stream + flush + snapshot), MB/s. bench_vmstate.py runs it beside fio.
//
//   vblk_vmstate_bench IMAGE SIZE MIN MAX [direct] [workers] [buffer-size]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "block/open.h"
#include "vblk/vmstate.h"

using namespace vblk;

namespace {

struct Args {
  uint64_t size, min, max;
  unsigned workers;
  uint64_t buffer_size;
};

Task<Status> run(Node& node, Args a) {
  VmstateOptions o;
  o.workers = a.workers;
  o.buffer_size = a.buffer_size;
  VmstateWriter w(node, o);
  // One pass of random bytes, reused: the bench measures the writer, not
  // the generator.
  std::vector<uint8_t> src(8 << 20);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < src.size(); i += 8) {
    const uint64_t x = rng();
    std::memcpy(src.data() + i, &x, 8);
  }
  std::uniform_int_distribution<uint64_t> piece(a.min, a.max);
  uint64_t pos = 0, at = 0;
  while (pos < a.size) {
    uint64_t n = std::min(piece(rng), a.size - pos);
    if (at + n > src.size()) at = 0;
    VBLK_CO_TRY(co_await w.write(pos, std::span<const uint8_t>(src.data() + at, n)));
    pos += n;
    at += n;
  }
  VBLK_CO_TRY(co_await w.flush());
  SnapshotInfo sn;
  sn.name = "bench";
  sn.vm_state_size = a.size;
  co_return co_await node.snapshot_create(sn);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s IMAGE SIZE MIN MAX [direct] [workers] [buffer-size]\n", argv[0]);
    return 2;
  }
  Args a{std::strtoull(argv[2], nullptr, 0), std::strtoull(argv[3], nullptr, 0), std::strtoull(argv[4], nullptr, 0),
         argc > 6 ? static_cast<unsigned>(std::atoi(argv[6])) : 8u, argc > 7 ? std::strtoull(argv[7], nullptr, 0) : 0};
  const bool direct = argc > 5 && std::string(argv[5]) == "direct";
  Loop loop;
  OpenContext ctx{loop};
  ctx.read_only = false;
  ImageOpenOptions io;
  io.format = "qcow2";
  io.read_only = false;
  io.direct = direct;
  auto node = open_image(ctx, argv[1], io);
  if (!node) {
    std::fprintf(stderr, "open: %s\n", node.error().what().c_str());
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto st = loop.run(run(**node, a));
  if (st) st = loop.run((*node)->flush());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st) {
    std::fprintf(stderr, "savevm: %s\n", st.error().what().c_str());
    return 1;
  }
  (void)loop.run((*node)->close());
  std::printf("{\"bytes\": %llu, \"seconds\": %.4f, \"mb_per_s\": %.1f}\n", static_cast<unsigned long long>(a.size), s,
              static_cast<double>(a.size) / s / 1e6);
  return 0;
}
