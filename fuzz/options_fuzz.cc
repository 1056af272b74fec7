// libFuzzer target: the option parsers a user's text reaches. Byte 0 picks
// the parser, the rest is the text:
//   0  a size (parse_size: "1G", "512k", "1.5M", "0x100")
//   1  keyval ("-blockdev"/--image-opts syntax: "driver=qcow2,file.size=1M")
//   2  the same with the implied key "file" (a leading bare value)
//   3  a json: pseudo-filename's object (parse_json_value, as
//      src/cli/common.cc takes it, then converted the same way)
//   4  an NBD URI (parse_nbd_uri)
// Parsed options then go through the typed getters (take_bool, take_size,
// take_number, take_string, take_dict on the keys drivers ask for) and,
// when they stay in memory (fuzz/sandbox.h), through open_node itself over
// a graph with an in-memory node, then close. Errors are fine; a crash, a
// sanitizer report, a leak or an uncaught exception is a bug.
#include <cstdint>
#include <memory>
#include <string>

#include "fuzz/sandbox.h"
#include "vblk/copy_drivers.h"
#include "vblk/graph.h"
#include "vblk/mem_node.h"
#include "vblk/nbd_client.h"
#include "vblk/open.h"
#include "vblk/options.h"
#include "vblk/qmp_json.h"

using namespace vblk;

namespace {

Loop& loop() {
  static Loop l;
  return l;
}

// Each getter, on a copy of its own, for every key a driver might ask for
// (a getter takes the key it reads, so one copy serves all keys).
void getters(const Json& opts) {
  static const char* kKeys[] = {"size",
                                "read-only",
                                "cache",
                                "direct",
                                "no-flush",
                                "discard",
                                "offset",
                                "cluster-size",
                                "node-name",
                                "driver",
                                "file",
                                "read-zeroes",
                                "auto-read-only",
                                "force-share",
                                "detect-zeroes",
                                "l2-cache-size",
                                "cache-clean-interval"};
  Json b = opts, z = opts, n = opts, s = opts, d = opts;
  for (const char* k : kKeys) {
    (void)take_bool(b, k);
    (void)take_size(z, k);
    (void)take_number(n, k);
    (void)take_string(s, k);
    (void)take_dict(d, k);
  }
}

void open_and_close(Json opts) {
  if (!opts.is_object() || !fuzz::in_memory_only(opts)) return;
  Graph g;
  MemNode::Options mo;
  mo.size = 16 << 10;
  mo.max_size = 1 << 20;
  auto mem = std::make_shared<MemNode>(loop(), mo);
  mem->set_node_name("mem");
  (void)g.add(mem);
  OpenContext ctx{loop()};
  ctx.graph = &g;
  auto n = open_node(ctx, std::move(opts));
  if (n) (void)loop().run((*n)->close());
}

void keyval(const std::string& text, const std::string& implied) {
  auto j = parse_keyval(text, implied);
  if (!j) return;
  getters(*j);
  open_and_close(*j);
}

void json_filename(const std::string& text) {
  auto m = qmp::parse_json_value(text);
  if (!m.ok) return;
  (void)qmp::to_qmp_text(m.value);
  if (!m.value.is_object()) return;
  (void)qmp::qdict_key_order(m.value);
  // As open_cli_image does: the ordered value through its text.
  Json o = Json::parse(m.value.dump());
  getters(o);
  if (o.contains("driver")) open_and_close(std::move(o));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool registered = (register_copy_drivers(), true);
  (void)registered;
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 5) {
    case 0: (void)parse_size(text); break;
    case 1: keyval(text, ""); break;
    case 2: keyval(text, "file"); break;
    case 3: json_filename(text); break;
    case 4: {
      nbd::Address addr;
      std::string name, err;
      (void)nbd::parse_nbd_uri(text, addr, name, &err);
      break;
    }
  }
  return 0;
}
