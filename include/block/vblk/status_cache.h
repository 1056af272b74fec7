// StatusCache: the last block-status extents a protocol node answered (QEMU's
// BdrvBlockStatusCache, extended to holes and to a few entries).
//
// Why: a protocol driver's block status can be expensive and is asked again
// and again for neighbouring offsets. The file driver answers with an
// lseek(SEEK_DATA)/lseek(SEEK_HOLE) pair, and on tmpfs each SEEK_HOLE walks
// the page cache up to the next hole (milliseconds on a fully written GiB);
// the copy engine asks once per chunk, copy-before-write once per guest
// write, map and NBD block status once per extent. The driver answers the
// whole extent up to the next data/hole boundary, the node keeps it here,
// and the next questions inside it cost nothing.
//
// What the node keeps: [begin, end) with the status flags, for answers that
// are plain (the map is the offset itself in this node, no pass-through, no
// recursion). Holes are kept only while no one outside this process may
// write the node (its users do not share write): a stale hole would read as
// zeroes where another writer put data, while a stale data extent only costs
// a copy of zeroes (QEMU's reasoning for caching data alone).
//
// Who invalidates (src/block/node.cc, the request path every change
// crosses): write (a write inside a cached data extent leaves it as it is;
// one touching a hole drops it), write-zeroes and discard (drop what they
// touch), copy offload (at the destination and at the node it really
// writes, copy_target), truncate (everything). A generation counter, moved
// by every change, keeps an answer that raced with a change out of the cache.
//
// Plain data, one loop, no allocation.
#pragma once

#include <array>
#include <cstdint>

namespace vblk {

class StatusCache {
 public:
  struct Entry {
    uint64_t begin = 0, end = 0;  // empty when begin == end
    uint32_t flags = 0;
  };
  static constexpr size_t kEntries = 4;

  // The entry holding offset, or nullptr.
  const Entry* lookup(uint64_t offset) const {
    for (const Entry& e : entries_)
      if (e.begin <= offset && offset < e.end) return &e;
    return nullptr;
  }

  // Remembers [begin, end) with flags, unless something changed the node
  // since `gen` was read (generation()).
  void fill(uint64_t gen, uint64_t begin, uint64_t end, uint32_t flags) {
    if (gen != gen_ || begin >= end) return;
    for (Entry& e : entries_) {  // an overlapping entry is replaced, not kept beside
      if (e.begin < end && begin < e.end) e = Entry{};
    }
    entries_[next_] = Entry{begin, end, flags};
    next_ = (next_ + 1) % kEntries;
    ++fills_;
  }

  // A change to [offset, offset + bytes). keep_data: a plain write, after
  // which a data extent is still data.
  void invalidate(uint64_t offset, uint64_t bytes, bool keep_data, uint32_t data_flag) {
    ++gen_;
    const uint64_t end = offset + bytes < offset ? UINT64_MAX : offset + bytes;
    for (Entry& e : entries_) {
      if (e.begin < end && offset < e.end && !(keep_data && (e.flags & data_flag))) e = Entry{};
    }
  }

  void clear() {
    ++gen_;
    entries_ = {};
  }

  uint64_t generation() const { return gen_; }
  // Answers the driver gave that went into the cache (tests count them).
  uint64_t fills() const { return fills_; }

 private:
  std::array<Entry, kEntries> entries_{};
  size_t next_ = 0;
  uint64_t gen_ = 0;
  uint64_t fills_ = 0;
};

}  // namespace vblk
