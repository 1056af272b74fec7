// vblk snapshot: list, create, apply and delete internal snapshots
// (qemu-img snapshot, including its option set: 7.2 takes no -f).
#include <getopt.h>
#include <sys/time.h>

#include <cstdio>
#include <cstring>

#include "common.h"
#include "vblk/image_format.h"

namespace vblk::cli {

namespace {

enum Action { kNone, kList, kApply, kCreate, kDelete };

}  // namespace

int cmd_snapshot(int argc, char** argv) {
  enum { OPT_OBJECT = 256, OPT_IMAGE_OPTS };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  ImageArgs a;
  a.read_only = false;
  Action action = kNone;
  std::string name;
  bool quiet = false, force_share = false;
  auto set_action = [&](Action act) {
    if (action != kNone) error_exit("Cannot mix '-l', '-a', '-c', '-d'");
    action = act;
    if (act != kList) name = optarg;
  };
  if (int rc = for_each_option(
          argc, argv, ":la:c:d:hqU", longopts,
          [&] {
            std::printf(
                "usage: %s snapshot [--image-opts] [-U] [-q] [-l | -a snapshot | -c snapshot | -d snapshot] "
                "filename\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'l':
                set_action(kList);
                a.read_only = true;
                break;
              case 'a': set_action(kApply); break;
              case 'c': set_action(kCreate); break;
              case 'd': set_action(kDelete); break;
              case 'q': quiet = true; break;
              case 'U': force_share = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  (void)quiet;
  if (optind != argc - 1) error_exit("Expecting one image file name");
  a.filename = argv[optind];

  if (force_share && !a.read_only) {
    error_report("Could not open '" + a.filename + "': force-share=on can only be used with read-only images");
    return 1;
  }
  Loop loop;
  a.force_share = force_share;
  auto node = open_cli_image(loop, a);
  if (!node) return 1;
  int ret = 0;
  switch (action) {
    case kNone: break;
    case kList: dump_snapshots(image::snapshots(*node)); break;
    case kCreate: {
      SnapshotInfo sn;
      sn.name = name.substr(0, 255);  // QEMUSnapshotInfo.name is char[256]
      timeval tv;
      gettimeofday(&tv, nullptr);
      sn.date_sec = static_cast<uint32_t>(tv.tv_sec);
      sn.date_nsec = static_cast<uint32_t>(tv.tv_usec * 1000);
      sn.icount = 0;  // qemu-img leaves it zeroed
      auto st = loop.run(image::snapshot_create(*node, sn));
      if (!st) {
        // A driver's own report comes first (rbd: "failed to create snap: ...").
        if (!st.error().message.empty()) error_report(st.error().message);
        error_report("Could not create snapshot '" + name + "': " + std::to_string(-st.error().code) + " (" +
                     std::strerror(st.error().code) + ")");
        ret = 1;
      }
      break;
    }
    case kApply: {
      auto st = loop.run(image::snapshot_goto(*node, name));
      if (node->driver() == "raw" && a.format.empty() && !a.image_opts) {
        // qemu-img falls back to the raw node's file (rbd: its snapshots),
        // reopening the raw node afterwards, whatever the outcome: its
        // probing warning appears a second time.
        warn_probed_raw(node->file_child() ? node->file_child()->filename() : node->filename());
      }
      if (!st) {
        std::string why = st.error().what();
        if (image::supports_snapshots(*node) && st.error().code != EBUSY) {
          // The driver's own words come first, on their own line (QEMU's
          // error_report inside the driver), then the generic failure. EBUSY
          // (dirty bitmaps) is the block layer's refusal: said as it is.
          if (!st.error().message.empty()) error_report(st.error().message);
          why = std::string("Failed to load snapshot: ") + std::strerror(st.error().code);
        }
        error_report("Could not apply snapshot '" + name + "': " + why);
        ret = 1;
      }
      break;
    }
    case kDelete: {
      // qemu-img looks the snapshot up by name, then deletes that id+name.
      const SnapshotInfo* found = nullptr;
      auto list = image::snapshots(*node);
      for (const auto& sn : list)
        if (sn.name == name) {
          found = &sn;
          break;
        }
      if (!found) {
        error_report("Could not delete snapshot '" + name + "': snapshot not found");
        ret = 1;
        break;
      }
      auto st = loop.run(image::snapshot_delete(*node, found->id, found->name));
      if (!st) {
        error_report("Could not delete snapshot '" + name + "': " + st.error().what());
        ret = 1;
      }
      break;
    }
  }
  if (!a.read_only) {
    auto st = loop.run(node->flush());
    if (!st && !ret) {
      error_report(st.error().what());
      ret = 1;
    }
  }
  return ret;
}

}  // namespace vblk::cli
