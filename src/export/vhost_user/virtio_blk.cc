// The virtio-blk device (virtio 1.x, 5.2) over a node: what VirtioBlk is.
#include "vhost_user/virtio_blk.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "vblk/buffer.h"

namespace vblk::vhost {

namespace {

// QEMU's limits for one discard or write-zeroes segment (virtio-blk.h).
constexpr uint32_t kMaxDiscardSectors = 32768;
constexpr uint32_t kMaxWriteZeroesSectors = 32768;
// The largest request QEMU's block layer takes (BDRV_REQUEST_MAX_BYTES).
constexpr uint64_t kMaxRequestBytes = (uint64_t{INT32_MAX} >> 9) << 9;
// Requests whose buffers are scattered go through bounce buffers of at
// most this size, and all of them together hold at most kBounceBudget: a
// front end with full rings of huge requests costs no more than that.
constexpr uint64_t kBounceWindow = 1u << 20;
constexpr uint64_t kBounceBudget = 64u << 20;

using Segs = std::vector<std::span<uint8_t>>;

// Joins buffers that follow each other in host memory (a guest's
// physically contiguous pages), so most requests need one node request.
void merge(Segs& v) {
  size_t out = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (out && v[out - 1].data() + v[out - 1].size() == v[i].data())
      v[out - 1] = {v[out - 1].data(), v[out - 1].size() + v[i].size()};
    else
      v[out++] = v[i];
  }
  v.resize(out);
}

// Copies up to out.size() bytes from the front of `segs` (skipping `skip`).
size_t gather(const Segs& segs, uint64_t skip, std::span<uint8_t> out) {
  size_t done = 0;
  for (const auto& s : segs) {
    if (done == out.size()) break;
    if (skip >= s.size()) {
      skip -= s.size();
      continue;
    }
    size_t n = std::min<size_t>(s.size() - skip, out.size() - done);
    std::memcpy(out.data() + done, s.data() + skip, n);
    done += n;
    skip = 0;
  }
  return done;
}

size_t scatter(Segs& segs, uint64_t skip, std::span<const uint8_t> in) {
  size_t done = 0;
  for (auto& s : segs) {
    if (done == in.size()) break;
    if (skip >= s.size()) {
      skip -= s.size();
      continue;
    }
    size_t n = std::min<size_t>(s.size() - skip, in.size() - done);
    std::memcpy(s.data() + skip, in.data() + done, n);
    done += n;
    skip = 0;
  }
  return done;
}

// The data buffers of a request: `segs` without its first `skip` bytes.
Segs data_segments(const Segs& segs, uint64_t skip) {
  Segs out;
  for (const auto& s : segs) {
    if (skip >= s.size()) {
      skip -= s.size();
      continue;
    }
    out.push_back(s.subspan(static_cast<size_t>(skip)));
    skip = 0;
  }
  merge(out);
  return out;
}

class VirtioBlkDevice final : public VirtioBlk {
 public:
  VirtioBlkDevice(Loop& loop, NodeRef& node, VirtioBlkOptions o)
      : opts_(std::move(o)), node_(node), bounce_(loop, kBounceBudget), wce_(!opts_.writethrough) {}

  uint64_t features() const override {
    uint64_t f = bit(kBlkFSegMax) | bit(kBlkFBlkSize) | bit(kBlkFTopology) | bit(kBlkFFlush) | bit(kBlkFDiscard) |
                 bit(kBlkFWriteZeroes);
    if (opts_.config_wce) f |= bit(kBlkFConfigWce);
    if (opts_.mq_always || opts_.num_queues > 1) f |= bit(kBlkFMq);
    if (!opts_.writable) f |= bit(kBlkFRo);
    return f;
  }
  uint16_t num_queues() const override { return opts_.num_queues; }

  bool get_config(uint32_t offset, std::span<uint8_t> out) override {
    BlkConfig c = make_config();
    if (offset > sizeof c || out.size() > sizeof c - offset) return false;
    std::memcpy(out.data(), reinterpret_cast<const uint8_t*>(&c) + offset, out.size());
    return true;
  }

