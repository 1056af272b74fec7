// copy-before-write's COW buffer (see include/copy/vblk/copy_before_write.h): the
// buffered copy a guest write makes, and the drain that writes the buffer out
// to the target.
#include <algorithm>

#include "vblk/copy_before_write.h"

namespace vblk {

namespace {
// Drain writes in flight at once: enough to keep a target busy that takes
// many requests (a throttle, NBD, RBD).
constexpr unsigned kDrainWrites = 8;
}  // namespace

Status CopyBeforeWrite::enable_buffer(const CowBufferOptions& opts) {
  // A target backed by the source is read by others directly (fleecing's
  // temporary image): old data still in the buffer is not on it yet, so
  // they would read the guest's new data through its backing file. The
  // buffer is for a target read through snapshot-access.
  if (bcs_->options().write_flags & kReqSerialising)
    return Error(EINVAL,
                 "A COW buffer cannot be used with a target backed by the source (it is read directly); "
                 "read the snapshot through snapshot-access");
  auto b = CowBuffer::create(loop(), bcs_->options().cluster_size, opts);
  VBLK_TRY(b);
  buffer_ = std::move(*b);
  buffer_->set_on_spilled([this] { drain_wake_.set(); });
  return {};
}

CowBufferStats CopyBeforeWrite::buffer_stats() const {
  CowBufferStats s = final_stats_;
  if (buffer_) s = buffer_->stats();
  s.sync_copies = sync_copies_;
  return s;
}

Task<std::optional<Status>> CopyBeforeWrite::buffered_copy(uint64_t begin, uint64_t end) {
  buffer_users_.add();
  struct Done {
    WaitGroup& wg;
    ~Done() { wg.done(); }
  } done{buffer_users_};
  // Tasks and claims on these clusters finish first: after them the bitmap
  // says exactly which clusters still hold data the target lacks.
  co_await bcs_->wait_idle(begin, end - begin);
  if (buffer_stopping_) co_return std::nullopt;
  const uint64_t cs = bcs_->options().cluster_size;
  const uint64_t dirty = bcs_->dirty_bytes(begin, end - begin);
  if (!dirty) co_return Status{};
  // Only the disk's last cluster can be shorter than cs.
  const size_t n = static_cast<size_t>((dirty + cs - 1) / cs);
  std::vector<CowBuffer::Slot> slots;
  if (!buffer_->reserve(n, slots)) co_return std::nullopt;
  // No suspension since dirty_bytes: the claim takes exactly those clusters.
  std::unique_ptr<BlockCopyClaim> claim = bcs_->claim(begin, end - begin);
  struct Piece {
    uint64_t offset, bytes;
  };
  std::vector<Piece> pieces;
  for (const auto& r : claim->ranges())
    for (uint64_t off = r.offset; off < r.offset + r.bytes; off += cs)
      pieces.push_back({off, std::min(cs, r.offset + r.bytes - off)});
  while (slots.size() > pieces.size()) {
    buffer_->unreserve(slots.back());
    slots.pop_back();
  }
  // sync=top: what the source's top layer does not allocate is not the
  // backup's (the engine skips it the same way).
  uint64_t skipped = 0;
  if (bcs_->options().skip_unallocated) {
    std::vector<Piece> keep;
    std::vector<CowBuffer::Slot> keep_slots;
    for (size_t i = 0; i < pieces.size(); ++i) {
      auto bs = co_await filtered().block_status(pieces[i].offset, pieces[i].bytes);
      if (bs && bs->bytes >= pieces[i].bytes && !(bs->flags & kStatusAllocated)) {
        buffer_->unreserve(slots[i]);
        skipped += pieces[i].bytes;
      } else {
        keep.push_back(pieces[i]);
        keep_slots.push_back(slots[i]);
      }
    }
    pieces.swap(keep);
    slots.swap(keep_slots);
  }
  Status st;
  bool spill_failed = false;
  for (size_t i = 0; i < pieces.size() && st.ok(); ++i) {
    st = co_await filtered().read(pieces[i].offset, slots[i].data(pieces[i].bytes));
    if (!st.ok()) break;
    st = co_await buffer_->commit_slot(slots[i], pieces[i].bytes);
    spill_failed = !st.ok();
  }
  if (!st.ok()) {
    // Nothing was saved and the source is unchanged: the clusters are dirty
    // again. A failed source read is the copy's error (on-cbw-error
    // decides); a failed spill write only means the buffer cannot take
    // them, so they are copied synchronously.
    for (auto& s : slots) buffer_->unreserve(s);
    bcs_->end_claim(std::move(claim), false);
    if (spill_failed) co_return std::nullopt;
    co_return st;
  }
  for (size_t i = 0; i < pieces.size(); ++i) buffer_->insert(pieces[i].offset, pieces[i].bytes, slots[i]);
  bcs_->end_claim(std::move(claim), true);
  bcs_->drop_pending(skipped);
  if (!pieces.empty()) {
    bcs_->hold_background(true);
    kick_drain();
  }
  co_return Status{};
}

void CopyBeforeWrite::kick_drain() {
  if (!buffer_ || buffer_stopping_) return;
  drain_wake_.set();
  if (drain_running_) return;
  drain_running_ = true;
  buffer_users_.add();
  spawn_detached(drain_loop());
}

Task<void> CopyBeforeWrite::drain_loop() {
  std::stop_source never;
  for (;;) {
    if (buffer_stopping_) break;
    CowBuffer::Entry* e = nullptr;
    if (!drain_paused_ && drain_error_.ok() && drain_writes_ < kDrainWrites) e = buffer_->next_to_drain();
    if (!e) {
      // Nothing to start: the loop ends when nothing is left at all and
      // comes back with the next buffered copy.
      if (buffer_->empty() && drain_writes_ == 0) break;
      drain_wake_.reset();
      co_await drain_wake_.wait();
      continue;
    }
    // The job's speed applies to the drain as to its own copy.
    if (uint64_t delay = bcs_->rate_delay_ns()) {
      co_await loop().sleep(std::chrono::nanoseconds(std::min<uint64_t>(delay, 100'000'000)), never.get_token());
      continue;
    }
    e->draining = true;
    ++drain_writes_;
    bcs_->rate_account(e->bytes);
    buffer_users_.add();
    spawn_detached(drain_one(e->offset));
  }
  drain_running_ = false;
  buffer_users_.done();
}

Task<void> CopyBeforeWrite::drain_one(uint64_t offset) {
  CowBuffer::Entry* e = buffer_->find(offset);
  Status st;
  // Spilled data comes back into a buffer of this write's own (at most
  // kDrainWrites clusters beyond the buffer's memory).
  AlignedBuffer spilled;
  std::span<const uint8_t> data = buffer_->memory_of(*e);
  if (data.empty()) {
    spilled = AlignedBuffer(e->bytes);
    auto r = co_await buffer_->read_old(offset, spilled.span());
    st = r ? *r : Status(Error(EIO, "COW buffer entry vanished"));
    data = spilled.span();
  }
  const uint64_t bytes = e->bytes;
  // e stays valid: only this write removes its entry.
  if (st.ok()) st = co_await target_->write(offset, data, bcs_->options().write_flags);
  e = buffer_->find(offset);
  if (st.ok()) {
    bcs_->add_done(bytes);
    // Snapshot readers find it on the target from now on.
    done_->set(offset, bytes);
    buffer_->remove(offset);
  } else {
    e->draining = false;
    if (drain_error_.ok()) drain_error_ = st;
  }
  --drain_writes_;
  const bool empty = buffer_->empty();
  if (empty) bcs_->hold_background(false);
  if (empty || !st.ok()) notify_drain_listener();
  drain_wake_.set();
  buffer_users_.done();
}

void CopyBeforeWrite::notify_drain_listener() {
  if (drain_listener_) drain_listener_();
}

void CopyBeforeWrite::clear_drain_error() {
  drain_error_ = Status{};
  kick_drain();
}

void CopyBeforeWrite::set_drain_paused(bool paused) {
  drain_paused_ = paused;
  if (!paused) kick_drain();
}

Task<void> CopyBeforeWrite::stop_buffer() {
  if (!buffer_) co_return;
  buffer_stopping_ = true;
  drain_wake_.set();
  co_await buffer_users_.wait();
  co_await buffer_->quiesce();
  // What it held stays in the job's total (QEMU's len counts the work a
  // cancelled job did not do), and its counters stay for query-jobs.
  // Old data dropped unwritten: the snapshot is no longer whole, and its
  // readers must get errors rather than the guest's new data.
  if (!buffer_->empty() && snapshot_error_.ok()) snapshot_error_ = Error(ECANCELED, "COW buffer dropped");
  final_stats_ = buffer_->stats();
  final_stats_.used = final_stats_.spilled = 0;  // freed; the peaks stay
  bcs_->hold_background(false);
  buffer_.reset();
}

Task<Status> CopyBeforeWrite::do_close() {
  // A filter deleted with data still buffered: the snapshot goes with it.
  co_await stop_buffer();
  co_await quiesce();
  co_return co_await FilterNode::do_close();
}

}  // namespace vblk
