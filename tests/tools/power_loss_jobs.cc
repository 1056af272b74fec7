// power_loss_jobs: cuts the power while a job copies a guest's disk, and
// checks what every disk was left with.
//
// Each scenario puts qcow2 images on MemNodes that share one power supply
// (include/block/vblk/mem_node.h: a host whose disks all lose power at once),
// starts a job over them — mirror to a new image and complete, active
// commit and complete, intermediate commit, stream, full backup — and
// keeps a seeded guest writing, zeroing and flushing through the device's
// node the whole time, as an NBD export would, before, during and after
// the job's graph change. A first run counts the write-type requests
// that reach the media; then, for each chosen point k, the same run again
// with the power cut just before request k (alternately dropping every
// unflushed write and keeping a random subset of their sectors). Then:
//   - every image passes `qemu-img check` (leaks allowed);
//   - the guest's disk, read by `qemu-img convert` through the backing
//     chain its header names, holds in every sector the value it had at
//     the guest's last completed flush or a value written after it. The
//     guest's disk is the node its export held at the cut: the target once
//     a mirror or active commit has switched, the chain's top otherwise;
//   - a copy not yet switched to (mirror target) holds nothing but zeroes
//     and guest data of the right sector; a backup target nothing but
//     zeroes and the source's data as it was when the job started.
//
//   power_loss_jobs [--points N] [--seed S] [--scenario NAME] [--qemu-img PATH] [--keep DIR] [--list]
//
// Prints one line per scenario and a closing "N passed, N failed" line;
// exits 1 if any point failed.
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "block/drivers/qcow2/qcow2.h"
#include "guest_model.h"
#include "image_check.h"
#include "tool_args.h"
#include "vblk/backup.h"
#include "vblk/block_copy.h"
#include "vblk/buffer.h"
#include "vblk/commit.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"
#include "vblk/job.h"
#include "vblk/mem_node.h"
#include "vblk/mirror.h"
#include "vblk/node_ref.h"
#include "vblk/open.h"
#include "vblk/stream.h"
#include "vblk/sync.h"

using namespace vblk;
using namespace vblk::power;

namespace {

constexpr uint64_t kDisk = 8 << 20;

struct Image {
  std::string name;
  uint32_t cluster_size = 65536;
  std::string backing;  // the image below, "" for none
  int prefill = 0;      // guest writes made before the run (through the chain)
};

// Convert: no job and no guest during the copy: the block-copy engine as
// `vblk convert` drives it, from the device image (after its prefill) to
// an empty qcow2 target, then the target's flush.
enum class Kind {
  Mirror,
  MirrorBlocking,
  CommitActive,
  CommitIntermediate,
  Stream,
  Backup,
  Convert,
  ConvertCompressed
};

struct Scenario {
  std::string name;
  Kind kind;
  std::vector<Image> images;  // bottom first; the last is the device
  std::string target;         // an image of its own (mirror, backup), created empty
  uint32_t target_cluster = 65536;
};

std::vector<Scenario> scenarios() {
  return {
      {"mirror-complete", Kind::Mirror, {{"src", 65536, "", 120}}, "tgt"},
      {"mirror-blocking-4k", Kind::MirrorBlocking, {{"src", 4096, "", 120}}, "tgt", 4096},
      {"commit-active", Kind::CommitActive, {{"base", 65536, "", 30}, {"top", 65536, "base", 20}}, ""},
      {"commit-intermediate",
       Kind::CommitIntermediate,
       {{"base", 65536, "", 20}, {"mid", 4096, "base", 20}, {"top", 65536, "mid", 10}},
       ""},
      {"stream", Kind::Stream, {{"base", 65536, "", 30}, {"top", 4096, "base", 20}}, ""},
      {"backup-full", Kind::Backup, {{"src", 65536, "", 120}}, "tgt"},
      {"convert", Kind::Convert, {{"src", 65536, "", 120}}, "tgt", 4096},
      {"convert-compressed", Kind::ConvertCompressed, {{"src", 65536, "", 120}}, "tgt"},
  };
}

const Image* device_image(const Scenario& sc) { return &sc.images.back(); }

// The guest: rounds of 1-4 concurrent writes and write-zeroes through
// whatever node its export holds when each request starts, a flush after
// some rounds. No discards: over a backing file they show the backing's
// data again, which is no guest value.
struct Guest {
  Loop& loop;
  Model& model;
  std::mt19937_64 rng;
  uint64_t next_id;
  bool failed = false;

