// The generic request path every node request crosses (see node.h): range and
// permission checks, alignment padding, bounce buffers, max-transfer
// splitting, FUA and write-zeroes emulation, in-flight tracking.
#include "vblk/node.h"

#include <algorithm>
#include <cstring>

#include "vblk/buffer.h"
#include "vblk/image_format.h"

namespace vblk {

namespace {
// Bounce and zero buffers are capped so a huge request does not allocate its
// whole size at once.
constexpr uint64_t kBounceChunk = 1 << 20;
// write() from zeroes_by_writing: the zero buffer is no candidate for
// detect-zeroes (it would come back as the write_zeroes it emulates).
// Internal to this file, never passed to drivers.
constexpr uint32_t kReqNoDetect = 1u << 31;
}  // namespace

Node::Node(Loop& loop, std::string driver) : loop_(loop), driver_(std::move(driver)), idle_(loop) { idle_.set(); }
Node::~Node() {
  // The children lose a user: what this node needed of them (a qcow2 node's
  // write lock on its file) goes with it.
  for (auto& c : children_) {
    auto& ps = c.node->parents_;
    if (auto it = std::find(ps.begin(), ps.end(), this); it != ps.end()) ps.erase(it);
  }
  for (auto& c : children_)
    if (c.node.use_count() > 1) (void)c.node->refresh_perms();
}

std::string Node::filename() const {
  if (Node* f = file_child()) return f->filename();
  return {};
}

void Node::replace_child(const std::string& role, std::shared_ptr<Node> n) {
  auto it = std::find_if(children_.begin(), children_.end(), [&](const Child& c) { return c.role == role; });
  std::shared_ptr<Node> old;
  if (it != children_.end()) {
    old = std::move(it->node);
    std::erase(old->parents_, this);
    if (n) {
      it->node = n;
    } else {
      children_.erase(it);
    }
  } else if (n) {
    children_.push_back({role, n});
  }
  if (n) n->parents_.push_back(this);
  // The old child no longer needs what this node asked of it.
  if (old) (void)old->refresh_perms();
}

void Node::set_format(ImageFormat* f) {
  format_ = f;
  if (f) f->node_ = this;
}

Status Node::attach_backing(std::shared_ptr<Node> b) {
  if (!caps_.supports_backing) return Error(EINVAL, "The overlay does not support backing images");
  Node* raw = b.get();
  replace_child("backing", std::move(b));
  if (format_) format_->backing_changed(raw);
  return refresh_perms();
}

Task<Status> Node::reopen_read_only() {
  if (read_only_) co_return Status{};
  co_await drain();
  if (format_) {
    VBLK_CO_TRY(co_await format_->prepare_read_only());
  } else {
    VBLK_CO_TRY(co_await flush());
  }
  read_only_ = true;
  if (Node* f = file_child(); f && !f->read_only()) {
    co_await f->drain();
    VBLK_CO_TRY(co_await f->flush());
    f->set_read_only(true);
  }
  co_return refresh_perms();
}

Node* Node::child(const std::string& role) const {
  for (const auto& c : children_)
    if (c.role == role) return c.node.get();
  return nullptr;
}

Result<uint64_t> Node::allocated_size() const {
  if (Node* f = file_child()) return f->allocated_size();
  return Error(ENOTSUP);
}

Status Node::check_range(uint64_t offset, uint64_t bytes, bool write) const {
  // QEMU's BDRV_MAX_LENGTH: nothing is addressed at or beyond it.
  constexpr uint64_t kMaxLength = 0x7fffffffc0000000ull;
  if (write && read_only_) return Error(EPERM, "Block node is read-only");
  if (offset + bytes < offset || offset + bytes > kMaxLength) return Error(EIO);
  if (!growable_ && offset + bytes > length_) return Error(EIO);
  return {};
}

// ---- in-flight tracking

Node::Tracked* Node::find_conflict(const Tracked& t) const {
  if (!t.serialising && serialising_in_flight_ == 0) return nullptr;
  for (Tracked* o = tracked_head_; o; o = o->next)
    if (o->begin < t.end && t.begin < o->end && (o->serialising || t.serialising)) return o;
  return nullptr;
}

Task<void> Node::wait_conflicts(Tracked& t) {
  while (Tracked* blocker = find_conflict(t)) {
    struct Wait {
      Tracked* b;
      bool await_ready() noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) { b->waiters.push_back(h); }
      void await_resume() noexcept {}
    };
    co_await Wait{blocker};
  }
}

