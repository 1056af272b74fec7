// Guest I/O on qcow2: reads by mapping, allocating writes with copy-on-write,
// zero and discard by L2 flags, block status, flush.
#include <fmt/format.h>

#include <functional>
#include <thread>

#include "drivers/qcow2/inflate.h"
#include "drivers/qcow2/qcow2.h"
#include "vblk/status_group.h"

namespace vblk::qcow2 {

namespace {
constexpr uint64_t kMaxAllocRun = 8 << 20;  // bytes of new clusters per allocating step
}

// The stored bytes are read on the loop; the inflate itself runs on the
// loop's thread pool (one job per cluster, at most kInflateJobs of this node
// at once: a bounded queue, whatever the number of requests), so clusters of
// concurrent reads inflate on every core while the loop goes on.
void Qcow2Node::compressed_range(uint64_t entry, uint64_t& host, uint64_t& bytes) const {
  const uint32_t x = 62 - (h_.cluster_bits - 8);
  host = entry & ((1ull << x) - 1);
  const uint64_t sectors = ((entry >> x) & ((1ull << (h_.cluster_bits - 8)) - 1)) + 1;
  bytes = sectors * 512 - (host & 511);
}

Task<Status> Qcow2Node::read_compressed(uint64_t entry, uint64_t in_cluster, std::span<uint8_t> out) {
  uint64_t host = 0, csize = 0;
  compressed_range(entry, host, csize);
  AlignedBuffer in(csize);
  VBLK_CO_TRY(co_await file_->read(host, in.span()));
  // A whole cluster wanted (convert, backup, large reads): inflate straight
  // into the caller's buffer, no copy.
  const bool whole = in_cluster == 0 && out.size() == cs_;
  AlignedBuffer cluster;
  if (!whole) cluster = AlignedBuffer(cs_);
  uint8_t* dst = whole ? out.data() : cluster.data();
  const InflateKind kind = h_.compression_type == kCompressionZstd ? InflateKind::Zstd : InflateKind::Deflate;
  Status st;
  if (cs_ < kInflateOffloadMin) {
    st = inflate_cluster(kind, in.data(), csize, dst, cs_);
  } else {
    co_await inflate_slots_.acquire();
    std::function<long()> job = [&] {
      st = inflate_cluster(kind, in.data(), csize, dst, cs_);
      return 0L;
    };
    co_await loop().run_blocking(job);
    inflate_slots_.release();
  }
  if (!st) co_return st;
  if (!whole) std::memcpy(out.data(), cluster.data() + in_cluster, out.size());
  co_return Status{};
}

Task<Status> Qcow2Node::read_compressed_run(CompressedRun run) {
  if (run.clusters.size() == 1) co_return co_await read_compressed(run.clusters[0].first, 0, run.clusters[0].second);
  AlignedBuffer in(run.host_hi - run.host_lo);
  VBLK_CO_TRY(co_await file_->read(run.host_lo, in.span()));
  const InflateKind kind = h_.compression_type == kCompressionZstd ? InflateKind::Zstd : InflateKind::Deflate;
  Status st;
  std::function<long()> job = [&] {
    for (const auto& [entry, out] : run.clusters) {
      uint64_t host = 0, csize = 0;
      compressed_range(entry, host, csize);
      st = inflate_cluster(kind, in.data() + (host - run.host_lo), csize, out.data(), cs_);
      if (!st) break;
    }
    return 0L;
  };
  co_await inflate_slots_.acquire();
  co_await loop().run_blocking(job);
  inflate_slots_.release();
  co_return st;
}

Task<Status> Qcow2Node::read_mapping(uint64_t offset, const Mapping& m, std::span<uint8_t> out) {
  switch (m.type) {
    case ClusterType::Normal: co_return co_await read_data(m.host, out);
    case ClusterType::Compressed: co_return co_await read_compressed(m.host, offset & (cs_ - 1), out);
    case ClusterType::ZeroPlain:
    case ClusterType::ZeroAlloc: std::memset(out.data(), 0, out.size()); co_return Status{};
    case ClusterType::Unallocated:
    case ClusterType::UnallocatedAlloc: break;
  }
  // Unallocated: the backing file shows through; beyond its end, zeroes.
  uint64_t from_backing = 0;
  if (backing_ && offset < backing_->length())
    from_backing = std::min<uint64_t>(out.size(), backing_->length() - offset);
  if (from_backing) VBLK_CO_TRY(co_await backing_->read(offset, out.subspan(0, from_backing)));
  if (from_backing < out.size()) std::memset(out.data() + from_backing, 0, out.size() - from_backing);
  co_return Status{};
}

// A job's trip through the pool (a worker's wake-up, the eventfd back to
// the loop) costs latency, not CPU: four jobs per core keep every worker's
// next cluster queued while the loop collects the last one.
unsigned Qcow2Node::inflate_jobs() { return 4 * std::max(1u, std::thread::hardware_concurrency()); }

namespace {
// Compressed pieces of one read in flight at once (each holds its buffer):
// a 1 MiB chunk of 64 KiB clusters.
constexpr uint64_t kPiecesPerRead = 16;
}  // namespace

Task<Status> Qcow2Node::do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t) {
  size_t done = 0;
  // Compressed clusters are read and inflated concurrently (each inflate a
  // pool job); the rest in order, while those run. Whole clusters stored
  // back to back go as one run (one read, one job).
  StatusGroup pieces(loop(), kPiecesPerRead);
  Status st;
  CompressedRun run;
  auto start_run = [&]() -> Task<void> {
    if (run.clusters.empty()) co_return;
    co_await pieces.spawn(read_compressed_run(std::move(run)));
    run = CompressedRun{};
  };
  while (done < buf.size() && st && pieces.ok()) {
    Mapping m;
    {
      co_await lock_.lock();
      auto r = co_await lookup(offset + done, buf.size() - done);
      lock_.unlock();
      if (!r) {
        st = r.take_error();
        break;
      }
      m = *r;
    }
    size_t n = static_cast<size_t>(std::min<uint64_t>(m.bytes, buf.size() - done));
    if (m.type == ClusterType::Compressed && ((offset + done) & (cs_ - 1)) == 0 && n == cs_ &&
        cs_ >= kInflateOffloadMin) {
      uint64_t host = 0, csize = 0;
      compressed_range(m.host, host, csize);
      // Joins the run if its bytes start where the run's end (within the
      // run's last sector) and the run holds fewer than kCompressedRunClusters.
      const bool joins = !run.clusters.empty() && host >= run.host_lo && host <= align_up(run.host_hi, 512) &&
                         run.clusters.size() < kCompressedRunClusters;
      if (!joins) {
        co_await start_run();
        run.host_lo = host;
        run.host_hi = host;
      }
      run.host_hi = std::max(run.host_hi, host + csize);
      run.clusters.emplace_back(m.host, buf.subspan(done, n));
    } else if (m.type == ClusterType::Compressed) {
      co_await start_run();
      co_await pieces.spawn(read_mapping(offset + done, m, buf.subspan(done, n)));
    } else {
      co_await start_run();
      st = co_await read_mapping(offset + done, m, buf.subspan(done, n));
    }
    done += n;
  }
  if (st && pieces.ok()) co_await start_run();
  // The clusters in flight write into buf and f: wait for them, even after
  // an error.
  co_await pieces.wait();
  if (!st) co_return st;
  co_return pieces.take_status();
}