  void set_config(uint32_t offset, std::span<const uint8_t> in) override {
    // Only the write-cache byte is the driver's to change.
    if (opts_.config_wce && offset == offsetof(BlkConfig, wce) && in.size() == 1) wce_ = in[0] != 0;
  }

  Task<Result<uint32_t>> handle(Chain& c) override {
    if (c.in_bytes < 1) co_return Error(EPROTO, "virtio-blk request without room for a status");
    BlkReqHeader h{};
    if (c.out_bytes < sizeof h) co_return Error(EPROTO, "virtio-blk request header too short");
    gather(c.out, 0, std::span(reinterpret_cast<uint8_t*>(&h), sizeof h));
    // The status is the last writable byte; the data lies before it.
    uint8_t* status = &c.in.back().back();
    if (c.in.back().size() == 1)
      c.in.pop_back();
    else
      c.in.back() = c.in.back().first(c.in.back().size() - 1);
    const uint64_t in_len = c.in_bytes - 1;
    uint32_t written = 1;
    uint8_t st = kBlkSOk;
    switch (h.type & ~0x80000000u) {  // bit 31: the legacy barrier flag
      case kBlkTIn: {
        written += static_cast<uint32_t>(in_len);  // as QEMU, whatever the status
        if (!range_ok(h.sector, in_len)) {
          st = kBlkSIoErr;
          break;
        }
        Segs segs = data_segments(c.in, 0);
        if (!co_await read(h.sector << kSectorShift, segs, in_len)) st = kBlkSIoErr;
        break;
      }
      case kBlkTOut: {
        const uint64_t len = c.out_bytes - sizeof h;
        if (!opts_.writable || !range_ok(h.sector, len)) {
          st = kBlkSIoErr;
          break;
        }
        Segs segs = data_segments(c.out, sizeof h);
        if (!co_await write(h.sector << kSectorShift, segs, len)) st = kBlkSIoErr;
        break;
      }
      case kBlkTFlush: {
        if (opts_.ledger && !opts_.ledger->flush_can_vouch()) {
          st = kBlkSIoErr;
          break;
        }
        const uint64_t covered = opts_.ledger ? opts_.ledger->flush_begins() : 0;
        if (!co_await node_->flush())
          st = kBlkSIoErr;
        else if (opts_.ledger)
          opts_.ledger->flushed(covered);
        break;
      }
      case kBlkTGetId: {
        char id[kBlkIdBytes] = {};
        std::memcpy(id, opts_.serial.data(), std::min(sizeof id, opts_.serial.size()));
        size_t n = std::min<uint64_t>(in_len, sizeof id);
        scatter(c.in, 0, std::span(reinterpret_cast<const uint8_t*>(id), n));
        written += static_cast<uint32_t>(n);
        break;
      }
      case kBlkTDiscard:
      case kBlkTWriteZeroes: st = co_await discard_or_zero(c, h.type == kBlkTWriteZeroes); break;
      default: st = kBlkSUnsupp; break;
    }
    const uint32_t kind = h.type & ~0x80000000u;
    if (opts_.ledger && st == kBlkSOk && (kind == kBlkTOut || kind == kBlkTDiscard || kind == kBlkTWriteZeroes))
      opts_.ledger->answered();
    *status = st;
    co_return written;
  }

  BlkConfig config() const override { return make_config(); }

 private:
  BlkConfig make_config() const {
    BlkConfig c{};
    c.capacity = node_->length() >> kSectorShift;
    c.seg_max = opts_.seg_max;
    c.blk_size = opts_.logical_block_size;
    c.min_io_size = 1;
    c.opt_io_size = 1;
    c.wce = wce_ ? 1 : 0;
    c.num_queues = opts_.num_queues;
    c.max_discard_sectors = kMaxDiscardSectors;
    c.max_discard_seg = 1;
    c.discard_sector_alignment = opts_.logical_block_size >> kSectorShift;
    c.max_write_zeroes_sectors = kMaxWriteZeroesSectors;
    c.max_write_zeroes_seg = 1;
    c.write_zeroes_may_unmap = 1;
    return c;
  }