void Node::link(Tracked& t) {
  t.next = tracked_head_;
  if (tracked_head_) tracked_head_->prev = &t;
  tracked_head_ = &t;
  ++in_flight_;
  if (t.serialising) ++serialising_in_flight_;
  idle_.reset();
}

void Node::untrack(Tracked& t) {
  if (t.prev)
    t.prev->next = t.next;
  else
    tracked_head_ = t.next;
  if (t.next) t.next->prev = t.prev;
  if (t.serialising) --serialising_in_flight_;
  for (auto h : t.waiters) loop_.post(h);
  if (--in_flight_ == 0) idle_.set();
}

Task<void> Node::drain() {
  while (in_flight_ > 0) co_await idle_.wait();
}

// ---- read

Task<Status> Node::read(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) {
  if (buf.empty()) co_return Status{};
  VBLK_CO_TRY(check_range(offset, buf.size(), false));
  const uint64_t align = limits_.request_alignment;
  const uint64_t begin = align_down(offset, align);
  const uint64_t end = align_up(offset + buf.size(), align);
  Tracked t{begin, end, false};
  if (find_conflict(t)) co_await wait_conflicts(t);
  link(t);
  Status st;
  if (begin == offset && end == offset + buf.size() && is_aligned(buf.data(), limits_.buffer_alignment)) {
    st = co_await read_aligned(offset, buf, flags);
  } else {
    // Unaligned offset, length or memory: read the aligned superset into a
    // bounce buffer, in bounded chunks.
    uint64_t pos = offset;
    size_t copied = 0;
    while (copied < buf.size() && st.ok()) {
      uint64_t a = align_down(pos, align);
      uint64_t want = std::min<uint64_t>(buf.size() - copied, kBounceChunk);
      uint64_t e = align_up(pos + want, align);
      AlignedBuffer bounce(e - a, std::max<size_t>(limits_.buffer_alignment, 512));
      st = co_await read_aligned(a, bounce.span(), flags);
      if (st.ok()) std::memcpy(buf.data() + copied, bounce.data() + (pos - a), want);
      copied += want;
      pos += want;
    }
  }
  untrack(t);
  co_return st;
}

Task<Status> Node::read_aligned(uint64_t offset, std::span<uint8_t> buf, uint32_t flags) {
  const uint64_t max = limits_.max_transfer ? limits_.max_transfer : buf.size();
  for (size_t done = 0; done < buf.size();) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(max, buf.size() - done));
    VBLK_CO_TRY(co_await do_read(offset + done, buf.subspan(done, n), flags));
    done += n;
  }
  co_return Status{};
}

// ---- write

Task<Status> Node::write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  if (buf.empty()) co_return Status{};
  VBLK_CO_TRY(check_range(offset, buf.size(), true));
  const bool detect = detect_zeroes_ != DetectZeroes::Off && !(flags & (kReqNoDetect | kReqCompressed));
  flags &= ~kReqNoDetect;
  if (detect && caps_.zeroes && buffer_is_zero(buf)) {
    // detect-zeroes: the whole request is zeroes (QEMU's bdrv_aligned_pwritev).
    const uint32_t zf = detect_zeroes_ == DetectZeroes::Unmap ? kReqMayUnmap : 0u;
    co_return co_await write_zeroes(offset, buf.size(), (flags & (kReqFua | kReqSurviveKill | kReqSerialising)) | zf);
  }
  flags = effective_write_flags(flags);
  const uint64_t align = limits_.request_alignment;
  const uint64_t begin = align_down(offset, align);
  const uint64_t end = align_up(offset + buf.size(), align);
  const bool aligned = begin == offset && end == offset + buf.size();
  if (flags & kReqCompressed) {
    // Only drivers that store compressed data take it; they get the request
    // as it is (no padding: a compressed unit cannot be read-modify-written).
    if (!caps_.compressed_writes) co_return Error(ENOTSUP);
    if (!aligned) co_return Error(EINVAL);
  }
  // A padded write reads and rewrites its edge blocks: it must not overlap
  // anything in flight, or it could write back stale bytes.
  Tracked t{begin, end, !aligned || (flags & kReqSerialising) != 0};
  flags &= ~kReqSerialising;
  if (find_conflict(t)) co_await wait_conflicts(t);
  link(t);
  // Before and after: a block status answered while the write runs is not
  // kept (the generation moved), one cached before is dropped after.
  status_changed(offset, buf.size(), true);
  Status st;
  if (aligned && is_aligned(buf.data(), limits_.buffer_alignment)) {
    st = co_await write_aligned(offset, buf, flags);
  } else if (aligned) {
    for (size_t copied = 0; copied < buf.size() && st.ok();) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size() - copied, kBounceChunk));
      AlignedBuffer bounce(n, std::max<size_t>(limits_.buffer_alignment, 512));
      std::memcpy(bounce.data(), buf.data() + copied, n);
      st = co_await write_aligned(offset + copied, bounce.span(), flags);
      copied += n;
    }
  } else {
    st = co_await write_padded(offset, buf, flags);
  }
  status_changed(offset, buf.size(), true);
  bitmaps_.mark(offset, buf.size());
  untrack(t);
  co_return st;
}

