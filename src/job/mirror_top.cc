// The mirror job's filter (see include/job/vblk/mirror_top.h).
#include "vblk/mirror_top.h"

#include <algorithm>

#include "vblk/buffer.h"

namespace vblk {

MirrorTop::MirrorTop(Loop& loop, std::shared_ptr<Node> source, std::string driver)
    : FilterNode(loop, std::move(driver), std::move(source)), unheld_(loop), inside_(loop), reads_inside_(loop) {}

MirrorTop::~MirrorTop() = default;

PermPair MirrorTop::child_perm(const Child& c, PermPair self) const {
  PermPair p = FilterNode::child_perm(c, self);
  if (commit_) {
    p.perm &= ~kPermConsistentRead;
    p.shared |= kPermWrite;
  }
  return p;
}

void MirrorTop::attach(BlockCopyState* bcs, std::function<void()> kick) {
  bcs_ = bcs;
  kick_ = std::move(kick);
}

void MirrorTop::start_write_blocking(std::function<void(int)> on_error) {
  on_error_ = std::move(on_error);
  write_blocking_ = true;
}

void MirrorTop::detach() {
  bcs_ = nullptr;
  kick_ = {};
  on_error_ = {};
  write_blocking_ = false;
}

Task<void> MirrorTop::hold() {
  held_ = true;
  unheld_.reset();
  co_await inside_.wait();
}

Task<void> MirrorTop::drain_source() {
  hold_reads_ = true;
  co_await hold();
  co_await filtered().drain();
  hold_reads_ = false;
  release(nullptr);
}

void MirrorTop::release(std::shared_ptr<Node> dest) {
  if (dest && dest.get() != &filtered()) dest_ = std::move(dest);
  held_ = false;
  hold_reads_ = false;
  unheld_.set();
}

Task<Status> MirrorTop::do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) {
  while (held_ && hold_reads_) co_await unheld_.wait();
  reads_inside_.add();
  Status st = co_await dest().read(offset, buf, flags);
  reads_inside_.done();
  co_return st;
}

Task<void> MirrorTop::hold_all() {
  hold_reads_ = true;
  co_await hold();
  co_await reads_inside_.wait();
}

Task<Status> MirrorTop::do_flush() { co_return co_await dest().flush(); }

Task<Status> MirrorTop::do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  co_return co_await write_common(Method::Copy, offset, buf.size(), buf, flags);
}

Task<Status> MirrorTop::do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  // Zeroes the child cannot write come back here as data (FilterNode's rule).
  co_return co_await write_common(Method::Zero, offset, bytes, {}, flags | kReqNoFallback);
}

Task<Status> MirrorTop::do_discard(uint64_t offset, uint64_t bytes) {
  co_return co_await write_common(Method::Discard, offset, bytes, {}, 0);
}

Task<Status> MirrorTop::do_method(Node& n, Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf,
                                  uint32_t flags) {
  switch (m) {
    case Method::Copy: co_return co_await n.write(offset, buf, flags);
    case Method::Zero: co_return co_await n.write_zeroes(offset, bytes, flags);
    case Method::Discard: co_return co_await n.discard(offset, bytes);
  }
  co_return Status{};
}

Task<Status> MirrorTop::write_common(Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf,
                                     uint32_t flags) {
  // The job is finishing: wait until it says where writes go from now on.
  while (held_) co_await unheld_.wait();
  if (dest_) co_return co_await do_method(*dest_, m, offset, bytes, buf, flags);
  inside_.add();
  Status st;
  if (bcs_ && covering_) {
    st = co_await write_covering(m, offset, bytes, buf, flags);
  } else if (bcs_ && write_blocking_) {
    st = co_await write_blocking(m, offset, bytes, buf, flags);
  } else {
    st = co_await do_method(filtered(), m, offset, bytes, buf, flags);
    // Marked after the write (even a failed one may have changed data): a
    // copy that read the old data before is repeated.
    if (bcs_ && bytes) {
      bcs_->bitmap().set(offset, bytes);
      if (kick_) kick_();
    }
  }
  inside_.done();
  co_return st;
}

