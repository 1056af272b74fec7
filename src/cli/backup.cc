// vblk backup: a one-shot, point-in-time backup of an image (or an NBD
// export) into a new image, full or incremental, on the same backup job
// that `vblk serve` runs for blockdev-backup.
//
//   full:        vblk backup [--bitmap NAME] SRC TARGET
//                TARGET is created (-O, default qcow2) and gets the whole
//                disk; with --bitmap, the persistent bitmap NAME of SRC is
//                created if missing and starts over at the backup's point in
//                time (sync=full, bitmap-mode=on-success), so the next
//                incremental backup copies only what was written after it.
//   incremental: vblk backup --incremental --bitmap NAME -B PREV SRC TARGET
//                TARGET is created as a qcow2 overlay of PREV (the previous
//                backup of the chain) and gets only the clusters NAME has
//                dirty (sync=bitmap, on-success): the chain's top then reads
//                as SRC did. A missing or inconsistent bitmap (its writer
//                died with it in use) is refused with an error and no
//                target: never a silent full copy, never a chain that lies.
//
// A file target is written as TARGET.vblk-partial and renamed to TARGET
// only once the backup is complete and on disk, so a killed backup leaves
// nothing that looks finished. On any failure the target this command
// created is removed and the bitmap is as it was: a bitmap it created is
// removed, one the job reset gets its bits back. Restore is
// `vblk convert` of any point of the chain: as sparse as the source.
#include "vblk/backup.h"

#include <fcntl.h>
#include <getopt.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <vector>

#include "common.h"
#include "progress.h"
#include "vblk/create.h"
#include "vblk/graph.h"
#include "vblk/image_format.h"
#include "vblk/job.h"
#include "vblk/named_bitmap.h"
#include "vblk/options.h"
#include "vblk/perm.h"