  struct Op {
    bool zero;
    uint64_t offset, bytes, id;
  };

  Op pick() {
    const uint64_t bytes = (1 + rng() % 128) * kSector;
    const uint64_t offset = (rng() % ((kDisk - bytes) / kSector + 1)) * kSector;
    const bool zero = rng() % 5 == 0;
    return {zero, offset, bytes, zero ? 0 : next_id++};
  }

  Task<void> run_op(NodeRef& device, Op op, WaitGroup& wg) {
    Status st;
    if (op.zero) {
      const uint32_t f = (rng() & 1) ? uint32_t{kReqMayUnmap} : 0u;
      st = co_await device->write_zeroes(op.offset, op.bytes, f);
    } else {
      AlignedBuffer buf(op.bytes);
      for (uint64_t s = 0; s < op.bytes / kSector; ++s)
        fill_sector(buf.data() + s * kSector, op.id, op.offset / kSector + s);
      st = co_await device->write(op.offset, buf.span());
    }
    if (!st) failed = true;
    wg.done();
  }

  Task<void> rounds(NodeRef& device, int n) {
    WaitGroup wg(loop);
    for (int round = 0; round < n && !failed; ++round) {
      const int k = 1 + static_cast<int>(rng() % 4);
      std::vector<Op> ops;
      for (int i = 0; i < k; ++i) ops.push_back(pick());
      for (const auto& op : ops)
        for (uint64_t s = op.offset / kSector; s < (op.offset + op.bytes) / kSector; ++s) model.since[s].insert(op.id);
      for (const auto& op : ops) {
        wg.add();
        spawn_detached(run_op(device, op, wg));
      }
      co_await wg.wait();
      if (failed) break;
      // Completed: overlapping requests of one round leave any of their values.
      std::vector<std::set<uint64_t>> next = model.current;
      std::vector<bool> reset(next.size(), false);
      for (const auto& op : ops) {
        for (uint64_t s = op.offset / kSector; s < (op.offset + op.bytes) / kSector; ++s) {
          if (!reset[s]) {
            next[s].clear();
            reset[s] = true;
          }
          next[s].insert(op.id);
        }
      }
      model.current = std::move(next);
      if (rng() % 3 == 0) {
        if (!co_await device->flush()) {
          failed = true;
          break;
        }
        model.flushed();
      }
    }
  }
};

Result<std::shared_ptr<Node>> open_qcow2(OpenContext& ctx, const std::string& name, const std::string& backing) {
  Json opts = {{"driver", "qcow2"}, {"node-name", name}, {"file", "m-" + name}};
  if (backing.empty())
    opts["backing"] = nullptr;
  else
    opts["backing"] = backing;
  return open_node(ctx, std::move(opts));
}

// The images as the run starts: created, the chain's layers written by
// the guest before (each through the chain up to it, so a layer holds
// what a guest wrote while it was the top), all closed.
struct Base {
  std::map<std::string, std::vector<uint8_t>> media;
  std::vector<uint64_t> ids;  // the guest's view, sector by sector
  uint64_t next_id = 1;
  std::string error;
};

Base make_base(const Scenario& sc, uint64_t seed) {
  Base b;
  b.ids.assign(kDisk / kSector, 0);
  Loop loop;
  std::mt19937_64 rng(seed);
  std::vector<Image> all = sc.images;
  if (!sc.target.empty()) all.push_back({sc.target, sc.target_cluster, "", 0});
  for (const Image& im : all) {
    auto mem = std::make_shared<MemNode>(loop, MemNode::Options{});
    qcow2::Qcow2Node::CreateOptions o;
    o.size = kDisk;
    o.cluster_size = im.cluster_size;
    if (!im.backing.empty()) {
      o.backing_file = im.backing + ".qcow2";
      o.backing_format = "qcow2";
    }
    if (Status st = loop.run(qcow2::Qcow2Node::create(loop, mem, o)); !st) {
      b.error = im.name + ": create: " + st.error().what();
      return b;
    }
    b.media[im.name] = mem->data();
  }
  for (size_t i = 0; i < sc.images.size(); ++i) {
    if (!sc.images[i].prefill) continue;
    Graph g;
    OpenContext ctx{loop};
    ctx.graph = &g;
    std::vector<std::shared_ptr<MemNode>> mems;
    std::shared_ptr<Node> top;
    for (size_t j = 0; j <= i; ++j) {
      auto mem = std::make_shared<MemNode>(loop, b.media[sc.images[j].name]);
      mem->set_node_name("m-" + sc.images[j].name);
      (void)g.add(mem);
      mems.push_back(mem);
      auto n = open_qcow2(ctx, sc.images[j].name, sc.images[j].backing);
      if (!n) {
        b.error = "prefill open: " + n.error().what();
        return b;
      }
      top = *n;
    }
    for (int w = 0; w < sc.images[i].prefill; ++w) {
      const uint64_t bytes = (1 + rng() % 256) * kSector;
      const uint64_t offset = (rng() % ((kDisk - bytes) / kSector + 1)) * kSector;
      const uint64_t id = b.next_id++;
      AlignedBuffer buf(bytes);
      for (uint64_t s = 0; s < bytes / kSector; ++s) {
        fill_sector(buf.data() + s * kSector, id, offset / kSector + s);
        b.ids[offset / kSector + s] = id;
      }
      if (Status st = loop.run(top->write(offset, buf.span())); !st) {
        b.error = "prefill write: " + st.error().what();
        return b;
      }
    }
    if (Status st = loop.run(top->close()); !st) {
      b.error = "prefill close: " + st.error().what();
      return b;
    }
    for (size_t j = 0; j <= i; ++j) b.media[sc.images[j].name] = mems[j]->power_cut(MemNode::CutMode::Drop, 0);
  }
  return b;
}

struct RunResult {
  uint64_t writes = 0;
  bool cut = false;
  std::string on_device_at_cut;  // the image the guest's export held at the cut (or at the end)
  std::map<std::string, std::vector<uint8_t>> media;
  std::vector<std::set<uint64_t>> at_start;  // the guest's view when the job started (backup's point in time)
  std::string error;                         // the run itself broke (no cut)
  bool complete = false;                     // a convert's target flush completed before any cut
  // The job's graph change happens between these write counts (its last
  // requests, before its end was seen): where the points crowd.
  uint64_t window_begin = 0, window_end = 0;
};

Task<Status> wait_job(Loop& loop, const std::shared_ptr<Job>& job, const std::function<bool()>& until) {
  for (int i = 0; i < 120000 && !until(); ++i) co_await loop.sleep(std::chrono::microseconds(250));
  if (!until())
    co_return Error(ETIMEDOUT, std::string("job ") + job->id() + " hangs in status " +
                                   std::to_string(static_cast<int>(job->status())) + (job->busy() ? " busy" : ""));
  co_return Status{};
}

RunResult run(const Scenario& sc, const Base& base, uint64_t seed, uint64_t cut_at, MemNode::CutMode mode,
              Model& model) {
  RunResult res;
  Loop loop;
  auto supply = std::make_shared<MemNode::PowerSupply>();
  supply->cut_at = cut_at;
  supply->mode = mode;
  supply->seed = seed ^ cut_at;
  Graph graph;
  JobManager mgr(loop);
  OpenContext ctx{loop};
  ctx.graph = &graph;
  std::map<std::string, std::shared_ptr<MemNode>> mems;
  for (const auto& [name, bytes] : base.media) {
    auto mem = std::make_shared<MemNode>(loop, bytes);
    mem->set_node_name("m-" + name);
    mem->join(supply);
    (void)graph.add(mem);
    mems[name] = mem;
  }
  std::map<Node*, std::string> names;
  for (const Image& im : sc.images) {
    auto n = open_qcow2(ctx, im.name, im.backing);
    if (!n) {
      res.error = "open " + im.name + ": " + n.error().what();
      return res;
    }
    names[n->get()] = im.name;
  }
  if (!sc.target.empty()) {
    auto n = open_qcow2(ctx, sc.target, "");
    if (!n) {
      res.error = "open " + sc.target + ": " + n.error().what();
      return res;
    }
    names[n->get()] = sc.target;
  }
  NodeRef device;
  device.reset(graph.find(device_image(sc)->name));
  // What the export holds at the cut: the filter of a job counts as the
  // node under it.
  auto holder = [&]() -> std::string {
    for (Node* n = device.get(); n;) {
      if (auto it = names.find(n); it != names.end()) return it->second;
      Node* below = n->child("backing");
      n = below ? below : n->file_child();
    }
    return "?";
  };
  std::string last_holder;  // once the export is gone (the images closing)
  supply->on_cut = [&] { res.on_device_at_cut = device ? holder() : last_holder; };

  Guest guest{loop, model, std::mt19937_64(seed), base.next_id};
  res.at_start = model.current;
  std::shared_ptr<Job> job;
  std::string err;
  if (sc.kind == Kind::Convert || sc.kind == Kind::ConvertCompressed) {
    // As `vblk convert` sets the engine up for a new qcow2 target.
    std::shared_ptr<Node> dst = graph.find(sc.target);
    BlockCopyOptions o;
    o.cluster_size = image::cluster_size(*dst);
    o.max_workers = 16;
    o.target_is_zero = true;
    o.detect_zeroes = 4096;
    if (sc.kind == Kind::ConvertCompressed) {
      o.write_flags |= kReqCompressed;
      o.detect_zeroes = o.cluster_size;
    }
    res.window_begin = UINT64_MAX;
    Status st = loop.run([&]() -> Task<Status> {
      BlockCopyState bcs(*device, *dst, o);
      bcs.bitmap().set_all();
      VBLK_CO_TRY(co_await bcs.copy(0, kDisk));
      co_return co_await dst->flush();
    }());
    res.complete = st.ok();
    if (!st && !supply->cut) res.error = "convert: " + st.error().what();
  }
  switch (sc.kind) {
    case Kind::Convert:
    case Kind::ConvertCompressed: break;
    case Kind::Mirror:
    case Kind::MirrorBlocking: {
      MirrorArgs a;
      a.job_id = "job";
      a.device = device_image(sc)->name;
      a.target = sc.target;
      a.sync = "full";
      a.write_blocking = sc.kind == Kind::MirrorBlocking;
      auto r = start_mirror(mgr, graph, a);
      if (r)
        job = *r;
      else
        err = r.error().what();
      break;
    }
    case Kind::CommitActive:
    case Kind::CommitIntermediate: {
      CommitArgs a;
      a.job_id = "job";
      a.device = device_image(sc)->name;
      a.base_node = "base";
      if (sc.kind == Kind::CommitIntermediate) {
        a.top_node = "mid";
        a.backing_file = "base.qcow2";
      }
      auto r = start_commit(mgr, graph, a);
      if (r)
        job = *r;
      else
        err = r.error().what();
      break;
    }
    case Kind::Stream: {
      StreamArgs a;
      a.job_id = "job";
      a.device = device_image(sc)->name;
      auto r = start_stream(mgr, graph, a);
      if (r)
        job = *r;
      else
        err = r.error().what();
      break;
    }
    case Kind::Backup: {
      BackupArgs a;
      a.job_id = "job";
      a.device = device_image(sc)->name;
      a.target = sc.target;
      a.sync = "full";
      auto r = start_backup(mgr, graph, a);
      if (r)
        job = *r;
      else
        err = r.error().what();
      break;
    }
  }
  if (sc.kind == Kind::Convert || sc.kind == Kind::ConvertCompressed) {
    // Done above.
  } else if (!job) {
    if (!supply->cut) res.error = "start: " + err;
  } else {
    auto gone = [&] { return job->status() == JobStatus::Null || job->status() == JobStatus::Concluded; };
    const bool completes = sc.kind == Kind::Mirror || sc.kind == Kind::MirrorBlocking || sc.kind == Kind::CommitActive;
    loop.run([&]() -> Task<void> {
      co_await guest.rounds(device, 10);
      // A round now and then while the job copies.
      auto between = [&]() -> Task<void> {
        co_await guest.rounds(device, 1);
        co_await loop.sleep(std::chrono::microseconds(500));
      };
      if (completes) {
        // Guest writes go on until the job is in sync, then the switch.
        for (int i = 0; i < 4000 && !job->is_ready() && !gone() && !guest.failed; ++i) co_await between();
        for (int i = 0; i < 20000 && !job->is_ready() && !gone(); ++i)
          co_await loop.sleep(std::chrono::microseconds(250));
        res.window_begin = supply->submitted;
        if (job->is_ready()) (void)job->complete();
      } else {
        res.window_begin = UINT64_MAX;
      }
      for (int i = 0; i < 4000 && !gone() && !guest.failed; ++i) co_await between();
      if (Status st = co_await wait_job(loop, job, gone); !st) err = st.error().what();
      res.window_end = supply->submitted;
      // And after the switch.
      co_await guest.rounds(device, 10);
      if (!guest.failed) {
        if (co_await device->flush())
          model.flushed();
        else
          guest.failed = true;
      }
    }());
    if (!err.empty())
      res.error = err;
    else if (!supply->cut && !job->result().ok())
      res.error = "job: " + job->error_text();
    else if (!supply->cut && guest.failed)
      res.error = "a guest request failed without a cut";
  }
  if (!supply->cut) res.on_device_at_cut = holder();
  last_holder = holder();
  device.reset();
  job.reset();
  // Closing flushes what each image caches; closing a node closes the
  // nodes under it.
  for (auto it = sc.images.rbegin(); it != sc.images.rend(); ++it)
    if (auto n = graph.find(it->name)) {
      Status st = loop.run(n->close());
      if (!st && !supply->cut && res.error.empty()) res.error = "close " + it->name + ": " + st.error().what();
    }
  if (!sc.target.empty())
    if (auto n = graph.find(sc.target)) (void)loop.run(n->close());
  res.writes = supply->submitted;
  res.cut = supply->cut;
  for (auto& [name, mem] : mems)
    res.media[name] = mem->cut_image() ? *mem->cut_image() : mem->power_cut(MemNode::CutMode::Drop, 0);
  return res;
}

std::string read_chain(const std::string& qemu_img, const std::string& path, const std::string& raw,
                       std::vector<uint8_t>* out) {
  std::string o;
  int rc = run_cmd({qemu_img, "convert", "-U", "-f", "qcow2", "-O", "raw", path, raw}, &o);
  if (rc != 0) return "qemu-img convert " + path + " rc " + std::to_string(rc) + ": " + o;
  *out = read_file(raw);
  ::unlink(raw.c_str());
  return {};
}

std::string verify(const Scenario& sc, const RunResult& r, const Model& model, const std::string& qemu_img,
                   const std::string& dir, CheckStats& stats, bool end) {
  ::mkdir(dir.c_str(), 0755);
  for (const auto& [name, bytes] : r.media)
    if (!write_file(dir + "/" + name + ".qcow2", bytes)) return "cannot write " + dir;
  for (const auto& [name, bytes] : r.media)
    if (std::string p = check_qcow2(qemu_img, dir + "/" + name + ".qcow2", bytes, stats); !p.empty()) return p;
  // The guest's disk: the image its export held, through the chain its
  // header names.
  std::vector<uint8_t> disk;
  if (std::string p = read_chain(qemu_img, dir + "/" + r.on_device_at_cut + ".qcow2", dir + "/disk.raw", &disk);
      !p.empty())
    return p;
  if (std::string p = verify_content(disk, model, ("guest disk " + r.on_device_at_cut).c_str()); !p.empty()) return p;
  if (!sc.target.empty() && r.on_device_at_cut != sc.target) {
    std::vector<uint8_t> copy;
    if (std::string p = read_chain(qemu_img, dir + "/" + sc.target + ".qcow2", dir + "/copy.raw", &copy); !p.empty())
      return p;
    const uint64_t sectors = kDisk / kSector;
    if (sc.kind == Kind::Backup || sc.kind == Kind::Convert || sc.kind == Kind::ConvertCompressed) {
      // The point in time: zeroes where not yet copied, the source's data
      // as the job started elsewhere; all of it once the job is done (a
      // convert: once its target flush completed before the cut).
      end = end || r.complete;
      for (uint64_t s = 0; s < sectors; ++s) {
        const int64_t id = decode_sector(copy.data() + s * kSector, s);
        const bool pit = id >= 0 && r.at_start[s].count(static_cast<uint64_t>(id));
        if (!pit && (end || id != 0))
          return "backup target sector " + std::to_string(s) + " holds " +
                 (id < 0 ? std::string("garbage") : "write " + std::to_string(id));
      }
    } else if (std::string p = verify_no_garbage(copy, sectors, "mirror target"); !p.empty()) {
      return p;
    }
  }
  return {};
}

void remove_dir(const std::string& dir) {
  std::string o;
  run_cmd({"rm", "-rf", dir}, &o);
}

}  // namespace

