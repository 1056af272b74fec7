// vblk compare: are two images' contents the same (qemu-img compare)?
#include <getopt.h>
#include <inttypes.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common.h"
#include "progress.h"
#include "vblk/buffer.h"

namespace vblk::cli {

namespace {

constexpr uint64_t kIoBuf = 2 << 20;

// Length of the run of 512-byte sectors from the start that all differ (or
// all match) like the first one; *differs says which.
uint64_t compare_run(const uint8_t* a, const uint8_t* b, uint64_t n, bool* differs) {
  auto sector_differs = [&](uint64_t off) {
    uint64_t len = std::min<uint64_t>(512, n - off);
    return std::memcmp(a + off, b + off, len) != 0;
  };
  *differs = sector_differs(0);
  uint64_t off = std::min<uint64_t>(512, n);
  while (off < n && sector_differs(off) == *differs) off += std::min<uint64_t>(512, n - off);
  return off;
}

struct Ctx {
  Loop& loop;
  Node& a;
  Node& b;
  const std::string& name_a;
  const std::string& name_b;
  bool strict;
  Progress& progress;
};

// Checks that [off, off+len) of `n` reads as zeroes; 1 = mismatch, <0 = error.
Task<int> check_empty(Node& n, const std::string& name, uint64_t off, uint64_t len) {
  AlignedBuffer buf(len);
  auto st = co_await n.read(off, buf.span());
  if (!st) {
    error_report("Error while reading offset " + std::to_string(off) + " of " + name + ": " + st.error().what());
    co_return -4;
  }
  for (uint64_t s = 0; s < len; s += 512) {
    uint64_t l = std::min<uint64_t>(512, len - s);
    if (!buffer_is_zero(buf.span().subspan(s, l))) {
      std::printf("Content mismatch at offset %" PRIu64 "!\n", off + s);
      co_return 1;
    }
  }
  co_return 0;
}

Task<int> run_compare(Ctx c) {
  const uint64_t s1 = c.a.length(), s2 = c.b.length();
  const uint64_t total = std::min(s1, s2), base = std::max(s1, s2);
  c.progress.print(0, 100);
  if (c.strict && s1 != s2) {
    std::printf("Strict mode: Image size mismatch!\n");
    co_return 1;
  }
  AlignedBuffer b1(kIoBuf), b2(kIoBuf);
  uint64_t off = 0;
  while (off < total) {
    auto st1 = co_await c.a.block_status_above(off, s1 - off);
    if (!st1) {
      error_report("Sector allocation test failed for " + c.name_a);
      co_return 3;
    }
    auto st2 = co_await c.b.block_status_above(off, s2 - off);
    if (!st2) {
      error_report("Sector allocation test failed for " + c.name_b);
      co_return 3;
    }
    uint64_t chunk = std::min(st1->bytes, st2->bytes);
    if (c.strict && st1->flags != st2->flags) {
      std::printf("Strict mode: Offset %" PRIu64 " block status mismatch!\n", off);
      co_return 1;
    }
    const bool alloc1 = st1->flags & kStatusAllocated, alloc2 = st2->flags & kStatusAllocated;
    if ((st1->flags & kStatusZero) && (st2->flags & kStatusZero)) {
      // both read as zeroes
    } else if (alloc1 == alloc2) {
      if (alloc1) {
        chunk = std::min(chunk, kIoBuf);
        auto r1 = co_await c.a.read(off, b1.span().subspan(0, chunk));
        if (!r1) {
          error_report("Error while reading offset " + std::to_string(off) + " of " + c.name_a + ": " +
                       r1.error().what());
          co_return 4;
        }
        auto r2 = co_await c.b.read(off, b2.span().subspan(0, chunk));
        if (!r2) {
          error_report("Error while reading offset " + std::to_string(off) + " of " + c.name_b + ": " +
                       r2.error().what());
          co_return 4;
        }
        bool differs = false;
        uint64_t run = compare_run(b1.data(), b2.data(), chunk, &differs);
        if (differs || run != chunk) {
          std::printf("Content mismatch at offset %" PRIu64 "!\n", off + (differs ? 0 : run));
          co_return 1;
        }
      }
    } else {
      chunk = std::min(chunk, kIoBuf);
      int r;
      if (alloc1) {
        r = co_await check_empty(c.a, c.name_a, off, chunk);
      } else {
        r = co_await check_empty(c.b, c.name_b, off, chunk);
      }
      if (r) co_return r < 0 ? -r : r;
    }
    off += chunk;
    c.progress.print(static_cast<float>(chunk) / static_cast<float>(base) * 100, 100);
  }
  if (s1 != s2) {
    std::printf("Warning: Image size mismatch!\n");
    Node& over = s1 > s2 ? c.a : c.b;
    const std::string& name = s1 > s2 ? c.name_a : c.name_b;
    while (off < base) {
      auto st = co_await over.block_status_above(off, base - off);
      if (!st) {
        error_report("Sector allocation test failed for " + name);
        co_return 3;
      }
      uint64_t chunk = st->bytes;
      if ((st->flags & kStatusAllocated) && !(st->flags & kStatusZero)) {
        chunk = std::min(chunk, kIoBuf);
        int r = co_await check_empty(over, name, off, chunk);
        if (r) co_return r < 0 ? -r : r;
      }
      off += chunk;
      c.progress.print(static_cast<float>(chunk) / static_cast<float>(base) * 100, 100);
    }
  }
  std::printf("Images are identical.\n");
  co_return 0;
}

}  // namespace

int cmd_compare(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  std::string fmt1, fmt2, cache = "writeback";
  bool progress = false, quiet = false, strict = false, image_opts = false, force_share = false;
  if (int rc = for_each_option(
          argc, argv, ":hf:F:T:pqsU", longopts,
          [&] {
            std::printf(
                "usage: %s compare [--image-opts] [-f fmt] [-F fmt] [-T src_cache] [-p] [-q] [-s] [-U] filename1 "
                "filename2\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': fmt1 = optarg; break;
              case 'F': fmt2 = optarg; break;
              case 'T': cache = optarg; break;
              case 'p': progress = true; break;
              case 'q': quiet = true; break;
              case 's': strict = true; break;
              case 'U': force_share = true; break;
              case OPT_OBJECT: cli_object(optarg, 2); break;
              case OPT_IMAGE_OPTS: image_opts = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (quiet) progress = false;
  if (optind != argc - 2) error_exit("Expecting two image file names");
  std::string f1 = argv[optind], f2 = argv[optind + 1];
  if (image_opts && (!fmt1.empty() || !fmt2.empty())) {
    error_report("--image-opts and --format are mutually exclusive");
    return 2;
  }
  CacheMode mode;
  if (!parse_cache_mode(cache, mode)) {
    error_report("Invalid source cache option: " + cache);
    return 2;
  }
  // -q silences the result lines too: they go through stdout.
  if (quiet) std::freopen("/dev/null", "w", stdout);
  Progress meter(progress, 2.0f);
  Loop loop;
  ImageArgs a1{f1, fmt1, image_opts, true, mode, ""};
  ImageArgs a2{f2, fmt2, image_opts, true, mode, ""};
  a1.force_share = a2.force_share = force_share;
  auto n1 = open_cli_image(loop, a1);
  if (!n1) {
    meter.end();
    return 2;
  }
  auto n2 = open_cli_image(loop, a2);
  if (!n2) {
    meter.end();
    return 2;
  }
  int ret = loop.run(run_compare(Ctx{loop, *n1, *n2, f1, f2, strict, meter}));
  meter.end();
  return ret;
}

}  // namespace vblk::cli
