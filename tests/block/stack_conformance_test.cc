// One byte model over every stack of drivers and filters that runs in
// memory: MemNode alone, raw (with and without an offset), qcow2 at every
// cluster size (512 B to 2 MiB, subclusters, compressed clusters, v2,
// lazy refcounts, tiny metadata caches, a backing chain, LUKS encryption),
// luks, the NBD
// client talking to vblk's own server, and each filter (throttle, blkdebug,
// copy-before-write with snapshot-access over it, mirror_top). The file
// drivers have their own harness (driver_conformance_test.cc) because they
// need real files and devices.
//
// Every stack runs the same seeded workload: batches of up to six
// requests in flight at once on disjoint ranges (so the model knows what
// each must see), writes at any byte offset and length, with FUA or
// compressed where the stack takes them, zero writes with and without
// unmap, discards (after which the range may read as zeroes or as old
// data: the model forgets it), reads compared with the model, flushes,
// and block-status walks whose zero extents must read as zeroes. At the
// end the whole disk must read as the model; a stack over qcow2 or luks
// is then closed, opened again from its media and read again; a qcow2
// image must pass check with no corruption and no leak; and a
// copy-before-write snapshot must still read as the disk did before the
// first write.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "block/drivers/luks/create.h"
#include "block/drivers/qcow2/qcow2.h"
#include "vblk/buffer.h"
#include "vblk/copy_drivers.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"
#include "vblk/mem_node.h"
#include "vblk/mirror_top.h"
#include "vblk/nbd_server.h"
#include "vblk/net.h"
#include "vblk/open.h"
#include "vblk/secret_store.h"
#include "vblk/sync.h"
#include "vblk/throttle.h"

using namespace vblk;

// Named, not anonymous: the unity build puts several test files in one
// translation unit, and their helpers share names.
namespace stack_conformance_test {

constexpr uint64_t kSize = 4 << 20;

struct QcowShape {
  uint32_t cluster_size = 65536;
  bool extended_l2 = false;
  uint32_t version = 3;
  bool lazy_refcounts = false;
  uint32_t refcount_bits = 16;
  uint8_t compression_type = qcow2::kCompressionZlib;
  bool encrypted = false;            // encrypt.format=luks, secret conf-sec
  Json open_extra = Json::object();  // cache sizes and the like
};

// The secret every encrypted stack uses.
void add_secret() {
  (void)SecretStore::process().remove("conf-sec");
  SecretSpec spec;
  spec.data = "conformance";
  EXPECT_TRUE(SecretStore::process().add("conf-sec", spec).ok());
}

// One stack under test, and what is needed to check it afterwards.
struct Stack {
  Loop loop;
  Graph graph;
  ThrottleGroups groups{loop};
  std::shared_ptr<Node> top;
  std::vector<uint8_t> initial = std::vector<uint8_t>(kSize, 0);
  bool compressed = false;  // whole-cluster compressed writes are offered
  // Clusters no request has touched: compressed writes go only there, since
  // qcow2 (QEMU's too) fails one over an allocated cluster with EIO.
  std::vector<bool> touched = std::vector<bool>(kSize / 512, false);
  uint64_t cluster = 0;  // their size
  // Reopening from the media: the options, and whether qcow2's check runs.
  Json reopen;
  bool qcow2_check = false;
  // copy-before-write: the point in time, read through snapshot-access.
  std::shared_ptr<Node> snapshot;
  // NBD: the server and its socket.
  std::unique_ptr<nbd::Server> server;
  std::string sock_dir;
  bool serving = false;

  OpenContext ctx() { return OpenContext{.loop = loop, .graph = &graph, .throttle_groups = &groups}; }

