// vblk info: what an image is (qemu-img info).
#include <getopt.h>

#include <cstdio>

#include "common.h"
#include "vblk/format_info_json.h"
#include "vblk/image_format.h"
#include "vblk/snapshot_info_json.h"

namespace vblk::cli {

namespace {

// ImageInfo in QAPI schema order; qdict_order() gives QEMU's print order.
nlohmann::ordered_json info_json(Node& top) {
  const ImageFormat* f = top.format();
  nlohmann::ordered_json j;
  j["filename"] = top.filename();
  j["format"] = top.driver();
  if (top.caps().reports_dirty_flag) j["dirty-flag"] = f && f->dirty_flag();
  if (auto sz = top.allocated_size()) j["actual-size"] = *sz;
  j["virtual-size"] = top.length();
  if (image::cluster_size(top)) j["cluster-size"] = image::cluster_size(top);
  if (f && f->encrypted()) j["encrypted"] = true;
  std::string bf = image::backing_file_name(top);
  if (!bf.empty()) {
    j["backing-filename"] = bf;
    j["full-backing-filename"] = path_combine(top.filename(), bf);
    if (!image::backing_file_format(top).empty()) j["backing-filename-format"] = image::backing_file_format(top);
  }
  auto snaps = image::snapshots(top);
  if (!snaps.empty()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& sn : snaps) list.push_back(snapshot_info_json(sn));
    j["snapshots"] = list;
  }
  if (auto spec = f ? f->format_info() : std::nullopt) j["format-specific"] = format_info_json(*spec);
  return qdict_order(j);
}

std::string human_key(std::string k) {
  for (auto& c : k)
    if (c == '-') c = ' ';
  return k;
}

// QEMU's dump_qobject: "key: value", or "key:" and the members indented;
// list elements are labelled "[i]".
void dump_specific(const nlohmann::ordered_json& data, int indent);

void dump_entry(const std::string& label, const nlohmann::ordered_json& v, int indent) {
  std::string pad(static_cast<size_t>(indent) * 4, ' ');
  if (v.is_object() || v.is_array()) {
    std::printf("%s%s:\n", pad.c_str(), label.c_str());
    dump_specific(v, indent + 1);
  } else if (v.is_string()) {
    std::printf("%s%s: %s\n", pad.c_str(), label.c_str(), v.get<std::string>().c_str());
  } else {
    std::printf("%s%s: %s\n", pad.c_str(), label.c_str(), v.dump().c_str());
  }
}

void dump_specific(const nlohmann::ordered_json& data, int indent) {
  if (data.is_array()) {
    for (size_t i = 0; i < data.size(); ++i) dump_entry("[" + std::to_string(i) + "]", data[i], indent);
    return;
  }
  for (auto it = data.begin(); it != data.end(); ++it) dump_entry(human_key(it.key()), it.value(), indent);
}

void info_human(Node& top) {
  const ImageFormat* f = top.format();
  std::printf("image: %s\n", top.filename().c_str());
  std::printf("file format: %s\n", top.driver().c_str());
  std::printf("virtual size: %s (%llu bytes)\n", size_to_str(top.length()).c_str(),
              static_cast<unsigned long long>(top.length()));
  auto sz = top.allocated_size();
  std::printf("disk size: %s\n", sz ? size_to_str(*sz).c_str() : "unavailable");
  if (f && f->encrypted()) std::printf("encrypted: yes\n");
  if (image::cluster_size(top))
    std::printf("cluster_size: %llu\n", static_cast<unsigned long long>(image::cluster_size(top)));
  if (f && f->dirty_flag()) std::printf("cleanly shut down: no\n");
  std::string bf = image::backing_file_name(top);
  if (!bf.empty()) {
    std::string full = path_combine(top.filename(), bf);
    if (full != bf) {
      std::printf("backing file: %s (actual path: %s)\n", bf.c_str(), full.c_str());
    } else {
      std::printf("backing file: %s\n", bf.c_str());
    }
    if (!image::backing_file_format(top).empty())
      std::printf("backing file format: %s\n", image::backing_file_format(top).c_str());
  }
  dump_snapshots(image::snapshots(top));
  if (auto spec = f ? f->format_info() : std::nullopt) {
    std::printf("Format specific information:\n");
    dump_specific(qdict_order(format_info_json(*spec))["data"], 1);
  }
}

}  // namespace

