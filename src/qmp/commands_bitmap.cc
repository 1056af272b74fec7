// Dirty bitmap commands: block-dirty-bitmap-add|remove|clear|enable|disable|
// merge and x-debug-block-dirty-bitmap-sha256, with QEMU 7.2's validation
// order and texts (block/monitor/bitmap-qmp-cmds.c, block/dirty-bitmap.c).
// The bitmaps live on the nodes (Node::bitmaps(), vblk/named_bitmap.h);
// query-named-block-nodes shows them (commands_block.cc).
#include <algorithm>
#include <bit>

#include "transaction.h"
#include "vblk/image_format.h"
#include "vblk/qmp_daemon.h"

namespace vblk::qmp {

namespace {

// QEMU's block_dirty_bitmap_lookup.
Result<NamedBitmap*> lookup(Daemon& d, const std::string& node, const std::string& name,
                            std::shared_ptr<Node>* out = nullptr) {
  auto n = d.graph.find(node);
  if (!n) return Error(ENOENT, "Node '" + node + "' not found");
  NamedBitmap* b = n->bitmaps().find(name);
  if (!b) return Error(ENOENT, "Dirty bitmap '" + name + "' not found");
  if (out) *out = n;
  return b;
}

uint64_t default_granularity(const Node& n) { return default_bitmap_granularity(image::cluster_size(n)); }

Task<Reply> bitmap_add(Daemon& d, const OJson& a) {
  std::string node = a["node"].get<std::string>();
  std::string name = a["name"].get<std::string>();
  if (name.empty()) co_return Reply::fail("Bitmap name cannot be empty");
  auto n = d.graph.find(node);
  if (!n) co_return Reply::fail("Cannot find device='" + node + "' nor node-name='" + node + "'");
  uint64_t gran;
  if (a.contains("granularity")) {
    gran = a["granularity"].get<uint64_t>();
    if (gran < 512 || !std::has_single_bit(gran))
      co_return Reply::fail("Granularity must be power of 2 and at least 512");
  } else {
    gran = default_granularity(*n);
  }
  bool persistent = a.contains("persistent") && a["persistent"].get<bool>();
  bool disabled = a.contains("disabled") && a["disabled"].get<bool>();
  if (persistent)
    if (auto st = image::can_store_new_bitmap(*n, name, gran); !st) co_return Reply::fail(st.error());
  auto b = n->bitmaps().create(name, n->length(), gran);
  if (!b) co_return Reply::fail(b.error());
  (*b)->enabled = !disabled;
  (*b)->persistent = persistent;
  co_return Reply::ok();
}

Task<Reply> bitmap_remove(Daemon& d, const OJson& a) {
  std::shared_ptr<Node> n;
  auto b = lookup(d, a["node"].get<std::string>(), a["name"].get<std::string>(), &n);
  if (!b) co_return Reply::fail(b.error());
  if (auto st = check_bitmap(**b, kBitmapBusy | kBitmapRo); !st) co_return Reply::fail(st.error());
  std::string name = (*b)->name;
  if ((*b)->persistent) {
    auto st = co_await image::remove_persistent_bitmap(*n, name);
    if (!st) co_return Reply::fail(st.error());
  }
  n->bitmaps().remove(name);
  co_return Reply::ok();
}

// clear, enable, disable.
Task<Reply> bitmap_verb(Daemon& d, const OJson& a, std::string verb) {
  auto b = lookup(d, a["node"].get<std::string>(), a["name"].get<std::string>());
  if (!b) co_return Reply::fail(b.error());
  NamedBitmap& bm = **b;
  if (auto st = check_bitmap(bm, verb == "clear" ? kBitmapDefault : kBitmapAllowRo); !st)
    co_return Reply::fail(st.error());
  if (verb == "clear")
    bm.bits.reset_all();
  else
    bm.enabled = verb == "enable";
  co_return Reply::ok();
}

// The members of BlockDirtyBitmapOrStr's object branch (BlockDirtyBitmap).
const std::vector<Arg> kExternalBitmap = {{"node", ArgType::Str, true}, {"name", ArgType::Str, true}};

Task<Reply> bitmap_merge(Daemon& d, const OJson& a) {
  const OJson& list = a["bitmaps"];
  // The input visitor checks every element before the command runs.
  for (size_t i = 0; i < list.size(); ++i) {
    const OJson& e = list[i];
    if (e.is_string()) continue;
    // QEMU 7.2 names the alternate 'null' here.
    if (!e.is_object()) co_return Reply::fail("Invalid parameter type for 'null', expected: BlockDirtyBitmapOrStr");
    if (auto err = check_args(kExternalBitmap, false, e, "bitmaps[" + std::to_string(i) + "]"))
      co_return Reply::fail(*err);
  }
  std::shared_ptr<Node> n;
  auto dst = lookup(d, a["node"].get<std::string>(), a["target"].get<std::string>(), &n);
  if (!dst) co_return Reply::fail(dst.error());
  if (auto st = check_bitmap(**dst, kBitmapDefault); !st) co_return Reply::fail(st.error());
  // Sources are merged into an anonymous bitmap first, so a failure leaves
  // the target unchanged.
  DirtyBitmap anon(n->length(), (*dst)->bits.granularity());
  for (const OJson& e : list) {
    NamedBitmap* src;
    if (e.is_string()) {
      std::string name = e.get<std::string>();
      src = n->bitmaps().find(name);
      if (!src) co_return Reply::fail("Dirty bitmap '" + name + "' not found");
    } else {
      auto s = lookup(d, e["node"].get<std::string>(), e["name"].get<std::string>());
      if (!s) co_return Reply::fail(s.error());
      src = *s;
    }
    if (auto st = check_bitmap(*src, kBitmapAllowRo); !st) co_return Reply::fail(st.error());
    if (auto st = merge_bitmap(anon, src->bits); !st) co_return Reply::fail(st.error());
  }
  (*dst)->bits.merge_from(anon);
  co_return Reply::ok();
}

Task<Reply> bitmap_sha256(Daemon& d, const OJson& a) {
  auto b = lookup(d, a["node"].get<std::string>(), a["name"].get<std::string>());
  if (!b) co_return Reply::fail(b.error());
  OJson r = OJson::object();
  r["sha256"] = bitmap_sha256((*b)->bits);
  co_return Reply::ok(std::move(r));
}

Status to_status(const Reply& r) {
  if (r.error) return Error(EINVAL, r.error->desc);
  return {};
}

// The bitmap commands as transaction actions (QEMU 7.2's block_dirty_
// bitmap_*_prepare/commit/abort): prepare does what the command does and
// keeps what abort needs to undo it — the new bitmap to drop (add), the
// old bits (clear, merge), the old state (enable, disable); remove only
// hides the bitmap (busy) until commit drops it.
class BitmapAction final : public TxAction {
 public:
  BitmapAction(std::string verb, const OJson& a)
      : verb_(std::move(verb)), name_("block-dirty-bitmap-" + verb_), a_(a) {}
  const char* name() const override { return name_.c_str(); }