  std::shared_ptr<MemNode> mem(const std::string& name, uint64_t size) {
    MemNode::Options o;
    o.size = size;
    o.max_size = 64ull << 20;
    auto m = std::make_shared<MemNode>(loop, o);
    m->set_node_name(name);
    EXPECT_TRUE(graph.add(m).ok());
    return m;
  }
  std::shared_ptr<Node> open(Json opts) {
    auto c = ctx();
    auto n = open_node(c, std::move(opts));
    EXPECT_TRUE(n.ok()) << (n.ok() ? "" : n.error().what());
    return n.ok() ? *n : nullptr;
  }
  // A qcow2 image on a new MemNode `file`, opened as node `name`.
  std::shared_ptr<Node> qcow2(const std::string& name, const std::string& file, const QcowShape& s,
                              const std::string& backing = "") {
    auto m = mem(file, 0);
    qcow2::Qcow2Node::CreateOptions co;
    co.size = kSize;
    co.cluster_size = s.cluster_size;
    co.extended_l2 = s.extended_l2;
    co.version = s.version;
    co.lazy_refcounts = s.lazy_refcounts;
    co.refcount_bits = s.refcount_bits;
    co.compression_type = s.compression_type;
    if (!backing.empty()) {
      co.backing_file = backing + ".qcow2";
      co.backing_format = "qcow2";
    }
    if (s.encrypted) {
      add_secret();
      luks::CreateOptions lo;
      lo.key_secret = "conf-sec";
      lo.iter_time = 10;
      auto f = luks::format(lo, "encrypt.");
      EXPECT_TRUE(f.ok());
      if (f) co.encrypt = std::make_shared<const luks::Formatted>(std::move(*f));
    }
    EXPECT_TRUE(loop.run(qcow2::Qcow2Node::create(loop, m, co)).ok());
    Json o = s.open_extra;
    if (s.encrypted) o["encrypt"] = {{"format", "luks"}, {"key-secret", "conf-sec"}};
    o["driver"] = "qcow2";
    o["node-name"] = name;
    o["file"] = file;
    o["backing"] = backing.empty() ? Json(nullptr) : Json(backing);
    reopen = o;
    qcow2_check = true;
    cluster = s.cluster_size;
    return open(o);
  }
  ~Stack() {
    if (top) (void)loop.run(top->close());
    top.reset();
    if (snapshot) (void)loop.run(snapshot->close());
    if (server && serving) {
      server->stop();
      loop.run_until([&] { return !serving; });
    }
    if (!sock_dir.empty()) std::filesystem::remove_all(sock_dir);
  }
};

using Builder = std::function<void(Stack&)>;

struct Config {
  const char* name;
  Builder build;
};

std::vector<uint8_t> pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng() | 1);  // never zero
  return v;
}

// ---- the stacks

Builder over_mem(const char* driver) {
  return [driver](Stack& s) {
    s.mem("m0", kSize);
    if (std::string(driver) == "mem") {
      s.top = s.graph.find("m0");
    } else if (std::string(driver) == "raw-offset") {
      ASSERT_TRUE(s.graph.remove("m0").ok());
      s.mem("m0", kSize + 3 * 65536);
      s.top = s.open({{"driver", "raw"}, {"file", "m0"}, {"offset", 65536}, {"size", kSize}});
    } else if (std::string(driver) == "blkdebug") {
      s.top = s.open({{"driver", "blkdebug"}, {"image", "m0"}});
    } else {
      s.top = s.open({{"driver", driver}, {"file", "m0"}});
    }
  };
}

Builder qcow2_stack(QcowShape shape, bool compressed = false) {
  return [shape, compressed](Stack& s) {
    s.top = s.qcow2("d0", "m0", shape);
    s.compressed = compressed;
  };
}

// base (64 KiB clusters, data in its first half) <- top.
Builder backing_chain(QcowShape t) {
  return [t](Stack& s) {
    QcowShape b;
    auto base = s.qcow2("base", "m1", b);
    ASSERT_TRUE(base);
    auto data = pattern(kSize / 2, 99);
    ASSERT_TRUE(s.loop.run(base->write(0, data)).ok());
    ASSERT_TRUE(s.loop.run(base->flush()).ok());
    std::copy(data.begin(), data.end(), s.initial.begin());
    s.top = s.qcow2("d0", "m0", t, "base");
  };
}

Builder luks_stack() {
  return [](Stack& s) {
    add_secret();
    auto m = s.mem("m0", 0);
    luks::CreateOptions co;
    co.key_secret = "conf-sec";
    co.iter_time = 10;
    co.size = kSize;
    ASSERT_TRUE(s.loop.run(luks::create(*m, co)).ok());
    s.reopen = {{"driver", "luks"}, {"file", "m0"}, {"key-secret", "conf-sec"}};
    s.top = s.open(s.reopen);
    ASSERT_TRUE(s.top);
    // A new LUKS image reads as the decryption of a zeroed file, as in QEMU.
    ASSERT_TRUE(s.loop.run(s.top->read(0, s.initial)).ok());
  };
}

Builder throttle_stack() {
  return [](Stack& s) {
    ThrottleLimits l;
    l.buckets[kOpsTotal].avg = 1'000'000;
    l.buckets[kBpsTotal].avg = 1ull << 40;
    ASSERT_TRUE(s.groups.add("tg0", l).ok());
    s.mem("m0", kSize);
    s.top = s.open({{"driver", "throttle"}, {"throttle-group", "tg0"}, {"file", "m0"}});
  };
}

