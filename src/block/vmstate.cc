// VmstateWriter and VmstateReader (include/block/vblk/vmstate.h).
#include "vblk/vmstate.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "vblk/image_format.h"

namespace vblk {

namespace {

uint64_t unit_size(const Node& node, const VmstateOptions& o) {
  uint64_t s = o.buffer_size ? o.buffer_size : std::max<uint64_t>(image::cluster_size(node), uint64_t{4} << 20);
  return align_up(s, 4096);
}

// Huge-page backed where the kernel allows and the size is whole huge
// pages: one large buffer is then few physical segments per request (as
// the COW buffers do it). A smaller buffer would take a whole 2 MiB page.
AlignedBuffer new_buffer(uint64_t size) {
  if (size % (2 << 20) == 0) return AlignedBuffer::huge(size);
  return AlignedBuffer(size, 4096);
}

}  // namespace

// ---- VmstateWriter

VmstateWriter::VmstateWriter(Node& node, VmstateOptions opts)
    : node_(node),
      buf_size_(unit_size(node, opts)),
      slots_(node.loop(), std::max(1u, opts.workers)),
      busy_(node.loop()) {}

VmstateWriter::~VmstateWriter() {
  if (busy_.count()) {
    // Its workers would write into freed memory: a programming error.
    std::fprintf(stderr, "vblk: VmstateWriter destroyed with writes in flight\n");
    std::abort();
  }
}

AlignedBuffer VmstateWriter::take_buffer() {
  if (free_.empty()) return new_buffer(buf_size_);
  AlignedBuffer b = std::move(free_.back());
  free_.pop_back();
  return b;
}

Task<void> VmstateWriter::worker(AlignedBuffer buf, uint64_t pos, size_t len) {
  auto st = co_await image::write_vmstate(node_, pos, buf.span().subspan(0, len));
  if (!st && !error_) error_ = st.error();
  free_.push_back(std::move(buf));
  slots_.release();
  busy_.done();
}

Task<void> VmstateWriter::submit() {
  if (!filled_) co_return;
  co_await slots_.acquire();
  busy_.add();
  const size_t len = filled_;
  filled_ = 0;
  spawn_detached(worker(std::move(cur_), cur_pos_, len));
  cur_ = AlignedBuffer();
}

Task<Status> VmstateWriter::reposition(uint64_t pos) {
  co_await submit();
  co_await busy_.wait();
  if (error_) co_return *error_;
  if (!cur_.size()) cur_ = take_buffer();
  cur_pos_ = align_down(pos, buf_size_);
  filled_ = static_cast<size_t>(pos - cur_pos_);
  // Read-modify-write: the unit's bytes before pos are whatever the area
  // holds (written earlier, or zeroes), and go back out unchanged.
  if (filled_) {
    auto st = co_await image::read_vmstate(node_, cur_pos_, cur_.span().subspan(0, filled_));
    if (!st) {
      filled_ = 0;
      error_ = st.error();
      co_return st;
    }
  }
  co_return Status{};
}

Task<Status> VmstateWriter::write(uint64_t pos, std::span<const uint8_t> data) {
  if (error_) co_return *error_;
  if (data.empty()) co_return Status{};
  if (!cur_.size() || pos != cur_pos_ + filled_) {
    // A fresh buffer at exactly where the last one ended continues the
    // stream; anything else restarts it.
    if (!cur_.size() && filled_ == 0 && pos == cur_pos_ && pos % buf_size_ == 0) {
      cur_ = take_buffer();
    } else {
      VBLK_CO_TRY(co_await reposition(pos));
    }
  }
  end_ = std::max(end_, pos + data.size());
  while (!data.empty()) {
    const size_t n = std::min<size_t>(data.size(), buf_size_ - filled_);
    std::memcpy(cur_.data() + filled_, data.data(), n);
    filled_ += n;
    data = data.subspan(n);
    if (filled_ == buf_size_) {
      co_await submit();
      cur_pos_ += buf_size_;
      if (!data.empty()) cur_ = take_buffer();
    }
  }
  co_return Status{};
}

Task<Status> VmstateWriter::flush() {
  co_await submit();
  co_await busy_.wait();
  if (error_) co_return *error_;
  co_return Status{};
}

// ---- VmstateReader

VmstateReader::VmstateReader(Node& node, std::string snapshot_id, uint64_t length, VmstateOptions opts)
    : node_(node),
      snapshot_id_(std::move(snapshot_id)),
      length_(length),
      buf_size_(unit_size(node, opts)),
      slots_(std::max(1u, opts.workers)),
      busy_(node.loop()) {}

VmstateReader::~VmstateReader() {
  if (busy_.count()) {
    std::fprintf(stderr, "vblk: VmstateReader destroyed with reads in flight\n");
    std::abort();
  }
}

Task<void> VmstateReader::fetch(Slot* s) {
  s->status = co_await image::read_vmstate(node_, s->pos, s->buf.span().subspan(0, s->len), snapshot_id_);
  s->done->set();
  busy_.done();
}

Task<void> VmstateReader::start(Slot& s, uint64_t pos) {
  // The slot's previous read may still run when the reader skipped ahead.
  if (s.valid && !s.done->is_set()) co_await s.done->wait();
  if (!s.buf.size()) s.buf = new_buffer(buf_size_);
  if (!s.done) s.done = std::make_unique<CoEvent>(node_.loop());
  s.done->reset();
  s.pos = pos;
  s.len = static_cast<size_t>(std::min(buf_size_, length_ - pos));
  s.valid = true;
  busy_.add();
  spawn_detached(fetch(&s));
}

Task<void> VmstateReader::close() {
  co_await busy_.wait();
  for (auto& s : slots_) s.valid = false;
}

Task<Status> VmstateReader::read(uint64_t pos, std::span<uint8_t> out) {
  if (pos > length_ || out.size() > length_ - pos) co_return Error(EINVAL, "Read beyond the VM state");
  const uint64_t n = slots_.size();
  while (!out.empty()) {
    const uint64_t unit = pos / buf_size_;
    Slot& s = slots_[unit % n];
    if (!(s.valid && s.pos == unit * buf_size_)) {
      // Out of order: forget the read-ahead, start again here.
      co_await close();
      next_ = unit;
    }
    // Keep `n` units in flight from here on.
    while (next_ < unit + n && next_ * buf_size_ < length_) {
      co_await start(slots_[next_ % n], next_ * buf_size_);
      ++next_;
    }
    co_await s.done->wait();
    if (!s.status) {
      Status st = s.status;
      s.valid = false;  // read it again next time
      co_return st;
    }
    const uint64_t in = pos - s.pos;
    const size_t k = static_cast<size_t>(std::min<uint64_t>(out.size(), s.len - in));
    std::memcpy(out.data(), s.buf.data() + in, k);
    out = out.subspan(k);
    pos += k;
  }
  co_return Status{};
}

}  // namespace vblk
