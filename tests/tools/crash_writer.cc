// crash_writer: drives random writes, write-zeroes and discards into an image
// through vblk's block layer, with periodic flushes, logging every operation
// before it is issued and every completed flush. The crash test kills it with
// SIGKILL at a random moment and checks the image against the log.
//
//   crash_writer IMAGE FORMAT SEED LOG [snapshots]
//
// Log lines: "W seq first count" (blocks of 4 KiB, content derived from
// (block, seq)), "Z seq first count" (zeroes), "F seq" (every operation with
// a smaller or equal seq is durable). With "snapshots", internal snapshots
// are created (and the oldest deleted) between batches: "S name seq" before
// creating snapshot `name` of the state after operation `seq`, "SS name seq"
// once it exists; "D name" before deleting it, "DD name" once it is gone.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "vblk/buffer.h"
#include "vblk/image_format.h"
#include "vblk/open.h"
#include "vblk/sync.h"

using namespace vblk;

namespace {

// A failed operation is a bug in vblk, not a crash the test caused: say
// which, then abort (the test tells an abort from its own SIGKILL).
[[noreturn]] void die(const Status& st) {
  std::fprintf(stderr, "crash_writer: %s\n", st.error().what().c_str());
  std::abort();
}

constexpr uint64_t kBlock = 4096;

void fill_block(uint8_t* p, uint64_t block, uint64_t seq) {
  std::memcpy(p, &block, 8);
  std::memcpy(p + 8, &seq, 8);
  uint64_t x = block * 0x9E3779B97F4A7C15ull ^ seq;
  for (uint64_t i = 16; i < kBlock; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

// Blocks claimed by the operations of the current batch: concurrent
// operations never overlap, so the log's order is the order on disk.
struct Claims {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  bool claim(uint64_t first, uint64_t count) {
    for (auto [f, c] : ranges)
      if (first < f + c && f < first + count) return false;
    ranges.push_back({first, count});
    return true;
  }
};

struct State {
  Loop& loop;
  Node& node;
  int log_fd;
  std::mt19937_64 rng;
  uint64_t seq = 0;
  uint64_t blocks;
  uint64_t cluster_blocks;
  Claims claims;
  bool snapshots = false;
  std::vector<std::string> live;  // snapshots created, oldest first
  uint64_t made = 0;
};

void log_line(State& s, const std::string& line) {
  std::string l = line + "\n";
  if (::write(s.log_fd, l.data(), l.size()) != static_cast<ssize_t>(l.size())) std::abort();
}

Task<void> one_op(State& s, WaitGroup& wg) {
  int kind = static_cast<int>(s.rng() % 10);
  if (kind < 7) {
    uint64_t count = 1 + s.rng() % 16;
    uint64_t first = s.rng() % (s.blocks - count);
    if (!s.claims.claim(first, count)) {
      wg.done();
      co_return;
    }
    uint64_t seq = ++s.seq;
    log_line(s, "W " + std::to_string(seq) + " " + std::to_string(first) + " " + std::to_string(count));
    AlignedBuffer b(count * kBlock);
    for (uint64_t i = 0; i < count; ++i) fill_block(b.data() + i * kBlock, first + i, seq);
    auto st = co_await s.node.write(first * kBlock, b.span());
    if (!st) die(st);
  } else {
    // Zeroes and discards on whole clusters, so both read back as zeroes.
    uint64_t clusters = 1 + s.rng() % 4;
    uint64_t count = clusters * s.cluster_blocks;
    uint64_t first = (s.rng() % (s.blocks / s.cluster_blocks - clusters)) * s.cluster_blocks;
    if (!s.claims.claim(first, count)) {
      wg.done();
      co_return;
    }
    uint64_t seq = ++s.seq;
    log_line(s, "Z " + std::to_string(seq) + " " + std::to_string(first) + " " + std::to_string(count));
    Status st;
    if (kind < 9) {
      const uint32_t f = kind == 8 ? uint32_t{kReqMayUnmap} : 0u;
      st = co_await s.node.write_zeroes(first * kBlock, count * kBlock, f);
    } else {
      st = co_await s.node.discard(first * kBlock, count * kBlock);
    }
    if (!st) die(st);
  }
  wg.done();
}

Task<void> run(State& s) {
  for (;;) {
    // A batch of concurrent operations, then drain and flush.
    WaitGroup wg(s.loop);
    s.claims.ranges.clear();
    uint64_t n = 1 + s.rng() % 16;
    wg.add(n);
    for (uint64_t i = 0; i < n; ++i) spawn_detached(one_op(s, wg));
    co_await wg.wait();
    if (s.snapshots && s.rng() % 4 == 0) {
      // At most 8 snapshots live: with refcount_bits=4 a cluster shared by
      // 15 of them cannot be shared again, and creation refuses (EINVAL, as
      // QEMU's does), which is not the crash this test is after.
      const bool del = s.live.size() >= 2 && s.rng() % 2;
      if (del || s.live.size() >= 8) {
        std::string name = s.live.front();
        log_line(s, "D " + name);
        SnapshotInfo victim;
        for (const auto& sn : image::snapshots(s.node))
          if (sn.name == name) victim = sn;
        auto st = co_await image::snapshot_delete(s.node, victim.id, victim.name);
        if (!st) die(st);
        s.live.erase(s.live.begin());
        log_line(s, "DD " + name);
      } else {
        std::string name = "s" + std::to_string(s.seq) + "_" + std::to_string(++s.made);
        log_line(s, "S " + name + " " + std::to_string(s.seq));
        SnapshotInfo sn;
        sn.name = name;
        auto st = co_await image::snapshot_create(s.node, sn);
        if (!st) die(st);
        s.live.push_back(name);
        // Creation flushes: everything so far is durable.
        log_line(s, "SS " + name + " " + std::to_string(s.seq));
        log_line(s, "F " + std::to_string(s.seq));
      }
      continue;
    }
    if (s.rng() % 3 == 0) {
      uint64_t upto = s.seq;
      auto st = co_await s.node.flush();
      if (!st) die(st);
      log_line(s, "F " + std::to_string(upto));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && !(argc == 6 && std::string(argv[5]) == "snapshots")) {
    std::fprintf(stderr, "usage: crash_writer IMAGE FORMAT SEED LOG [snapshots]\n");
    return 2;
  }
  Loop loop;
  OpenContext ctx{loop};
  ImageOpenOptions o;
  o.format = argv[2];
  o.read_only = false;
  auto node = open_image(ctx, argv[1], o);
  if (!node) {
    std::fprintf(stderr, "crash_writer: %s\n", node.error().what().c_str());
    return 1;
  }
  int log_fd = ::open(argv[4], O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
  if (log_fd < 0) return 1;
  uint64_t cluster = image::cluster_size(**node) ? image::cluster_size(**node) : 65536;
  State s{loop,
          **node,
          log_fd,
          std::mt19937_64(std::stoull(argv[3])),
          0,
          (*node)->length() / kBlock,
          std::max<uint64_t>(1, cluster / kBlock)};
  s.snapshots = argc == 6;
  loop.run(run(s));  // runs until killed
  return 0;
}