Builder cbw_stack() {
  return [](Stack& s) {
    auto m = s.mem("m0", kSize);
    auto data = pattern(kSize, 5);
    // Data in three quarters, so that some first writes copy data and
    // others copy zeroes.
    std::fill(data.begin() + kSize / 4, data.begin() + kSize / 2, 0);
    m->mutable_data() = data;
    s.initial = data;
    s.mem("t0", kSize);
    register_copy_drivers();
    s.top = s.open({{"driver", "copy-before-write"}, {"node-name", "cbw"}, {"file", "m0"}, {"target", "t0"}});
    ASSERT_TRUE(s.top);  // named "cbw" in the graph by open_node
    s.snapshot = s.open({{"driver", "snapshot-access"}, {"file", "cbw"}});
  };
}

Builder mirror_top_stack() {
  return [](Stack& s) {
    auto m = s.mem("m0", kSize);
    s.top = std::make_shared<MirrorTop>(s.loop, m);
  };
}

// The NBD client, over a unix socket, to vblk's server exporting `inner`
// (built by `below` as the stack's top, then moved under the server).
Builder nbd_stack(Builder below) {
  return [below](Stack& s) {
    below(s);
    ASSERT_TRUE(s.top);
    auto inner = s.top;
    s.top.reset();
    s.reopen = Json();
    s.qcow2_check = false;
    s.compressed = false;
    char tmpl[] = "/tmp/vblk-conf-nbd-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    s.sock_dir = tmpl;
    const std::string path = s.sock_dir + "/s";
    s.server = std::make_unique<nbd::Server>(s.loop, nbd::Server::Options{});
    ASSERT_TRUE(s.server->add_export(nbd::Export{"", "", inner, true, {}}).ok());
    auto l = listen_unix(s.loop, path);
    ASSERT_TRUE(l.ok());
    s.serving = true;
    spawn_detached([](Stack& st, Fd fd) -> Task<void> {
      co_await st.server->serve(std::move(fd));
      st.serving = false;
    }(s, std::move(*l)));
    s.top = s.open({{"driver", "nbd"}, {"server", {{"type", "unix"}, {"path", path}}}, {"export", ""}});
    // The server's export holds `inner`; the client is the top.
    inner.reset();
  };
}

// ---- the workload

struct Model {
  std::vector<uint8_t> bytes;
  std::vector<bool> known;  // false after a discard: old data or zeroes
  explicit Model(std::vector<uint8_t> initial) : bytes(std::move(initial)), known(bytes.size(), true) {}
  void set(uint64_t off, std::span<const uint8_t> b) {
    std::copy(b.begin(), b.end(), bytes.begin() + static_cast<long>(off));
    std::fill_n(known.begin() + static_cast<long>(off), b.size(), true);
  }
  void zero(uint64_t off, uint64_t n) {
    std::fill_n(bytes.begin() + static_cast<long>(off), n, 0);
    std::fill_n(known.begin() + static_cast<long>(off), n, true);
  }
  void forget(uint64_t off, uint64_t n) { std::fill_n(known.begin() + static_cast<long>(off), n, false); }
  // The first byte at which `got` (read at off) disagrees, or -1.
  int64_t mismatch(uint64_t off, std::span<const uint8_t> got) const {
    for (size_t i = 0; i < got.size(); ++i)
      if (known[off + i] && got[i] != bytes[off + i]) return static_cast<int64_t>(off + i);
    return -1;
  }
  bool zero_where_known(uint64_t off, uint64_t n) const {
    for (uint64_t i = off; i < off + n; ++i)
      if (known[i] && bytes[i]) return false;
    return true;
  }
};

struct Req {
  char op;  // 'w' write, 'c' compressed write, 'z' zeroes, 'Z' zeroes may-unmap, 'd' discard, 'r' read
  uint64_t off, len;
  uint32_t flags = 0;
  std::vector<uint8_t> buf;
  Status st;
};

Task<void> issue(Node& n, Req& r, WaitGroup& wg) {
  switch (r.op) {
    case 'w':
    case 'c': r.st = co_await n.write(r.off, r.buf, r.flags); break;
    case 'z':
    case 'Z': r.st = co_await n.write_zeroes(r.off, r.len, r.flags); break;
    case 'd': r.st = co_await n.discard(r.off, r.len); break;
    case 'r': r.st = co_await n.read(r.off, r.buf); break;
  }
  wg.done();
}

Task<Status> run_batch(Node& n, std::vector<Req>& batch) {
  WaitGroup wg(n.loop());
  for (auto& r : batch) {
    wg.add();
    spawn_detached(issue(n, r, wg));
  }
  co_await wg.wait();
  co_return Status{};
}