Task<Status> Node::write_padded(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  const uint64_t align = limits_.request_alignment;
  uint64_t pos = offset;
  size_t copied = 0;
  while (copied < buf.size()) {
    uint64_t want = std::min<uint64_t>(buf.size() - copied, kBounceChunk);
    uint64_t a = align_down(pos, align);
    uint64_t e = align_up(pos + want, align);
    AlignedBuffer bounce(e - a, std::max<size_t>(limits_.buffer_alignment, 512));
    // Fill the partial head and tail blocks from the node (past its end the
    // driver returns zeroes); one read if they are the same block.
    const bool head = a < pos;
    const bool tail = e > pos + want;
    if (head) VBLK_CO_TRY(co_await read_aligned(a, bounce.span().subspan(0, align), 0));
    if (tail && !(head && e - align == a))
      VBLK_CO_TRY(co_await read_aligned(e - align, bounce.span().subspan(e - align - a, align), 0));
    std::memcpy(bounce.data() + (pos - a), buf.data() + copied, want);
    VBLK_CO_TRY(co_await write_aligned(a, bounce.span(), flags));
    copied += want;
    pos += want;
  }
  co_return Status{};
}

Task<Status> Node::write_aligned(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  const bool emulate_fua = (flags & kReqFua) && !caps_.native_fua;
  if (emulate_fua) flags &= ~kReqFua;
  const uint64_t max = limits_.max_transfer ? limits_.max_transfer : buf.size();
  for (size_t done = 0; done < buf.size();) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(max, buf.size() - done));
    VBLK_CO_TRY(co_await do_write(offset + done, buf.subspan(done, n), flags));
    done += n;
  }
  if (growable_ && offset + buf.size() > length_) length_ = offset + buf.size();
  if (emulate_fua) VBLK_CO_TRY(co_await do_flush());
  co_return Status{};
}

// ---- write zeroes

