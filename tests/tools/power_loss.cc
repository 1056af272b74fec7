// power_loss: cuts the power under a qcow2 image at chosen instants and
// checks what the disk was left with.
//
// Each scenario runs a seeded guest workload on qcow2 over a MemNode
// (include/block/vblk/mem_node.h): concurrent writes, write-zeroes and discards,
// flushes, internal snapshots created and deleted, a persistent bitmap
// stored by a close and reopen. A first run counts the write-type requests
// that reach the medium; then, for each chosen point k, the same workload
// runs again with the power cut just before request k, either dropping
// every unflushed write or keeping a random subset of their sectors
// (snapshots are taken with and without a VM state, as savevm does). The
// image the medium held is then
//   - checked by qemu-img check: no corruption (leaks are allowed: a crash
//     may leak clusters, as in QEMU), and
//   - read back by qemu-img convert and by vblk: every guest sector holds
//     the value it had at the last completed guest flush or a value written
//     after it (never anything else: a flushed write is never lost, and no
//     sector shows data that was never written there).
//
//   power_loss [--points N] [--seed S] [--scenario NAME] [--qemu-img PATH] [--keep DIR] [--list]
//
// Prints one line per scenario and a closing "N passed, N failed" line;
// exits 1 if any point failed.
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "block/drivers/qcow2/qcow2.h"
#include "guest_model.h"
#include "image_check.h"
#include "tool_args.h"
#include "vblk/buffer.h"
#include "vblk/copy_drivers.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"
#include "vblk/mem_node.h"
#include "vblk/nbd_server.h"
#include "vblk/net.h"
#include "vblk/open.h"
#include "vblk/sync.h"
#include "vblk/throttle.h"

using namespace vblk;
using namespace vblk::power;

namespace {

struct Scenario {
  std::string name;
  qcow2::Qcow2Node::CreateOptions create;
  Json open_opts;       // extra qcow2 options (small caches)
  uint64_t max_op = 0;  // largest guest request
  int rounds = 0;
  bool snapshots = false;
  bool bitmap = false;  // a persistent bitmap, stored by a close and reopen midway
  bool compressed = false;
  // What the guest writes through: "" the qcow2 node itself; "nbd" vblk's
  // NBD client talking to vblk's server, which exports the qcow2 node;
  // "throttle", "blkdebug" (no rules) or "copy-before-write" (its target
  // another disk) above the qcow2 node. Their flushes must reach the
  // medium as the node's own do.
  std::string via;
};

std::vector<Scenario> scenarios() {
  std::vector<Scenario> v;
  {
    // 512-byte clusters with 64-bit refcounts: a refcount block covers
    // 32 KiB of file, so the refcount table grows several times.
    Scenario s{.name = "alloc-512-rc64"};
    s.create.size = 4 << 20;
    s.create.cluster_size = 512;
    s.create.refcount_bits = 64;
    s.open_opts = {{"l2-cache-size", "4096"}, {"refcount-cache-size", "4096"}};
    s.max_op = 16 << 10;
    s.rounds = 40;
    s.snapshots = true;
    s.bitmap = true;
    v.push_back(s);
  }
  {
    Scenario s{.name = "alloc-4k-snapshots"};
    s.create.size = 8 << 20;
    s.create.cluster_size = 4096;
    s.open_opts = {{"l2-cache-size", "16384"}};
    s.max_op = 64 << 10;
    s.rounds = 40;
    s.snapshots = true;
    v.push_back(s);
  }
  {
    Scenario s{.name = "extended-l2-64k"};
    s.create.size = 16 << 20;
    s.create.extended_l2 = true;
    s.max_op = 128 << 10;
    s.rounds = 40;
    s.bitmap = true;
    v.push_back(s);
  }
  {
    Scenario s{.name = "compressed-64k"};
    s.create.size = 8 << 20;
    s.max_op = 128 << 10;
    s.rounds = 30;
    s.compressed = true;
    v.push_back(s);
  }
  for (const char* via : {"nbd", "throttle", "blkdebug", "copy-before-write"}) {
    Scenario s{.name = std::string("via-") + via};
    s.create.size = 8 << 20;
    s.create.cluster_size = 4096;
    s.max_op = 64 << 10;
    s.rounds = 30;
    s.via = via;
    v.push_back(s);
  }
  {
    Scenario s{.name = "lazy-refcounts-rc1"};
    s.create.size = 4 << 20;
    s.create.cluster_size = 1024;
    s.create.refcount_bits = 1;
    s.create.lazy_refcounts = true;
    s.max_op = 16 << 10;
    s.rounds = 40;
    v.push_back(s);
  }
  return v;
}

struct Guest {
  Loop& loop;
  const Scenario& sc;
  Model& model;
  std::mt19937_64 rng;
  uint64_t next_id = 1;
  bool failed = false;  // an operation failed: the power is gone