namespace vblk::cli {

namespace {

// Where a file target is written until the backup has finished.
constexpr const char* kPartialSuffix = ".vblk-partial";

// Gives the finished backup its name: never over a file that appeared
// meanwhile, and durable (the directory entry synced) before success.
Status publish_file(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0)
    return Error(errno, "rename '" + from + "' to '" + to + "': " + std::strerror(errno));
  std::string dir = std::filesystem::path(to).parent_path().string();
  if (dir.empty()) dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Error(errno, "open directory '" + dir + "': " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Error(err, "sync directory '" + dir + "': " + std::strerror(err));
  return {};
}

// vblk backup's command line, parsed and checked.
struct BackupCommand {
  ImageArgs sa;  // the source
  std::string target, out_fmt = "qcow2", backing, backing_fmt, bitmap;
  bool incremental = false, progress = false, quiet = false;
  uint64_t cow_buffer = 0, rate = 0;
};

void usage() {
  std::printf(
      "usage: %s backup [-f fmt] [-O output_fmt] [--bitmap name [--incremental -B backing_file [-F "
      "backing_fmt]]] [--cow-buffer size] [-r rate_limit] [--object objectdef] [-p] [-q] source target\n",
      g_prog.c_str());
}

}  // namespace

Parsed<BackupCommand> parse_backup(int argc, char** argv) {
  enum { OPT_BITMAP = 256, OPT_INCREMENTAL, OPT_COW_BUFFER, OPT_IMAGE_OPTS, OPT_OBJECT };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"bitmap", required_argument, nullptr, OPT_BITMAP},
      {"incremental", no_argument, nullptr, OPT_INCREMENTAL},
      {"cow-buffer", required_argument, nullptr, OPT_COW_BUFFER},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {nullptr, 0, nullptr, 0},
  };
  BackupCommand cmd;
  if (int rc = for_each_option(
          argc, argv, ":f:O:B:F:r:hpq", longopts, [&] { usage(); },
          [&](int c) {
            switch (c) {
              case 'f': cmd.sa.format = optarg; break;
              case 'O': cmd.out_fmt = optarg; break;
              case 'B': cmd.backing = optarg; break;
              case 'F': cmd.backing_fmt = optarg; break;
              case 'p': cmd.progress = true; break;
              case 'q': cmd.quiet = true; break;
              case 'r':
              case OPT_COW_BUFFER: {
                auto v = parse_size(optarg);
                if (!v) {
                  error_report(std::string("Invalid ") + (c == 'r' ? "rate limit" : "COW buffer size") + " '" + optarg +
                               "'");
                  return 1;
                }
                (c == 'r' ? cmd.rate : cmd.cow_buffer) = *v;
                break;
              }
              case OPT_BITMAP: cmd.bitmap = optarg; break;
              case OPT_INCREMENTAL: cmd.incremental = true; break;
              case OPT_IMAGE_OPTS: cmd.sa.image_opts = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (optind != argc - 2) error_exit("Expecting a source and a target");
  cmd.sa.filename = argv[optind];
  cmd.target = argv[optind + 1];
  if (cmd.incremental && cmd.bitmap.empty()) error_exit("--incremental needs --bitmap: the bitmap says what changed");
  if (cmd.incremental && cmd.backing.empty())
    error_exit("--incremental needs -B: the previous backup of the chain, the new target's backing file");
  if (!cmd.incremental && !cmd.backing.empty()) error_exit("-B is only for --incremental");
  if (!cmd.backing_fmt.empty() && cmd.backing.empty()) error_exit("-F needs -B");
  if (cmd.incremental && cmd.out_fmt != "qcow2") error_exit("an incremental backup is a qcow2 overlay (-O qcow2)");
  if (cmd.quiet) cmd.progress = false;
  return cmd;
}

int run_backup(BackupCommand cmd) {
  if (::access(cmd.target.c_str(), F_OK) == 0) {
    // A backup never overwrites: an existing file may be a backup itself.
    error_report("Could not create '" + cmd.target + "': the file exists (a backup never overwrites one)");
    return 1;
  }
  // A file target is written under a partial name and renamed when the
  // backup has finished: a killed backup never leaves a file at TARGET that
  // looks like a finished one (an rbd image is written in place).
  const bool in_place = cmd.target.rfind("rbd:", 0) == 0;
  const std::string written = in_place ? cmd.target : cmd.target + kPartialSuffix;
  if (!in_place && ::access(written.c_str(), F_OK) == 0) {
    error_report("Could not create '" + cmd.target + "': '" + written +
                 "' exists, a backup into it was stopped or is still running; remove it first");
    return 1;
  }

  Loop loop;
  // The source's bitmap changes with the backup, so it is opened for
  // writing then; either way others may not write it meanwhile.
  cmd.sa.read_only = cmd.bitmap.empty();
  cmd.sa.unshare = kPermWrite | kPermResize;
  auto src = open_cli_image(loop, cmd.sa);
  if (!src) return 1;
  NamedBitmap* existing = cmd.bitmap.empty() ? nullptr : src->bitmaps().find(cmd.bitmap);
  const uint64_t granularity = default_bitmap_granularity(image::cluster_size(*src));
  if (cmd.incremental) {
    if (!existing) {
      error_report("Refusing the incremental backup: bitmap '" + cmd.bitmap + "' of '" + cmd.sa.filename +
                   "' does not exist; make a full backup with --bitmap " + cmd.bitmap + " to start a chain");
      return 1;
    }
    if (existing->inconsistent) {
      error_report("Refusing the incremental backup: bitmap '" + cmd.bitmap + "' of '" + cmd.sa.filename +
                   "' is inconsistent (its writer stopped without storing it), so it may miss writes; make a "
                   "full backup with --bitmap " +
                   cmd.bitmap + " after removing it (vblk bitmap --remove)");
      return 1;
    }
  } else if (!cmd.bitmap.empty() && !existing) {
    if (Status st = image::can_store_new_bitmap(*src, cmd.bitmap, granularity); !st) {
      error_report("Cannot keep bitmap '" + cmd.bitmap + "': " + st.error().what());
      return 1;
    }
  }

  if (create_target(written, cmd.out_fmt, "", cmd.backing, cmd.backing_fmt, src->length(),
                    "error while creating the backup target: ") != 0)
    return 1;
  // Unless the backup completed: the target this command made goes, a bitmap
  // it made goes (kept, it would call everything before it backed up), and
  // a bitmap it reset gets its bits back (nobody else wrote the source: the
  // command unshares write). The source's close then stores the bitmaps.
  struct UndoUnlessDone {
    bool done = false;
    std::string path;
    Node& src;
    std::string created_bitmap;
    std::string reused_bitmap;
    std::optional<DirtyBitmap> reused_bits;
    ~UndoUnlessDone() {
      if (done) return;
      (void)delete_image(path);
      if (!created_bitmap.empty()) src.bitmaps().remove(created_bitmap);
      // Looked up again: the job replaces a bitmap's record on success.
      if (NamedBitmap* b = src.bitmaps().find(reused_bitmap); b && reused_bits) b->bits = *reused_bits;
    }
  } undo{.path = written, .src = *src};
  if (existing) {
    undo.reused_bitmap = cmd.bitmap;
    undo.reused_bits = existing->bits;
  } else if (!cmd.bitmap.empty()) {
    // A new chain: the bitmap starts here (clean; the job keeps it so).
    auto nb = src->bitmaps().create(cmd.bitmap, src->length(), granularity);
    if (!nb) {
      error_report("Cannot keep bitmap '" + cmd.bitmap + "': " + nb.error().what());
      return 1;
    }
    (*nb)->persistent = true;
    undo.created_bitmap = cmd.bitmap;
  }

  ImageArgs ta;
  ta.filename = written;
  ta.format = cmd.out_fmt;
  ta.read_only = false;
  auto dst = open_cli_image(loop, ta);
  if (!dst) return 1;

  Graph graph;
  JobManager jobs(loop);
  std::string job_error;
  jobs.set_event_sink([&](const std::string& name, const nlohmann::ordered_json& data) {
    if (name == "BLOCK_JOB_COMPLETED" && data.contains("error")) job_error = data["error"].get<std::string>();
  });
  for (auto* n : {&src, &dst}) {
    if (Status st = graph.add(*n); !st) {
      error_report(st.error().what());
      return 1;
    }
  }
  BackupArgs a;
  a.job_id = "backup";
  a.device = src->node_name();
  a.target = dst->node_name();
  a.sync = cmd.incremental ? "bitmap" : "full";
  if (!cmd.bitmap.empty()) {
    a.bitmap = cmd.bitmap;
    a.bitmap_mode = "on-success";
  }
  if (cmd.rate) a.speed = static_cast<int64_t>(cmd.rate);
  a.cow_buffer_size = static_cast<int64_t>(cmd.cow_buffer);
  // Zeroes found in the data are written as zeroes (holes where the target
  // can unmap), so a backup is as sparse as qemu-img convert makes it
  // (qemu-img's default -S 4k).
  a.detect_zeroes = 4096;
  auto job = start_backup(jobs, graph, a);
  if (!job) {
    error_report((cmd.incremental ? "Refusing the incremental backup: " : "Cannot start the backup: ") +
                 job.error().what());
    return 1;
  }
  {
    Progress meter(cmd.progress, 1.0f);
    float shown = 0;
    meter.print(0, 100);
    loop.run_until([&] {
      uint64_t total = (*job)->progress_total();
      float pct = total ? 100.0f * static_cast<float>((*job)->progress_current()) / static_cast<float>(total) : 0;
      if (pct > shown) {
        meter.print(pct - shown, 100);
        shown = pct;
      }
      return (*job)->status() == JobStatus::Null || (*job)->status() == JobStatus::Concluded;
    });
    if ((*job)->result().ok() && shown < 100) meter.print(100 - shown, 100);
    meter.end();
  }
  if (!(*job)->result().ok()) {
    error_report("The backup failed: " + (job_error.empty() ? (*job)->result().error().what() : job_error));
    return 1;
  }
  if (Status st = loop.run(dst->flush()); !st) {
    error_report("error while flushing the backup: " + st.error().what());
    return 1;
  }
  (void)graph.remove(dst->node_name());
  (void)graph.remove(src->node_name());
  dst.reset();  // closed: every byte and the metadata are on disk before the rename
  if (!in_place) {
    if (Status st = publish_file(written, cmd.target); !st) {
      error_report("Could not finish the backup '" + cmd.target + "': " + st.error().what());
      return 1;
    }
  }
  undo.done = true;
  return 0;
}

int cmd_backup(int argc, char** argv) {
  auto parsed = parse_backup(argc, argv);
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  return run_backup(std::move(std::get<BackupCommand>(parsed)));
}

}  // namespace vblk::cli