Task<Status> Node::write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  if (bytes == 0) co_return Status{};
  VBLK_CO_TRY(check_range(offset, bytes, true));
  flags = effective_write_flags(flags);
  const bool serialising = flags & kReqSerialising;
  flags &= ~kReqSerialising;
  const uint64_t align = limits_.request_alignment;
  // Unaligned head and tail become ordinary padded writes of zeroes.
  uint64_t head_end = std::min(offset + bytes, align_up(offset, align));
  if (head_end > offset) {
    VBLK_CO_TRY(co_await zeroes_by_writing(offset, head_end - offset, flags));
  }
  uint64_t mid_end = std::max(head_end, align_down(offset + bytes, align));
  if (mid_end > head_end) {
    Tracked t{head_end, mid_end, caps_.serialise_zeroes || serialising};
    if (find_conflict(t)) co_await wait_conflicts(t);
    link(t);
    Status st;
    status_changed(head_end, mid_end - head_end, false);
    if (caps_.zeroes) {
      const uint64_t max = limits_.max_zeroes ? limits_.max_zeroes : mid_end - head_end;
      bool emulate_fua = (flags & kReqFua) && !caps_.native_fua;
      for (uint64_t pos = head_end; pos < mid_end && st.ok();) {
        uint64_t n = std::min(max, mid_end - pos);
        const uint32_t f = emulate_fua ? flags & ~kReqFua : flags;
        st = co_await do_write_zeroes(pos, n, f);
        pos += n;
      }
      if (st.ok() && growable_ && mid_end > length_) length_ = mid_end;
      if (st.ok() && emulate_fua) st = co_await do_flush();
    } else {
      st = Error(ENOTSUP);
    }
    status_changed(head_end, mid_end - head_end, false);
    // The fallback below writes zero buffers through write(), which marks.
    if (caps_.zeroes) bitmaps_.mark(head_end, mid_end - head_end);
    untrack(t);
    if (!st.ok()) {
      if (st.error().code != ENOTSUP || (flags & kReqNoFallback)) co_return st;
      VBLK_CO_TRY(co_await zeroes_by_writing(head_end, mid_end - head_end, flags));
    }
  }
  if (offset + bytes > mid_end && mid_end >= head_end) {
    VBLK_CO_TRY(co_await zeroes_by_writing(mid_end, offset + bytes - mid_end, flags));
  }
  co_return Status{};
}

Task<Status> Node::zeroes_by_writing(uint64_t offset, uint64_t bytes, uint32_t flags) {
  if (flags & kReqNoFallback) co_return Error(ENOTSUP);
  AlignedBuffer zero(std::min(bytes, kBounceChunk), std::max<size_t>(limits_.buffer_alignment, 512));
  zero.zero();
  for (uint64_t pos = offset; pos < offset + bytes;) {
    uint64_t n = std::min<uint64_t>(zero.size(), offset + bytes - pos);
    VBLK_CO_TRY(co_await write(pos, zero.span().subspan(0, n), (flags & (kReqFua | kReqSurviveKill)) | kReqNoDetect));
    pos += n;
  }
  co_return Status{};
}

// ---- discard, flush, truncate

Task<Status> Node::discard(uint64_t offset, uint64_t bytes) {
  VBLK_CO_TRY(check_range(offset, bytes, true));
  if (!caps_.discard) co_return Status{};  // discard is advisory
  // Like QEMU, a discard the driver takes marks the whole request, edges
  // included, even where only whole aligned blocks are discarded.
  bitmaps_.mark(offset, bytes);
  // Only whole aligned blocks can be discarded.
  uint64_t a = align_up(offset, limits_.request_alignment);
  uint64_t e = align_down(offset + bytes, limits_.request_alignment);
  if (e <= a) co_return Status{};
  Tracked t{a, e, caps_.serialise_zeroes};
  if (find_conflict(t)) co_await wait_conflicts(t);
  link(t);
  status_changed(a, e - a, false);
  Status st = co_await do_discard(a, e - a);
  status_changed(a, e - a, false);
  untrack(t);
  if (!st.ok() && st.error().code == ENOTSUP) co_return Status{};
  co_return st;
}

Task<Status> Node::flush() {
  // cache=unsafe (QEMU's BDRV_O_NO_FLUSH) skips only the flush to disk: a
  // node with children (a format, a filter) still writes its own state back
  // and passes the flush on, and each child decides for itself.
  if (no_flush_ && children_.empty()) co_return Status{};
  co_return co_await do_flush();
}

Task<Status> Node::truncate(uint64_t length, bool exact, Prealloc prealloc) {
  if (read_only_) co_return Error(EPERM, "Block node is read-only");
  co_await drain();
  status_cache_.clear();
  Status st;
  if (prealloc == Prealloc::Off) {
    st = co_await do_truncate(length, exact);
  } else {
    st = co_await do_truncate_prealloc(length, exact, prealloc);
  }
  status_cache_.clear();
  VBLK_CO_TRY(st);
  bitmaps_.resize(length_);
  co_return Status{};
}

Task<Status> Node::do_truncate_prealloc(uint64_t, bool, Prealloc prealloc) {
  co_return Error(ENOTSUP, std::string("Unsupported preallocation mode: ") + prealloc_name(prealloc));
}

