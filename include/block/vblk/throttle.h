// I/O throttling, QEMU's throttle-group objects and leaky buckets
// (util/throttle.c, block/throttle-groups.c), for the `throttle` filter
// driver: vblk uses it to model slow backup targets and to cap a tenant.
//
// A ThrottleGroup holds six buckets — bytes and operations, each for reads,
// writes and their total — with QEMU's semantics: a bucket fills by the
// request's units (bytes, or operations: one per request, or one per
// `iops-size` bytes when that is set), drains at `avg` units per second,
// and lets requests through while its level is within avg/10 (no burst
// rate), or within max * max-length (a burst rate `max` for `max-length`
// seconds, itself enforced by a second level that drains at `max`). A request
// that finds a bucket over its size waits until enough has drained; then its
// units are added. Reads and writes queue separately, each in arrival order
// (one at a time through the check), so a stream of small requests cannot
// overtake a large one.
//
// Several throttle nodes may share one group: the limits are for them all.
//
// Ownership: ThrottleGroups owns the groups by id; a throttle node keeps its
// group alive with a shared_ptr, which is how object-del knows it is in use.
// Thread-safety: loop thread only.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "vblk/loop.h"
#include "vblk/result.h"
#include "vblk/sync.h"
#include "vblk/task.h"

namespace vblk {

enum ThrottleBucket { kBpsTotal, kBpsRead, kBpsWrite, kOpsTotal, kOpsRead, kOpsWrite, kThrottleBuckets };

struct ThrottleLimits {
  struct Bucket {
    uint64_t avg = 0;         // units per second, 0 = unlimited
    uint64_t max = 0;         // burst rate, 0 = none
    uint64_t max_length = 1;  // seconds the burst rate may last
  };
  std::array<Bucket, kThrottleBuckets> buckets{};
  uint64_t iops_size = 0;  // bytes counted as one operation (0: every request is one)

  bool enabled() const;
  // QEMU's throttle_is_valid, with its messages.
  Status validate() const;
};

// The QMP / --object spelling: `limits` {"bps-total": N, "iops-read-max": N,
// "bps-write-max-length": N, "iops-size": N, ...} and the legacy top-level
// "x-bps-total" style properties. Returns QEMU's error text for values of
// the wrong type or range; unknown keys are left for the caller to report.
Status parse_throttle_limits(const nlohmann::ordered_json& props, ThrottleLimits& out);
// The member names of `limits`, in QEMU's ThrottleLimits order.
const std::array<const char*, 19>& throttle_limit_names();

class ThrottleGroup {
 public:
  ThrottleGroup(Loop& loop, std::string id, ThrottleLimits limits)
      : loop_(loop), id_(std::move(id)), limits_(limits), queue_{CoMutex(loop), CoMutex(loop)} {}

  const std::string& id() const { return id_; }
  const ThrottleLimits& limits() const { return limits_; }

  // Waits until a request of `bytes` may go, then accounts it.
  Task<void> intercept(bool write, uint64_t bytes);

 private:
  struct Level {
    double level = 0;        // units in the bucket
    double burst_level = 0;  // units in the burst bucket
  };
  void leak(uint64_t now);
  uint64_t wait_ns(bool write) const;
  void account(bool write, uint64_t bytes);

  Loop& loop_;
  std::string id_;
  ThrottleLimits limits_;
  std::array<Level, kThrottleBuckets> levels_{};
  uint64_t last_leak_ns_ = 0;
  CoMutex queue_[2];  // [0] reads, [1] writes: one request at a time in the check
};

// The daemon's throttle-group objects by id.
class ThrottleGroups {
 public:
  explicit ThrottleGroups(Loop& loop) : loop_(loop) {}
  // QEMU's errors for a duplicate id or invalid limits.
  Status add(const std::string& id, const ThrottleLimits& limits);
  std::shared_ptr<ThrottleGroup> find(const std::string& id) const;
  bool contains(const std::string& id) const { return groups_.count(id) != 0; }
  // EBUSY ("in use") while a throttle node holds it.
  Status remove(const std::string& id);

 private:
  Loop& loop_;
  std::map<std::string, std::shared_ptr<ThrottleGroup>> groups_;
};

}  // namespace vblk
