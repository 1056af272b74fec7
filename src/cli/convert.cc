// vblk convert: copy an image into a new (or existing) image of another
// format, qemu-img convert compatible, on the block-copy engine.
//
// The source is copied by one engine call over the whole disk: block status
// picks data, zero and (with -B) unallocated ranges; read data is scanned for
// zero runs of -S bytes so the target stays sparse; a freshly created target
// (or --target-is-zero) reads as zeroes, so zero ranges cost nothing.
// Differences from qemu-img: writes are always out of order (-W is accepted
// and changes nothing: the engine's tasks run in parallel), and one source
// image only.
#include <fcntl.h>
#include <getopt.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "progress.h"
#include "vblk/block_copy.h"
#include "vblk/image_format.h"
#include "vblk/options.h"

namespace vblk::cli {

namespace {

// The value of `key` in a -o option list ("a=1,key=v"; ",," is a comma),
// the last one given; nullopt if absent.
std::optional<std::string> option_value(const std::string& options, const std::string& key) {
  std::optional<std::string> v;
  std::string item;
  for (size_t i = 0; i <= options.size(); ++i) {
    if (i < options.size() && options[i] == ',' && i + 1 < options.size() && options[i + 1] == ',') {
      item += ',';
      ++i;
      continue;
    }
    if (i == options.size() || options[i] == ',') {
      size_t eq = item.find('=');
      if (item.substr(0, eq) == key) v = eq == std::string::npos ? "on" : item.substr(eq + 1);
      item.clear();
      continue;
    }
    item += options[i];
  }
  return v;
}

constexpr uint64_t kMaxSparse = 16 << 20;

// Whether `path` is a regular file that opens with O_DIRECT (not a URI,
// not a file system without O_DIRECT such as tmpfs).
bool supports_direct(const std::string& path) {
  if (path.find("://") != std::string::npos || path.rfind("nbd:", 0) == 0 || path.rfind("json:", 0) == 0) return false;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// qemu-img convert's command line, parsed and checked in its order.
struct ConvertArgs {
  std::string fmt, out_fmt = "raw", options, backing, backing_fmt, cache = "unsafe", src_cache = "writeback";
  bool compress = false, progress = false, quiet = false, skip_create = false, copy_range = false;
  bool force_share = false, image_opts = false, target_is_zero = false;
  bool explicit_sparse = false, src_cache_given = false, cache_given = false;
  uint64_t min_sparse = 4096, rate = 0;
  unsigned workers = 0;  // 0: the engine's default
  std::string src_name, out_name;
  CacheMode src_mode, dst_mode;
};

void convert_usage() {
  std::printf(
      "usage: %s convert [--image-opts] [--target-is-zero] [-U] [-C] [-c] [-p] [-q] [-n] [-f fmt] [-t cache] "
      "[-T src_cache] [-O output_fmt] [-B backing_file [-F backing_fmt]] [-o options] [-S sparse_size] "
      "[-r rate_limit] [-m num_coroutines] [-W] filename output_filename\n",
      g_prog.c_str());
}

}  // namespace

Parsed<ConvertArgs> parse_convert(int argc, char** argv) {
  enum { kObject = 256, kImageOpts, kTargetIsZero };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, kObject},
      {"image-opts", no_argument, nullptr, kImageOpts},
      {"force-share", no_argument, nullptr, 'U'},
      {"target-is-zero", no_argument, nullptr, kTargetIsZero},
      {nullptr, 0, nullptr, 0},
  };
  ConvertArgs a;
  if (int rc = for_each_option(
          argc, argv, ":hf:O:B:CF:co:l:S:pt:T:qnm:WUr:", longopts, [&] { convert_usage(); },
          [&](int c) {
            switch (c) {
              case 'f': a.fmt = optarg; break;
              case 'O': a.out_fmt = optarg; break;
              case 'B': a.backing = optarg; break;
              case 'F': a.backing_fmt = optarg; break;
              case 'C': a.copy_range = true; break;
              case 'c': a.compress = true; break;
              case 'o': a.options = a.options.empty() ? std::string(optarg) : a.options + "," + optarg; break;
              case 'l': error_report("Snapshot parameters are not supported by vblk convert"); return 1;
              case 'S': {
                auto r = parse_size(optarg);
                if (!r) {
                  error_report(
                      "Invalid buffer size for sparse output specified. You may use k, M, G, T, P or E suffixes for");
                  error_report("kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.");
                  return 1;
                }
                if (*r % 512 || *r > kMaxSparse) {
                  error_report(
                      "Invalid buffer size for sparse output specified. Valid sizes are multiples of 512 up to "
                      "16777216. Select 0 to disable sparse detection (fully allocates output).");
                  return 1;
                }
                a.min_sparse = *r;
                a.explicit_sparse = true;
                break;
              }
              case 'p': a.progress = true; break;
              case 't':
                a.cache = optarg;
                a.cache_given = true;
                break;
              case 'T':
                a.src_cache = optarg;
                a.src_cache_given = true;
                break;
              case 'q': a.quiet = true; break;
              case 'n': a.skip_create = true; break;
              case 'm': {
                auto m = parse_ulong(optarg, 16);
                if (!m || *m < 1) {
                  error_report("Invalid number of coroutines. Allowed number of coroutines is between 1 and 16");
                  return 1;
                }
                a.workers = static_cast<unsigned>(*m);
                break;
              }
              case 'W': break;  // the engine always writes out of order
              case 'U': a.force_share = true; break;
              case 'r': {
                auto r = cvtnum("rate limit", optarg);
                if (!r) return 1;
                a.rate = static_cast<uint64_t>(*r);
                break;
              }
              case kObject: cli_object(optarg); break;
              case kImageOpts: a.image_opts = true; break;
              case kTargetIsZero: a.target_is_zero = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (a.quiet) a.progress = false;
  if (a.compress && a.copy_range) {
    error_report("Cannot enable copy offloading when -c is used");
    return 1;
  }
  if (a.explicit_sparse && a.copy_range) {
    error_report("Cannot enable copy offloading when -S is used");
    return 1;
  }
  if (a.target_is_zero && !a.skip_create) {
    error_report("--target-is-zero requires use of -n flag");
    return 1;
  }
  if (argc - optind < 2) {
    error_report("Must specify image file name");
    return 1;
  }
  if (argc - optind > 2) {
    error_report("vblk convert takes one source image");
    return 1;
  }
  if (a.skip_create && !a.options.empty()) {
    error_report("-o has no effect when skipping image creation");
    return 1;
  }
  a.src_name = argv[optind];
  a.out_name = argv[optind + 1];
  if (!parse_cache_mode(a.src_cache, a.src_mode)) {
    error_report("Invalid source cache option: " + a.src_cache);
    return 1;
  }
  if (!parse_cache_mode(a.cache, a.dst_mode)) {
    error_report("Invalid cache option: " + a.cache);
    return 1;
  }
  if (a.out_fmt != "raw" && a.out_fmt != "qcow2" && a.out_fmt != "file" && a.out_fmt != "luks") {
    error_report("Unknown file format '" + a.out_fmt + "'");
    return 1;
  }
  if (a.compress && a.out_fmt != "qcow2") {
    error_report("Compression not supported for this file format");
    return 1;
  }
  if (a.compress && !a.skip_create &&
      (option_value(a.options, "encrypt") || option_value(a.options, "encrypt.format"))) {
    error_report("Compression and encryption not supported at the same time");
    return 1;
  }
  if (!a.backing.empty()) {
    if (a.out_fmt != "qcow2") {
      error_report("Backing file not supported for file format '" + a.out_fmt + "'");
      return 1;
    }
    if (a.backing_fmt.empty()) {
      error_report("Use of backing file requires explicit backing format");
      return 1;
    }
  }
  return a;
}

int run_convert(const ConvertArgs& a) {
  Loop loop;
  ImageArgs sa;
  sa.filename = a.src_name;
  sa.format = a.fmt;
  sa.image_opts = a.image_opts;
  sa.cache = a.src_mode;
  // The source must not change under the copy (qemu-img convert's
  // BDRV_O_NO_SHARE), unless -U says the caller knows better.
  sa.force_share = a.force_share;
  if (!a.force_share) sa.unshare = kPermWrite | kPermResize;
  // Without -T, a plain file source is read with O_DIRECT where the file
  // system allows it: a one-pass copy gains nothing from the page cache,
  // and reading through it costs a kernel memory copy of every byte (and
  // evicts the host's useful cache). The data read is the same either way
  // (direct reads see what buffered writers wrote). -T writeback restores
  // qemu-img's buffered reads.
  if (!a.src_cache_given && !a.image_opts && supports_direct(a.src_name)) sa.cache.direct = true;
  auto src = open_cli_image(loop, sa);
  if (!src) return 1;
  const uint64_t size = src->length();

  if (!a.skip_create) {
    if (create_target(a.out_name, a.out_fmt, a.options, a.backing, a.backing_fmt, size,
                      "error while converting " + a.out_fmt + ": ") != 0)
      return 1;
  }
  ImageArgs ta;
  ta.filename = a.out_name;
  ta.format = a.out_fmt;
  ta.read_only = false;
  ta.cache = a.dst_mode;
  // Likewise the target without -t: O_DIRECT writes, still without flushes
  // (cache=unsafe's promise is only that nothing is flushed). Buffered
  // writes would copy every byte into the page cache and leave the disk
  // write for later; on io_uring they are also handed to kernel workers.
  // -t writeback or -t unsafe given explicitly keep the page cache.
  if (!a.cache_given && supports_direct(a.out_name)) ta.cache.direct = true;
  // An encrypted target is opened with the key-secret it was created with
  // (qemu-img's img_add_key_secrets copies -o key-secret and
  // encrypt.key-secret to the open).
  if ((a.out_fmt == "luks" || a.out_fmt == "qcow2") && !a.skip_create) {
    const std::string key = a.out_fmt == "luks" ? "key-secret" : "encrypt.key-secret";
    if (auto secret = option_value(a.options, key)) {
      Json o = {{"driver", a.out_fmt}, {"file", {{"driver", "file"}, {"filename", a.out_name}}}};
      if (a.out_fmt == "luks")
        o["key-secret"] = *secret;
      else
        o["encrypt"] = {{"key-secret", *secret}};
      ta.filename = "json:" + o.dump();
      ta.format.clear();
      ta.open_error_prefix = "Could not open '" + a.out_name + "': ";
    }
  }
  auto dst = open_cli_image(loop, ta);
  if (!dst) return 1;
  if (dst->length() < size) {
    error_report("output file is smaller than input file");
    return 1;
  }

  BlockCopyOptions o;
  uint64_t cs = image::cluster_size(*dst);
  o.cluster_size = cs && (cs & (cs - 1)) == 0 && cs <= (2u << 20) ? cs : 64 << 10;
  // qemu-img keeps 8 coroutines x 2 MiB in flight; 16 x 1 MiB is the same
  // memory with finer parallelism.
  o.max_workers = a.workers ? a.workers : 16;
  o.use_copy_range = a.copy_range;
  o.speed = a.rate;
  const bool has_backing = !a.backing.empty() || !image::backing_file_name(*dst).empty();
  // With a backing file the target shows it wherever the source's top layer
  // does not allocate: copy only what the top layer has.
  o.skip_unallocated = has_backing;
  // A new luks image does not read as zeroes (its payload decrypts to
  // noise): zero areas are written, as QEMU does (no bdrv_has_zero_init).
  o.target_is_zero = !has_backing && ((!a.skip_create && a.out_fmt != "luks") || a.target_is_zero);
  if (a.min_sparse == 0) {
    o.allocate_zeroes = true;
  } else if (!a.copy_range) {
    o.detect_zeroes = a.min_sparse;
  }
  if (a.compress) {
    // qemu-img convert -c: every cluster is written on its own as a
    // compressed cluster (qcow2 stores one that does not shrink as a normal
    // cluster); the engine's chunks are whole, aligned clusters already
    // (its granularity is the target's cluster size). Only a cluster that
    // is zero as a whole is left out, as qemu-img does with compression.
    o.write_flags |= kReqCompressed;
    if (a.min_sparse) o.detect_zeroes = o.cluster_size;
  }

  Status st;
  {
    BlockCopyState bcs(*src, *dst, o);
    bcs.bitmap().set_all();
    Progress meter(a.progress, 1.0f);
    float shown = 0;
    meter.print(0, 100);
    auto call = bcs.copy_async(0, size);
    loop.run_until([&] {
      uint64_t total = bcs.progress_total();
      float pct = total ? 100.0f * static_cast<float>(bcs.progress_done()) / static_cast<float>(total) : 100.0f;
      if (pct > shown) {
        meter.print(pct - shown, 100);
        shown = pct;
      }
      return call->finished();
    });
    if (call->failed()) {
      std::fprintf(stderr, "%s: error while %s at byte %llu: %s\n", g_prog.c_str(),
                   call->error_is_read() ? "reading" : "writing", static_cast<unsigned long long>(call->error_offset()),
                   call->status().error().what().c_str());
      return 1;
    }
    if (shown < 100) meter.print(100 - shown, 100);
    meter.end();
    // For bench/bench_convert.py: proves in-flight data stayed under the cap.
    if (const char* v = std::getenv("VBLK_COPY_STATS"); v && *v == '1')
      std::fprintf(stderr, "block-copy: memory peak %llu of cap %llu\n",
                   static_cast<unsigned long long>(bcs.memory_peak()),
                   static_cast<unsigned long long>(bcs.options().max_memory));
  }
  // cache=unsafe skips only the file's fsync; the format's metadata (qcow2
  // tables) is written back here.
  st = loop.run(dst->flush());
  if (!st) {
    error_report("error while flushing the output image: " + st.error().what());
    return 1;
  }
  return 0;
}

int cmd_convert(int argc, char** argv) {
  auto a = parse_convert(argc, argv);
  if (auto* rc = std::get_if<int>(&a)) return *rc;
  return run_convert(std::get<ConvertArgs>(a));
}

}  // namespace vblk::cli
