// libFuzzer target: the input is a qcow2 image file. It is opened read-only
// and read-write (in memory, backing files never opened), its whole virtual
// disk read and mapped with bounded work, written to a little, then checked
// without and with repair. Anything the driver does with a hostile image may
// fail with an error; it must not crash, hang, leak or trip a sanitizer.
#include <cstdint>
#include <cstdio>
#include <memory>

#include "vblk/buffer.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"
#include "vblk/mem_node.h"
#include "vblk/open.h"

using namespace vblk;

namespace {

// Work bounds per input: enough to reach every kind of table entry of a
// small image (the first 1 MiB and the last 64 KiB of the disk span the
// first and last L2 tables), small enough that an input costs about a
// millisecond: zero-filling unallocated guest bytes and a file grown to
// tens of MiB used to take most of each run.
constexpr uint64_t kReadBytes = 1ull << 20;  // guest bytes read per open
constexpr uint64_t kChunk = 64ull << 10;     // read request size
constexpr int kStatusCalls = 512;            // block-status requests per open
constexpr uint64_t kMaxFileSize = 16ull << 20;

Loop& loop() {
  static Loop l;  // one ring for the whole run
  return l;
}

Task<void> exercise(Node& n, bool writable) {
  const uint64_t len = n.length();
  // Read: the start of the disk and, if it is large, its last bytes too
  // (where the highest L1/L2 indexes are).
  AlignedBuffer buf(kChunk);
  uint64_t read = 0;
  for (uint64_t off = 0; off < len && read < kReadBytes; off += kChunk, read += kChunk) {
    uint64_t n_bytes = std::min<uint64_t>(kChunk, len - off);
    (void)co_await n.read(off, buf.span().subspan(0, n_bytes));
  }
  if (len > kReadBytes) {
    uint64_t off = (len - kChunk) / 512 * 512;
    (void)co_await n.read(off, buf.span().subspan(0, len - off));
  }
  // Block status over everything, in runs as qemu-img map asks for them.
  uint64_t off = 0;
  for (int i = 0; i < kStatusCalls && off < len; ++i) {
    auto st = co_await n.block_status_above(off, len - off);
    if (!st || st->bytes == 0) break;
    off += st->bytes;
  }
  if (!writable) co_return;
  // A few writes: allocation, copy-on-write, zero clusters and discard on
  // top of whatever the metadata claims.
  buf.zero();
  for (uint64_t i = 0; i < kChunk; ++i) buf.data()[i] = static_cast<uint8_t>(i * 7);
  if (len >= 4096) {
    (void)co_await n.write(0, buf.span().subspan(0, 4096));
    (void)co_await n.write(len / 2 / 512 * 512, buf.span().subspan(0, std::min<uint64_t>(len / 2, 3 * 512)));
    (void)co_await n.write_zeroes(len / 4 / 512 * 512, std::min<uint64_t>(len / 4, 1 << 20) / 512 * 512, kReqMayUnmap);
    (void)co_await n.discard(len / 8 / 512 * 512, std::min<uint64_t>(len / 8, 1 << 20) / 512 * 512);
    (void)co_await n.read(0, buf.span().subspan(0, 4096));
  }
  (void)co_await n.flush();
}

// Opens the qcow2 node over `file`; null when the image is refused.
std::shared_ptr<Node> open_qcow2(const std::shared_ptr<Node>& file, bool read_only, bool check) {
  Graph g;
  file->set_node_name("img");
  if (!g.add(file)) return nullptr;
  OpenContext ctx{loop()};
  ctx.graph = &g;
  ctx.read_only = read_only;
  ctx.check = check;
  Json opts = {{"driver", "qcow2"}, {"file", "img"}, {"backing", nullptr}, {"read-only", read_only}};
  auto n = open_node(ctx, std::move(opts));
  if (!n) return nullptr;
  return *n;
}

// The image file, in memory: it grows on writes past its end like a file,
// up to kMaxFileSize (a corrupt table can point allocations at any offset;
// beyond that writes fail with ENOSPC, a path worth fuzzing too), and
// never suspends.
std::shared_ptr<MemNode> image_file(const uint8_t* data, size_t size) {
  MemNode::Options o;
  o.max_size = kMaxFileSize;
  o.yield = false;
  return std::make_shared<MemNode>(loop(), std::vector<uint8_t>(data, data + size), o);
}

void close_node(std::shared_ptr<Node>& n) {
  loop().run(n->drain());
  n.reset();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Plain opens: read-only, then read-write with a few writes.
  for (bool ro : {true, false}) {
    auto file = image_file(data, size);
    if (auto n = open_qcow2(file, ro, false)) {
      loop().run(exercise(*n, !ro));
      close_node(n);
    }
  }
  // Check as qemu-img check does: report only (read-only), then repair
  // everything and check again.
  {
    auto file = image_file(data, size);
    if (auto n = open_qcow2(file, true, true)) {
      (void)loop().run(image::check(*n, kCheckReport));
      close_node(n);
    }
  }
  {
    auto file = image_file(data, size);
    if (auto n = open_qcow2(file, false, true)) {
      auto r = loop().run(image::check(*n, kCheckFixLeaks | kCheckFixErrors));
      if (r && (r->corruptions_fixed || r->leaks_fixed)) (void)loop().run(image::check(*n, kCheckReport));
      close_node(n);
    }
  }
  return 0;
}