std::optional<Prealloc> parse_prealloc(const std::string& s) {
  if (s == "off") return Prealloc::Off;
  if (s == "metadata") return Prealloc::Metadata;
  if (s == "falloc") return Prealloc::Falloc;
  if (s == "full") return Prealloc::Full;
  return std::nullopt;
}

const char* prealloc_name(Prealloc p) {
  switch (p) {
    case Prealloc::Off: return "off";
    case Prealloc::Metadata: return "metadata";
    case Prealloc::Falloc: return "falloc";
    case Prealloc::Full: return "full";
  }
  return "off";
}

// ---- block status

Task<Result<BlockStatus>> Node::block_status(uint64_t offset, uint64_t bytes) {
  if (offset >= length_) co_return BlockStatus{.flags = kStatusEof, .bytes = 0};
  bytes = std::min(bytes, length_ - offset);
  if (bytes == 0) co_return BlockStatus{.flags = 0, .bytes = 0};
  const uint64_t align = limits_.request_alignment;
  const uint64_t a = align_down(offset, align);
  const uint64_t e = std::max(align_up(offset + bytes, align), a + align);
  BlockStatus s;
  if (const StatusCache::Entry* hit = caps_.cache_status ? status_cache_.lookup(a) : nullptr) {
    s = BlockStatus{.flags = hit->flags, .bytes = hit->end - a, .map = a, .file = this};
  } else {
    const uint64_t gen = status_cache_.generation();
    auto r = co_await do_block_status(a, e - a);
    if (!r) co_return r;
    s = *r;
    if (caps_.cache_status) remember_status(gen, a, s);
  }
  // Narrow the widened answer back to what was asked.
  uint64_t skip = offset - a;
  s.bytes = s.bytes > skip ? std::min(s.bytes - skip, bytes) : std::min<uint64_t>(bytes, align - skip);
  if (s.flags & kStatusOffsetValid) s.map += skip;
  if (s.flags & kStatusRaw) {
    // A pass-through layer: the answer is the child's, at the mapped offset.
    Node* f = s.file;
    auto inner = co_await f->block_status(s.map, s.bytes);
    if (!inner) co_return inner;
    BlockStatus in = *inner;
    in.flags &= ~kStatusEof;
    if (offset + in.bytes == length_) in.flags |= kStatusEof;
    co_return in;
  }
  if ((s.flags & kStatusRecurse) && s.file && s.file != this && (s.flags & kStatusData) && !(s.flags & kStatusZero) &&
      (s.flags & kStatusOffsetValid)) {
    // The format maps data here, but the file may hold a hole: then it reads
    // as zeroes (QEMU's BDRV_BLOCK_RECURSE). Errors only lose the extra hint.
    auto inner = co_await s.file->block_status(s.map, s.bytes);
    if (inner) {
      if ((inner->flags & kStatusEof) && (!inner->bytes || (inner->flags & kStatusZero))) {
        s.flags |= kStatusZero;
      } else {
        s.bytes = inner->bytes;
        s.flags |= inner->flags & kStatusZero;
      }
    }
  }
  s.flags &= ~kStatusRecurse;
  if (s.flags & (kStatusData | kStatusZero)) {
    s.flags |= kStatusAllocated;
  } else if (caps_.supports_backing) {
    // Unallocated here: zeroes unless a backing file covers the range.
    Node* backing = child("backing");
    if (!backing || offset >= backing->length()) s.flags |= kStatusZero;
  }
  s.flags &= ~kStatusEof;
  if (offset + s.bytes == length_) s.flags |= kStatusEof;
  co_return s;
}

void Node::remember_status(uint64_t gen, uint64_t offset, const BlockStatus& s) {
  if (!s.bytes || s.file != this || (s.flags & (kStatusRaw | kStatusRecurse))) return;
  if ((s.flags & kStatusOffsetValid) && s.map != offset) return;
  // A hole another process may fill stays uncached (status_cache.h).
  if (!(s.flags & kStatusData) && (perms_.shared & kPermWrite)) return;
  status_cache_.fill(gen, offset, offset + s.bytes, s.flags & (kStatusData | kStatusZero | kStatusOffsetValid));
}