// Whether [offset, offset+bytes) reads as zeroes by its L2 entries alone: zero
// clusters, or unallocated ones with no backing data there. Caller holds lock_.
Task<Result<bool>> Qcow2Node::reads_as_zero(uint64_t offset, uint64_t bytes) {
  while (bytes) {
    auto r = co_await lookup(offset, bytes);
    if (!r) co_return r.take_error();
    switch (r->type) {
      case ClusterType::ZeroPlain:
      case ClusterType::ZeroAlloc: break;
      case ClusterType::Unallocated:
      case ClusterType::UnallocatedAlloc:
        if (backing_ && offset < backing_->length()) co_return false;
        break;
      default: co_return false;
    }
    uint64_t k = std::min(r->bytes, bytes);
    offset += k;
    bytes -= k;
  }
  co_return true;
}

// One step of a write: either an in-place write to clusters this image owns,
// or the allocation of a run of new clusters filled with the new data and
// the old data around it (copy-on-write). *done is how far it got.
Task<Status> Qcow2Node::write_cluster_run(uint64_t offset, std::span<const uint8_t> buf, uint64_t* done) {
  auto guard = co_await lock_.scoped();

  Mapping m;
  uint64_t first = 0, last = 0;
  for (;;) {
    auto r = co_await lookup(offset, std::min<uint64_t>(buf.size(), kMaxAllocRun), true);
    if (!r) co_return r.take_error();
    m = *r;
    uint64_t n = std::min<uint64_t>(m.bytes, buf.size());
    first = offset / cs_;
    last = (offset + n - 1) / cs_;
    // Another write filling any of these clusters goes first; then look again.
    const bool waited = co_await wait_allocs(first, last);
    if (!waited) break;
  }
  const uint64_t n = std::min<uint64_t>(m.bytes, buf.size());
  if (m.type == ClusterType::Normal && m.copied) {
    guard.unlock();
    // The hot path: a sorted-index lookup, no allocation.
    if (uint32_t ol = overlaps(0, m.host, n)) co_return co_await refuse_overlap(ol, m.host, n);
    VBLK_CO_TRY(co_await write_data(m.host, buf.subspan(0, n)));
    *done = n;
    co_return Status{};
  }
  if (l2_entry_size_ == 16) {
    // Subclusters: one cluster at a time, only the covered subclusters.
    guard.unlock();
    co_return co_await write_subclusters(offset, buf, done);
  }

  // The L2 table first, then the data clusters (QEMU's order, so that the
  // same writes give the same host layout).
  {
    auto t = co_await l2_for_write(first * cs_);
    if (!t) co_return t.take_error();
  }
  // Whether the old contents around the new data read as zeroes (no backing
  // data, zero clusters): then the new clusters are zeroed by the file
  // (fallocate) instead of writing zero buffers, as QEMU's handle_alloc_space
  // (not when encrypted: zeroes in the file are not zeroes in the image).
  const uint64_t run_start = first * cs_;
  const uint64_t count = last - first + 1;
  const uint64_t total = count * cs_;
  const uint64_t head = offset - run_start;
  const uint64_t tail = total - head - n;
  bool zero_cow = false;
  if ((head || tail) && !encrypted()) {
    auto z = co_await reads_as_zero(run_start, head);
    if (!z) co_return z.take_error();
    zero_cow = *z;
    if (zero_cow && tail) {
      z = co_await reads_as_zero(offset + n, tail);
      if (!z) co_return z.take_error();
      zero_cow = *z;
    }
  }

  // Allocate the run and claim its guest clusters.
  auto host = co_await alloc_clusters(count);
  if (!host) co_return host.take_error();
  AllocClaim claim(*this, first, last);
  guard.unlock();

  bool data_only = head == 0 && tail == 0;
  // New clusters come from refcounts a hostile image controls: checked like
  // any other write (check_new_clusters knows only what is cached).
  if (uint32_t ol = overlaps(0, *host, total)) co_return co_await refuse_overlap(ol, *host, total);
  Status st{};
  if (zero_cow) {
    // Without fallocate support the zeroes are written with the data below.
    data_only = static_cast<bool>(co_await file_->write_zeroes(*host, total, kReqNoFallback));
    if (data_only) st = co_await file_->write(*host + head, buf.subspan(0, n));
  } else if (data_only) {
    st = co_await write_data(*host, buf.subspan(0, n));
  }
  if (st && !data_only) {
    // Copy-on-write: only the uncovered edges are read from the old place
    // (backing file, zeroes, compressed or shared cluster).
    // (do_read looks each piece up: with subclusters an edge may mix types;
    // no other write can touch these clusters while we own them.)
    AlignedBuffer cow(total, std::max<size_t>(limits_.buffer_alignment, 512));
    if (zero_cow) {
      cow.zero();
    } else {
      if (head) st = co_await do_read(run_start, cow.span().subspan(0, head), 0);
      if (st && tail) st = co_await do_read(offset + n, cow.span().subspan(head + n, tail), 0);
    }
    if (st) {
      std::memcpy(cow.data() + head, buf.data(), n);
      st = encrypt_for(*host, cow.span());
      if (st) st = co_await file_->write(*host, cow.span());
    }
  }
  if (!st) {
    co_await guard.relock();
    co_return co_await abort_alloc(*host, total, st.error());
  }

  // Link the new clusters into the L2 table; free what they replace. The
  // data and the refcounts reach the disk before these entries do.
  co_await guard.relock();
  l2_cache_->depends_on_flush();
  // Lazy refcounts: the image is marked dirty instead, and L2 entries may
  // reach the disk before their clusters' refcounts (a crash leaves errors
  // the next read-write open repairs).
  if (lazy_refcounts_) VBLK_CO_TRY(co_await mark_dirty());
  if (!dirty_flag()) VBLK_CO_TRY(co_await l2_cache_->set_dependency(rb_cache_.get()));
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t guest = (first + i) * cs_;
    auto t = co_await l2_for_write(guest);
    if (!t) co_return t.take_error();
    uint64_t l2i = (guest >> h_.cluster_bits) & (l2_entries_ - 1);
    uint64_t old = l2_entry(*t, l2i);
    // With subclusters the whole new cluster is allocated data.
    set_l2_entry(*t, l2i, (*host + i * cs_) | kOflagCopied, l2_entry_size_ == 16 ? 0xffffffffull : 0);
    if (old & (kOflagCompressed | kL2OffsetMask)) VBLK_CO_TRY(co_await free_entry(old));
  }
  *done = n;
  co_return Status{};
}

