// Throttle groups and their leaky buckets: see include/block/vblk/throttle.h.
#include "vblk/throttle.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>

namespace vblk {

namespace {

constexpr uint64_t kValueMax = 1000000000000000ull;  // QEMU's THROTTLE_VALUE_MAX
constexpr double kNsPerSec = 1e9;

// The buckets a request of each direction fills and is checked against.
constexpr ThrottleBucket kBucketsFor[2][4] = {{kBpsTotal, kBpsRead, kOpsTotal, kOpsRead},
                                              {kBpsTotal, kBpsWrite, kOpsTotal, kOpsWrite}};

bool is_ops(int b) { return b >= kOpsTotal; }

// "iops-read-max-length" -> bucket kOpsRead, field max_length.
enum class Field { Avg, Max, MaxLength };
struct LimitName {
  ThrottleBucket bucket;
  Field field;
};

std::optional<LimitName> decode(const std::string& name) {
  std::string rest;
  int base;
  if (name.rfind("iops-", 0) == 0) {
    base = kOpsTotal;
    rest = name.substr(5);
  } else if (name.rfind("bps-", 0) == 0) {
    base = kBpsTotal;
    rest = name.substr(4);
  } else {
    return std::nullopt;
  }
  int dir;
  if (rest.rfind("total", 0) == 0)
    dir = 0;
  else if (rest.rfind("read", 0) == 0)
    dir = 1;
  else if (rest.rfind("write", 0) == 0)
    dir = 2;
  else
    return std::nullopt;
  rest = rest.substr(dir == 0 ? 5 : dir == 1 ? 4 : 5);
  Field f;
  if (rest.empty())
    f = Field::Avg;
  else if (rest == "-max")
    f = Field::Max;
  else if (rest == "-max-length")
    f = Field::MaxLength;
  else
    return std::nullopt;
  return LimitName{static_cast<ThrottleBucket>(base + dir), f};
}

void set_limit(ThrottleLimits& l, const LimitName& n, uint64_t v) {
  auto& b = l.buckets[n.bucket];
  if (n.field == Field::Avg)
    b.avg = v;
  else if (n.field == Field::Max)
    b.max = v;
  else
    b.max_length = v;
}

// An integer (QMP's and, after vblk serve's keyval conversion, --object's).
std::optional<int64_t> int_value(const nlohmann::ordered_json& v) {
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

}  // namespace

const std::array<const char*, 19>& throttle_limit_names() {
  static const std::array<const char*, 19> kNames = {
      "iops-total", "iops-total-max", "iops-total-max-length", "iops-read", "iops-read-max", "iops-read-max-length",
      "iops-write", "iops-write-max", "iops-write-max-length", "bps-total", "bps-total-max", "bps-total-max-length",
      "bps-read",   "bps-read-max",   "bps-read-max-length",   "bps-write", "bps-write-max", "bps-write-max-length",
      "iops-size"};
  return kNames;
}

bool ThrottleLimits::enabled() const {
  for (const auto& b : buckets)
    if (b.avg) return true;
  return false;
}

Status ThrottleLimits::validate() const {
  auto both = [&](ThrottleBucket t, ThrottleBucket r, ThrottleBucket w, bool max) {
    auto v = [&](ThrottleBucket b) { return max ? buckets[b].max : buckets[b].avg; };
    return v(t) && (v(r) || v(w));
  };
  if (both(kBpsTotal, kBpsRead, kBpsWrite, false) || both(kOpsTotal, kOpsRead, kOpsWrite, false) ||
      both(kBpsTotal, kBpsRead, kBpsWrite, true) || both(kOpsTotal, kOpsRead, kOpsWrite, true))
    return Error(EINVAL, "bps/iops/max total values and read/write values cannot be used at the same time");
  if (iops_size && !buckets[kOpsTotal].avg && !buckets[kOpsRead].avg && !buckets[kOpsWrite].avg)
    return Error(EINVAL, "iops size requires an iops value to be set");
  for (const auto& b : buckets) {
    if (b.avg > kValueMax || b.max > kValueMax)
      return Error(EINVAL, "bps/iops/max values must be within [0, " + std::to_string(kValueMax) + "]");
    if (!b.max_length) return Error(EINVAL, "the burst length cannot be 0");
    if (b.max_length > 1 && !b.max) return Error(EINVAL, "burst length set without burst rate");
    if (b.max && b.max_length > kValueMax / b.max) return Error(EINVAL, "burst length too high for this burst rate");
    if (b.max && !b.avg) return Error(EINVAL, "bps_max/iops_max require corresponding bps/iops values");
    if (b.max && b.max < b.avg) return Error(EINVAL, "bps_max/iops_max cannot be lower than bps/iops");
  }
  return {};
}

Status parse_throttle_limits(const nlohmann::ordered_json& props, ThrottleLimits& out) {
  // Legacy properties first ("x-bps-total"), then the `limits` struct.
  for (const auto& [key, v] : props.items()) {
    if (key.rfind("x-", 0) != 0) continue;
    std::string name = key.substr(2);
    auto n = decode(name);
    if (!n && name != "iops-size") continue;  // unknown: the caller reports it
    auto x = int_value(v);
    if (!x) return Error(EINVAL, "Invalid parameter type for '" + key + "', expected: integer");
    if (*x < 0) return Error(EINVAL, "Property values cannot be negative");
    if (n) {
      if (n->field == Field::MaxLength && *x > UINT32_MAX)
        return Error(EINVAL, key + " value must be in the range [0, " + std::to_string(UINT32_MAX) + "]");
      set_limit(out, *n, static_cast<uint64_t>(*x));
    } else {
      out.iops_size = static_cast<uint64_t>(*x);
    }
  }
  if (props.contains("limits")) {
    const auto& l = props["limits"];
    if (!l.is_object()) return Error(EINVAL, "Invalid parameter type for 'limits', expected: object");
    for (const char* name : throttle_limit_names()) {
      if (!l.contains(name)) continue;
      auto x = int_value(l[name]);
      if (!x) return Error(EINVAL, std::string("Invalid parameter type for 'limits.") + name + "', expected: integer");
      // QEMU stores them unsigned: a negative value becomes a huge one and
      // fails the range check.
      auto u = static_cast<uint64_t>(*x);
      auto n = decode(name);
      if (n && n->field == Field::MaxLength && *x > int64_t{UINT32_MAX})
        return Error(EINVAL, std::string(name) + " value must be in the range [0, " + std::to_string(UINT32_MAX) + "]");
      if (n)
        set_limit(out, *n, u);
      else
        out.iops_size = u;
    }
    for (const auto& [key, v] : l.items()) {
      (void)v;
      bool known = false;
      for (const char* name : throttle_limit_names()) known = known || key == name;
      if (!known) return Error(EINVAL, "Parameter 'limits." + key + "' is unexpected");
    }
  }
  return out.validate();
}

void ThrottleGroup::leak(uint64_t now) {
  if (last_leak_ns_ == 0 || now < last_leak_ns_) {
    last_leak_ns_ = now;
    return;
  }
  const double delta = static_cast<double>(now - last_leak_ns_);
  last_leak_ns_ = now;
  for (int i = 0; i < kThrottleBuckets; ++i) {
    const auto& b = limits_.buckets[i];
    auto& l = levels_[i];
    l.level = std::max(l.level - static_cast<double>(b.avg) * delta / kNsPerSec, 0.0);
    if (b.max_length > 1) l.burst_level = std::max(l.burst_level - static_cast<double>(b.max) * delta / kNsPerSec, 0.0);
  }
}

// QEMU's throttle_compute_wait over the direction's buckets: the longest
// time until every bucket is back within its size.
uint64_t ThrottleGroup::wait_ns(bool write) const {
  double wait = 0;
  for (ThrottleBucket i : kBucketsFor[write]) {
    const auto& b = limits_.buckets[i];
    const auto& l = levels_[i];
    if (!b.avg) continue;
    double size, burst_size;
    if (!b.max) {
      // No burst rate: still let short bursts through, or every other
      // request would wait.
      size = static_cast<double>(b.avg) / 10;
      burst_size = 0;
    } else {
      size = static_cast<double>(b.max) * static_cast<double>(b.max_length);
      burst_size = static_cast<double>(b.max) / 10;
    }
    double extra = l.level - size;
    if (extra > 0) {
      wait = std::max(wait, extra * kNsPerSec / static_cast<double>(b.avg));
      continue;
    }
    if (b.max_length > 1) {
      extra = l.burst_level - burst_size;
      if (extra > 0) wait = std::max(wait, extra * kNsPerSec / static_cast<double>(b.max));
    }
  }
  return static_cast<uint64_t>(std::ceil(wait));
}

void ThrottleGroup::account(bool write, uint64_t bytes) {
  double units = 1.0;
  if (limits_.iops_size && bytes > limits_.iops_size)
    units = static_cast<double>(bytes) / static_cast<double>(limits_.iops_size);
  for (ThrottleBucket i : kBucketsFor[write]) {
    const double add = is_ops(i) ? units : static_cast<double>(bytes);
    levels_[i].level += add;
    if (limits_.buckets[i].max_length > 1) levels_[i].burst_level += add;
  }
}

Task<void> ThrottleGroup::intercept(bool write, uint64_t bytes) {
  if (!limits_.enabled()) co_return;
  auto turn = co_await queue_[write].scoped();
  for (;;) {
    leak(Loop::now_ns());
    const uint64_t w = wait_ns(write);
    if (w == 0) break;
    co_await loop_.sleep(std::chrono::nanoseconds(w));
  }
  account(write, bytes);
}

Status ThrottleGroups::add(const std::string& id, const ThrottleLimits& limits) {
  if (groups_.count(id))
    return Error(EEXIST, "attempt to add duplicate property '" + id + "' to object (type 'container')");
  VBLK_TRY(limits.validate());
  groups_[id] = std::make_shared<ThrottleGroup>(loop_, id, limits);
  return {};
}

std::shared_ptr<ThrottleGroup> ThrottleGroups::find(const std::string& id) const {
  auto it = groups_.find(id);
  return it == groups_.end() ? nullptr : it->second;
}

Status ThrottleGroups::remove(const std::string& id) {
  auto it = groups_.find(id);
  if (it == groups_.end()) return Error(ENOENT, "object '" + id + "' not found");
  if (it->second.use_count() > 1) return Error(EBUSY, "object '" + id + "' is in use, can not be deleted");
  groups_.erase(it);
  return {};
}

}  // namespace vblk
