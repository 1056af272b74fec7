// MemNode (include/block/vblk/mem_node.h): memory as the medium, with faults,
// latency, a request record and a volatile write cache that power_cut()
// can drop.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "vblk/mem_node.h"

namespace vblk {

MemNode::MemNode(Loop& loop, Options o) : MemNode(loop, std::vector<uint8_t>(o.size), o) {}

MemNode::MemNode(Loop& loop, std::vector<uint8_t> contents) : MemNode(loop, std::move(contents), Options{}) {}

MemNode::MemNode(Loop& loop, std::vector<uint8_t> contents, Options o)
    : Node(loop, "mem"), opts_(o), volatile_(std::move(contents)), durable_(volatile_) {
  limits_ = o.limits;
  if (o.caps) {
    caps_ = *o.caps;
  } else {
    caps_.zeroes = true;
    caps_.discard = true;
    caps_.native_fua = true;
  }
  set_length(volatile_.size());
  set_format(this);
}

MemNode::~MemNode() {
  if (supply_) std::erase(supply_->nodes, this);
}

void MemNode::join(const std::shared_ptr<PowerSupply>& supply) {
  supply_ = supply;
  supply_->nodes.push_back(this);
}

Task<Status> MemNode::enter(char op, uint64_t offset, uint64_t bytes, uint32_t flags) {
  const size_t idx = ops_.size();
  if (opts_.record) ops_.push_back({op, offset, bytes, flags, Loop::now_ns(), 0});
  if (op != 'r' && op != 'c' && op != 'v' && op != 'V') {
    ++submitted_;
    if (cut_at_ && submitted_ == cut_at_ && !cut_) cut_ = power_cut(cut_mode_, cut_seed_);
    if (supply_ && ++supply_->submitted == supply_->cut_at && !supply_->cut) {
      supply_->cut = true;
      uint64_t i = 0;
      for (MemNode* n : supply_->nodes) n->cut_ = n->power_cut(supply_->mode, supply_->seed + i++);
      if (supply_->on_cut) supply_->on_cut();
    }
  }
  peak_ = std::max(peak_, ++in_flight_);
  if (opts_.concurrency) opts_.concurrency->peak = std::max(opts_.concurrency->peak, ++opts_.concurrency->now);
  if (opts_.latency_ns) {
    co_await loop().sleep(std::chrono::nanoseconds(opts_.latency_ns));
  } else if (opts_.yield) {
    co_await loop().yield();
  }
  --in_flight_;
  if (opts_.concurrency) --opts_.concurrency->now;
  if (opts_.record && idx < ops_.size()) ops_[idx].end_ns = Loop::now_ns();
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

void MemNode::check_limits(uint64_t offset, uint64_t bytes, const void* buf) {
  const BlockLimits& l = limits_;
  bool ok = offset % l.request_alignment == 0 && bytes % l.request_alignment == 0;
  if (buf) ok &= reinterpret_cast<uintptr_t>(buf) % l.buffer_alignment == 0;
  if (l.max_transfer && buf) ok &= bytes <= l.max_transfer;
  if (l.max_zeroes && !buf) ok &= bytes <= l.max_zeroes;
  if (!ok) ++limit_violations_;
}

int MemNode::count(char op, uint64_t offset, uint64_t bytes) const {
  int n = 0;
  for (const auto& o : ops_)
    if (o.op == op && o.offset < offset + bytes && offset < o.offset + o.bytes) ++n;
  return n;
}

bool MemNode::fits(uint64_t offset, uint64_t bytes) const {
  return offset <= opts_.max_size && bytes <= opts_.max_size - offset;
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
    if (p.fua)
      apply(img, p, nullptr);
    else if (mode == CutMode::Reorder)
      apply(img, p, &rng);
  }
  return img;
}

void MemNode::cut_before(uint64_t n, CutMode mode, uint64_t seed) {
  cut_at_ = n;
  cut_mode_ = mode;
  cut_seed_ = seed;
}

Task<Status> MemNode::do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) {
  check_limits(offset, buf.size(), buf.data());
  VBLK_CO_TRY(co_await enter('r', offset, buf.size(), flags));
  std::fill(buf.begin(), buf.end(), 0);
  if (offset < volatile_.size()) {
    const uint64_t n = std::min<uint64_t>(buf.size(), volatile_.size() - offset);
    std::memcpy(buf.data(), volatile_.data() + offset, n);
  }
  co_return Status{};
}

