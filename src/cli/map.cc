// vblk map: where an image's data lives (qemu-img map).
#include <getopt.h>
#include <inttypes.h>

#include <cstdio>

#include "common.h"
#include "vblk/chain.h"

namespace vblk::cli {

namespace {

struct MapEntry {
  uint64_t start = 0, length = 0;
  bool data = false, zero = false, present = false;
  int depth = 0;
  bool has_offset = false;
  uint64_t offset = 0;
  std::string filename;  // set when has_offset
};

// qemu-img's get_block_status: walk down the backing chain until a layer
// knows (data or zero); depth counts the layers passed.
Task<Result<MapEntry>> get_entry(Node& top, uint64_t offset, uint64_t bytes) {
  Node* n = &top;
  int depth = 0;
  BlockStatus st;
  for (;;) {
    n = skip_filters(n);
    auto r = co_await n->block_status(offset, bytes);
    if (!r) co_return r.take_error();
    st = *r;
    bytes = st.bytes;
    if (st.flags & (kStatusZero | kStatusData)) break;
    Node* next = n->child("backing");
    if (!next) {
      st.flags = 0;
      break;
    }
    n = next;
    ++depth;
  }
  MapEntry e;
  e.start = offset;
  e.length = bytes;
  e.data = st.flags & kStatusData;
  e.zero = st.flags & kStatusZero;
  e.present = st.flags & kStatusAllocated;
  e.depth = depth;
  e.has_offset = st.flags & kStatusOffsetValid;
  if (e.has_offset) {
    e.offset = st.map;
    e.filename = st.file ? st.file->filename() : std::string();
  }
  co_return e;
}

bool mergeable(const MapEntry& curr, const MapEntry& next) {
  if (curr.length == 0) return false;
  if (curr.zero != next.zero || curr.data != next.data || curr.depth != next.depth || curr.present != next.present ||
      curr.has_offset != next.has_offset)
    return false;
  if (curr.filename != next.filename) return false;
  if (curr.has_offset && curr.offset + curr.length != next.offset) return false;
  return true;
}

// Returns false when the entry cannot be shown (human output only).
bool dump(const MapEntry& e, MapEntry* next, bool json) {
  if (json) {
    std::printf(
        "{ \"start\": %" PRIu64 ", \"length\": %" PRIu64 ", \"depth\": %d, \"present\": %s, \"zero\": %s, \"data\": %s",
        e.start, e.length, e.depth, e.present ? "true" : "false", e.zero ? "true" : "false", e.data ? "true" : "false");
    if (e.has_offset) std::printf(", \"offset\": %" PRIu64, e.offset);
    std::putchar('}');
    if (next) std::puts(",");
    return true;
  }
  if (e.data && !e.zero) {
    if (!e.has_offset) {
      error_report("File contains external, encrypted or compressed clusters.");
      return false;
    }
    std::printf("%#-16" PRIx64 "%#-16" PRIx64 "%#-16" PRIx64 "%s\n", e.start, e.length, e.offset, e.filename.c_str());
  }
  // Zero and unallocated runs are not printed: let them merge.
  if (next && (!next->data || next->zero)) {
    next->data = false;
    next->zero = true;
  }
  return true;
}

}  // namespace

int cmd_map(int argc, char** argv) {
  ImageArgs a;
  enum { OPT_OUTPUT = 256, OPT_IMAGE_OPTS, OPT_OBJECT };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"format", required_argument, nullptr, 'f'},
      {"output", required_argument, nullptr, OPT_OUTPUT},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {"start-offset", required_argument, nullptr, 's'},
      {"max-length", required_argument, nullptr, 'l'},
      {nullptr, 0, nullptr, 0},
  };
  std::string output = "human";
  int64_t start = 0, max_len = -1;
  if (int rc = for_each_option(
          argc, argv, ":f:s:l:hU", longopts,
          [&] {
            std::printf(
                "usage: %s map [--image-opts] [-f fmt] [--start-offset=offset] [--max-length=len] [--output=ofmt] [-U] "
                "filename\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': a.format = optarg; break;
              case 'U': a.force_share = true; break;
              case 's': {
                auto v = cvtnum("start offset", optarg);
                if (!v) return 1;
                start = *v;
                break;
              }
              case 'l': {
                auto v = cvtnum("max length", optarg);
                if (!v) return 1;
                max_len = *v;
                break;
              }
              case OPT_OUTPUT: output = optarg; break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (optind != argc - 1) error_exit("Expecting one image file name");
  a.filename = argv[optind];
  bool json;
  if (output == "json") {
    json = true;
  } else if (output == "human") {
    json = false;
  } else {
    error_report("--output must be used with human or json as argument.");
    return 1;
  }
  if (a.image_opts && !a.format.empty()) {
    error_report("--image-opts and --format are mutually exclusive");
    return 1;
  }
  Loop loop;
  auto top = open_cli_image(loop, a);
  if (!top) return 1;

  if (json) {
    std::putchar('[');
  } else {
    std::printf("%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File");
  }
  uint64_t length = top->length();
  if (max_len >= 0) length = std::min<uint64_t>(static_cast<uint64_t>(start + max_len), length);

  MapEntry curr;
  curr.start = static_cast<uint64_t>(start);
  int ret = 0;
  while (curr.start + curr.length < length) {
    uint64_t o = curr.start + curr.length;
    auto next = loop.run(get_entry(*top, o, length - o));
    if (!next) {
      error_report("Could not read file metadata: " + next.error().what());
      ret = 1;
      break;
    }
    if (mergeable(curr, *next)) {
      curr.length += next->length;
      continue;
    }
    if (curr.length > 0) {
      if (!dump(curr, &*next, json)) return 1;
    }
    curr = *next;
  }
  if (ret) return ret;  // qemu-img leaves the listing unterminated too
  if (!dump(curr, nullptr, json)) return 1;
  if (json) std::puts("]");
  return 0;
}

}  // namespace vblk::cli