int cmd_info(int argc, char** argv) {
  ImageArgs a;
  bool json = false, chain = false;
  enum { OPT_OUTPUT = 256, OPT_BACKING_CHAIN, OPT_IMAGE_OPTS, OPT_OBJECT };
  static const option longopts[] = {
      {"help", no_argument, nullptr, 'h'},
      {"format", required_argument, nullptr, 'f'},
      {"output", required_argument, nullptr, OPT_OUTPUT},
      {"backing-chain", no_argument, nullptr, OPT_BACKING_CHAIN},
      {"object", required_argument, nullptr, OPT_OBJECT},
      {"image-opts", no_argument, nullptr, OPT_IMAGE_OPTS},
      {"force-share", no_argument, nullptr, 'U'},
      {nullptr, 0, nullptr, 0},
  };
  std::string output = "human";
  if (int rc = for_each_option(
          argc, argv, ":f:hU", longopts,
          [&] {
            std::printf("usage: %s info [--image-opts] [-f fmt] [--output=ofmt] [--backing-chain] [-U] filename\n",
                        g_prog.c_str());
          },
          [&](int c) {
            switch (c) {
              case 'f': a.format = optarg; break;
              case 'U': a.force_share = true; break;
              case OPT_OUTPUT: output = optarg; break;
              case OPT_BACKING_CHAIN: chain = true; break;
              case OPT_IMAGE_OPTS: a.image_opts = true; break;
              case OPT_OBJECT: cli_object(optarg); break;
            }
            return kNextOption;
          });
      rc != kNextOption)
    return rc;
  if (optind != argc - 1) error_exit("Expecting one image file name");
  a.filename = argv[optind];
  if (output == "json") {
    json = true;
  } else if (output != "human") {
    error_report("--output must be used with human or json as argument.");
    return 1;
  }
  if (a.image_opts && !a.format.empty()) {
    error_report("--image-opts and --format are mutually exclusive");
    return 1;
  }
  // As qemu-img: backing files are not opened; --backing-chain opens each
  // image on its own, following the names, and refuses a loop.
  Loop loop;
  a.no_backing = true;
  a.no_io = true;
  auto top = open_cli_image(loop, a);
  if (!top) return 1;
  std::vector<std::shared_ptr<Node>> owned{top};
  std::vector<Node*> images{top.get()};
  if (chain) {
    std::vector<std::string> seen{top->filename()};
    while (!image::backing_file_name(*images.back()).empty()) {
      Node* cur = images.back();
      ImageArgs b;
      b.filename = path_combine(cur->filename(), image::backing_file_name(*cur));
      b.format = image::backing_file_format(*cur);
      b.no_backing = true;
      b.no_io = true;
      b.force_share = a.force_share;
      for (const auto& s : seen) {
        if (s == b.filename) {
          error_report("Backing file '" + image::backing_file_name(*cur) + "' creates an infinite loop.");
          return 1;
        }
      }
      seen.push_back(b.filename);
      auto next = open_cli_image(loop, b);
      if (!next) return 1;
      owned.push_back(next);
      images.push_back(next.get());
    }
  }
  if (json) {
    nlohmann::ordered_json out;
    if (chain) {
      out = nlohmann::ordered_json::array();
      for (Node* n : images) out.push_back(info_json(*n));
    } else {
      out = info_json(*top);
    }
    std::printf("%s\n", qemu_json_pretty(out).c_str());
  } else {
    for (size_t i = 0; i < images.size(); ++i) {
      if (i) std::printf("\n");
      info_human(*images[i]);
    }
  }
  return 0;
}

}  // namespace vblk::cli