Task<Result<BlockStatus>> Node::block_status_above(uint64_t offset, uint64_t bytes) {
  auto top = co_await block_status(offset, bytes);
  if (!top) co_return top;
  BlockStatus s = *top;
  s.depth = 1;
  if (s.bytes == 0 || (s.flags & kStatusAllocated)) co_return s;
  uint64_t eof = (s.flags & kStatusEof) ? offset + s.bytes : 0;
  bytes = s.bytes;
  for (Node* p = child("backing"); p; p = p->child("backing")) {
    auto r = co_await p->block_status(offset, bytes);
    if (!r) co_return r;
    uint32_t depth = s.depth + 1;
    s = *r;
    s.depth = static_cast<int>(depth);
    if (s.bytes == 0) {
      // Past the end of a shorter backing file: zeroes, as if allocated here.
      s.bytes = bytes;
      s.file = p;
      s.flags = kStatusZero | kStatusAllocated;
      break;
    }
    if (s.flags & kStatusAllocated) {
      s.flags &= ~kStatusEof;
      break;
    }
    bytes = s.bytes;
  }
  if (offset + s.bytes == eof) s.flags |= kStatusEof;
  co_return s;
}

// ---- copy range

Task<Status> Node::copy_range(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes, uint32_t flags) {
  if (bytes == 0) co_return Status{};
  VBLK_CO_TRY(check_range(offset, bytes, false));
  VBLK_CO_TRY(dst.check_range(dst_offset, bytes, true));
  if (!caps_.copy_range) co_return Error(ENOTSUP);
  // kReqSerialising is about the destination's overlapping requests.
  Tracked t1{offset, offset + bytes, false}, t2{dst_offset, dst_offset + bytes, (flags & kReqSerialising) != 0};
  flags &= ~kReqSerialising;
  if (find_conflict(t1)) co_await wait_conflicts(t1);
  link(t1);
  if (dst.find_conflict(t2)) co_await dst.wait_conflicts(t2);
  dst.link(t2);
  // The offload writes the node copy_target() names (a raw format's file),
  // past that node's request path: its cached extents go here.
  uint64_t real_offset = dst_offset;
  Node* real = dst.copy_target(real_offset);
  dst.status_changed(dst_offset, bytes, true);
  if (real && real != &dst) real->status_changed(real_offset, bytes, true);
  Status st = co_await do_copy_range_to(offset, dst, dst_offset, bytes, flags);
  dst.status_changed(dst_offset, bytes, true);
  if (real && real != &dst) real->status_changed(real_offset, bytes, true);
  dst.bitmaps_.mark(dst_offset, bytes);
  if (st.ok() && dst.growable_ && dst_offset + bytes > dst.length_) dst.length_ = dst_offset + bytes;
  dst.untrack(t2);
  untrack(t1);
  co_return st;
}

// ---- defaults for drivers

Task<Status> Node::do_write(uint64_t, std::span<const uint8_t>, uint32_t) { co_return Error(EPERM); }
Task<Status> Node::do_write_zeroes(uint64_t, uint64_t, uint32_t) { co_return Error(ENOTSUP); }
Task<Status> Node::do_discard(uint64_t, uint64_t) { co_return Error(ENOTSUP); }

Task<Status> Node::do_flush() {
  for (auto& c : children_) VBLK_CO_TRY(co_await c.node->flush());
  co_return Status{};
}

Task<Result<BlockStatus>> Node::do_block_status(uint64_t offset, uint64_t bytes) {
  // Without better knowledge everything is data stored at this layer.
  co_return BlockStatus{.flags = kStatusData | kStatusOffsetValid, .bytes = bytes, .map = offset, .file = this};
}

Task<Status> Node::do_copy_range_to(uint64_t, Node&, uint64_t, uint64_t, uint32_t) { co_return Error(ENOTSUP); }
Task<Status> Node::close() {
  if (closed_) co_return Status{};
  closed_ = true;
  co_return co_await do_close();
}

Task<Status> Node::do_close() {
  for (auto& c : children_) VBLK_CO_TRY(co_await c.node->close());
  co_return Status{};
}

Task<Status> Node::do_truncate(uint64_t, bool) {
  co_return Error(ENOTSUP, "Image format driver does not support resize");
}

}  // namespace vblk