Task<Status> Qcow2Node::do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t flags) {
  // After a fatal corruption QEMU drops the driver: ENOMEDIUM ("No medium found").
  if (corrupt()) co_return Error(ENOMEDIUM);
  if (flags & kReqCompressed) {
    // QEMU would store the cluster in the clear; vblk refuses, in the words
    // qemu-img convert uses for -c with encryption.
    if (encrypted()) co_return Error(ENOTSUP, "Compression and encryption not supported at the same time");
    VBLK_CO_TRY(co_await write_compressed(offset, buf));
  } else {
    uint64_t done = 0;
    while (done < buf.size()) {
      uint64_t n = 0;
      VBLK_CO_TRY(co_await write_cluster_run(offset + done, buf.subspan(done), &n));
      done += n;
    }
  }
  if (flags & kReqSurviveKill) VBLK_CO_TRY(co_await metadata_to_file());
  co_return Status{};
}

Task<Status> Qcow2Node::metadata_to_file() {
  // Checked before taking the lock: a write that changed no metadata (an
  // allocated cluster overwritten) costs nothing; one whose tables another
  // request's write-back already carried finds them clean.
  if (!l2_cache_->has_dirty() && !rb_cache_->has_dirty()) co_return Status{};
  auto g = co_await lock_.scoped();
  // The caches' dependencies keep the crash-safety order on the way (a new
  // cluster's refcount and data are flushed before the L2 entry naming it
  // is written); the last step is not synced: the page cache outlives us.
  VBLK_CO_TRY(co_await l2_cache_->write_dirty());
  co_return co_await rb_cache_->write_dirty();
}