  Task<Status> prepare(TxContext& tx) override {
    Daemon& d = tx.d;
    if (verb_ == "add") {
      Reply r = co_await bitmap_add(d, a_);
      if (!r.error) {
        node_ = d.graph.find(a_["node"].get<std::string>());
        added_ = true;
      }
      co_return to_status(r);
    }
    const char* key = "name";
    if (verb_ == "merge") key = "target";
    std::string target = a_[key].get<std::string>();
    auto b = lookup(d, a_["node"].get<std::string>(), target, &node_);
    if (verb_ == "remove") {
      if (!b) co_return b.take_error();
      VBLK_CO_TRY(check_bitmap(**b, kBitmapBusy | kBitmapRo));
      if ((*b)->persistent) VBLK_CO_TRY(co_await image::remove_persistent_bitmap(*node_, (*b)->name));
      (*b)->busy = true;
      bm_ = *b;
      co_return Status{};
    }
    if (b) {
      saved_bits_ = (*b)->bits;
      was_enabled_ = (*b)->enabled;
    }
    Reply r;
    if (verb_ == "merge") {
      r = co_await bitmap_merge(d, a_);
    } else {
      r = co_await bitmap_verb(d, a_, verb_);
    }
    if (!r.error) bm_ = *b;
    co_return to_status(r);
  }

