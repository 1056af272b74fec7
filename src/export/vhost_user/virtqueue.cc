#include "vhost_user/virtqueue.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace vblk::vhost {

namespace {

// Ring words are shared with another process: read and write them once,
// with the ordering the virtio spec asks for.
uint16_t load_acquire(const uint16_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
uint16_t load_once(const uint16_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
void store_release(uint16_t* p, uint16_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
void store_once(uint16_t* p, uint16_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

Desc read_desc(const Desc* table, uint32_t i) {
  Desc d;
  std::memcpy(&d, &table[i], sizeof d);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // one copy, not re-read
  return d;
}

Error bad(const std::string& why) { return Error(EPROTO, why); }

}  // namespace

Status SplitQueue::start(const GuestMemory& mem, bool event_idx, bool indirect, InflightQueue* inflight) {
  if (num == 0 || num > kMaxQueueSize || (num & (num - 1))) return bad("invalid queue size " + std::to_string(num));
  if (!addr_set) return bad("queue addresses not set");
  if (addr.desc_user_addr % 16 || addr.avail_user_addr % 2 || addr.used_user_addr % 4)
    return bad("misaligned queue addresses");
  auto d = mem.uva(addr.desc_user_addr, uint64_t{num} * sizeof(Desc));
  auto a = mem.uva(addr.avail_user_addr, 4 + 2 * uint64_t{num} + 2);
  auto u = mem.uva(addr.used_user_addr, 4 + sizeof(UsedElem) * uint64_t{num} + 2);
  if (d.empty() || a.empty() || u.empty()) return bad("queue rings outside the memory table");
  desc_ = reinterpret_cast<Desc*>(d.data());
  avail_ = reinterpret_cast<uint16_t*>(a.data());
  used_ = reinterpret_cast<uint16_t*>(u.data());
  event_idx_ = event_idx;
  indirect_ = indirect;
  used_idx_ = load_acquire(&used_[1]);
  signalled_valid_ = false;
  inflight_ = inflight;
  resubmit_.clear();
  resubmit_pos_ = 0;
  counter_ = 0;
  if (inflight_) return recover_inflight();
  return {};
}

// libvhost-user's vu_check_queue_inflights, with every field the front end
// could have scribbled on checked.
Status SplitQueue::recover_inflight() {
  InflightQueue& f = *inflight_;
  if (f.version == 0) {  // a fresh area
    std::memset(f.desc, 0, sizeof(InflightDesc) * num);
    f.desc_num = static_cast<uint16_t>(num);
    f.used_idx = used_idx_;
    f.version = kInflightVersion;
    return {};
  }
  if (f.version != kInflightVersion || f.desc_num != num)
    return bad("inflight area of version " + std::to_string(f.version) + " for " + std::to_string(f.desc_num) +
               " descriptors");
  // Killed between publishing a completion and clearing its entry: the
  // used index moved, so that request is done.
  if (f.used_idx != used_idx_) {
    if (f.last_batch_head >= num) return bad("inflight batch head out of range");
    f.desc[f.last_batch_head].inflight = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    f.used_idx = used_idx_;
  }
  std::vector<std::pair<uint64_t, uint16_t>> pending;
  for (uint32_t i = 0; i < num; ++i)
    if (f.desc[i].inflight == 1)
      pending.push_back({f.desc[i].counter, static_cast<uint16_t>(i)});
    else if (f.desc[i].inflight != 0)
      return bad("inflight entry " + std::to_string(i) + " corrupt");
  std::sort(pending.begin(), pending.end());
  for (const auto& [counter, head] : pending) resubmit_.push_back(head);
  if (!pending.empty()) counter_ = pending.back().first + 1;
  // Everything popped before is either completed or about to be popped
  // again: new requests start after them.
  last_avail = static_cast<uint16_t>(used_idx_ + pending.size());
  return {};
}

uint16_t SplitQueue::avail_idx() const { return load_acquire(&avail_[1]); }

bool SplitQueue::empty() const { return avail_idx() == last_avail; }

Result<bool> SplitQueue::pop(const GuestMemory& mem, Chain& c) {
  if (resubmit_pos_ < resubmit_.size()) {
    // Already marked in flight, with its old counter.
    uint16_t head = resubmit_[resubmit_pos_++];
    return walk(mem, head, c);
  }
  uint16_t idx = avail_idx();
  if (idx == last_avail) return false;
  if (static_cast<uint16_t>(idx - last_avail) > num)
    return bad("available index moved from " + std::to_string(last_avail) + " to " + std::to_string(idx));
  uint16_t head = load_once(&avail_[2 + last_avail % num]);
  if (head >= num) return bad("descriptor head " + std::to_string(head) + " out of range");
  auto r = walk(mem, head, c);
  if (!r) return r;
  ++last_avail;
  if (inflight_) {
    InflightDesc& d = inflight_->desc[head];
    d.counter = counter_++;
    d.inflight = 1;
  }
  return true;
}

Result<bool> SplitQueue::walk(const GuestMemory& mem, uint16_t head, Chain& c) {
  c.clear();
  c.head = head;
  const Desc* table = desc_;
  uint32_t max = num;
  uint32_t i = head;
  uint32_t seen = 0;
  bool in_indirect = false;
  for (;;) {
    Desc d = read_desc(table, i);
    if (d.flags & kDescIndirect) {
      if (!indirect_) return bad("indirect descriptor not negotiated");
      if (in_indirect || seen > 0) return bad("indirect descriptor inside a chain");
      if (d.flags & kDescNext) return bad("indirect descriptor with a next one");
      if (d.len == 0 || d.len % sizeof(Desc) || d.len / sizeof(Desc) > kMaxQueueSize)
        return bad("indirect table of " + std::to_string(d.len) + " bytes");
      auto t = mem.gpa(d.addr, d.len);
      if (t.empty()) return bad("indirect table outside the memory table");
      if (reinterpret_cast<uintptr_t>(t.data()) % alignof(Desc)) return bad("misaligned indirect table");
      table = reinterpret_cast<const Desc*>(t.data());
      max = d.len / sizeof(Desc);
      in_indirect = true;
      i = 0;
      continue;
    }
    if (++seen > max) return bad("descriptor chain loops");
    if (d.flags & kDescWrite) {
      if (!mem.gpa_pieces(d.addr, d.len, c.in)) return bad("descriptor outside the memory table");
      c.in_bytes += d.len;
    } else {
      if (!c.in.empty()) return bad("device-readable descriptor after a writable one");
      if (!mem.gpa_pieces(d.addr, d.len, c.out)) return bad("descriptor outside the memory table");
      c.out_bytes += d.len;
    }
    if (!(d.flags & kDescNext)) break;
    i = d.next;
    if (i >= max) return bad("descriptor next " + std::to_string(i) + " out of range");
  }
  return true;
}

void SplitQueue::push(uint16_t head, uint32_t len) {
  auto* ring = reinterpret_cast<UsedElem*>(used_ + 2);
  UsedElem e{head, len};
  std::memcpy(&ring[used_idx_ % num], &e, sizeof e);
  if (inflight_) inflight_->last_batch_head = head;
  ++used_idx_;
  store_release(&used_[1], used_idx_);
  if (inflight_) {
    // In this order, so that a back end killed anywhere in between leaves
    // an area recover_inflight() reads right.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    inflight_->desc[head].inflight = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    inflight_->used_idx = used_idx_;
  }
}

bool SplitQueue::need_notify() {
  // The used index must be visible before the driver's wishes are read.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!event_idx_) return !(load_once(&avail_[0]) & kAvailNoInterrupt);
  bool valid = signalled_valid_;
  uint16_t old = signalled_used_;
  uint16_t now = used_idx_;
  signalled_valid_ = true;
  signalled_used_ = now;
  uint16_t event = load_once(&avail_[2 + num]);
  // vring_need_event: has the index passed `event` since the last interrupt?
  return !valid || static_cast<uint16_t>(now - event - 1) < static_cast<uint16_t>(now - old);
}

void SplitQueue::set_notify(bool on) {
  if (event_idx_) {
    if (on) store_once(&used_[2 + 4 * num], last_avail);  // avail_event: kick once past here
  } else {
    uint16_t f = load_once(&used_[0]);
    store_once(&used_[0], on ? f & ~kUsedNoNotify : f | kUsedNoNotify);
  }
  // The driver must see this before the device looks at the ring again.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

RingState SplitQueue::state() const {
  RingState r;
  r.avail_idx = avail_idx();
  r.last_avail = last_avail;
  r.used_idx = used_idx_;
  r.avail_flags = load_once(&avail_[0]);
  r.used_flags = load_once(&used_[0]);
  r.event_idx = event_idx_;
  if (event_idx_) {
    r.used_event = load_once(&avail_[2 + num]);
    r.avail_event = load_once(&used_[2 + 4 * num]);
  }
  r.signalled = signalled_valid_;
  r.signalled_at = signalled_used_;
  return r;
}

std::string to_string(const RingState& r) {
  std::string s = "avail idx " + std::to_string(r.avail_idx) + ", popped " + std::to_string(r.last_avail) +
                  ", used idx " + std::to_string(r.used_idx) + ", avail flags " + std::to_string(r.avail_flags) +
                  ", used flags " + std::to_string(r.used_flags);
  if (r.event_idx)
    s += ", used_event " + std::to_string(r.used_event) + ", avail_event " + std::to_string(r.avail_event);
  s += r.signalled ? ", last interrupt at used idx " + std::to_string(r.signalled_at) : ", no interrupt sent";
  return s;
}

}  // namespace vblk::vhost
