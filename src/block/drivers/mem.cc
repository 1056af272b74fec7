// MemNode (include/vblk/mem_node.h): memory as the medium, with faults,
// latency, a request record and a volatile write cache that power_cut()
// can drop.
#include "vblk/mem_node.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace vblk {

MemNode::MemNode(Loop& loop, Options o) : MemNode(loop, std::vector<uint8_t>(o.size), o) {}

MemNode::MemNode(Loop& loop, std::vector<uint8_t> contents) : MemNode(loop, std::move(contents), Options{}) {}

MemNode::MemNode(Loop& loop, std::vector<uint8_t> contents, Options o)
    : Node(loop, "mem"), opts_(o), volatile_(std::move(contents)), durable_(volatile_) {
  limits_ = o.limits;
  caps_.zeroes = true;
  caps_.discard = true;
  caps_.native_fua = true;
  set_length(volatile_.size());
}

MemNode::~MemNode() {
  if (supply_) std::erase(supply_->nodes, this);
}

void MemNode::join(const std::shared_ptr<PowerSupply>& supply) {
  supply_ = supply;
  supply_->nodes.push_back(this);
}

Task<Status> MemNode::enter(char op, uint64_t offset, uint64_t bytes, uint32_t flags) {
  if (opts_.record) ops_.push_back({op, offset, bytes, flags});
  if (op != 'r') {
    ++submitted_;
    if (cut_at_ && submitted_ == cut_at_ && !cut_) cut_ = power_cut(cut_mode_, cut_seed_);
    if (supply_ && ++supply_->submitted == supply_->cut_at && !supply_->cut) {
      supply_->cut = true;
      uint64_t i = 0;
      for (MemNode* n : supply_->nodes) n->cut_ = n->power_cut(supply_->mode, supply_->seed + i++);
      if (supply_->on_cut) supply_->on_cut();
    }
  }
  if (opts_.latency_ns) {
    co_await loop().sleep(std::chrono::nanoseconds(opts_.latency_ns));
  } else if (opts_.yield) {
    co_await loop().yield();
  }
  if (cut_) co_return Error(EIO);
  for (size_t i = 0; i < faults.size(); ++i) {
    const Fault f = faults[i];
    if (f.op == op && f.offset < offset + std::max<uint64_t>(bytes, 1) && offset < f.offset + f.bytes) {
      if (f.once) faults.erase(faults.begin() + static_cast<long>(i));
      co_return Error(f.err);
    }
  }
  co_return Status{};
}

bool MemNode::grow(uint64_t end) {
  if (end > opts_.max_size) return false;
  if (end > volatile_.size()) {
    volatile_.resize(end);
    set_length(end);
  }
  return true;
}

void MemNode::remember(Pending p) {
  if (p.fua) apply(durable_, p, nullptr);
  pending_.push_back(std::move(p));
}

void MemNode::apply(std::vector<uint8_t>& img, const Pending& p, std::mt19937_64* pick) {
  if (p.op == 't') {
    if (!pick || (*pick)() & 1) img.resize(p.offset);
    return;
  }
  // Sector by sector: each lands whole or not at all.
  uint64_t pos = p.offset;
  const uint64_t end = p.offset + p.bytes;
  while (pos < end) {
    const uint64_t next = std::min(end, (pos / kSector + 1) * kSector);
    if (!pick || (*pick)() & 1) {
      if (img.size() < next) img.resize(next);
      if (p.op == 'w') {
        std::memcpy(img.data() + pos, p.data.data() + (pos - p.offset), next - pos);
      } else {
        std::memset(img.data() + pos, 0, next - pos);
      }
    }
    pos = next;
  }
}

std::vector<uint8_t> MemNode::power_cut(CutMode mode, uint64_t seed) const {
  std::vector<uint8_t> img = durable_;
  std::mt19937_64 rng(seed);
  for (const Pending& p : pending_) {
    // FUA writes are on the medium already, but a later one of a sector
    // must still win over an earlier unflushed write picked here: replay
    // in order.
    if (p.fua) apply(img, p, nullptr);
    else if (mode == CutMode::Reorder) apply(img, p, &rng);
  }
  return img;
}

void MemNode::cut_before(uint64_t n, CutMode mode, uint64_t seed) {
  cut_at_ = n;
  cut_mode_ = mode;
  cut_seed_ = seed;
}

Task<Status> MemNode::do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) {
  VBLK_CO_TRY(co_await enter('r', offset, buf.size(), flags));
  std::fill(buf.begin(), buf.end(), 0);
  if (offset < volatile_.size()) {
    const uint64_t n = std::min<uint64_t>(buf.size(), volatile_.size() - offset);
    std::memcpy(buf.data(), volatile_.data() + offset, n);
  }
  co_return Status{};
}

Task<Status> MemNode::do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  VBLK_CO_TRY(co_await enter('w', offset, buf.size(), flags));
  if (offset > opts_.max_size || !grow(offset + buf.size())) co_return Error(ENOSPC);
  std::memcpy(volatile_.data() + offset, buf.data(), buf.size());
  remember({'w', offset, buf.size(), std::vector<uint8_t>(buf.begin(), buf.end()), (flags & kReqFua) != 0});
  co_return Status{};
}

Task<Status> MemNode::do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  VBLK_CO_TRY(co_await enter('z', offset, bytes, flags));
  if (offset > opts_.max_size || !grow(offset + bytes)) co_return Error(ENOSPC);
  std::memset(volatile_.data() + offset, 0, bytes);
  remember({'z', offset, bytes, {}, (flags & kReqFua) != 0});
  co_return Status{};
}

Task<Status> MemNode::do_discard(uint64_t offset, uint64_t bytes) {
  VBLK_CO_TRY(co_await enter('d', offset, bytes, 0));
  if (offset >= volatile_.size()) co_return Status{};
  bytes = std::min<uint64_t>(bytes, volatile_.size() - offset);
  std::memset(volatile_.data() + offset, 0, bytes);
  remember({'z', offset, bytes, {}, false});
  co_return Status{};
}

Task<Status> MemNode::do_flush() {
  // What completed before the flush was issued is what it makes durable
  // (counted from the first write ever: flushes overlap, and one issued
  // earlier may complete first and take its part off pending_).
  const uint64_t covered = flushed_ + pending_.size();
  VBLK_CO_TRY(co_await enter('f', 0, 0, 0));
  const size_t n = covered > flushed_ ? static_cast<size_t>(covered - flushed_) : 0;
  // In order, FUA writes again too: an earlier write of their sector must
  // not land over them.
  for (size_t i = 0; i < n; ++i) apply(durable_, pending_[i], nullptr);
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<long>(n));
  flushed_ += n;
  co_return Status{};
}

Task<Status> MemNode::do_truncate(uint64_t length, bool) {
  VBLK_CO_TRY(co_await enter('t', length, 0, 0));
  if (length > opts_.max_size) co_return Error(ENOSPC);
  volatile_.resize(length);
  set_length(length);
  remember({'t', length, 0, {}, false});
  co_return Status{};
}

}  // namespace vblk