// A request on a range disjoint from those already in the batch.
bool pick(std::mt19937_64& rng, Stack& s, const std::vector<Req>& batch, Req& r) {
  const uint64_t c = s.cluster ? s.cluster : 65536;
  const unsigned kind = rng() % 16;
  const uint64_t cluster_no = rng() % (kSize / c);
  if (kind < 2 && s.compressed && !s.touched[cluster_no * c / 512]) {
    r.op = 'c';
    r.off = cluster_no * c;
    r.len = c;
    r.flags = kReqCompressed;
  } else {
    // Mostly 512-byte aligned, a quarter at any byte.
    const bool bytewise = rng() % 4 == 0;
    r.off = rng() % kSize;
    const uint64_t max = std::min<uint64_t>(kSize - r.off, rng() % 8 == 0 ? (1 << 20) : 65536);
    r.len = 1 + rng() % max;
    if (!bytewise) {
      r.off &= ~511ull;
      r.len = std::max<uint64_t>(512, r.len & ~511ull);
      r.len = std::min(r.len, kSize - r.off);
    }
    if (kind < 7) {
      r.op = 'w';
      r.flags = rng() % 8 == 0 ? uint32_t{kReqFua} : 0u;
    } else if (kind < 9) {
      r.op = rng() % 2 ? 'Z' : 'z';
      r.flags = r.op == 'Z' ? uint32_t{kReqMayUnmap} : 0u;
    } else if (kind < 10) {
      r.op = 'd';
    } else {
      r.op = 'r';
    }
  }
  for (const auto& o : batch)
    if (r.off < o.off + o.len && o.off < r.off + r.len) return false;
  if (r.op != 'r') {
    for (uint64_t i = r.off / c * c; i < r.off + r.len; i += c) s.touched[i / 512] = true;
  }
  if (r.op == 'w' || r.op == 'c') r.buf = pattern(r.len, rng());
  if (r.op == 'r') r.buf.assign(r.len, 0xee);
  return true;
}

// Walks block status over the disk: zero extents must read as zeroes.
void check_status(Stack& s, const Model& m) {
  uint64_t off = 0;
  int guard = 0;
  while (off < kSize && guard++ < 100000) {
    auto st = s.loop.run(s.top->block_status(off, kSize - off));
    ASSERT_TRUE(st.ok()) << st.error().what();
    ASSERT_GT(st->bytes, 0u);
    ASSERT_LE(off + st->bytes, kSize);
    if (st->flags & kStatusZero) {
      ASSERT_TRUE(m.zero_where_known(off, st->bytes)) << "zero extent at " << off;
    }
    off += st->bytes;
  }
}

void read_all_matches(Stack& s, Node& n, const Model& m, const char* when) {
  std::vector<uint8_t> all(kSize);
  ASSERT_TRUE(s.loop.run(n.read(0, all)).ok()) << when;
  int64_t bad = m.mismatch(0, all);
  ASSERT_EQ(bad, -1) << when << ": byte " << bad;
}

class StackConformance : public ::testing::TestWithParam<Config> {};