  struct GuestOp {
    char kind;  // 'w' 'c' (compressed) 'z' 'd'
    uint64_t offset, bytes, id;
  };

  std::set<uint64_t> compressed_used;

  GuestOp pick() {
    uint64_t size = sc.create.size;
    const uint64_t cs = sc.create.cluster_size;
    const int r = static_cast<int>(rng() % 100);
    if (sc.compressed) {
      // Compressed writes go to clusters never allocated (qcow2 refuses to
      // overwrite one, as QEMU's does), in the upper half; the rest of the
      // workload keeps to the lower half.
      size /= 2;
      if (r < 30 && compressed_used.size() < size / cs) {
        uint64_t c = size / cs + rng() % (size / cs);
        while (compressed_used.count(c)) c = size / cs + (c + 1 - size / cs) % (size / cs);
        compressed_used.insert(c);
        return {'c', c * cs, cs, next_id++};
      }
    }
    uint64_t bytes = (1 + rng() % (sc.max_op / kSector)) * kSector;
    uint64_t offset = (rng() % ((size - bytes) / kSector + 1)) * kSector;
    char kind = r < 75 ? 'w' : (r < 90 ? 'z' : 'd');
    return {kind, offset, bytes, kind == 'w' ? next_id++ : 0};
  }

  Task<void> run_op(Node& n, GuestOp op, WaitGroup& wg) {
    Status st;
    if (op.kind == 'w' || op.kind == 'c') {
      AlignedBuffer buf(op.bytes);
      for (uint64_t s = 0; s < op.bytes / kSector; ++s)
        fill_sector(buf.data() + s * kSector, op.id, op.offset / kSector + s);
      const uint32_t f = op.kind == 'c' ? uint32_t{kReqCompressed} : 0u;
      st = co_await n.write(op.offset, buf.span(), f);
    } else if (op.kind == 'z') {
      const uint32_t f = (rng() & 1) ? uint32_t{kReqMayUnmap} : 0u;
      st = co_await n.write_zeroes(op.offset, op.bytes, f);
    } else {
      // qcow2 without a backing file reads discarded clusters as zeroes;
      // partial clusters are left as they are, so only whole ones count.
      st = co_await n.discard(op.offset, op.bytes);
    }
    if (!st) failed = true;
    wg.done();
  }

