// MetaCache: a bounded LRU cache of qcow2 metadata tables (L2 tables or
// refcount blocks), one cluster per entry, written back lazily.
//
// Crash-safety rule (QEMU's, coarse and proven): a cache may depend on
// another, set at the moment the ordering matters. Before any dirty entry of
// a cache is written, its dependency is flushed (entries written, then the
// file flushed). Allocation makes the L2 cache depend on the refcount cache
// (a new L2 entry never reaches the disk before the refcount that makes its
// cluster allocated); freeing makes the refcount cache depend on the L2 cache
// (a refcount never drops on disk while an L2 entry there still points to the
// cluster). "Depends on flush" orders data before metadata: the file is
// flushed before the next entry is written.
//
// Concurrency: used only under the qcow2 node's metadata lock, so at most one
// coroutine is inside at a time; entries handed out are pinned (Ref) and are
// not evicted while pinned.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "vblk/buffer.h"
#include "vblk/node.h"

namespace vblk::qcow2 {

class MetaCache {
  struct Entry {
    uint64_t offset = 0;
    AlignedBuffer data;
    bool dirty = false;  // changed through set_dirty, which counts
    int pins = 0;
    MetaCache* owner = nullptr;
    uint64_t last_use = 0;
  };

 public:
  class Ref {
   public:
    Ref() = default;
    explicit Ref(Entry* e) : e_(e) { ++e_->pins; }
    Ref(Ref&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
    Ref& operator=(Ref&& o) noexcept {
      if (this != &o) {
        release();
        e_ = std::exchange(o.e_, nullptr);
      }
      return *this;
    }
    ~Ref() { release(); }
    uint8_t* data() { return e_->data.data(); }
    uint64_t offset() const { return e_->offset; }
    explicit operator bool() const { return e_ != nullptr; }
    void mark_dirty() { e_->owner->set_dirty(*e_, true); }

   private:
    void release() {
      if (e_) --e_->pins;
      e_ = nullptr;
    }
    Entry* e_ = nullptr;
  };

  MetaCache(Node& file, uint64_t table_size, size_t capacity);

  // Asked before every write-back of a table (the qcow2 overlap check); a
  // failure refuses the write, and the table stays dirty.
  using WriteCheck = std::function<Task<Status>(uint64_t offset, uint64_t size)>;
  void set_write_check(WriteCheck c) { write_check_ = std::move(c); }

  // This cache's next write waits for `dep` to be flushed first. Flushes
  // whatever would otherwise form a cycle (QEMU's qcow2_cache_set_dependency).
  Task<Status> set_dependency(MetaCache* dep);
  // The next write of this cache is preceded by a file flush.
  void depends_on_flush() { depends_on_flush_ = true; }
  void set_capacity(size_t entries) { capacity_ = entries ? entries : 1; }
  size_t capacity() const { return capacity_; }
  uint64_t table_size() const { return table_size_; }

  // The table at `offset`, read from the file on a miss.
  Task<Result<Ref>> get(uint64_t offset);
  // A zero-filled table at `offset` without reading (a newly allocated one).
  Task<Result<Ref>> get_empty(uint64_t offset);
  // Writes every dirty entry (dependency first), then flushes the file.
  Task<Status> flush();
  // Writes dirty entries without the final file flush (used as a dependency step).
  Task<Status> write_dirty();
  // Forgets the entry at offset (its cluster was freed), dirty or not.
  void discard(uint64_t offset);
  // Drops everything (after an error, or on close without writing).
  void clear();
  bool has_dirty() const { return dirty_ > 0; }

 private:
  Task<Result<Entry*>> slot_for(uint64_t offset);
  Task<Status> write_entry(Entry& e);
  void set_dirty(Entry& e, bool d) {
    if (e.dirty == d) return;
    e.dirty = d;
    d ? ++dirty_ : --dirty_;
  }

  Node& file_;
  uint64_t table_size_;
  size_t capacity_;
  Task<Status> flush_dependency();
  MetaCache* depends_ = nullptr;
  WriteCheck write_check_;
  bool depends_on_flush_ = false;
  uint64_t clock_ = 0;
  size_t dirty_ = 0;          // entries with dirty set: has_dirty() without a scan
  std::list<Entry> entries_;  // stable addresses for Ref
  std::unordered_map<uint64_t, Entry*> index_;
};

}  // namespace vblk::qcow2
