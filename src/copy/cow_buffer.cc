// The COW buffer's store (see include/copy/vblk/cow_buffer.h): cluster pieces cut
// from huge-page slabs, a spill file without a name, entries by offset and by
// age.
#include "vblk/cow_buffer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace vblk {

namespace {
// Staging pieces lent out at once (spill fills and spill reads in flight):
// memory beyond memory_size, so it is small and fixed; past it a spill read
// uses a buffer of its own and a spill fill is refused (synchronous copy).
constexpr uint64_t kMaxStaging = 32;
// Spill-out writes in flight at once.
constexpr unsigned kSpillOuts = 4;

Result<int> open_spill_file(const std::string& dir, bool want_direct, bool& direct) {
  // O_TMPFILE: the file never has a name. O_DIRECT where asked for and the
  // filesystem takes it (tmpfs does not).
  for (int flags : {O_TMPFILE | O_RDWR | O_DIRECT, O_TMPFILE | O_RDWR}) {
    if ((flags & O_DIRECT) && !want_direct) continue;
    int fd = ::open(dir.c_str(), flags | O_CLOEXEC, 0600);
    if (fd >= 0) {
      direct = flags & O_DIRECT;
      return fd;
    }
    if (errno == ENOENT || errno == ENOTDIR || errno == EACCES || errno == EROFS)
      return Error(errno, "Could not create the COW spill file in '" + dir + "': " + std::strerror(errno));
  }
  // No O_TMPFILE here: create a file and unlink it at once.
  std::string path = dir + "/vblk-cow-spill-XXXXXX";
  int fd = ::mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) return Error(errno, "Could not create the COW spill file in '" + dir + "': " + std::strerror(errno));
  ::unlink(path.c_str());
  direct = false;
  return fd;
}
}  // namespace

CowBuffer::CowBuffer(Loop& loop, uint64_t cs, CowBufferOptions opts)
    : loop_(loop), cs_(cs), opts_(std::move(opts)), busy_(loop) {
  mem_slots_ = opts_.memory_size / cs_;
  spill_slots_ = opts_.spill_size / cs_;
}

Result<std::unique_ptr<CowBuffer>> CowBuffer::create(Loop& loop, uint64_t cluster_size, CowBufferOptions opts) {
  if (opts.memory_size < cluster_size)
    return Error(EINVAL,
                 "cow-buffer-size must be at least the backup cluster size (" + std::to_string(cluster_size) + ")");
  if (opts.spill_size && opts.spill_size < cluster_size)
    return Error(EINVAL,
                 "cow-spill-size must be 0 or at least the backup cluster size (" + std::to_string(cluster_size) + ")");
  // The buffer is memory this process will touch: more than the host has
  // is a mistake, refused rather than found out by the OOM killer.
  const uint64_t phys = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (phys && opts.memory_size > phys)
    return Error(EINVAL, "cow-buffer-size (" + std::to_string(opts.memory_size) + ") exceeds the host's memory (" +
                             std::to_string(phys) + ")");
  // Whole clusters: a size that is not would silently hold less.
  if (opts.memory_size % cluster_size)
    return Error(
        EINVAL, "cow-buffer-size must be a multiple of the backup cluster size (" + std::to_string(cluster_size) + ")");
  if (opts.spill_size % cluster_size)
    return Error(EINVAL,
                 "cow-spill-size must be a multiple of the backup cluster size (" + std::to_string(cluster_size) + ")");
  std::unique_ptr<CowBuffer> b(new CowBuffer(loop, cluster_size, opts));
  if (b->spill_slots_) {
    std::string dir = opts.spill_dir.empty() ? std::string("/var/tmp") : opts.spill_dir;
    auto fd = open_spill_file(dir, opts.spill_direct, b->spill_direct_);
    VBLK_TRY(fd);
    b->spill_fd_ = *fd;
  }
  return b;
}

CowBuffer::~CowBuffer() {
  if (spill_outs_) {
    std::fprintf(stderr, "vblk: internal error: COW buffer destroyed with spill writes running\n");
    std::abort();
  }
  if (spill_fd_ >= 0) ::close(spill_fd_);
}

Task<void> CowBuffer::quiesce() { co_await busy_.wait(); }