  // `rounds` rounds of 1-6 concurrent requests, each maybe followed by a
  // guest flush; a snapshot created or deleted now and then.
  Task<void> run(Node& n, int rounds, std::vector<std::string>& snaps) {
    WaitGroup wg(loop);
    for (int round = 0; round < rounds && !failed; ++round) {
      const int k = 1 + static_cast<int>(rng() % 6);
      std::vector<GuestOp> ops;
      for (int i = 0; i < k; ++i) ops.push_back(pick());
      // Issued: the sectors may hold the new value from now on.
      std::vector<std::set<uint64_t>> touched_values;
      std::vector<uint64_t> touched;
      for (const auto& op : ops) {
        if (op.kind == 'd') continue;  // see below
        for (uint64_t s = op.offset / kSector; s < (op.offset + op.bytes) / kSector; ++s) model.since[s].insert(op.id);
      }
      for (const auto& op : ops) {
        if (op.kind != 'd') continue;
        // Only whole clusters are discarded (qcow2 keeps partial ones).
        const uint64_t cs = sc.create.cluster_size;
        const uint64_t b = (op.offset + cs - 1) / cs * cs, e = (op.offset + op.bytes) / cs * cs;
        for (uint64_t s = b / kSector; s < e / kSector && b < e; ++s) model.since[s].insert(0);
      }
      for (const auto& op : ops) {
        wg.add();
        spawn_detached(run_op(n, op, wg));
      }
      co_await wg.wait();
      if (failed) break;
      // Completed: concurrent overlapping requests leave any of their values.
      std::vector<std::set<uint64_t>> next = model.current;
      std::vector<bool> reset(model.current.size(), false);
      for (const auto& op : ops) {
        uint64_t b = op.offset, e = op.offset + op.bytes;
        if (op.kind == 'd') {
          const uint64_t cs = sc.create.cluster_size;
          b = (op.offset + cs - 1) / cs * cs;
          e = (op.offset + op.bytes) / cs * cs;
        }
        for (uint64_t s = b / kSector; s < e / kSector && b < e; ++s) {
          if (!reset[s]) {
            next[s].clear();
            reset[s] = true;
          }
          next[s].insert(op.id);
        }
      }
      model.current = std::move(next);
      if (rng() % 4 == 0) {
        if (!co_await n.flush()) {
          failed = true;
          break;
        }
        model.flushed();
      }
      if (sc.snapshots && rng() % 8 == 0) {
        if (snaps.size() >= 2 || (!snaps.empty() && rng() % 2)) {
          const std::string name = snaps.front();
          snaps.erase(snaps.begin());
          if (!co_await image::snapshot_delete(n, "", name)) {
            failed = true;
            break;
          }
        } else {
          SnapshotInfo sn;
          sn.name = "s" + std::to_string(round);
          if (rng() % 2) {
            // With a VM state (savevm): written to the state area first,
            // then the snapshot that owns it.
            const uint64_t len = (16 + rng() % 48) << 10;
            AlignedBuffer st(len);
            for (uint64_t i = 0; i < len; ++i) st.data()[i] = static_cast<uint8_t>(rng());
            if (!co_await image::write_vmstate(n, 0, st.span())) {
              failed = true;
              break;
            }
            sn.vm_state_size = len;
          }
          if (!co_await image::snapshot_create(n, sn)) {
            failed = true;
            break;
          }
          snaps.push_back(sn.name);
        }
      }
    }
  }
};

std::shared_ptr<Node> open_qcow2(Loop& loop, const std::shared_ptr<Node>& file, const Json& extra, bool ro,
                                 std::string* err) {
  Graph g;
  file->set_node_name("medium");
  if (!g.add(file)) {
    *err = "graph";
    return nullptr;
  }
  OpenContext ctx{loop};
  ctx.graph = &g;
  ctx.read_only = ro;
  Json opts = {{"driver", "qcow2"}, {"file", "medium"}, {"read-only", ro}};
  for (auto it = extra.begin(); it != extra.end(); ++it) opts[it.key()] = it.value();
  auto n = open_node(ctx, std::move(opts));
  if (!n) {
    *err = n.error().what();
    return nullptr;
  }
  (void)g.remove("medium");
  return *n;
}

// The stack the guest writes through (Scenario::via) above the image node.
struct Via {
  Loop& loop;
  Graph graph;
  ThrottleGroups groups{loop};
  std::unique_ptr<nbd::Server> server;
  std::string dir;
  bool serving = false;
  std::shared_ptr<Node> top;

  explicit Via(Loop& l) : loop(l) {}
  ~Via() {
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }

