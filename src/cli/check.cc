// vblk check: is an image's metadata consistent, and repair it (qemu-img check).
//
// Exit codes, as qemu-img's:
//   0  check completed, the image is good
//   1  check not completed because of internal errors (or bad usage)
//   2  check completed, the image is corrupted
//   3  check completed, the image has leaked clusters but is good otherwise
//   63 the format does not support checks
#include <getopt.h>
#include <inttypes.h>

#include <cstdio>
#include <cstring>

#include "common.h"
#include "vblk/image_format.h"

namespace vblk::cli {

namespace {

// ImageCheck in QAPI schema order; optional members only when non-zero, as
// qemu-img sets has_* (qdict_order() then gives QEMU's print order).
nlohmann::ordered_json check_json(const CheckResult& r, const std::string& filename, const std::string& format) {
  nlohmann::ordered_json j;
  j["filename"] = filename;
  j["format"] = format;
  j["check-errors"] = r.check_errors;
  auto opt = [&](const char* key, int64_t v) {
    if (v) j[key] = v;
  };
  opt("image-end-offset", r.image_end_offset);
  opt("corruptions", r.corruptions);
  opt("leaks", r.leaks);
  opt("corruptions-fixed", r.corruptions_fixed);
  opt("leaks-fixed", r.leaks_fixed);
  opt("total-clusters", r.total_clusters);
  opt("allocated-clusters", r.allocated_clusters);
  opt("fragmented-clusters", r.fragmented_clusters);
  opt("compressed-clusters", r.compressed_clusters);
  return qdict_order(j);
}

void check_human(const CheckResult& r) {
  if (!(r.corruptions || r.leaks || r.check_errors)) {
    std::printf("No errors were found on the image.\n");
  } else {
    if (r.corruptions)
      std::printf("\n%" PRId64
                  " errors were found on the image.\n"
                  "Data may be corrupted, or further writes to the image may corrupt it.\n",
                  r.corruptions);
    if (r.leaks)
      std::printf("\n%" PRId64
                  " leaked clusters were found on the image.\n"
                  "This means waste of disk space, but no harm to data.\n",
                  r.leaks);
    if (r.check_errors) std::printf("\n%" PRId64 " internal errors have occurred during the check.\n", r.check_errors);
  }
  if (r.total_clusters != 0 && r.allocated_clusters != 0)
    std::printf("%" PRId64 "/%" PRId64 " = %0.2f%% allocated, %0.2f%% fragmented, %0.2f%% compressed clusters\n",
                r.allocated_clusters, r.total_clusters, r.allocated_clusters * 100.0 / r.total_clusters,
                r.fragmented_clusters * 100.0 / r.allocated_clusters,
                r.compressed_clusters * 100.0 / r.allocated_clusters);
  if (r.image_end_offset) std::printf("Image end offset: %" PRId64 "\n", r.image_end_offset);
}

}  // namespace

int cmd_check(int argc, char** argv) {
  ImageArgs a;
  enum { OPT_OUTPUT = 256, OPT_OBJECT, OPT_IMAGE_OPTS };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"format", required_argument, nullptr, 'f'},
      {"repair", required_argument, nullptr, 'r'},
      {"output", required_argument, nullptr, OPT_OUTPUT},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  std::string cache = "writeback";
  const char* output = nullptr;
  bool quiet = false, force_share = false;
  uint32_t fix = kCheckReport;
  if (int rc = for_each_option(
          argc, argv, ":hf:r:T:qU", longopts,
          [&] {
            std::printf(
                "usage: %s check [--image-opts] [-q] [-f fmt] [--output=ofmt] [-r [leaks | all]] "
                "[-T src_cache] [-U] filename\n",
                g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': a.format = optarg; break;
              case 'r':
                if (!std::strcmp(optarg, "leaks")) {
                  fix = kCheckFixLeaks;
                } else if (!std::strcmp(optarg, "all")) {
                  fix = kCheckFixLeaks | kCheckFixErrors;
                } else {
                  error_exit(std::string("Unknown option value for -r (expecting 'leaks' or 'all'): ") + optarg);
                }
                break;
              case OPT_OUTPUT: output = optarg; break;
              case 'T': cache = optarg; break;
              case 'q': quiet = true; break;
              case 'U': force_share = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (optind != argc - 1) error_exit("Expecting one image file name");
  a.filename = argv[optind];
  bool json = false;
  if (output && !std::strcmp(output, "json")) {
    json = true;
  } else if (output && std::strcmp(output, "human") != 0) {
    error_report("--output must be used with human or json as argument.");
    return 1;
  }
  if (!parse_cache_mode(cache, a.cache)) {
    error_report("Invalid source cache option: " + cache);
    return 1;
  }
  if (a.image_opts && !a.format.empty()) {
    error_report("--image-opts and --format are mutually exclusive");
    return 1;
  }
  if (force_share && fix) {
    error_report("Could not open '" + a.filename + "': force-share=on can only be used with read-only images");
    return 1;
  }
  a.read_only = !fix;
  a.check = true;
  // -q silences everything qemu-img prints with qprintf (stdout).
  if (quiet) std::freopen("/dev/null", "w", stdout);

  Loop loop;
  a.force_share = force_share;
  auto node = open_cli_image(loop, a);
  if (!node) return 1;

  auto r = loop.run(image::check(*node, fix));
  if (!r && r.error().code == ENOTSUP) {
    error_report("This image format does not support checks");
    return 63;
  }
  CheckResult res;
  if (r) res = *r;
  if (r && (res.corruptions_fixed || res.leaks_fixed)) {
    if (!json)
      std::printf(
          "The following inconsistencies were found and repaired:\n\n"
          "    %" PRId64
          " leaked clusters\n"
          "    %" PRId64
          " corruptions\n\n"
          "Double checking the fixed image now...\n",
          res.leaks_fixed, res.corruptions_fixed);
    std::fflush(stdout);
    const int64_t leaks_fixed = res.leaks_fixed, corruptions_fixed = res.corruptions_fixed;
    r = loop.run(image::check(*node, kCheckReport));
    res = r ? *r : CheckResult{};
    res.leaks_fixed = leaks_fixed;
    res.corruptions_fixed = corruptions_fixed;
  }
  if (r) {
    if (json) {
      std::printf("%s\n", qemu_json_pretty(check_json(res, a.filename, node->driver())).c_str());
    } else {
      check_human(res);
    }
  }
  std::fflush(stdout);
  if (!r || res.check_errors) {
    if (!r) {
      error_report(std::string("Check failed: ") + std::strerror(r.error().code));
    } else {
      error_report("Check failed");
    }
    return 1;
  }
  if (res.corruptions) return 2;
  if (res.leaks) return 3;
  return 0;
}

}  // namespace vblk::cli