Task<Status> CowBuffer::spill_io(bool write, int64_t idx, uint8_t* buf, uint64_t bytes) {
  // O_DIRECT moves whole pieces (a short last cluster is padded; the pad is
  // never read back as data).
  const uint64_t len = spill_direct_ ? cs_ : bytes;
  const uint64_t off = static_cast<uint64_t>(idx) * cs_;
  // Two statements: GCC miscompiles co_await inside a conditional expression.
  long r;
  if (write) {
    r = co_await loop_.pwrite(spill_fd_, buf, len, off);
  } else {
    r = co_await loop_.pread(spill_fd_, buf, len, off);
  }
  if (r >= 0 && static_cast<uint64_t>(r) < (write ? len : bytes)) r = -EIO;
  if (r >= 0) co_return Status{};
  if (!write) co_return Error(static_cast<int>(-r), "COW spill file read failed");
  if (spill_error_.ok()) spill_error_ = Error(static_cast<int>(-r), "COW spill file write failed");
  co_return spill_error_;
}

int64_t CowBuffer::take_spill_slot() {
  if (!spill_free_.empty()) {
    int64_t idx = spill_free_.back();
    spill_free_.pop_back();
    return idx;
  }
  return static_cast<int64_t>(spill_next_++);
}

void CowBuffer::free_spill_slot(int64_t idx) {
  if (slot_readers_.count(idx)) {
    freed_while_read_.push_back(idx);  // given back when its reader is done
  } else {
    // Through the page cache, an emptied slot's dirty pages would still be
    // written back; punched out, they are dropped (the disk never sees data
    // that was drained in time). Advisory: a failure only costs the write.
    if (!spill_direct_)
      ::fallocate(spill_fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  static_cast<off_t>(idx) * static_cast<off_t>(cs_), static_cast<off_t>(cs_));
    spill_free_.push_back(idx);
    --spill_used_;
  }
}

Task<std::optional<Status>> CowBuffer::read_old(uint64_t offset, std::span<uint8_t> dst) {
  Entry* e = find(offset);
  if (!e) co_return std::nullopt;
  const uint64_t in = offset - e->offset;
  if (in + dst.size() > e->bytes) co_return Status(Error(EINVAL, "read across COW buffer entries"));
  if (e->slot.mem) {
    // In memory (also while a spill-out write of it runs).
    std::memcpy(dst.data(), e->slot.mem + in, dst.size());
    co_return Status{};
  }
  // The slot stays reserved while it is read, even if the entry is
  // drained meanwhile (free_spill_slot defers it).
  const int64_t idx = e->slot.spill;
  ++slot_readers_[idx];
  busy_.add();
  AlignedBuffer own;
  uint8_t* staging = take_staging();
  if (!staging) {
    own = AlignedBuffer(cs_);
    staging = own.data();
  }
  Status st = co_await spill_io(false, idx, staging, in + dst.size());
  if (st.ok()) std::memcpy(dst.data(), staging + in, dst.size());
  if (!own.data()) give_staging(staging);
  if (--slot_readers_[idx] == 0) {
    slot_readers_.erase(idx);
    if (auto it = std::find(freed_while_read_.begin(), freed_while_read_.end(), idx); it != freed_while_read_.end()) {
      freed_while_read_.erase(it);
      free_spill_slot(idx);
    }
  }
  busy_.done();
  co_return st;
}

void CowBuffer::maybe_spill_out() {
  while (spill_error_.ok() && spill_outs_ < kSpillOuts && mem_used_ * 4 > mem_slots_ * 3 &&
         spill_used_ < spill_slots_) {
    // The youngest entry in memory that nothing else is writing out.
    Entry* pick = nullptr;
    for (auto it = mem_by_age_.rbegin(); it != mem_by_age_.rend(); ++it) {
      Entry& e = entries_.at(it->second);
      if (!e.draining && !e.spilling) {
        pick = &e;
        break;
      }
    }
    if (!pick) return;
    pick->spilling = true;
    ++spill_outs_;
    ++spill_used_;
    spill_peak_ = std::max(spill_peak_, spill_used_);
    busy_.add();
    spawn_detached(spill_out(pick->offset, take_spill_slot()));
  }
}

Task<void> CowBuffer::spill_out(uint64_t offset, int64_t idx) {
  Entry* e = find(offset);
  Status st = co_await spill_io(true, idx, e->slot.mem, e->bytes);
  // Only the drain removes entries, and it leaves spilling ones alone.
  e = find(offset);
  e->spilling = false;
  --spill_outs_;
  if (!st.ok()) {
    free_spill_slot(idx);
  } else {
    give_piece(e->slot.mem);
    --mem_used_;
    mem_by_age_.erase(e->seq);
    e->slot.mem = nullptr;
    e->slot.spill = idx;
    maybe_spill_out();
  }
  if (on_spilled_) on_spilled_();
  busy_.done();
}