// Extended L2 (QEMU's calculate_l2_meta with subclusters): a write into a
// cluster writes the subclusters it covers, plus copy-on-write of the partial
// first and last subcluster, and marks just those allocated; the others stay
// unallocated or zero. A new host cluster copies what the old cluster had
// allocated (compressed: all of it).
Task<Status> Qcow2Node::write_subclusters(uint64_t offset, std::span<const uint8_t> buf, uint64_t* done) {
  auto guard = co_await lock_.scoped();
  const uint64_t ci = offset / cs_, guest = ci * cs_, in = offset % cs_;
  const uint64_t n = std::min<uint64_t>(buf.size(), cs_ - in);
  const uint64_t sc = cs_ / kSubclusters;
  const uint64_t l2i = ci & (l2_entries_ - 1);
  co_await wait_allocs(ci, ci);
  uint64_t e, bm, t_offset;
  {
    auto t = co_await l2_for_write(guest);
    if (!t) co_return t.take_error();
    e = l2_entry(*t, l2i);
    bm = l2_bitmap(*t, l2i);
    t_offset = t->offset();
  }
  const auto first_sc = static_cast<uint32_t>(in / sc), last_sc = static_cast<uint32_t>((in + n - 1) / sc);
  const uint32_t alloc = static_cast<uint32_t>(bm);
  const bool compressed = e & kOflagCompressed;
  const uint64_t host = compressed ? 0 : e & kL2OffsetMask;
  if (host & (cs_ - 1)) {
    (void)co_await mark_corrupt(fmt::format("Cluster allocation offset {} unaligned (L2 offset: {}, L2 index: {})",
                                            hex(host), hex(t_offset), hex(l2i)));
    co_return Error(EIO);
  }
  const bool keep_old = host && (e & kOflagCopied);
  uint64_t from, to;  // cluster-relative range written to the host cluster
  if (keep_old) {
    from = (alloc >> first_sc & 1) ? in : first_sc * sc;
    to = (alloc >> last_sc & 1) ? in + n : (last_sc + 1) * sc;
  } else if (compressed) {
    from = 0;
    to = cs_;
  } else if (host) {  // shared: copy everything allocated around the write
    uint32_t lead = alloc ? static_cast<uint32_t>(__builtin_ctz(alloc)) : 32;
    uint32_t trail = alloc ? static_cast<uint32_t>(__builtin_clz(alloc)) : 32;
    from = std::min(first_sc, lead) * sc;
    to = cs_ - std::min(kSubclusters - 1 - last_sc, trail) * sc;
  } else {
    from = first_sc * sc;
    to = (last_sc + 1) * sc;
  }
  uint64_t target = host;
  if (!keep_old) {
    auto h = co_await alloc_clusters(1);
    if (!h) co_return h.take_error();
    target = *h;
  }
  AllocClaim claim(*this, ci, ci);
  guard.unlock();

  if (uint32_t ol = overlaps(0, target + from, to - from))
    co_return co_await refuse_overlap(ol, target + from, to - from);
  Status st{};
  if (from == in && to == in + n) {
    st = co_await write_data(target + in, buf.subspan(0, n));
  } else {
    AlignedBuffer cow(to - from, std::max<size_t>(limits_.buffer_alignment, 512));
    if (in > from) st = co_await do_read(guest + from, cow.span().subspan(0, in - from), 0);
    if (st && to > in + n) st = co_await do_read(guest + in + n, cow.span().subspan(in + n - from, to - in - n), 0);
    if (st) {
      std::memcpy(cow.data() + (in - from), buf.data(), n);
      st = encrypt_for(target + from, cow.span());
      if (st) st = co_await file_->write(target + from, cow.span());
    }
  }
  if (!st) {
    co_await guard.relock();
    if (keep_old) co_return st;
    co_return co_await abort_alloc(target, cs_, st.error());
  }

  co_await guard.relock();
  l2_cache_->depends_on_flush();
  // Lazy refcounts: the dirty bit instead of the refcount-before-L2 order.
  if (lazy_refcounts_) VBLK_CO_TRY(co_await mark_dirty());
  if (!dirty_flag()) VBLK_CO_TRY(co_await l2_cache_->set_dependency(rb_cache_.get()));
  auto t = co_await l2_for_write(guest);
  if (!t) co_return t.take_error();
  uint64_t old = l2_entry(*t, l2i);
  uint64_t bitmap = l2_bitmap(*t, l2i);
  const auto a = static_cast<uint32_t>(from / sc), b = static_cast<uint32_t>((to - 1) / sc);
  uint64_t range = (b - a + 1 >= 32 ? 0xffffffffull : ((1ull << (b - a + 1)) - 1)) << a;
  bitmap = (bitmap | range) & ~(range << 32);
  set_l2_entry(*t, l2i, target | kOflagCopied, bitmap);
  if (!keep_old && (old & (kOflagCompressed | kL2OffsetMask))) VBLK_CO_TRY(co_await free_entry(old));
  *done = n;
  co_return Status{};
}

