// The copy-before-write filter's snapshot API (QEMU 7.2's
// bdrv_co_preadv_snapshot, bdrv_co_snapshot_block_status and
// bdrv_co_pdiscard_snapshot over copy-before-write), through which the
// snapshot-access driver reads the frozen view for fleecing. See the
// "Fleecing" section of include/copy/vblk/copy_before_write.h.
//
// The invariant: a snapshot read of a cluster either reads the target, where
// a copy-before-write has put the old data (done bitmap), or reads the source
// while registered as a frozen read, and no guest write changes the source
// under a frozen read (the write waits in snapshot_release). A lookup and its
// registration happen without a suspension in between, so one loop needs no
// lock for them.
#include <algorithm>
#include <cerrno>

#include "vblk/copy_before_write.h"

namespace vblk {

// A snapshot read of the source in flight, living in the reader's frame.
struct CopyBeforeWrite::FrozenRead {
  uint64_t begin = 0, end = 0;
  bool linked = false;
  std::vector<std::coroutine_handle<>> waiters;  // guest writes waiting for it
};

void CopyBeforeWrite::snapshot_begin() {
  // The snapshot may read what was to be copied when it began: everything,
  // or the clusters of the `bitmap` option.
  access_.emplace(bcs_->bitmap());
  done_.emplace(bcs_->bitmap().size(), bcs_->bitmap().granularity());
}

std::optional<CopyBeforeWrite::SnapshotSpan> CopyBeforeWrite::snapshot_lock(uint64_t offset, uint64_t bytes,
                                                                            FrozenRead& fr) {
  // A broken snapshot, and clusters it never held, read as QEMU's: EACCES.
  if (!snapshot_error_.ok()) return std::nullopt;
  uint64_t end = offset + bytes;
  if (access_->next_clean(offset, end)) return std::nullopt;
  // The COW buffer holds whole clusters: one is a run of its own, and the
  // runs of the other places end where the next buffered cluster begins.
  if (buffer_) {
    if (const CowBuffer::Entry* e = buffer_->find(offset))
      return SnapshotSpan{SnapshotFrom::Buffer, std::min(end, e->offset + e->bytes) - offset};
    if (auto next = buffer_->next_entry(offset); next && *next < end) end = *next;
  }
  // The longest run from offset whose clusters all come from one place.
  const bool done = done_->get(offset);
  std::optional<uint64_t> stop = done ? done_->next_clean(offset, end) : done_->next_dirty(offset, end);
  const uint64_t run = std::min(stop.value_or(end), end) - offset;
  if (done) return SnapshotSpan{SnapshotFrom::Target, run};
  fr.begin = offset;
  fr.end = offset + run;
  fr.linked = true;
  frozen_reads_.push_back(&fr);
  return SnapshotSpan{SnapshotFrom::Source, run};
}

void CopyBeforeWrite::snapshot_unlock(FrozenRead& fr) {
  if (!fr.linked) return;
  fr.linked = false;
  frozen_reads_.erase(std::find(frozen_reads_.begin(), frozen_reads_.end(), &fr));
  for (auto h : fr.waiters) loop().post(h);
  fr.waiters.clear();
}

Task<void> CopyBeforeWrite::snapshot_release(uint64_t begin, uint64_t end, bool copied) {
  // From here reads of these clusters go to the target: the old data is there.
  if (copied) done_->set(begin, end - begin);
  // Reads that started on the source before must finish before the guest
  // write changes it (QEMU's reqlist_wait_all on frozen_read_reqs).
  struct Wait {
    FrozenRead& fr;
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) { fr.waiters.push_back(h); }
    void await_resume() const noexcept {}
  };
  for (;;) {
    auto it = std::find_if(frozen_reads_.begin(), frozen_reads_.end(),
                           [&](const FrozenRead* r) { return r->begin < end && begin < r->end; });
    if (it == frozen_reads_.end()) co_return;
    co_await Wait{**it};
  }
}

Task<Status> CopyBeforeWrite::snapshot_read(uint64_t offset, std::span<uint8_t> buf) {
  uint64_t pos = 0;
  while (pos < buf.size()) {
    FrozenRead fr;
    auto span = snapshot_lock(offset + pos, buf.size() - pos, fr);
    if (!span) co_return Error(EACCES);
    Status st;
    if (span->from == SnapshotFrom::Buffer) {
      // Buffered old data needs no freezing: nothing changes it.
      auto r = co_await buffer_->read_old(offset + pos, buf.subspan(pos, span->bytes));
      st = r ? *r : Status(Error(EIO, "COW buffer entry vanished"));
    } else {
      Node& from = span->from == SnapshotFrom::Target ? *target_ : filtered();
      st = co_await from.read(offset + pos, buf.subspan(pos, span->bytes));
    }
    snapshot_unlock(fr);
    VBLK_CO_TRY(st);
    pos += span->bytes;
  }
  co_return Status{};
}

Task<Result<BlockStatus>> CopyBeforeWrite::snapshot_block_status(uint64_t offset, uint64_t bytes) {
  FrozenRead fr;
  auto span = snapshot_lock(offset, bytes, fr);
  if (!span) co_return Error(EACCES);
  // Buffered old data is data (as the source reported it before the guest
  // wrote; the target answers for it once drained).
  if (span->from == SnapshotFrom::Buffer) co_return BlockStatus{.flags = kStatusData, .bytes = span->bytes};
  // The status of whichever child the range is read from. The target is
  // asked only where it was written, so it never answers "unallocated".
  Node& from = span->from == SnapshotFrom::Target ? *target_ : filtered();
  auto r = co_await from.block_status(offset, span->bytes);
  snapshot_unlock(fr);
  co_return r;
}

Task<Status> CopyBeforeWrite::snapshot_discard(uint64_t offset, uint64_t bytes) {
  // Only whole block-copy clusters leave the snapshot.
  const uint64_t cs = bcs_->options().cluster_size;
  const uint64_t begin = align_up(offset, cs);
  const uint64_t end = align_down(offset + bytes, cs);
  if (end <= begin) co_return Status{};
  access_->reset(begin, end - begin);
  // Nobody reads these clusters of the snapshot any more: no need to copy.
  bcs_->bitmap().reset(begin, end - begin);
  co_return co_await target_->discard(begin, end - begin);
}

}  // namespace vblk