  Task<void> commit(TxContext&) override {
    if (verb_ == "remove" && bm_) {
      std::string name = bm_->name;
      bm_->busy = false;
      node_->bitmaps().remove(name);
    }
    co_return;
  }

  Task<void> abort(TxContext&) override {
    if (added_) {
      node_->bitmaps().remove(a_["name"].get<std::string>());
    } else if (bm_ && verb_ == "remove") {
      bm_->busy = false;
    } else if (bm_ && (verb_ == "clear" || verb_ == "merge")) {
      bm_->bits = *saved_bits_;
    } else if (bm_) {
      bm_->enabled = was_enabled_;
    }
    co_return;
  }

 private:
  std::string verb_, name_;
  OJson a_;
  std::shared_ptr<Node> node_;
  NamedBitmap* bm_ = nullptr;
  bool added_ = false;
  std::optional<DirtyBitmap> saved_bits_;
  bool was_enabled_ = false;
};

}  // namespace

std::unique_ptr<TxAction> make_bitmap_action(const std::string& verb, const OJson& args) {
  return std::make_unique<BitmapAction>(verb, args);
}

OJson dirty_bitmaps_info(const Node& n) {
  OJson list = OJson::array();
  for (const auto& b : n.bitmaps().list()) {
    // QEMU lists its anonymous bitmaps too (a backup's successor, block-copy's
    // bitmap); vblk has only some of them, so none are listed.
    if (b->name.empty()) continue;
    OJson o = OJson::object();
    o["name"] = b->name;
    o["recording"] = b->recording();
    o["persistent"] = b->persistent;
    o["busy"] = b->busy;
    o["granularity"] = b->bits.granularity();
    o["count"] = b->bits.dirty_clusters() * b->bits.granularity();
    if (b->inconsistent) o["inconsistent"] = true;
    list.push_back(std::move(o));
  }
  return list;
}

void register_bitmap_commands(Daemon& d) {
  const std::vector<Arg> node_name = {{"node", ArgType::Str, true}, {"name", ArgType::Str, true}};
  d.registry.add({"block-dirty-bitmap-add",
                  {{{"node", ArgType::Str, true},
                    {"name", ArgType::Str, true},
                    {"granularity", ArgType::UInt32},
                    {"persistent", ArgType::Bool},
                    {"disabled", ArgType::Bool}}},
                  [&d](const OJson& a) { return bitmap_add(d, a); }});
  d.registry.add({"block-dirty-bitmap-remove", {node_name}, [&d](const OJson& a) { return bitmap_remove(d, a); }});
  for (const char* verb : {"clear", "enable", "disable"})
    d.registry.add({std::string("block-dirty-bitmap-") + verb, {node_name}, [&d, verb](const OJson& a) {
                      return bitmap_verb(d, a, verb);
                    }});
  d.registry.add({"block-dirty-bitmap-merge",
                  {{{"node", ArgType::Str, true}, {"target", ArgType::Str, true}, {"bitmaps", ArgType::List, true}}},
                  [&d](const OJson& a) { return bitmap_merge(d, a); }});
  d.registry.add(
      {"x-debug-block-dirty-bitmap-sha256", {node_name}, [&d](const OJson& a) { return bitmap_sha256(d, a); }});
}

}  // namespace vblk::qmp