int main(int argc, char** argv) {
  ToolArgs args{.points = 120};
  if (!parse_tool_args(argc, argv, args, "vblk-power-jobs")) return 2;
  const auto all = scenarios();
  std::vector<const Scenario*> chosen;
  if (int rc = choose_scenarios(all, args, "power_loss_jobs", chosen); rc >= 0) return rc;
  const uint64_t points = args.points, seed = args.seed;
  const std::string &qemu_img = args.qemu_img, &keep_dir = args.keep_dir, &dir = args.dir;
  uint64_t passed = 0, failed = 0;
  const uint64_t per = std::max<uint64_t>(1, points / chosen.size());
  for (const Scenario* sc : chosen) {
    const uint64_t wseed = seed * 1000003 + std::hash<std::string>{}(sc->name);
    Base base = make_base(*sc, wseed);
    if (!base.error.empty()) {
      std::fprintf(stderr, "%s: %s\n", sc->name.c_str(), base.error.c_str());
      ++failed;
      continue;
    }
    CheckStats stats;
    Model dry(base.ids);
    RunResult full = run(*sc, base, wseed, 0, MemNode::CutMode::Drop, dry);
    std::string problem = full.error;
    if (problem.empty()) problem = verify(*sc, full, dry, qemu_img, dir + "/" + sc->name + "-end", stats, true);
    if (!problem.empty()) {
      std::fprintf(stderr, "%s: the run without a cut: %s\n", sc->name.c_str(), problem.c_str());
      ++failed;
      continue;
    }
    if (keep_dir.empty()) remove_dir(dir + "/" + sc->name + "-end");
    uint64_t sc_pass = 0, sc_fail = 0, missed = 0, after_switch = 0;
    std::mt19937_64 prng(wseed);
    // A third of the points fall where the job changes the graph (from
    // complete, or the job's last 40 requests, to its end); the rest spread
    // over the whole run, each jittered within its slot.
    const uint64_t w_end = std::min(full.writes, full.window_end + 4);
    const uint64_t w_begin = std::min(full.window_begin, full.window_end > 40 ? full.window_end - 40 : 0);
    const uint64_t focus = per / 3, spread = per - focus;
    for (uint64_t i = 0; i < per; ++i) {
      uint64_t k;
      if (i < spread) {
        const uint64_t slot = std::max<uint64_t>(1, full.writes / spread);
        k = std::min<uint64_t>(full.writes, 1 + i * full.writes / spread + prng() % slot);
      } else {
        k = std::max<uint64_t>(1, w_begin + prng() % (w_end - w_begin + 1));
      }
      const auto mode = (i % 2) ? MemNode::CutMode::Reorder : MemNode::CutMode::Drop;
      Model model(base.ids);
      RunResult r = run(*sc, base, wseed, k, mode, model);
      if (!r.cut) {
        ++missed;  // threads (compression, the pool) may order requests differently
        continue;
      }
      const std::string pdir = dir + "/" + sc->name + "-" + std::to_string(k);
      problem = r.error;
      if (problem.empty()) problem = verify(*sc, r, model, qemu_img, pdir, stats, false);
      if (r.on_device_at_cut != device_image(*sc)->name) ++after_switch;
      if (problem.empty()) {
        ++sc_pass;
        if (keep_dir.empty()) remove_dir(pdir);
      } else {
        ++sc_fail;
        std::fprintf(stderr, "%s: cut before write %" PRIu64 " (%s, device on %s): %s\n", sc->name.c_str(), k,
                     mode == MemNode::CutMode::Drop ? "drop" : "reorder", r.on_device_at_cut.c_str(), problem.c_str());
        if (keep_dir.empty()) remove_dir(pdir);
      }
    }
    std::printf(
        "%-22s %6" PRIu64 " writes  %4" PRIu64 " points (%" PRIu64 " after the switch)  %4" PRIu64 " passed (%" PRIu64
        " dirty, %" PRIu64 " COPIED behind)  %4" PRIu64 " failed  %" PRIu64 " not reached\n",
        sc->name.c_str(), full.writes, per, after_switch, sc_pass, stats.dirty, stats.copied_behind, sc_fail, missed);
    std::fflush(stdout);
    passed += sc_pass;
    failed += sc_fail;
  }
  if (keep_dir.empty()) remove_dir(dir);
  std::printf("power-loss-jobs: %" PRIu64 " passed, %" PRIu64 " failed\n", passed, failed);
  return failed ? 1 : 0;
}
