// One split virtqueue (virtio 1.x, 2.7) as a device walks it: descriptor
// chains popped from the available ring, completions pushed to the used
// ring, and the two notification suppressions (flags, or EVENT_IDX).
//
// The rings live in memory the front end (and through it the guest) keeps
// writing, so every index and descriptor is read once into a local copy and
// checked before use; anything out of bounds — a head or `next` past the
// table, a chain longer than the queue (a loop), an address outside the
// memory table, a readable descriptor after a writable one, a nested or
// oversized indirect table, an available index that jumps by more than the
// queue holds — is an error, and the caller stops the device.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "vblk/result.h"
#include "vhost_user/guest_memory.h"
#include "vhost_user/protocol.h"

namespace vblk::vhost {

// A popped request: its head (to complete it with) and its buffers in
// host memory, device-readable ones first.
struct Chain {
  uint16_t head = 0;
  std::vector<std::span<uint8_t>> out;  // device-readable
  std::vector<std::span<uint8_t>> in;   // device-writable
  uint64_t out_bytes = 0;
  uint64_t in_bytes = 0;
  void clear() {
    out.clear();
    in.clear();
    out_bytes = in_bytes = 0;
  }
};

// What the two sides of a ring say, read in place (a stall report).
struct RingState {
  uint16_t avail_idx = 0;     // the driver's: requests made available
  uint16_t last_avail = 0;    // ours: popped up to here
  uint16_t used_idx = 0;      // ours: completions published
  uint16_t avail_flags = 0;   // the driver's (NO_INTERRUPT)
  uint16_t used_flags = 0;    // ours (NO_NOTIFY)
  bool event_idx = false;     // with EVENT_IDX, also:
  uint16_t used_event = 0;    //   the driver's: notify once used passes this
  uint16_t avail_event = 0;   //   ours: kick once avail passes this
  bool signalled = false;     // an interrupt was sent since start,
  uint16_t signalled_at = 0;  //   the last at this used index
};
std::string to_string(const RingState& r);

class SplitQueue {
 public:
  // Set up from SET_VRING_NUM/ADDR/BASE; start() translates the rings.
  uint32_t num = 0;
  VringAddr addr{};
  bool addr_set = false;
  uint16_t last_avail = 0;

  // Maps the rings through `mem` (front-end addresses) and reads the used
  // index the driver left; EPROTO if anything is missing, misaligned or
  // not mapped. With an inflight area (`inflight`, this queue's part of
  // it, desc_num entries long), every pop and completion is recorded there
  // first, and the requests a previous back end popped but never
  // completed are popped again, oldest first, before anything new (the
  // available index then resumes after them, whatever SET_VRING_BASE said).
  Status start(const GuestMemory& mem, bool event_idx, bool indirect, InflightQueue* inflight = nullptr);
  bool started() const { return desc_ != nullptr; }
  void stop() { desc_ = nullptr; }

  // The next chain, false when the ring is empty, an error when the driver
  // broke the rules.
  Result<bool> pop(const GuestMemory& mem, Chain& c);
  // Completes `head` with `len` bytes written to its writable buffers.
  void push(uint16_t head, uint32_t len);
  // Whether the driver wants an interrupt for what was pushed since the
  // last one (call after push; it also records this one as sent).
  bool need_notify();
  // Asks for kicks (true) or says none are needed while the device polls
  // (false). After enabling, check empty() again: a kick may have been
  // skipped in between.
  void set_notify(bool on);
  bool empty() const;
  uint16_t used_idx() const { return used_idx_; }
  // Both sides' indices and flags as they are now (started() only).
  RingState state() const;
  // Requests from a previous back end still to be popped again.
  size_t resubmits() const { return resubmit_.size() - resubmit_pos_; }

 private:
  uint16_t avail_idx() const;
  Status recover_inflight();
  Result<bool> walk(const GuestMemory& mem, uint16_t head, Chain& c);

  Desc* desc_ = nullptr;
  uint16_t* avail_ = nullptr;  // flags, idx, ring[num], used_event
  uint16_t* used_ = nullptr;   // flags, idx, then UsedElem ring[num], avail_event
  bool event_idx_ = false;
  bool indirect_ = false;
  uint16_t used_idx_ = 0;
  uint16_t signalled_used_ = 0;
  bool signalled_valid_ = false;
  InflightQueue* inflight_ = nullptr;
  uint64_t counter_ = 0;
  std::vector<uint16_t> resubmit_;  // heads, in their old pop order
  size_t resubmit_pos_ = 0;
};

}  // namespace vblk::vhost
