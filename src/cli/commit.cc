// vblk commit: copy an image's data into its backing file (qemu-img commit).
//
// As QEMU 7.2's img_commit: the image's chain is opened, the base (the
// backing file, or -b further down the chain) writable; an active commit
// (the commit job of QMP's block-commit, src/job/commit.cc) copies what the
// layers above the base allocate into it and completes as soon as it is in
// sync; then the image is emptied (every cluster unallocated, so it reads
// from its backing file again), unless -d or -b. The images in between are
// not changed on disk (their data is in the base now, and the image reads
// the same through them).
#include "vblk/commit.h"

#include <getopt.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "progress.h"
#include "vblk/chain.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"
#include "vblk/job.h"

namespace vblk::cli {

namespace {

struct CommitCommand {
  ImageArgs image;
  std::string base;  // -b ("": the backing file)
  bool has_base = false, drop = false, progress = false, quiet = false;
  int64_t rate = 0;
};

Parsed<CommitCommand> parse_commit(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {nullptr, 0, nullptr, 0},
  };
  CommitCommand c;
  std::string cache = "writeback";
  if (int rc = for_each_option(
          argc, argv, ":f:ht:b:dpqr:", longopts,
          [&] {
            std::printf(
                "usage: %s commit [--object objectdef] [--image-opts] [-q] [-f fmt] [-t cache] [-b base] "
                "[-r rate_limit] [-d] [-p] filename\n",
                g_prog.c_str());
          },
          [&](int o) {
            switch (o) {
              case 'f': c.image.format = optarg; break;
              case 't': cache = optarg; break;
              case 'b':
                c.base = optarg;
                c.has_base = true;
                c.drop = true;  // -b implies -d
                break;
              case 'd': c.drop = true; break;
              case 'p': c.progress = true; break;
              case 'q': c.quiet = true; break;
              case 'r': {
                auto r = cvtnum("rate limit", optarg);
                if (!r) return 1;
                c.rate = *r;
                break;
              }
              case OPT_OBJECT: cli_object(optarg); break;
              case OPT_IMAGE_OPTS: c.image.image_opts = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (c.quiet) c.progress = false;
  if (optind != argc - 1) error_exit("Expecting one image file name");
  c.image.filename = argv[optind];
  c.image.read_only = false;
  // The chain below is opened here, layer by layer (run_commit).
  c.image.no_backing = true;
  if (!parse_cache_mode(cache, c.image.cache)) {
    error_report("Invalid cache option: " + cache);
    return 1;
  }
  return c;
}

// The chain below the image, opened as QEMU 7.2 does it: first read-only,
// as qemu-img opens any image (its errors in QEMU's words: a writer
// elsewhere refuses it, a missing file), to find the base; then the layers
// down to the base writable, each attached as the backing file of the one
// above (the base first), the base with its own chain read-only (QEMU reopens the base and
// the images in between read-write for the commit; a reader elsewhere
// refuses that: "Failed to get "write" lock"). Returns the base, or
// nullptr with the error reported.
std::shared_ptr<Node> open_chain_to_base(Loop& loop, const CommitCommand& c, Node& image) {
  Node* top = skip_filters(&image);
  const std::string first = image::backing_file_name(*top);
  struct Layer {
    std::string path, format;
  };
  std::vector<Layer> layers;  // from the image's backing file down to the base
  if (!first.empty() && top->caps().supports_backing) {
    ImageArgs ro;
    ro.filename = path_combine(top->filename(), first);
    ro.format = image::backing_file_format(*top);
    ro.cache.direct = c.image.cache.direct;  // inherited, as cache.direct is
    ro.cache.no_flush = c.image.cache.no_flush;
    Error err;
    ro.open_error = &err;
    auto chain = open_cli_image(loop, ro);
    if (!chain) {
      error_report_hint("Could not open '" + c.image.filename + "': Could not open backing file: " + err.what(), err);
      return nullptr;
    }
    bool found = false;
    for (Node *overlay = top, *layer = skip_filters(chain.get()); layer && !found;) {
      const std::string recorded = image::backing_file_name(*overlay);
      layers.push_back({path_combine(overlay->filename(), recorded), layer->driver()});
      found = !c.has_base || names_backing(overlay->filename(), recorded, c.base);
      overlay = layer;
      layer = skip_filters(filter_or_cow_child(*layer));
    }
    if (!found) layers.clear();
  }
  if (layers.empty()) {
    if (c.has_base) {
      error_report("Did not find '" + c.base + "' in the backing chain of '" + c.image.filename + "'");
    } else {
      error_report("Image does not have a backing file");
    }
    return nullptr;
  }
  // The base first, then the images in between from the bottom up (QEMU's
  // order: a reader of both hears about the base).
  std::shared_ptr<Node> base, below;
  for (size_t i = layers.size(); i-- > 0;) {
    const bool is_base = !base;
    ImageArgs rw;
    rw.filename = layers[i].path;
    rw.format = layers[i].format;
    rw.read_only = false;
    rw.no_backing = !is_base;
    rw.cache = c.image.cache;
    Error err;
    rw.open_error = &err;
    auto layer = open_cli_image(loop, rw);
    if (!layer) {
      error_report_hint(err.what(), err);
      return nullptr;
    }
    if (is_base) base = layer;
    if (below) {
      if (Status st = skip_filters(layer.get())->attach_backing(below); !st) {
        error_report_hint(st.error().what(), st.error());
        return nullptr;
      }
    }
    below = layer;
  }
  if (Status st = top->attach_backing(below); !st) {
    error_report_hint(st.error().what(), st.error());
    return nullptr;
  }
  return base;
}

int run_commit(const CommitCommand& c) {
  Loop loop;
  auto top = open_cli_image(loop, c.image);
  if (!top) return 1;
  Progress meter(c.progress, 1.0f);
  meter.print(0, 100);
  auto base = open_chain_to_base(loop, c, *top);
  if (!base) {
    meter.end();
    return 1;
  }

  Graph graph;
  JobManager jobs(loop);
  struct Ungraph {
    Graph& g;
    std::vector<std::string> names;
    ~Ungraph() {
      for (const auto& n : names) (void)g.remove(n);
    }
  } ungraph{graph, {}};
  for (auto* n : {&top, &base}) {
    if (Status st = graph.add(*n); !st) {
      meter.end();
      error_report(st.error().what());
      return 1;
    }
    ungraph.names.push_back((*n)->node_name());
  }
  CommitArgs a;
  a.job_id = "commit";
  a.device = top->node_name();
  a.base_node = base->node_name();
  if (c.rate) a.speed = c.rate;
  auto job = start_commit(jobs, graph, a);
  if (!job) {
    meter.end();
    error_report(job.error().what());
    return 1;
  }
  // QEMU's run_block_job: until ready (or failed), then complete.
  auto done = [&] { return (*job)->status() == JobStatus::Null || (*job)->status() == JobStatus::Concluded; };
  auto show = [&] {
    uint64_t total = (*job)->progress_total();
    float pct = total ? 100.0f * static_cast<float>((*job)->progress_current()) / static_cast<float>(total) : 0.0f;
    meter.print(pct, 0);
  };
  loop.run_until([&] {
    show();
    return (*job)->is_ready() || done();
  });
  if (!done()) {
    if (Status st = (*job)->complete(); !st) {
      meter.end();
      error_report(st.error().what());
      return 1;
    }
    loop.run_until(done);
  }
  if (!(*job)->result().ok()) {
    meter.end();
    // common_block_job_cb's words: the errno alone.
    error_report(std::string("Block job failed: ") + std::strerror((*job)->result().error().code));
    return 1;
  }
  meter.print(100, 0);
  // The base holds the data now; the image reads the same through it.
  if (!c.drop) {
    Status st = loop.run(image::make_empty(*top));
    if (!st && st.error().code != ENOTSUP) {
      meter.end();
      error_report("Failed to empty " + top->filename() + ": " + std::strerror(st.error().code));
      return 1;
    }
  }
  meter.end();
  for (const auto& n : ungraph.names) (void)graph.remove(n);
  ungraph.names.clear();
  base.reset();
  if (Status st = loop.run(top->close()); !st) {
    error_report(st.error().what());
    return 1;
  }
  if (!c.quiet) std::printf("Image committed.\n");
  return 0;
}

}  // namespace

int cmd_commit(int argc, char** argv) {
  auto parsed = parse_commit(argc, argv);
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  return run_commit(std::get<CommitCommand>(parsed));
}

}  // namespace vblk::cli
