// CowBuffer: where copy-before-write keeps the old data of clusters a guest
// overwrote before the backup copied them, so the guest write need not wait
// for a slow target (SPEC part 5; the design of the 2019 "buffer and delay
// backup COW write operation" series, with a bound and a spill file).
//
// The buffer holds whole clusters (the block-copy cluster size; the last one
// of the disk may be shorter), each in one slot: a piece of memory while
// there is room for memory_size bytes, else a slot of the spill file while
// there is room for spill_size bytes. reserve() hands out the memory a slot
// is filled through (for a spill slot a staging piece, written to the file by
// commit_slot and then given back), insert() makes a filled slot an entry,
// and entries leave in order of age (oldest()/next_to_drain()) once they are
// on the target (remove()).
//
// While memory is more than three quarters full, the youngest memory entries
// move to the spill file in the background (spill-out): the oldest are the
// next to drain and stay in memory, and a guest write finds memory free, so
// it waits only for its read, not for a spill write too.
//
// The spill file is created in spill_dir with O_TMPFILE (or created and
// unlinked at once where the filesystem has no O_TMPFILE): it has no name,
// so a crash leaves nothing behind. By default it is opened with O_DIRECT
// where the filesystem allows, so spilled data costs no page cache and the
// memory bound is the real one. With spill_direct off it goes through the
// page cache instead: a spill write is a copy into the kernel's memory,
// written back when the kernel needs the memory or its dirty data expires,
// and a slot the drain has emptied is punched out of the file, so data
// drained before that is never written to the disk at all (the guest's disk
// does not share its bandwidth with the spill). The process's memory bound
// still holds; the page cache is the kernel's, reclaimable by writeback.
//
// Ownership: the buffer owns its memory and the spill file; entries are
// addressed by disk offset. Thread-safety: one loop.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "vblk/buffer.h"
#include "vblk/loop.h"
#include "vblk/result.h"
#include "vblk/sync.h"
#include "vblk/task.h"

namespace vblk {

struct CowBufferOptions {
  uint64_t memory_size = 0;  // bytes of old data in memory
  std::string spill_dir;     // "" = /var/tmp
  uint64_t spill_size = 0;   // bytes of old data in the spill file (0 = none)
  bool spill_direct = true;  // O_DIRECT spill file (false: through the page cache)
};

// Counters for query-jobs' x-cow-buffer (bytes).
struct CowBufferStats {
  uint64_t size = 0, used = 0, used_peak = 0;
  uint64_t spill_size = 0, spilled = 0, spilled_peak = 0;
  uint64_t sync_copies = 0;  // filled in by copy-before-write
};

class CowBuffer {
 public:
  // One cluster's place. data() is where the old data is read into.
  struct Slot {
    uint8_t* mem = nullptr;  // memory piece, or the staging piece of a spill slot
    int64_t spill = -1;      // spill slot index, -1 for memory
    std::span<uint8_t> data(uint64_t bytes) const { return {mem, static_cast<size_t>(bytes)}; }
  };
  struct Entry {
    uint64_t offset = 0, bytes = 0;
    Slot slot;  // for a spilled entry, mem is null
    uint64_t seq = 0;
    bool draining = false;  // a drain write of it is in flight
    bool spilling = false;  // a spill-out write of it is in flight
  };

  static Result<std::unique_ptr<CowBuffer>> create(Loop& loop, uint64_t cluster_size, CowBufferOptions opts);
  ~CowBuffer();
  CowBuffer(const CowBuffer&) = delete;
  CowBuffer& operator=(const CowBuffer&) = delete;

  uint64_t cluster_size() const { return cs_; }

  // n slots, all or none: memory first, then spill (false: both full).
  bool reserve(size_t n, std::vector<Slot>& out);
  // Gives back a slot that was never inserted (its read failed).
  void unreserve(const Slot& s);
  // A spill slot's staging data goes to the file (the staging piece is then
  // given back). A memory slot needs nothing.
  Task<Status> commit_slot(Slot& s, uint64_t bytes);
  void insert(uint64_t offset, uint64_t bytes, const Slot& s);
  // Called when a spill-out write ends: the entry can be drained again.
  void set_on_spilled(std::function<void()> fn) { on_spilled_ = std::move(fn); }
  // Waits for spill-out writes (before the buffer is destroyed).
  Task<void> quiesce();
  // A failed spill-out write (the entry stays in memory; spill-out stops).
  const Status& spill_error() const { return spill_error_; }

  // The oldest entry no drain write is busy with (null if none).
  Entry* next_to_drain();
  // The entry's data where it is already in memory (empty if spilled;
  // read_old() reads spilled data).
  std::span<const uint8_t> memory_of(const Entry& e) const;
  void remove(uint64_t offset);
  // Old data for a snapshot reader: fills dst with [offset, offset+dst.size())
  // (inside one cluster) from the entry holding it; nullopt when no entry
  // does. A spilled entry's slot stays reserved until the read is done even
  // if the entry is drained meanwhile.
  Task<std::optional<Status>> read_old(uint64_t offset, std::span<uint8_t> dst);
  // The entry holding the cluster at offset (null if none).
  Entry* find(uint64_t offset);
  // Where the first entry at or after offset begins (nullopt if none).
  std::optional<uint64_t> next_entry(uint64_t offset) const;

  bool empty() const { return entries_.empty(); }
  size_t entries() const { return entries_.size(); }
  uint64_t bytes() const { return bytes_; }
  CowBufferStats stats() const;

 private:
  CowBuffer(Loop& loop, uint64_t cs, CowBufferOptions opts);
  uint8_t* take_piece();
  void give_piece(uint8_t* p);
  // A staging piece (null when kMaxStaging are lent out).
  uint8_t* take_staging();
  void give_staging(uint8_t* p);
  int64_t take_spill_slot();
  void free_spill_slot(int64_t idx);
  // One slot of the spill file in or out (whole pieces with O_DIRECT); a
  // failed write stops further spilling (spill_error_).
  Task<Status> spill_io(bool write, int64_t idx, uint8_t* buf, uint64_t bytes);
  void maybe_spill_out();
  Task<void> spill_out(uint64_t offset, int64_t idx);

  Loop& loop_;
  uint64_t cs_;
  CowBufferOptions opts_;
  int spill_fd_ = -1;
  bool spill_direct_ = false;
  uint64_t mem_slots_ = 0, spill_slots_ = 0;  // capacity
  uint64_t mem_used_ = 0, spill_used_ = 0;    // slots in use
  uint64_t mem_peak_ = 0, spill_peak_ = 0;
  uint64_t spill_next_ = 0;  // never-used spill slots start here
  std::vector<int64_t> spill_free_;
  std::vector<AlignedBuffer> slabs_;
  std::vector<uint8_t*> free_pieces_;
  uint64_t pieces_made_ = 0;
  uint64_t staging_out_ = 0;                 // staging pieces lent out
  std::map<uint64_t, Entry> entries_;        // by offset
  std::map<uint64_t, uint64_t> by_age_;      // seq -> offset
  std::map<uint64_t, uint64_t> mem_by_age_;  // seq -> offset, entries in memory
  uint64_t seq_ = 0;
  uint64_t bytes_ = 0;
  unsigned spill_outs_ = 0;  // spill-out writes in flight
  Status spill_error_;
  WaitGroup busy_;  // spill-out writes and spill reads
  std::function<void()> on_spilled_;
  std::map<int64_t, unsigned> slot_readers_;  // spill slots being read by read_old
  std::vector<int64_t> freed_while_read_;
};

}  // namespace vblk