  // The node the guest uses: `image` itself, or the stack over it.
  std::shared_ptr<Node> open(const std::string& via, const std::shared_ptr<Node>& image, std::string* err) {
    if (via.empty()) return image;
    image->set_node_name("image");
    if (!graph.add(image)) {
      *err = "graph";
      return nullptr;
    }
    Json opts;
    if (via == "nbd") {
      char tmpl[] = "/tmp/vblk-power-nbd-XXXXXX";
      if (!mkdtemp(tmpl)) {
        *err = "mkdtemp";
        return nullptr;
      }
      dir = tmpl;
      server = std::make_unique<nbd::Server>(loop, nbd::Server::Options{});
      (void)server->add_export(nbd::Export{"", "", image, true, {}});
      auto l = listen_unix(loop, dir + "/s");
      if (!l) {
        *err = l.error().what();
        return nullptr;
      }
      serving = true;
      spawn_detached([](Via& v, Fd fd) -> Task<void> {
        co_await v.server->serve(std::move(fd));
        v.serving = false;
      }(*this, std::move(*l)));
      opts = {{"driver", "nbd"}, {"server", {{"type", "unix"}, {"path", dir + "/s"}}}, {"export", ""}};
    } else if (via == "throttle") {
      ThrottleLimits lim;
      lim.buckets[kOpsTotal].avg = 1'000'000;
      (void)groups.add("tg0", lim);
      opts = {{"driver", "throttle"}, {"throttle-group", "tg0"}, {"file", "image"}};
    } else if (via == "blkdebug") {
      opts = {{"driver", "blkdebug"}, {"image", "image"}};
    } else if (via == "copy-before-write") {
      MemNode::Options o;
      o.yield = false;
      auto target = std::make_shared<MemNode>(loop, std::vector<uint8_t>(image->length()), o);
      target->set_node_name("target");
      (void)graph.add(target);
      opts = {{"driver", "copy-before-write"}, {"file", "image"}, {"target", "target"}};
    }
    OpenContext ctx{.loop = loop, .graph = &graph, .throttle_groups = &groups};
    auto n = open_node(ctx, std::move(opts));
    if (!n) {
      *err = n.error().what();
      return nullptr;
    }
    top = *n;
    return top;
  }