  // QEMU's virtio_blk_sect_range_ok.
  bool range_ok(uint64_t sector, uint64_t bytes) const {
    if (bytes % 512 || bytes > kMaxRequestBytes) return false;
    if (sector > (UINT64_MAX >> kSectorShift) || (sector << kSectorShift) % opts_.logical_block_size) return false;
    const uint64_t total = node_->length() >> kSectorShift;
    return sector <= total && bytes / 512 <= total - sector;
  }

  Task<bool> read(uint64_t off, Segs& segs, uint64_t len) {
    // (No co_await inside || or ?: here: gcc 12 destroys such an
    // awaitable's temporaries even when the operand is not evaluated.)
    if (len == 0) co_return true;
    if (segs.size() == 1) {
      Status s = co_await node_->read(off, segs[0]);
      co_return s.ok();
    }
    for (uint64_t done = 0; done < len;) {
      const uint64_t n = std::min(kBounceWindow, len - done);
      co_await bounce_.acquire(n);
      AlignedBuffer buf(n);
      Status s = co_await node_->read(off + done, buf.span());
      if (s) scatter(segs, done, buf.span());
      bounce_.release(n);
      if (!s) co_return false;
      done += n;
    }
    co_return true;
  }

  uint32_t write_flags() const {
    return (wce_ ? 0u : uint32_t{kReqFua}) | (opts_.survive_kill ? uint32_t{kReqSurviveKill} : 0u);
  }

  Task<bool> write(uint64_t off, Segs& segs, uint64_t len) {
    const uint32_t flags = write_flags();
    if (len == 0) co_return true;
    if (segs.size() == 1) {
      Status s = co_await node_->write(off, segs[0], flags);
      co_return s.ok();
    }
    for (uint64_t done = 0; done < len;) {
      const uint64_t n = std::min(kBounceWindow, len - done);
      co_await bounce_.acquire(n);
      AlignedBuffer buf(n);
      gather(segs, done, buf.span());
      Status s = co_await node_->write(off + done, buf.span(), flags);
      bounce_.release(n);
      if (!s) co_return false;
      done += n;
    }
    co_return true;
  }

  // QEMU's virtio_blk_handle_discard_write_zeroes: one segment, known flags.
  Task<uint8_t> discard_or_zero(const Chain& c, bool zero) {
    BlkDiscardWriteZeroes d{};
    if (gather(c.out, sizeof(BlkReqHeader), std::span(reinterpret_cast<uint8_t*>(&d), sizeof d)) != sizeof d)
      co_return kBlkSIoErr;
    constexpr uint32_t kUnmap = 1;
    if (d.flags & ~kUnmap) co_return kBlkSUnsupp;
    if (!opts_.writable) co_return kBlkSIoErr;
    const uint64_t bytes = uint64_t{d.num_sectors} << kSectorShift;
    if (zero) {
      if (d.num_sectors > kMaxWriteZeroesSectors || !range_ok(d.sector, bytes)) co_return kBlkSIoErr;
      const uint32_t flags = write_flags() | ((d.flags & kUnmap) ? uint32_t{kReqMayUnmap} : 0u);
      Status s = co_await node_->write_zeroes(d.sector << kSectorShift, bytes, flags);
      co_return s.ok() ? kBlkSOk : kBlkSIoErr;
    }
    if (d.flags & kUnmap) co_return kBlkSUnsupp;
    if (d.num_sectors > kMaxDiscardSectors || !range_ok(d.sector, bytes)) co_return kBlkSIoErr;
    Status s = co_await node_->discard(d.sector << kSectorShift, bytes);
    co_return s.ok() ? kBlkSOk : kBlkSIoErr;
  }

  VirtioBlkOptions opts_;
  NodeRef& node_;
  CoSemaphore bounce_;
  bool wce_ = true;
};

}  // namespace

std::unique_ptr<VirtioBlk> VirtioBlk::create(Loop& loop, NodeRef& node, VirtioBlkOptions o) {
  return std::make_unique<VirtioBlkDevice>(loop, node, std::move(o));
}

}  // namespace vblk::vhost
