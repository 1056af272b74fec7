// vblk bench: a simple I/O benchmark over the block layer (qemu-img bench).
// `depth` coroutines share one request counter, so at most `depth` requests
// are in flight and offsets advance exactly as qemu-img's do.
#include <getopt.h>
#include <inttypes.h>
#include <sys/time.h>

#include <cstdio>
#include <cstring>

#include "common.h"
#include "vblk/buffer.h"
#include "vblk/sync.h"

namespace vblk::cli {

namespace {

struct Bench {
  Loop& loop;
  Node& node;
  uint64_t count;  // total requests
  uint64_t depth;
  uint64_t bufsize;
  uint64_t step;
  uint64_t offset;  // next request offset
  uint64_t image_size;
  bool write;
  uint64_t flush_interval;
  bool drain;
  AlignedBuffer buf;
  uint64_t issued = 0;
  uint64_t completed = 0;
  Error failure;
  bool failed = false;
};

uint64_t next_offset(Bench& b) {
  uint64_t o = b.offset;
  b.offset = (b.offset + b.step) % b.image_size;
  return o;
}

// Each in-flight request has its own slice of the buffer, as in qemu-img.
Task<void> worker(Bench& b, uint64_t limit, WaitGroup& wg, uint64_t slot) {
  std::span<uint8_t> mine = b.buf.span().subspan(slot * b.bufsize, b.bufsize);
  while (!b.failed && b.issued < limit) {
    ++b.issued;
    uint64_t o = next_offset(b);
    // (Never co_await inside ?: — GCC 12 miscompiles the temporaries.)
    Status st;
    if (b.write) {
      st = co_await b.node.write(o, mine);
    } else {
      st = co_await b.node.read(o, mine);
    }
    if (!st && !b.failed) {
      b.failed = true;
      b.failure = st.take_error();
    }
    ++b.completed;
  }
  wg.done();
}

// Runs requests up to `limit` with `depth` in flight.
Task<void> run_until(Bench& b, uint64_t limit) {
  WaitGroup wg(b.loop);
  uint64_t n = std::min<uint64_t>(b.depth, limit - b.issued);
  wg.add(n);
  for (uint64_t i = 0; i < n; ++i) spawn_detached(worker(b, limit, wg, i));
  co_await wg.wait();
}

Task<Status> run_bench(Bench& b) {
  if (!b.flush_interval) {
    co_await run_until(b, b.count);
  } else if (b.drain) {
    // Drain, flush, continue: qemu-img's default flush behaviour.
    while (b.issued < b.count && !b.failed) {
      co_await run_until(b, std::min(b.count, b.issued + b.flush_interval));
      if (b.failed) break;
      auto st = co_await b.node.flush();
      if (!st) co_return Error(st.error().code, "Failed flush request: " + st.error().what());
    }
  } else {
    // Flushes run beside the writes.
    WaitGroup flushes(b.loop);
    Status flush_err;
    auto flusher = [](Bench& bb, WaitGroup& wg, Status& err) -> Task<void> {
      auto st = co_await bb.node.flush();
      if (!st) err = st;
      wg.done();
    };
    while (b.issued < b.count && !b.failed) {
      co_await run_until(b, std::min(b.count, b.issued + b.flush_interval));
      flushes.add();
      spawn_detached(flusher(b, flushes, flush_err));
    }
    co_await flushes.wait();
    if (!flush_err) co_return Error(flush_err.error().code, "Failed flush request: " + flush_err.error().what());
  }
  if (b.failed) co_return Error(b.failure.code, "Failed request: " + b.failure.what());
  co_return Status{};
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  enum { OPT_FLUSH_INTERVAL = 256, OPT_IMAGE_OPTS, OPT_PATTERN, OPT_NO_DRAIN };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"flush-interval", required_argument, nullptr, OPT_FLUSH_INTERVAL},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"pattern", required_argument, nullptr, OPT_PATTERN},
      {"no-drain", no_argument, nullptr, OPT_NO_DRAIN},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  ImageArgs a;
  unsigned long count = 75000, depth = 64, pattern = 0, flush_interval = 0;
  int64_t bufsize = 4096, step = 0, offset = 0;
  bool write = false, drain = true, force_share = false, native = false;
  if (int rc = for_each_option(
          argc, argv, ":hc:d:f:ni:o:qs:S:t:wU", longopts,
          [&] {
            std::printf(
                "usage: %s bench [-c count] [-d depth] [-f fmt] [--flush-interval=flush_interval] [-i aio] [-n] "
                "[--no-drain] [-o offset] [--pattern=pattern] [-q] [-s buffer_size] [-S step_size] [-t cache] [-w] "
                "[-U] "
                "filename\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'c': {
                auto v = parse_ulong(optarg, INT32_MAX);
                if (!v) {
                  error_report("Invalid request count specified");
                  return 1;
                }
                count = *v;
                break;
              }
              case 'd': {
                auto v = parse_ulong(optarg, INT32_MAX);
                if (!v) {
                  error_report("Invalid queue depth specified");
                  return 1;
                }
                depth = *v;
                break;
              }
              case 'f': a.format = optarg; break;
              case 'n': native = true; break;
              case 'i':
                if (std::strcmp(optarg, "native") == 0) {
                  native = true;
                } else if (std::strcmp(optarg, "threads") == 0 || std::strcmp(optarg, "io_uring") == 0) {
                  if (!native) a.aio = optarg;
                } else {
                  error_report(std::string("Invalid aio option: ") + optarg);
                  return 1;
                }
                break;
              case 'o': {
                auto v = cvtnum("offset", optarg);
                if (!v) return 1;
                offset = *v;
                break;
              }
              case 'q': break;  // qemu-img accepts and ignores it
              case 's': {
                auto v = cvtnum("buffer size", optarg, INT32_MAX);
                if (!v) return 1;
                bufsize = *v;
                break;
              }
              case 'S': {
                auto v = cvtnum("step_size", optarg, INT32_MAX);
                if (!v) return 1;
                step = *v;
                break;
              }
              case 't':
                if (!parse_cache_mode(optarg, a.cache)) {
                  error_report("Invalid cache mode");
                  return 1;
                }
                break;
              case 'w': write = true; break;
              case 'U': force_share = true; break;
              case OPT_FLUSH_INTERVAL: {
                auto v = parse_ulong(optarg, INT32_MAX);
                if (!v) {
                  error_report("Invalid flush interval specified");
                  return 1;
                }
                flush_interval = *v;
                break;
              }
              case OPT_PATTERN: {
                auto v = parse_ulong(optarg, 0xff);
                if (!v) {
                  error_report("Invalid pattern byte specified");
                  return 1;
                }
                pattern = *v;
                break;
              }
              case OPT_NO_DRAIN: drain = false; break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (optind != argc - 1) error_exit("Expecting one image file name");
  a.filename = argv[optind];
  if (native) a.aio = "native";
  if (flush_interval && !write) {
    error_report("--flush-interval is only available in write tests");
    return 1;
  }
  if (flush_interval && flush_interval < depth) {
    error_report("Flush interval can't be smaller than depth");
    return 1;
  }
  if (depth == 0) {
    error_report("Invalid queue depth specified");
    return 1;
  }
  a.read_only = !write;
  Loop loop;
  if (force_share && write) {
    error_report("Could not open '" + a.filename + "': force-share=on can only be used with read-only images");
    return 1;
  }
  if (native && !a.cache.direct) {
    error_report("Could not open '" + a.filename +
                 "': aio=native was specified, but it requires cache.direct=on, which was not specified.");
    return 1;
  }
  a.force_share = force_share;
  auto node = open_cli_image(loop, a);
  if (!node) return 1;
  if (node->length() == 0) {
    error_report("Cannot run a benchmark on an empty image");
    return 1;
  }
  Bench b{loop,
          *node,
          count,
          depth,
          static_cast<uint64_t>(bufsize),
          step ? static_cast<uint64_t>(step) : static_cast<uint64_t>(bufsize),
          static_cast<uint64_t>(offset),
          node->length(),
          write,
          flush_interval,
          drain,
          AlignedBuffer::huge(std::max<uint64_t>(static_cast<uint64_t>(bufsize) * depth, 1))};
  std::memset(b.buf.data(), static_cast<int>(pattern), b.buf.size());
  std::printf("Sending %lu %s requests, %" PRId64 " bytes each, %lu in parallel (starting at offset %" PRId64
              ", step size %" PRIu64 ")\n",
              count, write ? "write" : "read", bufsize, depth, offset, b.step);
  if (flush_interval) std::printf("Sending flush every %lu requests\n", flush_interval);
  std::fflush(stdout);
  timeval t1, t2;
  gettimeofday(&t1, nullptr);
  Status st = loop.run(run_bench(b));
  gettimeofday(&t2, nullptr);
  if (!st) {
    error_report(st.error().what());
    return 1;
  }
  std::printf("Run completed in %3.3f seconds.\n",
              static_cast<double>(t2.tv_sec - t1.tv_sec) + static_cast<double>(t2.tv_usec - t1.tv_usec) / 1e6);
  std::fflush(stdout);
  // A write benchmark leaves its data durable, as qemu-img's close does.
  if (write) {
    auto fl = loop.run(node->close());
    if (!fl) {
      error_report("Failed flush request: " + fl.error().what());
      return 1;
    }
  }
  return 0;
}

}  // namespace vblk::cli
