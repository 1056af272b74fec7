// Creating qcow2 images and changing their size.
#include <fmt/format.h>

#include "drivers/qcow2/qcow2.h"
#include "vblk/buffer.h"

namespace vblk::qcow2 {

Status Qcow2Node::check_create_size(uint64_t size, uint32_t cluster_size, bool extended_l2) {
  uint64_t per_l1 = uint64_t(cluster_size) * (cluster_size / (extended_l2 ? 16 : 8));
  uint64_t l1 = (size + per_l1 - 1) / per_l1;
  if (size > static_cast<uint64_t>(INT64_MAX) - per_l1 || l1 * 8 > kMaxL1Bytes)
    return Error(EFBIG, "The image size is too large for file format 'qcow2' (try using a larger cluster size)");
  return {};
}

Status Qcow2Node::check_create_options(const CreateOptions& o, int64_t refcount_bits) {
  if (o.size % 512) return Error(EINVAL, "Image size must be a multiple of 512 bytes");
  const uint64_t cs = o.cluster_size;
  if (o.extended_l2 && o.version < 3)
    return Error(EINVAL,
                 "Extended L2 entries are only supported with compatibility level 1.1 and above (use version=v3 or "
                 "greater)");
  if (cs < 512 || cs > (2u << 20) || (cs & (cs - 1)))
    return Error(EINVAL, "Cluster size must be a power of two between 512 and 2048k");
  if (o.extended_l2 && cs < 16384)
    return Error(EINVAL, "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes");
  if (!o.backing_file.empty() && o.preallocation != "off" && !o.extended_l2)
    return Error(EINVAL, "Backing file and preallocation can only be used at the same time if extended_l2 is on");
  if (!o.backing_format.empty() && o.backing_file.empty())
    return Error(EINVAL, "Backing format cannot be used without backing file");
  if (o.version < 3 && o.lazy_refcounts)
    return Error(EINVAL,
                 "Lazy refcounts only supported with compatibility level 1.1 and above (use version=v3 or greater)");
  if (refcount_bits <= 0 || refcount_bits > 64 || (refcount_bits & (refcount_bits - 1)))
    return Error(EINVAL, "Refcount width must be a power of two and may not exceed 64 bits");
  if (o.version < 3 && refcount_bits != 16)
    return Error(EINVAL,
                 "Different refcount widths than 16 bits require compatibility level 1.1 or above (use version=v3 or "
                 "greater)");
  if (o.compression_type != kCompressionZlib && o.version < 3)
    return Error(EINVAL,
                 "Non-zlib compression type is only supported with compatibility level 1.1 and above (use "
                 "version=v3 or greater)");
  return {};
}

Task<Status> Qcow2Node::do_truncate(uint64_t length, bool) { co_return co_await resize(length); }

Task<Status> Qcow2Node::do_truncate_prealloc(uint64_t length, bool, Prealloc p) {
  co_return co_await resize(length, p);
}

Task<Status> Qcow2Node::resize(uint64_t size, Prealloc prealloc) {
  if (size % 512) co_return Error(EINVAL, "The new size must be a multiple of 512");
  // v2 did not require snapshots to record their disk size (QEMU's rule).
  if (h_.nb_snapshots && h_.version < 3) co_return Error(ENOTSUP, "Can't resize a v2 image which has snapshots");
  if (size < h_.size && prealloc != Prealloc::Off)
    co_return Error(EINVAL, "Preallocation can't be used for shrinking an image");
  if (size < h_.size) co_return co_await shrink(size);
  const uint64_t old_size = h_.size;
  // A backing file longer than the image would show through the new area:
  // QEMU's generic truncate asks for it to read as zeroes then. falloc and
  // full preallocation get zeroes from the file already (QEMU's qcow2 hands
  // the request down with the file's truncate and zeroes nothing itself).
  const bool zero_new = size > old_size && backing_ && backing_->length() > old_size && prealloc != Prealloc::Falloc &&
                        prealloc != Prealloc::Full;
  const uint64_t unit = l2_entry_size_ == 16 ? cs_ / kSubclusters : cs_;
  const uint64_t zero_start = std::min(align_up(old_size, unit), size);
  {
    auto g = co_await lock_.scoped();
    uint64_t per_l1 = cs_ * l2_entries_;
    uint64_t need = (size + per_l1 - 1) / per_l1;
    if (need * 8 > kMaxL1Bytes) co_return Error(EFBIG, "The image size is too large for file format 'qcow2'");
    if (need > h_.l1_size) VBLK_CO_TRY(co_await grow_l1_table(need));
    if (prealloc == Prealloc::Metadata) VBLK_CO_TRY(co_await prealloc_metadata(old_size, size));
    if (prealloc == Prealloc::Falloc || prealloc == Prealloc::Full)
      VBLK_CO_TRY(co_await prealloc_data(old_size, size, prealloc));
    if (zero_new && size > zero_start) {
      // Whole units become zero clusters (over any preallocation, which
      // stays allocated), as QEMU's qcow2_subcluster_zeroize with no flags.
      set_length(size);  // zeroize treats the image's end as a whole unit
      auto r = co_await zeroize(zero_start, size - zero_start, false);
      set_length(old_size);
      if (r && !*r) r = Error(ENOTSUP);  // v2 has no zero flag
      if (!r) co_return r.error().prefixed("Failed to zero out new clusters");
    }
  }
  if (zero_new && zero_start > old_size) {
    // The unit the old end falls in: its new part is written as data
    // zeroes (the rest of it is still guest data).
    AlignedBuffer z(zero_start - old_size);
    z.zero();
    auto st = co_await do_write(old_size, z.span(), 0);
    if (!st) co_return st.error().prefixed("Failed to zero out the new area");
  }
  auto g = co_await lock_.scoped();
  h_.size = size;
  VBLK_CO_TRY(co_await write_header());
  set_length(size);
  VBLK_CO_TRY(co_await l2_cache_->flush());
  co_return co_await rb_cache_->flush();
}

Task<Status> Qcow2Node::grow_l1_table(uint64_t need) {
  // A new, bigger L1 table: written and flushed before the header points to
  // it; the old one is freed afterwards.
  uint64_t clusters = (need * 8 + cs_ - 1) / cs_;
  auto where = co_await alloc_clusters(clusters);
  if (!where) co_return where.take_error();
  AlignedBuffer t(clusters * cs_);
  t.zero();
  for (uint64_t i = 0; i < l1_.size(); ++i) put64(t.data() + i * 8, l1_[i]);
  // Only the entries are written, as QEMU writes them (the rest of the
  // cluster stays a hole; reads past the end of the file are zeroes).
  // A failure before the header points to it leaves the new table
  // unreferenced: its clusters go back (QEMU leaks them).
  auto st = co_await checked_write(0, *where, t.span().subspan(0, need * 8));
  if (st) st = co_await rb_cache_->flush();
  if (!st) co_return co_await abort_alloc(*where, clusters * cs_, st.take_error());
  uint64_t old_off = h_.l1_table_offset, old_size = h_.l1_size;
  h_.l1_table_offset = *where;
  h_.l1_size = static_cast<uint32_t>(need);
  l1_.resize(need);
  VBLK_CO_TRY(co_await write_header());
  if (old_size) VBLK_CO_TRY(co_await update_refcount(old_off, align_up(old_size * 8, cs_), -1));
  co_return Status{};
}

Task<Status> Qcow2Node::create(Loop& loop, std::shared_ptr<Node> file, const CreateOptions& o) {
  const uint64_t cs = o.cluster_size;
  uint32_t order = static_cast<uint32_t>(__builtin_ctz(o.refcount_bits));
  // Header (cluster 0), refcount table (cluster 1), refcount block (cluster
  // 2) describing clusters 0-2; everything else through the allocator.
  Header h;
  h.version = o.version;
  h.cluster_bits = static_cast<uint32_t>(__builtin_ctz(o.cluster_size));
  h.refcount_table_offset = cs;
  h.refcount_table_clusters = 1;
  h.refcount_order = order;
  h.compression_type = o.compression_type;
  if (o.lazy_refcounts) h.compatible_features |= kCompatLazyRefcounts;
  if (o.compression_type != kCompressionZlib) h.incompatible_features |= kIncompatCompression;
  if (o.extended_l2) h.incompatible_features |= kIncompatExtendedL2;
  auto hdr = serialize_header(h);
  if (!hdr) co_return hdr.take_error();
  AlignedBuffer meta(3 * cs);
  meta.zero();
  std::memcpy(meta.data(), hdr->data(), cs);
  put64(meta.data() + cs, 2 * cs);
  Qcow2Node tmp(loop, file);
  tmp.refcount_bits_ = 1u << order;
  for (uint64_t i = 0; i < 3; ++i) tmp.refcount_set(meta.data() + 2 * cs, i, 1);
  if (o.truncate_file) VBLK_CO_TRY(co_await file->truncate(0));
  VBLK_CO_TRY(co_await file->write(0, meta.span()));

  OpenContext ctx{loop};
  VBLK_CO_TRY(co_await tmp.load(ctx, false));
  auto prealloc = parse_prealloc(o.preallocation);
  if (!prealloc) co_return Error(EINVAL, "Parameter 'preallocation' does not accept value '" + o.preallocation + "'");
  if (o.size || *prealloc != Prealloc::Off) VBLK_CO_TRY(co_await tmp.resize(o.size, *prealloc));
  if (!o.backing_file.empty()) {
    tmp.h_.backing_file = o.backing_file;
    tmp.h_.backing_format = o.backing_format;
    VBLK_CO_TRY(co_await tmp.write_header());
  }
  // Encryption last, as QEMU's qcow2_co_create: the volume's clusters
  // follow the L1 table and any preallocated data.
  if (o.encrypt) VBLK_CO_TRY(co_await tmp.set_up_encryption(*o.encrypt));
  co_return co_await tmp.flush();
}

}  // namespace vblk::qcow2