uint8_t* CowBuffer::take_piece() {
  if (free_pieces_.empty()) {
    constexpr uint64_t kSlab = 2 << 20;
    // Slabs of 2 MiB, but no more than the buffer can hold (a 64 KiB buffer
    // has no use for 2 MiB).
    const uint64_t want = std::min<uint64_t>(kSlab, (mem_slots_ + kMaxStaging - pieces_made_) * cs_);
    const uint64_t slab = std::max(cs_, want - want % cs_);
    slabs_.push_back(slab >= kSlab ? AlignedBuffer::huge(slab) : AlignedBuffer(slab));
    uint8_t* base = slabs_.back().data();
    for (uint64_t off = 0; off + cs_ <= slab; off += cs_) free_pieces_.push_back(base + off);
    pieces_made_ += slab / cs_;
  }
  uint8_t* p = free_pieces_.back();
  free_pieces_.pop_back();
  return p;
}

void CowBuffer::give_piece(uint8_t* p) { free_pieces_.push_back(p); }

bool CowBuffer::reserve(size_t n, std::vector<Slot>& out) {
  const uint64_t mem_free = mem_slots_ - mem_used_;
  // After a spill write failed, the spill file takes nothing more.
  const uint64_t spill_free = spill_error_.ok() ? spill_slots_ - spill_used_ : 0;
  const uint64_t staging_free = kMaxStaging - staging_out_;
  const uint64_t from_mem = std::min<uint64_t>(n, mem_free);
  const uint64_t from_spill = n - from_mem;
  if (from_spill > std::min(spill_free, staging_free)) return false;
  for (uint64_t i = 0; i < from_mem; ++i) out.push_back(Slot{take_piece(), -1});
  mem_used_ += from_mem;
  mem_peak_ = std::max(mem_peak_, mem_used_);
  for (uint64_t i = 0; i < from_spill; ++i) out.push_back(Slot{take_piece(), take_spill_slot()});
  staging_out_ += from_spill;
  spill_used_ += from_spill;
  spill_peak_ = std::max(spill_peak_, spill_used_);
  return true;
}

void CowBuffer::unreserve(const Slot& s) {
  if (s.mem) give_piece(s.mem);
  if (s.spill >= 0) {
    if (s.mem) --staging_out_;
    free_spill_slot(s.spill);
  } else {
    --mem_used_;
  }
}

Task<Status> CowBuffer::commit_slot(Slot& s, uint64_t bytes) {
  if (s.spill < 0) co_return Status{};
  VBLK_CO_TRY(co_await spill_io(true, s.spill, s.mem, bytes));
  give_piece(s.mem);
  --staging_out_;
  s.mem = nullptr;
  co_return Status{};
}

void CowBuffer::insert(uint64_t offset, uint64_t bytes, const Slot& s) {
  Entry e{offset, bytes, s, ++seq_, false};
  entries_.emplace(offset, e);
  by_age_.emplace(e.seq, offset);
  if (s.spill < 0) mem_by_age_.emplace(e.seq, offset);
  bytes_ += bytes;
  maybe_spill_out();
}

CowBuffer::Entry* CowBuffer::next_to_drain() {
  for (auto& [seq, off] : by_age_) {
    Entry& e = entries_.at(off);
    if (!e.draining && !e.spilling) return &e;
  }
  return nullptr;
}

std::span<const uint8_t> CowBuffer::memory_of(const Entry& e) const {
  if (e.slot.spill >= 0) return {};
  return {e.slot.mem, static_cast<size_t>(e.bytes)};
}

void CowBuffer::remove(uint64_t offset) {
  auto it = entries_.find(offset);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  by_age_.erase(e.seq);
  mem_by_age_.erase(e.seq);
  bytes_ -= e.bytes;
  if (e.slot.spill >= 0) {
    free_spill_slot(e.slot.spill);
  } else {
    give_piece(e.slot.mem);
    --mem_used_;
  }
  entries_.erase(it);
}

CowBuffer::Entry* CowBuffer::find(uint64_t offset) {
  auto it = entries_.find(offset - offset % cs_);
  return it == entries_.end() ? nullptr : &it->second;
}

std::optional<uint64_t> CowBuffer::next_entry(uint64_t offset) const {
  auto it = entries_.lower_bound(offset);
  if (it == entries_.end()) return std::nullopt;
  return it->first;
}

uint8_t* CowBuffer::take_staging() {
  if (staging_out_ >= kMaxStaging) return nullptr;
  ++staging_out_;
  return take_piece();
}

void CowBuffer::give_staging(uint8_t* p) {
  give_piece(p);
  --staging_out_;
}

CowBufferStats CowBuffer::stats() const {
  CowBufferStats s;
  s.size = opts_.memory_size;
  s.used = mem_used_ * cs_;
  s.used_peak = mem_peak_ * cs_;
  s.spill_size = opts_.spill_size;
  s.spilled = spill_used_ * cs_;
  s.spilled_peak = spill_peak_ * cs_;
  return s;
}

}  // namespace vblk