TEST_P(StackConformance, ConcurrentWorkloadMatchesModel) {
  Stack s;
  GetParam().build(s);
  ASSERT_TRUE(s.top);
  ASSERT_EQ(s.top->length(), kSize);
  Model m(s.initial);
  read_all_matches(s, *s.top, m, "before the workload");
  std::mt19937_64 rng(2026);
  int compressed = 0;
  for (int b = 0; b < 120; ++b) {
    std::vector<Req> batch;
    const int want = 1 + static_cast<int>(rng() % 6);
    for (int tries = 0; tries < 20 && static_cast<int>(batch.size()) < want; ++tries) {
      Req r;
      if (pick(rng, s, batch, r)) batch.push_back(std::move(r));
    }
    ASSERT_TRUE(s.loop.run(run_batch(*s.top, batch)).ok());
    for (auto& r : batch) {
      if (r.op == 'd' && !r.st.ok() && r.st.error().code == ENOTSUP) continue;
      ASSERT_TRUE(r.st.ok()) << "batch " << b << " op " << r.op << " at " << r.off << "+" << r.len << ": "
                             << r.st.error().what();
      switch (r.op) {
        case 'c': ++compressed; [[fallthrough]];
        case 'w': m.set(r.off, r.buf); break;
        case 'z':
        case 'Z': m.zero(r.off, r.len); break;
        case 'd': m.forget(r.off, r.len); break;
        case 'r': {
          int64_t bad = m.mismatch(r.off, r.buf);
          ASSERT_EQ(bad, -1) << "batch " << b << ": read " << r.off << "+" << r.len << " differs at " << bad;
          break;
        }
      }
    }
    if (b % 10 == 9) {
      ASSERT_TRUE(s.loop.run(s.top->flush()).ok());
    }
    if (b % 30 == 29) {
      ASSERT_NO_FATAL_FAILURE(check_status(s, m));
    }
  }
  if (s.compressed) {
    EXPECT_GT(compressed, 4);
  }
  ASSERT_TRUE(s.loop.run(s.top->flush()).ok());
  ASSERT_NO_FATAL_FAILURE(read_all_matches(s, *s.top, m, "after the workload"));
  ASSERT_NO_FATAL_FAILURE(check_status(s, m));
  if (s.snapshot) {
    Model before(s.initial);
    ASSERT_NO_FATAL_FAILURE(read_all_matches(s, *s.snapshot, before, "the copy-before-write snapshot"));
  }
  if (!s.reopen.is_null()) {
    ASSERT_TRUE(s.loop.run(s.top->close()).ok());
    s.graph.forget(s.top->node_name());  // open_node named it in the graph
    s.top.reset();
    Json o = s.reopen;
    if (o.contains("node-name")) o["node-name"] = "again";
    s.top = s.open(o);
    ASSERT_TRUE(s.top);
    ASSERT_NO_FATAL_FAILURE(read_all_matches(s, *s.top, m, "reopened"));
    if (s.qcow2_check) {
      auto r = s.loop.run(image::check(*s.top, kCheckReport));
      ASSERT_TRUE(r.ok()) << r.error().what();
      EXPECT_EQ(r->corruptions, 0);
      EXPECT_EQ(r->leaks, 0);
      EXPECT_EQ(r->check_errors, 0);
    }
  }
}

QcowShape shape(uint32_t cs) {
  QcowShape q;
  q.cluster_size = cs;
  return q;
}

std::vector<Config> configs() {
  QcowShape sub = shape(65536);
  sub.extended_l2 = true;
  QcowShape sub_zstd = shape(32768);
  sub_zstd.extended_l2 = true;
  sub_zstd.compression_type = qcow2::kCompressionZstd;
  QcowShape v2 = shape(65536);
  v2.version = 2;
  QcowShape lazy = shape(4096);
  lazy.lazy_refcounts = true;
  lazy.refcount_bits = 1;
  QcowShape luks_4k = shape(4096);
  luks_4k.encrypted = true;
  QcowShape luks_sub = shape(65536);
  luks_sub.encrypted = true;
  luks_sub.extended_l2 = true;
  QcowShape tiny_caches = shape(4096);
  tiny_caches.refcount_bits = 64;
  tiny_caches.open_extra = {{"l2-cache-size", 4096}, {"refcount-cache-size", 4096}};
  return {
      {"mem", over_mem("mem")},
      {"raw", over_mem("raw")},
      {"raw_offset", over_mem("raw-offset")},
      {"qcow2_512", qcow2_stack(shape(512))},
      {"qcow2_4k", qcow2_stack(shape(4096))},
      {"qcow2_64k", qcow2_stack(shape(65536))},
      {"qcow2_2m", qcow2_stack(shape(2 << 20))},
      {"qcow2_64k_subclusters", qcow2_stack(sub)},
      {"qcow2_64k_compressed", qcow2_stack(shape(65536), true)},
      {"qcow2_32k_subclusters_zstd_compressed", qcow2_stack(sub_zstd, true)},
      {"qcow2_v2", qcow2_stack(v2)},
      {"qcow2_4k_lazy_refcounts_rc1", qcow2_stack(lazy)},
      {"qcow2_4k_rc64_tiny_caches", qcow2_stack(tiny_caches)},
      {"qcow2_4k_over_backing", backing_chain(shape(4096))},
      {"qcow2_64k_subclusters_over_backing", backing_chain(sub)},
      {"luks", luks_stack()},
      {"qcow2_4k_luks", qcow2_stack(luks_4k)},
      {"qcow2_64k_subclusters_luks", qcow2_stack(luks_sub)},
      {"qcow2_luks_over_backing", backing_chain(luks_4k)},
      {"nbd_mem", nbd_stack(over_mem("mem"))},
      {"nbd_qcow2", nbd_stack(qcow2_stack(shape(65536)))},
      {"throttle", throttle_stack()},
      {"blkdebug", over_mem("blkdebug")},
      {"copy_before_write", cbw_stack()},
      {"mirror_top", mirror_top_stack()},
  };
}

INSTANTIATE_TEST_SUITE_P(Stacks, StackConformance, ::testing::ValuesIn(configs()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace stack_conformance_test