Task<Status> Qcow2Node::do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) {
  if (corrupt()) co_return Error(ENOMEDIUM);
  VBLK_CO_TRY(co_await zeroes(offset, bytes, flags));
  if (flags & kReqSurviveKill) VBLK_CO_TRY(co_await metadata_to_file());
  co_return Status{};
}

Task<Status> Qcow2Node::do_discard(uint64_t offset, uint64_t bytes) {
  if (corrupt()) co_return Error(ENOMEDIUM);
  // Without the zero flag, discarding could expose stale backing data: QEMU
  // declines (v2 with a backing file), and so does vblk.
  if (h_.version < 3 && backing_) co_return Status{};
  co_return co_await discard_range(offset, bytes, false);
}

// Every cluster of the active L1 table unallocated (QEMU's qcow2_make_empty
// fallback: a full discard of the whole disk; the clusters are freed, so
// reads fall through to the backing file). Snapshots keep what they share.
Task<Status> Qcow2Node::make_empty() {
  if (read_only() || corrupt()) co_return Error(EACCES);
  VBLK_CO_TRY(co_await discard_range(0, length(), true));
  co_return co_await flush();
}

Task<Status> Qcow2Node::do_flush() {
  // Dropped driver after a fatal corruption in check: nothing to flush.
  if (check_dead_) co_return Status{};
  auto g = co_await lock_.scoped();
  co_return co_await flush_all();
}

