// The overlap-check option and the sorted indexes behind the check (the
// check itself, which reads the node's tables, is in overlap_check.cc).
#include "drivers/qcow2/overlap.h"

#include <algorithm>

namespace vblk::qcow2 {

namespace {

// QEMU's overlap_bool_option_names, in bit order.
constexpr const char* kKindOptions[kOlBits] = {
    "main-header",    "active-l1",   "active-l2",   "refcount-table",   "refcount-block",
    "snapshot-table", "inactive-l1", "inactive-l2", "bitmap-directory",
};

Result<uint32_t> mode_bits(const std::string& mode) {
  if (mode == "none") return 0u;
  if (mode == "constant") return kOlConstant;
  if (mode == "cached") return kOlCached;
  if (mode == "all") return kOlAll;
  return Error(EINVAL, "Unsupported value '" + mode +
                           "' for qcow2 option 'overlap-check'. Allowed are any of the following: none, constant, "
                           "cached, all");
}

}  // namespace

const char* overlap_name(uint32_t bit) {
  switch (bit) {
    case kOlMainHeader: return "qcow2_header";
    case kOlActiveL1: return "active L1 table";
    case kOlActiveL2: return "active L2 table";
    case kOlRefcountTable: return "refcount table";
    case kOlRefcountBlock: return "refcount block";
    case kOlSnapshotTable: return "snapshot table";
    case kOlInactiveL1: return "inactive L1 table";
    case kOlInactiveL2: return "inactive L2 table";
    case kOlBitmapDirectory: return "bitmap directory";
    default: return "unknown metadata";
  }
}

Result<uint32_t> take_overlap_options(Json& opts) {
  // The mode comes as `overlap-check=MODE`, or as a template inside the
  // `overlap-check` dictionary (command line `overlap-check.template=`,
  // QMP's Qcow2OverlapCheckFlags) beside per-kind booleans.
  std::optional<std::string> mode, tmpl;
  Json flags = Json::object();
  if (auto it = opts.find("overlap-check"); it != opts.end()) {
    if (it->is_object()) {
      flags = *it;
    } else {
      auto m = take_string(opts, "overlap-check");
      VBLK_TRY(m);
      mode = *m;
    }
    opts.erase("overlap-check");
  }
  // Flattened spellings ("overlap-check.active-l2": false) join the dictionary.
  for (auto it = opts.begin(); it != opts.end();) {
    const std::string& k = it.key();
    if (k.rfind("overlap-check.", 0) == 0) {
      flags[k.substr(14)] = *it;
      it = opts.erase(it);
    } else {
      ++it;
    }
  }
  if (flags.contains("template")) {
    auto t = take_string(flags, "template");
    if (!t) return Error(EINVAL, "Invalid parameter type for 'overlap-check.template', expected: string");
    tmpl = *t;
  }
  if (mode && tmpl && *mode != *tmpl)
    return Error(EINVAL, "Conflicting values for qcow2 options 'overlap-check' ('" + *mode +
                             "') and 'overlap-check.template' ('" + *tmpl + "')");
  auto bits = mode_bits(mode ? *mode : tmpl ? *tmpl : "cached");
  VBLK_TRY(bits);
  uint32_t out = 0;
  for (int i = 0; i < kOlBits; ++i) {
    const std::string key = kKindOptions[i];
    auto v = take_bool(flags, key);
    if (!v) return Error(EINVAL, "Parameter 'overlap-check." + key + "' expects 'on' or 'off'");
    if (v->value_or(*bits & (1u << i))) out |= 1u << i;
  }
  if (!flags.empty())
    return Error(EINVAL,
                 "Block format 'qcow2' does not support the option 'overlap-check." + flags.begin().key() + "'");
  return out;
}

void ClusterSet::rebuild(const std::vector<uint64_t>& entries, uint64_t mask, uint32_t cluster_bits) {
  v_.clear();
  const uint64_t cs = uint64_t{1} << cluster_bits;
  for (uint64_t e : entries) {
    const uint64_t off = e & mask;
    if (!off) continue;
    // An unaligned table (a corrupt entry) covers two clusters.
    v_.push_back(off >> cluster_bits);
    if (off & (cs - 1)) v_.push_back((off >> cluster_bits) + 1);
  }
  sort();
}

void ClusterSet::sort() { std::sort(v_.begin(), v_.end()); }

bool ClusterSet::hits(uint64_t first, uint64_t last) const {
  auto it = std::lower_bound(v_.begin(), v_.end(), first);
  return it != v_.end() && *it <= last;
}

void RangeSet::sort() {
  std::sort(r_.begin(), r_.end());
  max_end_.resize(r_.size());
  uint64_t m = 0;
  for (size_t i = 0; i < r_.size(); ++i) max_end_[i] = m = std::max(m, r_[i].second);
}

bool RangeSet::hits(uint64_t start, uint64_t end) const {
  // The ranges starting before `end`; one of them reaches past `start` iff
  // the largest end among them does.
  auto it = std::lower_bound(r_.begin(), r_.end(), std::make_pair(end, uint64_t{0}));
  if (it == r_.begin()) return false;
  return max_end_[static_cast<size_t>(it - r_.begin()) - 1] > start;
}

}  // namespace vblk::qcow2
