// Compressed cluster writes (QEMU's qcow2_co_pwritev_compressed): whole
// clusters (the last, partial cluster at the image end too) are compressed
// with the image's compression type and packed into host clusters by the
// byte allocator. A cluster that does not shrink below the cluster size is
// written normally. Like QEMU, a compressed write never overwrites an
// allocated cluster (EIO): compression is for filling fresh images.
//
// The compressor settings are QEMU's (zlib: raw deflate, default level,
// window bits -12, memLevel 9; zstd: default level, one streaming call), so
// the compressed sizes, and with them the host layout, equal QEMU's.
//
// Compression is CPU bound: it runs on the loop's thread pool (the loop
// thread only allocates and writes), so parallel writers — the copy engine's
// workers in `convert -c` — compress on every core. The writes still happen
// in the order the compressions finish, one request at a time as before.
#include <zlib.h>
#include <zstd.h>

#include <functional>
#include <optional>

#include "drivers/qcow2/qcow2.h"

namespace vblk::qcow2 {

namespace {

// Below this cluster size a trip through the thread pool costs more than
// compressing on the loop thread.
constexpr uint64_t kOffloadMinCluster = 16 << 10;

// Compresses `in` into at most out.size() bytes; nullopt if it does not fit.
std::optional<size_t> compress(uint8_t type, std::span<const uint8_t> in, std::span<uint8_t> out) {
  if (type == kCompressionZstd) {
    ZSTD_CCtx* c = ZSTD_createCCtx();
    if (!c) return std::nullopt;
    ZSTD_outBuffer ob{out.data(), out.size(), 0};
    ZSTD_inBuffer ib{in.data(), in.size(), 0};
    // One call: anything but "done" means the output buffer was too small.
    size_t r = ZSTD_compressStream2(c, &ob, &ib, ZSTD_e_end);
    ZSTD_freeCCtx(c);
    if (r != 0) return std::nullopt;
    return ob.pos;
  }
  z_stream z{};
  if (deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, -12, 9, Z_DEFAULT_STRATEGY) != Z_OK) return std::nullopt;
  z.next_in = const_cast<uint8_t*>(in.data());
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  int r = deflate(&z, Z_FINISH);
  size_t n = out.size() - z.avail_out;
  deflateEnd(&z);
  if (r != Z_STREAM_END) return std::nullopt;
  return n;
}

}  // namespace

Task<Status> Qcow2Node::write_compressed(uint64_t offset, std::span<const uint8_t> buf) {
  if (offset % cs_) co_return Error(EINVAL);
  if (buf.size() % cs_ && offset + buf.size() != length()) co_return Error(EINVAL);
  AlignedBuffer in(cs_), out(cs_);
  // QEMU writes the clusters as parallel tasks: one failing cluster (already
  // allocated) does not stop the others. The first error is returned.
  Status first_error;
  for (size_t done = 0; done < buf.size();) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(cs_, buf.size() - done));
    // The last cluster of an image whose size is not a cluster multiple is
    // compressed padded with zeroes.
    in.zero();
    std::memcpy(in.data(), buf.data() + done, n);
    std::optional<size_t> len;
    if (cs_ >= kOffloadMinCluster) {
      std::function<long()> job = [&] {
        len = compress(h_.compression_type, in.span(), out.span().subspan(0, cs_ - 1));
        return 0L;
      };
      (void)co_await loop().run_blocking(job);
    } else {
      len = compress(h_.compression_type, in.span(), out.span().subspan(0, cs_ - 1));
    }
    Status st;
    if (!len) {
      st = co_await do_write(offset + done, buf.subspan(done, n), 0);
    } else {
      st = co_await write_compressed_cluster(offset + done, out.span().subspan(0, *len));
    }
    if (!st && first_error.ok()) first_error = st;
    done += n;
  }
  co_return first_error;
}

Task<Status> Qcow2Node::write_compressed_cluster(uint64_t guest, std::span<const uint8_t> data) {
  auto guard = co_await lock_.scoped();
  const uint64_t ci = guest / cs_;
  co_await wait_allocs(ci, ci);  // an allocating write into this cluster goes first
  const uint64_t l2i = ci & (l2_entries_ - 1);
  {
    auto t = co_await l2_for_write(guest);
    if (!t) co_return t.take_error();
    uint64_t old = l2_entry(*t, l2i);
    // Compression cannot overwrite anything (QEMU fails the same way).
    if (old & (kL2OffsetMask | kOflagCompressed)) co_return Error(EIO);
  }
  auto host = co_await alloc_bytes(data.size());
  if (!host) co_return host.take_error();

  AllocClaim claim(*this, ci, ci);
  guard.unlock();
  if (uint32_t ol = overlaps(0, *host, data.size())) co_return co_await refuse_overlap(ol, *host, data.size());
  auto st = co_await file_->write(*host, data);
  if (!st) {
    co_await guard.relock();
    co_return co_await abort_alloc(*host, data.size(), st.error());
  }

  co_await guard.relock();
  // The data and the refcounts reach the disk before the entry does.
  l2_cache_->depends_on_flush();
  // Lazy refcounts: the dirty bit instead of the refcount-before-L2 order.
  if (lazy_refcounts_) VBLK_CO_TRY(co_await mark_dirty());
  if (!dirty_flag()) VBLK_CO_TRY(co_await l2_cache_->set_dependency(rb_cache_.get()));
  auto t = co_await l2_for_write(guest);
  if (!t) co_return t.take_error();
  // Descriptor (qcow2.txt): host offset in the low x = 62 - (cluster_bits - 8)
  // bits, then the number of 512-byte sectors it spans beyond the first.
  const uint32_t x = 62 - (h_.cluster_bits - 8);
  uint64_t extra_sectors = ((*host + data.size() - 1) >> 9) - (*host >> 9);
  set_l2_entry(*t, l2i, *host | kOflagCompressed | (extra_sectors << x), 0);
  co_return Status{};
}

}  // namespace vblk::qcow2