// QEMU's heuristic: an image whose file allocates clearly fewer clusters than
// the refcounts claim was made with preallocation=metadata; its data clusters
// may be holes, so block status looks into the file for them.
Task<Result<bool>> Qcow2Node::detect_metadata_preallocation() {
  uint64_t file_length = file_->length();
  auto real = file_->allocated_size();
  if (!real) co_return real.take_error();
  uint64_t real_clusters = *real / cs_;
  uint64_t threshold = std::max(real_clusters * 10 / 9, real_clusters + 2);
  uint64_t end = (file_length + cs_ - 1) / cs_, count = 0;
  for (uint64_t i = 0; i < end && count < threshold; ++i) {
    auto rc = co_await get_refcount(i);
    if (!rc) co_return rc.take_error();
    count += *rc != 0;
  }
  co_return count >= threshold;
}

Task<Result<BlockStatus>> Qcow2Node::do_block_status(uint64_t offset, uint64_t bytes) {
  co_await lock_.lock();
  if (!prealloc_checked_) {
    auto d = co_await detect_metadata_preallocation();
    metadata_prealloc_ = d && *d;
    prealloc_checked_ = true;
  }
  auto r = co_await lookup(offset, bytes);
  lock_.unlock();
  if (!r) co_return r.take_error();
  BlockStatus s;
  s.bytes = std::min(r->bytes, bytes);
  // Encrypted data has no offset in the file that reads as the image's
  // (QEMU's qcow2_co_block_status with s->crypto).
  if (encrypted()) {
    const bool zero = r->type == ClusterType::ZeroPlain || r->type == ClusterType::ZeroAlloc;
    const bool unalloc = r->type == ClusterType::Unallocated || r->type == ClusterType::UnallocatedAlloc;
    s.flags = zero ? kStatusZero : unalloc ? 0u : kStatusData;
    co_return s;
  }
  switch (r->type) {
    case ClusterType::Normal:
      s.flags = kStatusData | kStatusOffsetValid | (metadata_prealloc_ ? kStatusRecurse : 0u);
      s.map = r->host;
      s.file = file_;
      break;
    case ClusterType::Compressed: s.flags = kStatusData; break;
    case ClusterType::ZeroAlloc:
      s.flags = kStatusZero | kStatusOffsetValid;
      s.map = r->host;
      s.file = file_;
      break;
    case ClusterType::ZeroPlain: s.flags = kStatusZero; break;
    case ClusterType::Unallocated: s.flags = 0; break;
    case ClusterType::UnallocatedAlloc:
      s.flags = kStatusOffsetValid;
      s.map = r->host;
      s.file = file_;
      break;
  }
  co_return s;
}

}  // namespace vblk::qcow2
