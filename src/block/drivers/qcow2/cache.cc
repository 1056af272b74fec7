#include "drivers/qcow2/cache.h"

namespace vblk::qcow2 {

MetaCache::MetaCache(Node& file, uint64_t table_size, size_t capacity)
    : file_(file), table_size_(table_size), capacity_(capacity ? capacity : 1) {}

Task<Status> MetaCache::flush_dependency() {
  MetaCache* dep = depends_;
  depends_ = nullptr;
  depends_on_flush_ = false;
  auto st = co_await dep->flush();
  // Not flushed: these entries still wait for it.
  if (!st && !depends_) depends_ = dep;
  co_return st;
}

Task<Status> MetaCache::set_dependency(MetaCache* dep) {
  if (dep->depends_) VBLK_CO_TRY(co_await dep->flush_dependency());
  if (depends_ && depends_ != dep) VBLK_CO_TRY(co_await flush_dependency());
  depends_ = dep;
  co_return Status{};
}

Task<Status> MetaCache::write_entry(Entry& e) {
  if (!e.dirty) co_return Status{};
  if (depends_) {
    VBLK_CO_TRY(co_await flush_dependency());
  } else if (depends_on_flush_) {
    VBLK_CO_TRY(co_await file_.flush());
    depends_on_flush_ = false;
  }
  if (write_check_) VBLK_CO_TRY(co_await write_check_(e.offset, table_size_));
  VBLK_CO_TRY(co_await file_.write(e.offset, e.data.span()));
  set_dirty(e, false);
  co_return Status{};
}

Task<Status> MetaCache::write_dirty() {
  // Every entry is tried (QEMU's qcow2_cache_write): one that cannot be
  // written must not keep the others in memory.
  if (depends_) VBLK_CO_TRY(co_await flush_dependency());
  Status first{};
  for (auto& e : entries_) {
    auto st = co_await write_entry(e);
    if (!st && first) first = st;
  }
  co_return first;
}

Task<Status> MetaCache::flush() {
  if (depends_) VBLK_CO_TRY(co_await flush_dependency());
  VBLK_CO_TRY(co_await write_dirty());
  co_return co_await file_.flush();
}

Task<Result<MetaCache::Entry*>> MetaCache::slot_for(uint64_t offset) {
  // Reuse the least recently used unpinned entry once at capacity; an
  // all-pinned cache grows past its capacity rather than deadlock.
  if (entries_.size() >= capacity_) {
    Entry* victim = nullptr;
    for (auto& e : entries_)
      if (e.pins == 0 && (!victim || e.last_use < victim->last_use)) victim = &e;
    if (victim) {
      VBLK_CO_TRY(co_await write_entry(*victim));
      // Writing may have suspended: the victim may have been pinned meanwhile.
      if (victim->pins == 0 && !victim->dirty) {
        index_.erase(victim->offset);
        victim->offset = offset;
        index_[offset] = victim;
        co_return victim;
      }
    }
  }
  entries_.emplace_back();
  Entry* e = &entries_.back();
  e->data = AlignedBuffer(table_size_);
  e->offset = offset;
  e->owner = this;
  index_[offset] = e;
  co_return e;
}

Task<Result<MetaCache::Ref>> MetaCache::get(uint64_t offset) {
  if (auto it = index_.find(offset); it != index_.end()) {
    it->second->last_use = ++clock_;
    co_return Ref(it->second);
  }
  auto slot = co_await slot_for(offset);
  if (!slot) co_return slot.take_error();
  Entry* e = *slot;
  Ref ref(e);  // pinned while reading
  auto st = co_await file_.read(offset, e->data.span());
  if (!st) {
    index_.erase(offset);
    e->offset = UINT64_MAX;  // unusable until reused
    set_dirty(*e, false);
    co_return st.take_error();
  }
  set_dirty(*e, false);
  e->last_use = ++clock_;
  co_return ref;
}

Task<Result<MetaCache::Ref>> MetaCache::get_empty(uint64_t offset) {
  Entry* e = nullptr;
  if (auto it = index_.find(offset); it != index_.end()) {
    e = it->second;
  } else {
    auto slot = co_await slot_for(offset);
    if (!slot) co_return slot.take_error();
    e = *slot;
  }
  e->data.zero();
  set_dirty(*e, true);
  e->last_use = ++clock_;
  co_return Ref(e);
}

void MetaCache::discard(uint64_t offset) {
  auto it = index_.find(offset);
  if (it == index_.end()) return;
  set_dirty(*it->second, false);
  it->second->offset = UINT64_MAX;
  index_.erase(it);
}

void MetaCache::clear() {
  for (auto& e : entries_) set_dirty(e, false);
  index_.clear();
  entries_.remove_if([](const Entry& e) { return e.pins == 0; });
  for (auto& e : entries_) e.offset = UINT64_MAX;
}

}  // namespace vblk::qcow2