  // Closes the stack (not the image node).
  Task<void> close() {
    if (!top) co_return;
    if (server) {
      (void)co_await top->close();
      top.reset();
      server->stop();
      while (serving) co_await loop.sleep(std::chrono::milliseconds(1));
    } else {
      // A filter's close would close its child too: only drain it.
      co_await top->drain();
      top.reset();
    }
    graph.forget("image");
  }
};

struct RunResult {
  uint64_t writes = 0;  // write-type requests that reached the medium
  std::optional<std::vector<uint8_t>> cut;
  std::vector<uint8_t> end;       // the medium after an uncut run
  uint64_t bitmap_stored_at = 0;  // write-type requests when the close had stored the bitmap
  std::string error;              // the workload itself broke (no cut)
};

// One run of the scenario's workload from `base` (the freshly created
// image), with the power cut before write-type request `cut_at` (0: never).
RunResult run_workload(const Scenario& sc, const std::vector<uint8_t>& base, uint64_t seed, uint64_t cut_at,
                       MemNode::CutMode mode, Model& model) {
  RunResult res;
  Loop loop;
  auto mem = std::make_shared<MemNode>(loop, base);
  if (cut_at) mem->cut_before(cut_at, mode, seed ^ cut_at);
  Guest g{loop, sc, model, std::mt19937_64(seed)};
  std::vector<std::string> snaps;
  std::string err;
  auto node = open_qcow2(loop, mem, sc.open_opts, false, &err);
  if (!node) {
    res.error = "open: " + err;
  } else {
    if (sc.bitmap) {
      auto b = node->bitmaps().create("b0", node->length(), 65536);
      if (b) (*b)->persistent = true;
    }
    const int first = sc.bitmap ? sc.rounds / 2 : sc.rounds;
    Via via(loop);
    std::shared_ptr<Node> guest = via.open(sc.via, node, &err);
    if (!guest) {
      res.error = "stack: " + err;
      return res;
    }
    loop.run(g.run(*guest, first, snaps));
    guest.reset();
    loop.run(via.close());
    if (sc.bitmap && !g.failed) {
      // The close stores the bitmap; the reopen marks it in use again.
      Status st = loop.run(node->close());
      node.reset();
      if (st) {
        model.flushed();  // a clean close flushes everything
        if (!mem->cut_image()) res.bitmap_stored_at = mem->writes_submitted();
        node = open_qcow2(loop, mem, sc.open_opts, false, &err);
        if (node)
          loop.run(g.run(*node, sc.rounds - first, snaps));
        else if (!mem->cut_image())
          res.error = "reopen: " + err;
      } else if (!mem->cut_image()) {
        res.error = "close: " + st.error().what();
      }
    }
    if (node) {
      Status st = loop.run(node->close());
      if (st && !mem->cut_image()) model.flushed();
      if (!st && !mem->cut_image()) res.error = "close: " + st.error().what();
      node.reset();
    }
    if (g.failed && !mem->cut_image() && res.error.empty()) res.error = "a guest request failed without a cut";
  }
  res.writes = mem->writes_submitted();
  res.cut = mem->cut_image();
  if (!res.cut) res.end = mem->power_cut(MemNode::CutMode::Drop, 0);
  return res;
}

// The cut image: qemu-img check, then the guest content through QEMU and
// through vblk. Empty string: good.
std::string verify_point(const Scenario& sc, const std::vector<uint8_t>& img, const Model& model,
                         const std::string& qemu_img, const std::string& dir, const std::string& tag, bool keep,
                         CheckStats& stats, bool want_bitmap = false) {
  const std::string path = dir + "/" + tag + ".qcow2";
  const std::string raw = dir + "/" + tag + ".raw";
  if (!write_file(path, img)) return "cannot write " + path;
  std::string out;
  std::string problem = check_qcow2(qemu_img, path, img, stats);
  int rc = 0;
  if (problem.empty() && want_bitmap) {
    // A stored persistent bitmap survives any later cut (in use, perhaps,
    // so not trusted; but listed, so the chain is not silently lost).
    out.clear();
    rc = run_cmd({qemu_img, "info", "-U", "--output=json", "-f", "qcow2", path}, &out);
    if (rc != 0 || out.find("\"name\": \"b0\"") == std::string::npos) problem = "the stored bitmap b0 is gone: " + out;
  }
  if (problem.empty()) {
    out.clear();
    rc = run_cmd({qemu_img, "convert", "-U", "-f", "qcow2", "-O", "raw", path, raw}, &out);
    if (rc != 0)
      problem = "qemu-img convert rc " + std::to_string(rc) + ": " + out;
    else
      problem = verify_content(read_file(raw), model, "qemu-img");
  }
  if (problem.empty()) {
    Loop loop;
    auto mem = std::make_shared<MemNode>(loop, img);
    std::string err;
    auto node = open_qcow2(loop, mem, Json::object(), true, &err);
    if (!node) {
      problem = "vblk open: " + err;
    } else {
      AlignedBuffer buf(sc.create.size);
      Status st = loop.run(node->read(0, buf.span()));
      if (!st)
        problem = "vblk read: " + st.error().what();
      else
        problem = verify_content(std::vector<uint8_t>(buf.data(), buf.data() + buf.size()), model, "vblk");
      (void)loop.run(node->close());
    }
  }
  if (!keep || problem.empty()) {
    ::unlink(path.c_str());
    ::unlink(raw.c_str());
  }
  return problem;
}

}  // namespace