Task<void> MirrorTop::enter_range(ActiveOp& op) {
  BlockCopyState& bcs = *bcs_;
  auto overlapping = [&]() -> ActiveOp* {
    for (ActiveOp* o : active_)
      if (o->begin < op.end && op.begin < o->end) return o;
    return nullptr;
  };
  // One such write per cluster at a time, and none while the engine copies
  // there: source and target then see the same order.
  for (;;) {
    if (ActiveOp* o = overlapping()) {
      struct Wait {
        ActiveOp* o;
        bool await_ready() noexcept { return false; }
        void await_suspend(std::coroutine_handle<> h) { o->waiters.push_back(h); }
        void await_resume() noexcept {}
      };
      co_await Wait{o};
      continue;
    }
    co_await bcs.wait_idle(op.begin, op.end - op.begin);
    if (!overlapping()) break;
  }
  active_.push_back(&op);
}

void MirrorTop::leave_range(ActiveOp& op) {
  std::erase(active_, &op);
  for (auto h : op.waiters) loop().post(h);
}

void MirrorTop::clean_under_writes() {
  if (!bcs_ || !covering_) return;
  for (const ActiveOp* o : active_)
    if (o->begin < o->end) bcs_->bitmap().reset(o->begin, o->end - o->begin);
}

Task<Status> MirrorTop::write_covering(Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf,
                                       uint32_t flags) {
  BlockCopyState& bcs = *bcs_;
  const uint64_t cs = bcs.options().cluster_size;
  const uint64_t begin = align_down(offset, cs);
  const uint64_t end = std::min(align_up(offset + bytes, cs), align_up(length(), cs));
  ActiveOp op{begin, end, {}};
  co_await enter_range(op);
  std::unique_ptr<BlockCopyClaim> claim = bcs.claim(begin, end - begin);
  Status st = co_await do_method(filtered(), m, offset, bytes, buf, flags);
  bcs.end_claim(std::move(claim), false);
  // Written (even in part: the format copied the rest of each cluster up):
  // the source has its own data there now. Failed: the clusters may still
  // need the data below (clean_under_writes may have taken their bits), and
  // copying a cluster the source owns changes nothing.
  if (begin < end) {
    if (st.ok())
      bcs.bitmap().reset(begin, end - begin);
    else
      bcs.bitmap().set(begin, end - begin);
  }
  leave_range(op);
  co_return st;
}

Task<Status> MirrorTop::write_blocking(Method m, uint64_t offset, uint64_t bytes, std::span<const uint8_t> buf,
                                       uint32_t flags) {
  BlockCopyState& bcs = *bcs_;
  const uint64_t cs = bcs.options().cluster_size;
  const uint64_t len = length();
  const uint64_t begin = align_down(offset, cs);
  const uint64_t end = std::min(align_up(offset + bytes, cs), align_up(len, cs));
  ActiveOp op{begin, end, {}};
  co_await enter_range(op);
  // The dirty clusters are taken from the engine (no task starts on them)
  // until the target has the data.
  std::unique_ptr<BlockCopyClaim> claim = bcs.claim(begin, end - begin);
  auto claimed = [&](uint64_t pos) {
    for (const auto& r : claim->ranges())
      if (pos >= r.offset && pos < r.offset + r.bytes) return true;
    return false;
  };
  Status st = co_await do_method(filtered(), m, offset, bytes, buf, flags);
  if (!st.ok()) {
    bcs.end_claim(std::move(claim), false);
    bcs.bitmap().set(offset, bytes);
  } else {
    // A dirty cluster the write covers only in part stays dirty (the
    // background copy takes it whole); the rest goes to the target now.
    uint64_t t_off = offset, t_end = offset + bytes;
    if (t_off % cs && claimed(t_off)) t_off = std::min(align_up(t_off, cs), t_end);
    if (t_end % cs && t_end != len && t_end > t_off && claimed(t_end - 1))
      t_end = std::max(align_down(t_end, cs), t_off);
    Status tst;
    const uint64_t n = t_end - t_off;
    if (n) {
      active_in_flight_ += n;
      std::span<const uint8_t> part;
      if (m == Method::Copy) part = buf.subspan(t_off - offset, n);
      // The target writes zeroes its own way if it must.
      tst = co_await do_method(bcs.target(), m, t_off, n, part, flags & ~kReqNoFallback);
      active_in_flight_ -= n;
    }
    bcs.end_claim(std::move(claim), false);
    if (tst.ok()) {
      active_done_ += n;
      const uint64_t cb = align_up(t_off, cs);
      const uint64_t ce = t_end == len ? t_end : align_down(t_end, cs);
      if (cb < ce) bcs.bitmap().reset(cb, ce - cb);
    } else {
      bcs.bitmap().set(begin, end - begin);
      if (kick_) kick_();
      if (on_error_) on_error_(tst.error().code);
    }
  }
  leave_range(op);
  co_return st;
}

}  // namespace vblk
