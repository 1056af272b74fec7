// vmstate_bench: the VmstateWriter API at full speed, as migration code
// drives it: a VM-state stream of SIZE bytes written in pieces of MIN to
// MAX bytes (uniformly random), into a qcow2 image's VM state area, then
// an internal snapshot carrying it; then the snapshot's state read back in
// order (what loadvm does). Prints one JSON line: bytes, seconds and MB/s
// of the save (stream + flush + snapshot) and of the load.
// bench_vmstate.py runs it beside fio.
//
//   vblk_vmstate_bench IMAGE SIZE MIN MAX [direct|cached] [workers] [buffer-size] [buffered|qemufile]
//
// buffered: VmstateWriter / VmstateReader (aligned buffers, async workers).
// qemufile: what QEMU 7.2's savevm does with the same node API: the pieces
// gathered in a 32 KiB buffer (QEMUFile's IO_BUF_SIZE), each full buffer
// written synchronously, one at a time, at its unaligned stream position
// (bdrv_writev_vmstate); loaded the same way.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "vblk/image_format.h"
#include "vblk/open.h"
#include "vblk/vmstate.h"

using namespace vblk;

namespace {

struct Args {
  uint64_t size, min, max;
  unsigned workers;
  uint64_t buffer_size;
  bool qemufile;
};

constexpr size_t kQemuFileBuf = 32 * 1024;

// QEMUFile's path: a 32 KiB buffer, written whole and waited for.
class QemuFileWriter {
 public:
  explicit QemuFileWriter(Node& n) : node_(n), buf_(kQemuFileBuf) {}
  Task<Status> write(uint64_t, std::span<const uint8_t> d) {
    while (!d.empty()) {
      const size_t k = std::min(d.size(), kQemuFileBuf - fill_);
      std::memcpy(buf_.data() + fill_, d.data(), k);
      fill_ += k;
      d = d.subspan(k);
      if (fill_ == kQemuFileBuf) VBLK_CO_TRY(co_await flush());
    }
    co_return Status{};
  }
  Task<Status> flush() {
    if (fill_) VBLK_CO_TRY(co_await image::write_vmstate(node_, pos_, buf_.span().subspan(0, fill_)));
    pos_ += fill_;
    fill_ = 0;
    co_return Status{};
  }

 private:
  Node& node_;
  AlignedBuffer buf_;
  size_t fill_ = 0;
  uint64_t pos_ = 0;
};

template <class W>
Task<Status> save(Node& node, Args a, W& w) {
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
  co_return co_await image::snapshot_create(node, sn);
}

Task<Status> run_save(Node& node, Args a) {
  if (a.qemufile) {
    QemuFileWriter w(node);
    co_return co_await save(node, a, w);
  }
  VmstateOptions o;
  o.workers = a.workers;
  o.buffer_size = a.buffer_size;
  VmstateWriter w(node, o);
  co_return co_await save(node, a, w);
}

// Reads the snapshot's state front to back, as loadvm feeds a migration.
Task<Status> run_load(Node& node, Args a) {
  const std::string id = image::snapshots(node).back().id;
  if (a.qemufile) {
    AlignedBuffer b(kQemuFileBuf);
    for (uint64_t pos = 0; pos < a.size; pos += kQemuFileBuf) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kQemuFileBuf, a.size - pos));
      VBLK_CO_TRY(co_await image::read_vmstate(node, pos, b.span().subspan(0, n), id));
    }
    co_return Status{};
  }
  VmstateOptions o;
  o.workers = a.workers;
  o.buffer_size = a.buffer_size;
  VmstateReader r(node, id, a.size, o);
  AlignedBuffer b(1 << 20);
  Status st;
  for (uint64_t pos = 0; pos < a.size && st;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(b.size(), a.size - pos));
    st = co_await r.read(pos, b.span().subspan(0, n));
    pos += n;
  }
  co_await r.close();
  co_return st;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s IMAGE SIZE MIN MAX [direct|cached] [workers] [buffer-size] [buffered|qemufile]\n",
                 argv[0]);
    return 2;
  }
  Args a{std::strtoull(argv[2], nullptr, 0),
         std::strtoull(argv[3], nullptr, 0),
         std::strtoull(argv[4], nullptr, 0),
         argc > 6 ? static_cast<unsigned>(std::atoi(argv[6])) : 8u,
         argc > 7 ? std::strtoull(argv[7], nullptr, 0) : 0,
         argc > 8 && std::string(argv[8]) == "qemufile"};
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
  auto t0 = std::chrono::steady_clock::now();
  auto st = loop.run(run_save(**node, a));
  if (st) st = loop.run((*node)->flush());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st) {
    std::fprintf(stderr, "savevm: %s\n", st.error().what().c_str());
    return 1;
  }
  // A cached image's state may still be in the page cache: drop it, so the
  // load reads the disk as a restore after a reboot does.
  if (!direct) (void)std::system(("dd if=" + std::string(argv[1]) + " iflag=nocache count=0 status=none").c_str());
  t0 = std::chrono::steady_clock::now();
  st = loop.run(run_load(**node, a));
  const double l = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st) {
    std::fprintf(stderr, "loadvm: %s\n", st.error().what().c_str());
    return 1;
  }
  (void)loop.run((*node)->close());
  std::printf(
      "{\"bytes\": %llu, \"seconds\": %.4f, \"mb_per_s\": %.1f, \"load_seconds\": %.4f, "
      "\"load_mb_per_s\": %.1f}\n",
      static_cast<unsigned long long>(a.size), s, static_cast<double>(a.size) / s / 1e6, l,
      static_cast<double>(a.size) / l / 1e6);
  return 0;
}