Task<Status> MemNode::do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  check_limits(offset, buf.size(), buf.data());
  VBLK_CO_TRY(co_await enter('w', offset, buf.size(), flags));
  if (!fits(offset, buf.size()) || !grow(offset + buf.size())) co_return Error(ENOSPC);
  std::memcpy(volatile_.data() + offset, buf.data(), buf.size());
  remember({'w', offset, buf.size(), std::vector<uint8_t>(buf.begin(), buf.end()), (flags & kReqFua) != 0});
  co_return Status{};
}

Task<Status> MemNode::do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  check_limits(offset, bytes, nullptr);
  VBLK_CO_TRY(co_await enter('z', offset, bytes, flags));
  if (!fits(offset, bytes) || !grow(offset + bytes)) co_return Error(ENOSPC);
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

Task<Result<BlockStatus>> MemNode::do_block_status(uint64_t offset, uint64_t bytes) {
  if (extents.empty()) co_return co_await Node::do_block_status(offset, bytes);
  for (const auto& e : extents) {
    if (offset >= e.offset + e.bytes) continue;
    if (offset < e.offset) co_return BlockStatus{.flags = kStatusData, .bytes = std::min(bytes, e.offset - offset)};
    co_return BlockStatus{.flags = e.flags, .bytes = std::min(bytes, e.offset + e.bytes - offset)};
  }
  co_return BlockStatus{.flags = kStatusData, .bytes = bytes};
}

Task<Status> MemNode::do_copy_range_to(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes,
                                       uint32_t flags) {
  ++copy_range_calls;
  if (copy_range_errno) co_return Error(copy_range_errno);
  auto* d = dynamic_cast<MemNode*>(&dst);
  if (!d) co_return Error(ENOTSUP);
  VBLK_CO_TRY(co_await enter('c', offset, bytes, flags));
  if (offset > volatile_.size() || bytes > volatile_.size() - offset) co_return Error(EINVAL);
  if (!d->fits(dst_offset, bytes) || !d->grow(dst_offset + bytes)) co_return Error(ENOSPC);
  std::memcpy(d->volatile_.data() + dst_offset, volatile_.data() + offset, bytes);
  d->remember({'w', dst_offset, bytes,
               std::vector<uint8_t>(volatile_.begin() + static_cast<long>(offset),
                                    volatile_.begin() + static_cast<long>(offset + bytes)),
               false});
  if (d->opts_.record) d->ops_.push_back({'c', dst_offset, bytes, flags, Loop::now_ns(), Loop::now_ns()});
  co_return Status{};
}

Task<Status> MemNode::write_vmstate(uint64_t pos, std::span<const uint8_t> buf) {
  if (!opts_.vmstate) co_return co_await ImageFormat::write_vmstate(pos, buf);
  VBLK_CO_TRY(co_await enter('v', pos, buf.size(), 0));
  if (!fits(pos, buf.size())) co_return Error(ENOSPC);
  if (vmstate_.size() < pos + buf.size()) vmstate_.resize(pos + buf.size());
  std::copy(buf.begin(), buf.end(), vmstate_.begin() + static_cast<long>(pos));
  co_return Status{};
}

Task<Status> MemNode::read_vmstate(uint64_t pos, std::span<uint8_t> buf, const std::string& snapshot_id) {
  if (!opts_.vmstate) co_return co_await ImageFormat::read_vmstate(pos, buf, snapshot_id);
  VBLK_CO_TRY(co_await enter('V', pos, buf.size(), 0));
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = pos + i < vmstate_.size() ? vmstate_[pos + i] : 0;
  co_return Status{};
}

}  // namespace vblk