int main(int argc, char** argv) {
  ToolArgs args{.points = 200};
  if (!parse_tool_args(argc, argv, args, "vblk-power-loss")) return 2;
  register_copy_drivers();
  const auto all = scenarios();
  std::vector<const Scenario*> chosen;
  if (int rc = choose_scenarios(all, args, "power_loss", chosen); rc >= 0) return rc;
  const uint64_t points = args.points, seed = args.seed;
  const std::string &qemu_img = args.qemu_img, &keep_dir = args.keep_dir, &dir = args.dir;
  uint64_t passed = 0, failed = 0;
  const uint64_t per = std::max<uint64_t>(1, points / chosen.size());
  for (const Scenario* sc : chosen) {
    // The image as qemu-img create would make it, on the medium.
    std::vector<uint8_t> base;
    {
      Loop loop;
      auto mem = std::make_shared<MemNode>(loop, MemNode::Options{});
      Status st = loop.run(qcow2::Qcow2Node::create(loop, mem, sc->create));
      if (!st) {
        std::fprintf(stderr, "%s: create: %s\n", sc->name.c_str(), st.error().what().c_str());
        ++failed;
        continue;
      }
      base = mem->data();
    }
    const uint64_t wseed = seed * 1000003 + std::hash<std::string>{}(sc->name);
    Model dry(sc->create.size / kSector);
    RunResult full = run_workload(*sc, base, wseed, 0, MemNode::CutMode::Drop, dry);
    if (!full.error.empty()) {
      std::fprintf(stderr, "%s: the workload without a cut failed: %s\n", sc->name.c_str(), full.error.c_str());
      ++failed;
      continue;
    }
    // The end of the uncut run, as the medium holds it, is checked like a
    // cut (the close flushed everything).
    CheckStats stats;
    if (std::string p = verify_point(*sc, full.end, dry, qemu_img, dir, sc->name + "-end", !keep_dir.empty(), stats);
        !p.empty()) {
      std::fprintf(stderr, "%s: the image after the uncut run: %s\n", sc->name.c_str(), p.c_str());
      ++failed;
      continue;
    }
    uint64_t sc_pass = 0, sc_fail = 0, drops = 0, reorders = 0, missed = 0;
    std::mt19937_64 prng(wseed);
    // Every instant of the reopen that marks a stored bitmap in use (a
    // handful of writes, which points spread over the run rarely hit).
    constexpr uint64_t kReopenWrites = 8;
    const uint64_t focus = full.bitmap_stored_at ? kReopenWrites : 0;
    for (uint64_t i = 0; i < per + focus; ++i) {
      // Spread over the whole run, each point jittered within its slot.
      const uint64_t slot = std::max<uint64_t>(1, full.writes / per);
      const uint64_t k = i >= per ? std::min<uint64_t>(full.writes, full.bitmap_stored_at + 1 + (i - per))
                                  : std::min<uint64_t>(full.writes, 1 + i * full.writes / per + prng() % slot);
      const auto mode = (i % 2) ? MemNode::CutMode::Reorder : MemNode::CutMode::Drop;
      (mode == MemNode::CutMode::Drop ? drops : reorders)++;
      Model model(sc->create.size / kSector);
      RunResult r = run_workload(*sc, base, wseed, k, mode, model);
      if (!r.cut) {
        // Compression runs in a thread pool: a run may issue its requests
        // in another order, and now and then fewer of them.
        ++missed;
        continue;
      }
      std::string problem;
      if (!r.error.empty())
        problem = r.error;
      else
        problem = verify_point(*sc, *r.cut, model, qemu_img, dir, sc->name + "-" + std::to_string(k), !keep_dir.empty(),
                               stats, r.bitmap_stored_at && k > r.bitmap_stored_at);
      if (problem.empty()) {
        ++sc_pass;
      } else {
        ++sc_fail;
        std::fprintf(stderr, "%s: cut before write %" PRIu64 " (%s): %s\n", sc->name.c_str(), k,
                     mode == MemNode::CutMode::Drop ? "drop" : "reorder", problem.c_str());
      }
    }
    std::printf("%-22s %6" PRIu64 " writes  %4" PRIu64 " points (%" PRIu64 " drop, %" PRIu64 " reorder)  %4" PRIu64
                " passed (%" PRIu64 " dirty, %" PRIu64 " COPIED behind)  %4" PRIu64 " failed  %" PRIu64
                " not reached\n",
                sc->name.c_str(), full.writes, per + focus, drops, reorders, sc_pass, stats.dirty, stats.copied_behind,
                sc_fail, missed);
    std::fflush(stdout);
    passed += sc_pass;
    failed += sc_fail;
  }
  if (keep_dir.empty()) ::rmdir(dir.c_str());
  std::printf("power-loss: %" PRIu64 " passed, %" PRIu64 " failed\n", passed, failed);
  return failed ? 1 : 0;
}
