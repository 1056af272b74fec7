// vblk rebase: change an image's backing file (qemu-img rebase).
//
// Safe mode (the default) keeps what the image reads: every range the image
// does not allocate itself, where the old chain and the new backing file
// differ, gets the old chain's data written into the image; then the header
// names the new backing file. Unsafe mode (-u) changes the header alone.
//
// The order is the data-safety argument. Everything that can fail without
// writing — the options, opening the new backing file, whether the image
// can record a backing file at all, whether -F was given — is checked
// before the first write (QEMU checks the last two only when it changes
// the header, after copying). The data copies come next: each makes the
// image read the same over the old chain and over the new backing file, so
// a failure or a crash among them leaves the image reading as before over
// its old backing file. They are flushed, and only then does the header
// name the new backing file (qcow2 writes that change crash-safe).
#include <getopt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "progress.h"
#include "vblk/buffer.h"
#include "vblk/chain.h"
#include "vblk/image_format.h"

namespace vblk::cli {

namespace {

constexpr uint64_t kIoBufSize = 2 * 1024 * 1024;  // qemu-img's IO_BUF_SIZE
constexpr uint64_t kSector = 512;

struct RebaseArgs {
  ImageArgs image;
  std::string backing;  // -b ("" with -b "": none)
  bool has_backing = false;
  std::string backing_fmt;  // -F
  std::string cache = "writeback", src_cache = "writeback";
  bool unsafe = false, progress = false, quiet = false, force_share = false, compress = false;
};

// qemu-img's compare_buffers: whether the first sector of the two buffers
// differs, and in *pnum how many bytes from the start (whole sectors, or up
// to `bytes`) share that answer.
bool compare_buffers(const uint8_t* a, const uint8_t* b, uint64_t bytes, uint64_t* pnum) {
  uint64_t i = std::min(bytes, kSector);
  const bool res = std::memcmp(a, b, i) != 0;
  while (i < bytes) {
    uint64_t len = std::min(bytes - i, kSector);
    if ((std::memcmp(a + i, b + i, len) != 0) != res) break;
    i += len;
  }
  *pnum = i;
  return res;
}

// QEMU's bdrv_find_backing_image as qemu-img rebase asks it: the node below
// the one in top's chain whose recorded backing file is `name` (both taken
// relative to that image), or nullptr.
Node* find_backing_image(Node& top, const std::string& name) {
  for (Node* cur = skip_filters(&top); cur && filter_or_cow_child(*cur);) {
    Node* below = skip_filters(filter_or_cow_child(*cur));
    if (names_backing(cur->filename(), image::backing_file_name(*cur), name)) return below;
    cur = below;
  }
  return nullptr;
}

// QEMU's bdrv_is_allocated_above(top, base, include_base=false): whether any
// layer from `top` down to (not including) `base` allocates the start of
// the range, and in *pnum for how long the answer holds. A layer shorter
// than the range counts as allocating it (it reads as zeroes there), so a
// range in doubt is compared rather than skipped.
Task<Result<bool>> allocated_above(Node* top, Node* base, uint64_t offset, uint64_t bytes, uint64_t* pnum) {
  uint64_t n = bytes;
  for (Node* cur = top; cur && cur != base; cur = skip_filters(filter_or_cow_child(*cur))) {
    if (offset >= cur->length()) {
      *pnum = n;
      co_return true;
    }
    auto st = co_await cur->block_status(offset, std::min(n, cur->length() - offset));
    if (!st) co_return st.take_error();
    const uint64_t run = std::max<uint64_t>(1, std::min(st->bytes, n));
    if (st->flags & kStatusAllocated) {
      *pnum = run;
      co_return true;
    }
    n = run;
  }
  *pnum = n;
  co_return false;
}

// Reads [offset, offset + n) of `node` into buf, zeroes where the node ends.
// n is cut at the node's end as qemu-img cuts it.
Task<Status> read_or_zero(Node* node, uint64_t offset, uint64_t& n, uint8_t* buf, bool* zero) {
  const uint64_t size = node ? node->length() : 0;
  if (offset >= size) {
    std::memset(buf, 0, n);
    if (zero) *zero = true;
    co_return Status{};
  }
  n = std::min(n, size - offset);
  co_return co_await node->read(offset, std::span<uint8_t>(buf, n));
}

struct CopyState {
  Node* top;          // the image (unfiltered)
  Node* old_backing;  // its backing chain today (nullptr: none)
  Node* new_backing;  // nullptr: none
  Node* prefix;       // the new backing is a node of the old chain (nullptr: not)
  bool compress;
  Progress* meter;
};

// Writes the old data where it differs from the new backing's, over the
// ranges the image does not allocate itself.
Task<Status> copy_differences(const CopyState& c) {
  const uint64_t size = c.top->length();
  AlignedBuffer buf_old(kIoBufSize), buf_new(kIoBufSize);
  const float local_progress = size ? 100.0f / static_cast<float>(size / std::min(size, kIoBufSize)) : 0.0f;
  const uint64_t cs = image::cluster_size(*c.top);
  for (uint64_t offset = 0, n = 0; offset < size; offset += n) {
    n = std::min(kIoBufSize, size - offset);
    auto st = co_await c.top->block_status(offset, n);
    if (!st)
      co_return Error(st.error().code,
                      std::string("error while reading image metadata: ") + std::strerror(st.error().code));
    n = std::max<uint64_t>(1, std::min(st->bytes, n));
    if (st->flags & kStatusAllocated) continue;
    if (c.prefix) {
      // Unchanged between the old backing file and the new one (a node of
      // the old chain): nothing to compare.
      uint64_t pnum = n;
      auto above = co_await allocated_above(c.old_backing, c.prefix, offset, n, &pnum);
      if (!above)
        co_return Error(above.error().code,
                        std::string("error while reading image metadata: ") + std::strerror(above.error().code));
      n = pnum;
      if (!*above) continue;
    }
    bool old_is_zero = false;
    if (Status r = co_await read_or_zero(c.old_backing, offset, n, buf_old.data(), &old_is_zero); !r)
      co_return Error(r.error().code, "error while reading from old backing file");
    if (Status r = co_await read_or_zero(c.new_backing, offset, n, buf_new.data(), nullptr); !r)
      co_return Error(r.error().code, "error while reading from new backing file");
    // -c: compressed clusters are whole clusters, so the comparison goes
    // cluster by cluster; a piece that is not a whole aligned cluster (the
    // image's or a backing file's unaligned end) is written plainly.
    const uint64_t unit = c.compress && cs ? cs : 0;
    for (uint64_t done = 0; done < n;) {
      uint64_t pnum = 0;
      bool differ = false;
      uint32_t flags = kReqNone;
      if (unit) {
        pnum = std::min(n - done, unit - (offset + done) % unit);
        differ = std::memcmp(buf_old.data() + done, buf_new.data() + done, pnum) != 0;
        if (pnum == unit) flags = kReqCompressed;
      } else {
        differ = compare_buffers(buf_old.data() + done, buf_new.data() + done, n - done, &pnum);
      }
      if (differ) {
        Status w;
        if (old_is_zero) {
          w = co_await c.top->write_zeroes(offset + done, pnum);
        } else {
          w = co_await c.top->write(offset + done, std::span<const uint8_t>(buf_old.data() + done, pnum), flags);
        }
        if (!w)
          co_return Error(w.error().code,
                          std::string("Error while writing to COW image: ") + std::strerror(w.error().code));
      }
      done += pnum;
    }
    c.meter->print(local_progress, 100);
  }
  co_return co_await c.top->flush();
}

Parsed<RebaseArgs> parse_rebase(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  RebaseArgs r;
  if (int rc = for_each_option(
          argc, argv, ":hf:F:b:upt:T:qUc", longopts,
          [&] {
            std::printf(
                "usage: %s rebase [--object objectdef] [--image-opts] [-U] [-q] [-f fmt] [-t cache] [-T src_cache] "
                "[-p] [-u] [-c] -b backing_file [-F backing_fmt] filename\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': r.image.format = optarg; break;
              case 'F': r.backing_fmt = optarg; break;
              case 'b':
                r.backing = optarg;
                r.has_backing = true;
                break;
              case 'u': r.unsafe = true; break;
              case 'p': r.progress = true; break;
              case 'c': r.compress = true; break;
              case 't': r.cache = optarg; break;
              case 'T': r.src_cache = optarg; break;
              case 'q': r.quiet = true; break;
              case 'U': r.force_share = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
              case OPT_IMAGE_OPTS: r.image.image_opts = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (r.quiet) r.progress = false;
  if (optind != argc - 1) error_exit("Expecting one image file name");
  if (!r.unsafe && !r.has_backing) error_exit("Must specify backing file (-b) or use unsafe mode (-u)");
  r.image.filename = argv[optind];
  r.image.read_only = false;
  // -u: the old backing file is not opened (it may be gone: rebase -u is
  // how a moved or renamed backing file is named again).
  r.image.no_backing = r.unsafe;
  return r;
}

// The header change's error in qemu-img's words.
std::string change_error(const RebaseArgs& r, int err) {
  std::string why = err == ENOSPC ? "No space left in the file" : std::strerror(err);
  return "Could not change the backing file to '" + r.backing + "': " + why;
}

int run_rebase(const RebaseArgs& r) {
  Loop loop;
  Progress meter(r.progress, 2.0f);
  meter.print(0, 100);
  struct EndMeter {
    Progress& m;
    ~EndMeter() { m.end(); }
  } end_meter{meter};
  // (After the meter's first line, as qemu-img checks them.)
  ImageArgs ia = r.image;
  if (!parse_cache_mode(r.cache, ia.cache)) {
    error_report("Invalid cache option: " + r.cache);
    return 1;
  }
  CacheMode src;
  if (!parse_cache_mode(r.src_cache, src)) {
    error_report("Invalid source cache option: " + r.src_cache);
    return 1;
  }

  auto image = open_cli_image(loop, ia);
  if (!image) return 1;
  Node* top = skip_filters(image.get());
  if (!r.backing_fmt.empty() && !find_driver(r.backing_fmt)) {
    error_report("Invalid format name: '" + r.backing_fmt + "'");
    return 1;
  }

  // The new backing file, opened (safe mode) before anything is written.
  std::shared_ptr<Node> opened_backing;
  Node* new_backing = nullptr;
  Node* prefix = nullptr;
  Node* old_backing = r.unsafe ? nullptr : skip_filters(filter_or_cow_child(*top));
  if (!r.unsafe && !r.backing.empty()) {
    const std::string real_path = path_combine(top->filename(), r.backing);
    prefix = find_backing_image(*image, real_path);
    if (prefix) {
      new_backing = prefix;
    } else {
      ImageArgs b;
      b.filename = real_path;
      b.format = r.backing_fmt;
      b.read_only = true;
      b.force_share = r.force_share;
      b.cache = src;
      Error err;
      b.open_error = &err;
      opened_backing = open_cli_image(loop, b);
      if (!opened_backing) {
        error_report_hint("Could not open new backing file '" + r.backing + "': " + err.what(), err);
        return 1;
      }
      new_backing = opened_backing.get();
    }
  }

  // What the header change would refuse, refused before the first write.
  if (!top->caps().supports_backing) {
    error_report(change_error(r, ENOTSUP));
    return 1;
  }
  if (!r.backing.empty() && r.backing_fmt.empty()) {
    error_report("Could not change the backing file to '" + r.backing + "': backing format must be specified");
    return 1;
  }
  if (r.backing.size() > 1023) {
    error_report(change_error(r, EINVAL));
    return 1;
  }
  if (r.compress && !r.unsafe && !top->caps().compressed_writes) {
    error_report("Compression not supported for this file format");
    return 1;
  }

  if (!r.unsafe) {
    CopyState c{top, old_backing, new_backing, prefix, r.compress, &meter};
    if (Status st = loop.run(copy_differences(c)); !st) {
      error_report(st.error().what());
      return 1;
    }
  }

  // Last: the header names the new backing file. Every range that differs
  // is in the image and flushed (copy_differences), so the image reads the
  // same whichever backing file its header names.
  if (Status st = loop.run(image::change_backing_file(*top, r.backing, r.backing_fmt)); !st) {
    error_report(change_error(r, st.error().code));
    return 1;
  }
  meter.print(100, 0);
  opened_backing.reset();
  if (Status st = loop.run(image->close()); !st) {
    error_report(st.error().what());
    return 1;
  }
  return 0;
}

}  // namespace

int cmd_rebase(int argc, char** argv) {
  auto parsed = parse_rebase(argc, argv);
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  return run_rebase(std::get<RebaseArgs>(parsed));
}

}  // namespace vblk::cli
