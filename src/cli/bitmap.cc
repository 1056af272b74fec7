// vblk bitmap: add, remove, clear, enable, disable and merge an image's
// persistent dirty bitmaps (qemu-img bitmap, with its options, checks, texts
// and exit codes). Restore and backup scripts use it offline, between the
// runs of a daemon that keeps the bitmaps.
//
// The actions run in the order given, each on its own; one that fails stops
// the rest, and what ran before it stays (the image is closed normally, so
// the bitmaps it holds are stored), as qemu-img does.
#include <getopt.h>

#include <bit>
#include <cstdio>
#include <vector>

#include "common.h"
#include "vblk/image_format.h"
#include "vblk/named_bitmap.h"
#include "vblk/options.h"

namespace vblk::cli {

namespace {

enum class Op { Add, Remove, Clear, Enable, Disable, Merge };

struct Action {
  Op op;
  std::string source;  // --merge: the bitmap merged in
};

const char* op_name(Op op) {
  switch (op) {
    case Op::Add: return "add";
    case Op::Remove: return "remove";
    case Op::Clear: return "clear";
    case Op::Enable: return "enable";
    case Op::Disable: return "disable";
    case Op::Merge: return "merge";
  }
  return "?";
}

NamedBitmap* find_bitmap(Node& n, const std::string& name, Status& st) {
  NamedBitmap* b = n.bitmaps().find(name);
  if (!b) st = Error(ENOENT, "Dirty bitmap '" + name + "' not found");
  return b;
}

// One action, with block-dirty-bitmap-*'s checks (the image's bitmaps are
// persistent: qemu-img adds them so).
Status run_action(Loop& loop, Node& n, Node& src_node, const Action& act, const std::string& name, bool has_granularity,
                  uint64_t granularity) {
  Status st;
  switch (act.op) {
    case Op::Add: {
      if (name.empty()) return Error(EINVAL, "Bitmap name cannot be empty");
      uint64_t g = has_granularity ? granularity : default_bitmap_granularity(image::cluster_size(n));
      if (g < 512 || !std::has_single_bit(g)) return Error(EINVAL, "Granularity must be power of 2 and at least 512");
      VBLK_TRY(image::can_store_new_bitmap(n, name, g));
      auto b = n.bitmaps().create(name, n.length(), g);
      VBLK_TRY(b);
      (*b)->persistent = true;
      return {};
    }
    case Op::Remove: {
      NamedBitmap* b = find_bitmap(n, name, st);
      if (!b) return st;
      VBLK_TRY(check_bitmap(*b, kBitmapBusy | kBitmapRo));
      VBLK_TRY(loop.run(image::remove_persistent_bitmap(n, name)));
      n.bitmaps().remove(name);
      return {};
    }
    case Op::Clear:
    case Op::Enable:
    case Op::Disable: {
      NamedBitmap* b = find_bitmap(n, name, st);
      if (!b) return st;
      VBLK_TRY(check_bitmap(*b, act.op == Op::Clear ? kBitmapDefault : kBitmapAllowRo));
      if (act.op == Op::Clear) {
        b->bits.reset_all();
      } else {
        b->enabled = act.op == Op::Enable;
      }
      return {};
    }
    case Op::Merge: {
      NamedBitmap* dst = find_bitmap(n, name, st);
      if (!dst) return st;
      VBLK_TRY(check_bitmap(*dst, kBitmapDefault));
      NamedBitmap* src = find_bitmap(src_node, act.source, st);
      if (!src) return st;
      VBLK_TRY(check_bitmap(*src, kBitmapAllowRo));
      // Through an anonymous bitmap, so a refused merge leaves dst as it was.
      DirtyBitmap anon(n.length(), dst->bits.granularity());
      VBLK_TRY(merge_bitmap(anon, src->bits));
      dst->bits.merge_from(anon);
      return {};
    }
  }
  return {};
}

}  // namespace

int cmd_bitmap(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS, OPT_ADD, OPT_REMOVE, OPT_CLEAR, OPT_ENABLE, OPT_DISABLE, OPT_MERGE };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"add", no_argument, nullptr, OPT_ADD},
      {"remove", no_argument, nullptr, OPT_REMOVE},
      {"clear", no_argument, nullptr, OPT_CLEAR},
      {"enable", no_argument, nullptr, OPT_ENABLE},
      {"disable", no_argument, nullptr, OPT_DISABLE},
      {"merge", required_argument, nullptr, OPT_MERGE},
      {nullptr, 0, nullptr, 0},
  };
  ImageArgs a;
  a.read_only = false;
  std::vector<Action> actions;
  bool add = false, merge = false;
  uint64_t granularity = 0;
  bool has_granularity = false;
  std::string src_filename, src_fmt;
  if (int rc = for_each_option(
          argc, argv, ":b:f:F:g:h", longopts,
          [&] {
            std::printf(
                "usage: %s bitmap (--merge SOURCE | --add | --remove | --clear | --enable | --disable)... "
                "[-b source_file [-F source_fmt]] [-g granularity] [--object objectdef] [--image-opts | -f fmt] "
                "filename bitmap\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'b': src_filename = optarg; break;
              case 'f': a.format = optarg; break;
              case 'F': src_fmt = optarg; break;
              case 'g': {
                auto g = parse_size(optarg);
                if (!g) {
                  error_report("Invalid granularity specified. You may use k, M, G, T, P or E suffixes for");
                  error_report("kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.");
                  return 1;
                }
                // 0 is "not given"; QMP's granularity is a uint32, and qemu-img
                // passes the low 32 bits of what it parsed (4G is then 0: refused).
                has_granularity = *g != 0;
                granularity = *g & 0xffffffffull;
                break;
              }
              case OPT_OBJECT: cli_object(optarg); break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
              case OPT_ADD:
                actions.push_back({Op::Add, {}});
                add = true;
                break;
              case OPT_REMOVE: actions.push_back({Op::Remove, {}}); break;
              case OPT_CLEAR: actions.push_back({Op::Clear, {}}); break;
              case OPT_ENABLE: actions.push_back({Op::Enable, {}}); break;
              case OPT_DISABLE: actions.push_back({Op::Disable, {}}); break;
              case OPT_MERGE:
                actions.push_back({Op::Merge, optarg});
                merge = true;
                break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  // qemu-img reports these without its "Try --help" line.
  const char* usage_error = nullptr;
  if (actions.empty()) {
    usage_error = "Need at least one of --add, --remove, --clear, --enable, --disable, or --merge";
  } else if (has_granularity && !add) {
    usage_error = "granularity only supported with --add";
  } else if (!src_fmt.empty() && src_filename.empty()) {
    usage_error = "-F only supported with -b";
  } else if (!src_filename.empty() && !merge) {
    usage_error = "Merge bitmap source file only supported with --merge";
  } else if (optind != argc - 2) {
    usage_error = "Expecting filename and bitmap name";
  }
  if (usage_error) {
    error_report(usage_error);
    return 1;
  }
  a.filename = argv[optind];
  const std::string name = argv[optind + 1];

  Loop loop;
  auto node = open_cli_image(loop, a);
  if (!node) return 1;
  std::shared_ptr<Node> src = node;
  if (!src_filename.empty()) {
    ImageArgs sa;
    sa.filename = src_filename;
    sa.format = src_fmt;
    sa.read_only = true;
    src = open_cli_image(loop, sa);
    if (!src) {
      (void)loop.run(node->close());
      return 1;
    }
  }
  int ret = 0;
  for (const Action& act : actions) {
    Status st = run_action(loop, *node, *src, act, name, has_granularity, granularity);
    if (!st) {
      // error_reportf_err: the message, then QEMU's hint on its own line.
      error_report(std::string("Operation ") + op_name(act.op) + " on bitmap " + name +
                   " failed: " + st.error().what());
      if (!st.error().hint.empty()) std::fprintf(stderr, "%s\n", st.error().hint.c_str());
      ret = 1;
      break;
    }
  }
  if (src != node) (void)loop.run(src->close());
  // Closing stores the bitmaps (and clears their in-use flags).
  if (Status st = loop.run(node->close()); !st) {
    error_report(st.error().what());
    ret = 1;
  }
  return ret;
}

}  // namespace vblk::cli
