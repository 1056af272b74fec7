// Opening a qcow2 image: header checks, tables, caches, backing file.
#include <fmt/format.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "drivers/qcow2/qcow2.h"
#include "perm_rules.h"
#include "vblk/buffer.h"
#include "vblk/chain.h"

namespace vblk::qcow2 {

Qcow2Node::Qcow2Node(Loop& loop, std::shared_ptr<Node> file) : Node(loop, "qcow2"), file_(file.get()), lock_(loop) {
  // The image grows at the bottom of its file child, through any filters
  // in between (blkdebug over the file): QEMU lets every node below a
  // format be written past its end.
  for (Node* n = file_; n; n = filtered_child(*n)) n->set_growable(true);
  set_format(this);
  limits_.request_alignment = file_->limits().request_alignment;
  limits_.buffer_alignment = file_->limits().buffer_alignment;
  caps_.zeroes = true;
  caps_.discard = true;
  caps_.compressed_writes = true;
  caps_.serialise_zeroes = true;
  caps_.supports_backing = true;
  add_child("file", std::move(file));
}

Qcow2Node::~Qcow2Node() = default;

PermPair Qcow2Node::child_perm(const Child& c, PermPair self) const {
  if (c.role == "backing") return perm_rules::cow(self);
  return perm_rules::storage(self, true, true, !read_only(), no_io_);
}

Task<Status> Qcow2Node::write_header() {
  auto buf = serialize_header(h_);
  if (!buf) co_return buf.take_error();
  AlignedBuffer b(buf->size());
  std::memcpy(b.data(), buf->data(), buf->size());
  VBLK_CO_TRY(co_await file_->write(0, b.span()));
  co_return co_await file_->flush();
}

Task<Status> Qcow2Node::write_header_as(Header h) {
  std::swap(h, h_);
  Status st = co_await write_header();
  if (!st.ok()) std::swap(h, h_);
  co_return st;
}

Task<Status> Qcow2Node::set_backing(std::shared_ptr<Node> backing, const std::string& file, const std::string& fmt) {
  // The header names the new backing file before reads go there: a crash
  // in between leaves an image that reads as the new chain does.
  // (Named first: no temporaries made by ?: inside a co_await, which GCC
  // 12 miscompiles.)
  const std::string name = backing ? file : std::string();
  const std::string format = backing ? fmt : std::string();
  VBLK_CO_TRY(co_await change_backing_file(name, format));
  backing_ = backing.get();
  replace_child("backing", std::move(backing));
  (void)refresh_perms();
  co_return Status{};
}

Task<Status> Qcow2Node::change_backing_file(const std::string& file, const std::string& fmt) {
  if (read_only() || corrupt()) co_return Error(EACCES);
  // QEMU's qcow2_change_backing_file: the header field holds 1023 bytes.
  if (file.size() > 1023) co_return Error(EINVAL);
  auto g = co_await lock_.scoped();
  Header h = h_;
  h.backing_file = file;
  h.backing_format = file.empty() ? std::string() : fmt;
  const bool rename = !h.backing_file.empty() && !h_.backing_file.empty() && h.backing_format == h_.backing_format &&
                      h.backing_file != h_.backing_file;
  if (rename) co_return co_await rename_backing(std::move(h));
  co_return co_await write_header_as(std::move(h));
}

// The header names another backing file of the same format, the change
// atomic under a power cut even where the drive tears the header cluster's
// write at sector boundaries: the name sits after the extensions, often in
// a sector after the one holding its offset and length, and one write of
// both could land half (the old length over the new name: "base.qcow" for
// "base.qcow2", found by vblk_power_loss_jobs). So the new name goes to a
// place the old one does not use, written and flushed first; then the first
// sector alone (its offset and length) switches to it. Until then the old
// header, its name untouched, holds.
Task<Status> Qcow2Node::rename_backing(Header h) {
  constexpr uint64_t kHeaderSector = 512;  // what a drive writes whole
  h.backing_file_offset = 0;
  auto std_layout = serialize_header(h);
  if (!std_layout) co_return std_layout.take_error();
  const uint64_t slot = be64((*std_layout).data() + 8);  // right after the extensions
  const uint64_t cs = cs_;
  const uint64_t old_at = h_.backing_file_offset, old_len = h_.backing_file.size();
  // The other of two slots 1 KiB apart (a name is at most 1023 bytes).
  uint64_t at = old_at == slot ? slot + 1024 : slot;
  if (at < old_at + old_len && old_at < at + h.backing_file.size()) at = old_at + 1024;
  if (cs < 4096 || at + h.backing_file.size() > cs || old_at < slot) {
    // Too small a cluster for two slots (512 B: one sector, atomic
    // anyway), or a name inside the extensions' area: in place.
    co_return co_await write_header_as(std::move(h));
  }
  h.backing_file_offset = at;
  auto buf = serialize_header(h);
  if (!buf) co_return buf.take_error();
  std::vector<uint8_t>& b = *buf;
  // The old name stays where it is until nothing points at it.
  std::memcpy(b.data() + old_at, h_.backing_file.data(), old_len);
  // Step 1: the sectors of the new name, the first sector still pointing
  // at the old one.
  const uint64_t s0 = align_down(at, kHeaderSector), s1 = align_up(at + h.backing_file.size(), kHeaderSector);
  AlignedBuffer first(s1 - s0);
  std::memcpy(first.data(), b.data() + s0, s1 - s0);
  if (s0 == 0) {
    put64(first.data() + 8, old_at);
    put32(first.data() + 16, static_cast<uint32_t>(old_len));
  }
  VBLK_CO_TRY(co_await file_->write(s0, first.span()));
  VBLK_CO_TRY(co_await file_->flush());
  // Step 2: the first sector, with the new offset and length.
  AlignedBuffer sector(kHeaderSector);
  std::memcpy(sector.data(), b.data(), kHeaderSector);
  VBLK_CO_TRY(co_await file_->write(0, sector.span()));
  VBLK_CO_TRY(co_await file_->flush());
  h_ = h;
  co_return Status{};
}

Task<Status> Qcow2Node::mark_dirty() {
  if (h_.incompatible_features & kIncompatDirty) co_return Status{};
  // Everything written so far is consistent on disk before the bit says
  // it may not be.
  VBLK_CO_TRY(co_await file_->flush());
  uint8_t b[8];
  put64(b, h_.incompatible_features | kIncompatDirty);
  VBLK_CO_TRY(co_await file_->write(72, {b, 8}));
  VBLK_CO_TRY(co_await file_->flush());
  h_.incompatible_features |= kIncompatDirty;
  co_return Status{};
}

Task<Status> Qcow2Node::mark_clean() {
  if (!(h_.incompatible_features & kIncompatDirty)) co_return Status{};
  // Refcounts complete on disk first, then the bit cleared.
  VBLK_CO_TRY(co_await do_flush());
  auto g = co_await lock_.scoped();
  uint8_t b[8];
  put64(b, h_.incompatible_features & ~kIncompatDirty);
  VBLK_CO_TRY(co_await file_->write(72, {b, 8}));
  VBLK_CO_TRY(co_await file_->flush());
  h_.incompatible_features &= ~kIncompatDirty;
  co_return Status{};
}

namespace {

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

Status validate_table(uint64_t offset, uint64_t entries, uint64_t entry_len, uint64_t max_bytes, uint64_t cs,
                      const char* name) {
  if (entries > max_bytes / entry_len) return Error(EFBIG, fmt::format("{} too large", name));
  if (static_cast<uint64_t>(INT64_MAX) - entries * entry_len < offset || offset % cs)
    return Error(EINVAL, fmt::format("{} offset invalid", name));
  return {};
}

}  // namespace

Task<Status> Qcow2Node::load(OpenContext& ctx, bool ro) {
  // The header and its extensions live in the first cluster (at most
  // 2 MiB); its first 4 KiB say how big that is. Only the cluster is read,
  // as QEMU does: reading 2 MiB of a small-cluster image reads guest data
  // too (an injected read error there failed the open, which QEMU's passes).
  const uint64_t flen = file_->length();
  uint64_t first = std::min<uint64_t>(flen, 4096);
  AlignedBuffer probe(4096);
  probe.zero();
  if (first) VBLK_CO_TRY(co_await file_->read(0, probe.span().subspan(0, first)));
  uint64_t head_len = first;
  if (flen > 4096) {
    const uint32_t cluster_bits = be32(probe.data() + 20);
    head_len = std::min<uint64_t>(flen, cluster_bits >= 12 && cluster_bits <= 21 ? 1ull << cluster_bits : 4096);
  }
  AlignedBuffer head(std::max<uint64_t>(512, head_len));
  head.zero();
  std::memcpy(head.data(), probe.data(), first);
  if (head_len > first) VBLK_CO_TRY(co_await file_->read(first, head.span().subspan(first, head_len - first)));
  auto h = parse_header(head.span(), flen);
  if (!h) co_return h.take_error();
  h_ = std::move(*h);
  cs_ = h_.cluster_size();
  if ((h_.incompatible_features & kIncompatCorrupt) && !ro && !ctx.check)
    co_return Error(EACCES, "qcow2: Image is corrupt; cannot be opened read/write");

  // vblk has no external data files; QEMU refuses this combination for I/O.
  if ((h_.autoclear_features & kAutoclearDataFileRaw) && !ctx.no_io)
    co_return Error(EINVAL, "data-file-raw requires a data file");

  l2_entry_size_ = h_.extended_l2() ? 16 : 8;
  l2_entries_ = cs_ / l2_entry_size_;
  l2_bits_ = static_cast<uint32_t>(__builtin_ctzll(l2_entries_));
  refcount_bits_ = 1u << h_.refcount_order;
  refcount_max_ = refcount_bits_ == 64 ? UINT64_MAX : (1ull << refcount_bits_) - 1;
  rb_entries_ = cs_ * 8 / refcount_bits_;

  if (h_.refcount_table_clusters == 0 && !ctx.check)
    co_return Error(EINVAL, "Image does not contain a reference count table");
  VBLK_CO_TRY(validate_table(h_.refcount_table_offset, uint64_t(h_.refcount_table_clusters) * cs_ / 8, 8,
                             kMaxRefcountTableBytes, cs_, "Reference count table"));
  // The snapshot table is not read in check mode: check reports on it.
  if (!ctx.check)
    VBLK_CO_TRY(validate_table(h_.snapshots_offset, h_.nb_snapshots, kSnapshotHeaderBytes,
                               uint64_t{kSnapshotHeaderBytes} * kMaxSnapshots, cs_, "Snapshot table"));
  VBLK_CO_TRY(validate_table(h_.l1_table_offset, h_.l1_size, 8, kMaxL1Bytes, cs_, "Active L1 table"));
  // The L1 table must cover the virtual size.
  uint64_t per_l1 = cs_ * l2_entries_;
  // QEMU's limit: the L1 index of the last cluster must fit in an int.
  if (h_.size / per_l1 > static_cast<uint64_t>(INT32_MAX) || h_.size > static_cast<uint64_t>(INT64_MAX) - per_l1)
    co_return Error(EFBIG, "Image is too big");
  uint64_t need_l1 = (h_.size + per_l1 - 1) / per_l1;
  if (h_.l1_size < need_l1) co_return Error(EINVAL, "L1 table is too small");

  // Tables. Reads past the end of the file return zeroes (file is growable),
  // and entries are validated where they are used.
  std::vector<uint64_t> l1(h_.l1_size, 0);
  if (h_.l1_size) {
    AlignedBuffer b(align_up(uint64_t(h_.l1_size) * 8, 512));
    auto st = co_await file_->read(h_.l1_table_offset, b.span());
    if (!st) co_return st.error().prefixed("Could not read L1 table");
    for (uint64_t i = 0; i < h_.l1_size; ++i) l1[i] = be64(b.data() + i * 8);
  }
  l1_.assign(std::move(l1));
  uint64_t rt_entries = uint64_t(h_.refcount_table_clusters) * cs_ / 8;
  {
    AlignedBuffer b(rt_entries * 8);
    auto st = co_await file_->read(h_.refcount_table_offset, b.span());
    if (!st) co_return st.error().prefixed("Could not initialize refcount handling");
    std::vector<uint64_t> rt(rt_entries);
    for (uint64_t i = 0; i < rt_entries; ++i) rt[i] = be64(b.data() + i * 8);
    rt_.assign(std::move(rt));
  }

  // Caches, sized like QEMU's defaults: enough L2 to map the whole disk up to
  // 32 MiB, a quarter of that for refcounts; options override (open()).
  uint64_t l2_bytes = std::min<uint64_t>(32ull << 20, std::max<uint64_t>(need_l1 * cs_, 2 * cs_));
  uint64_t rb_bytes = std::max<uint64_t>(4 * cs_, l2_bytes / 4);
  l2_cache_ = std::make_unique<MetaCache>(*file_, cs_, l2_bytes / cs_);
  rb_cache_ = std::make_unique<MetaCache>(*file_, cs_, rb_bytes / cs_);
  // Write-backs may overlap only their own kind (an L2 table is an L2 table,
  // active or not: snapshot operations rewrite inactive ones).
  l2_cache_->set_write_check([this](uint64_t off, uint64_t len) -> Task<Status> {
    if (uint32_t ol = overlaps(kOlActiveL2 | kOlInactiveL2, off, len)) co_return co_await refuse_overlap(ol, off, len);
    co_return Status{};
  });
  rb_cache_->set_write_check([this](uint64_t off, uint64_t len) -> Task<Status> {
    if (uint32_t ol = overlaps(kOlRefcountBlock, off, len)) co_return co_await refuse_overlap(ol, off, len);
    co_return Status{};
  });

  set_length(h_.size / 512 * 512);  // QEMU counts whole sectors
  set_read_only(ro);
  VBLK_CO_TRY(co_await open_crypto(ctx));
  if (!ctx.check) VBLK_CO_TRY(co_await read_snapshots());

  co_return Status{};
}

Result<std::shared_ptr<Node>> Qcow2Node::open(OpenContext& ctx, Json& opts) {
  auto ro = take_bool(opts, "read-only");
  VBLK_TRY(ro);
  bool read_only = ro->value_or(ctx.read_only);
  OpenContext cctx = ctx;
  cctx.read_only = read_only;
  auto l2size = take_size(opts, "l2-cache-size");
  VBLK_TRY(l2size);
  auto rbsize = take_size(opts, "refcount-cache-size");
  VBLK_TRY(rbsize);
  auto csize = take_size(opts, "cache-size");
  VBLK_TRY(csize);
  auto lazy = take_bool(opts, "lazy-refcounts");
  VBLK_TRY(lazy);
  for (const char* k : {"pass-discard-request", "pass-discard-snapshot", "pass-discard-other"}) {
    auto v = take_bool(opts, k);
    VBLK_TRY(v);
  }
  auto overlap = take_overlap_options(opts);
  VBLK_TRY(overlap);
  // Not acted on (vblk's caches are bounded, not aged), but checked as
  // QEMU checks it: a bad value is an error, not silently ignored.
  auto clean = take_number(opts, "cache-clean-interval");
  VBLK_TRY(clean);
  if (clean->value_or(0) > UINT32_MAX) return Error(EINVAL, "Cache clean interval too big");
  // encrypt.format and encrypt.key-secret (QEMU's QCryptoBlockOpenOptions
  // for qcow2), nested or flat; checked against the header in load.
  std::optional<std::string> encrypt_format, key_secret;
  if (auto enc = take_dict(opts, "encrypt")) {
    auto f = take_string(*enc, "format");
    VBLK_TRY(f);
    auto k = take_string(*enc, "key-secret");
    VBLK_TRY(k);
    if (!enc->empty()) return Error(EINVAL, "Invalid parameter 'encrypt." + enc->begin().key() + "'");
    encrypt_format = *f;
    key_secret = *k;
  }
  bool no_backing = false;
  if (opts.contains("backing") && opts["backing"].is_null()) {
    opts.erase("backing");
    no_backing = true;
  }
  auto file = open_child(cctx, opts, "file", true);
  VBLK_TRY(file);
  // `backing` given (a node name or options, as fleecing's temporary image
  // backed by the node it snapshots) overrides the header's backing file.
  std::shared_ptr<Node> given_backing;
  if (opts.contains("backing")) {
    auto b = open_child(cctx, opts, "backing", true);
    VBLK_TRY(b);
    given_backing = *b;
    no_backing = true;
  }
  auto node = std::make_shared<Qcow2Node>(ctx.loop, *file);
  node->set_node_name(ctx.node_name);
  // The file's locks before the first write (a dirty image's repair, the
  // bitmaps' in_use bits): a writable qcow2 node writes its file whoever
  // its users turn out to be.
  node->set_read_only(read_only);
  node->no_io_ = ctx.no_io;
  node->encrypt_format_ = std::move(encrypt_format);
  node->key_secret_ = std::move(key_secret);
  VBLK_TRY(node->refresh_perms());
  node->overlap_check_ = *overlap;
  auto st = ctx.loop.run(node->load(cctx, read_only));
  VBLK_TRY(st);
  node->lazy_refcounts_ = lazy->value_or(node->h_.compatible_features & kCompatLazyRefcounts);
  if (node->lazy_refcounts_ && node->h_.version < 3)
    return Error(EINVAL, "Lazy refcounts require a qcow2 image with at least qemu 1.1 compatibility level");
  // Autoclear bits vblk does not know describe structures it will not keep
  // up to date: a read-write open clears them (QEMU's qcow2_do_open), so the
  // program that set them knows its data went stale.
  if (!read_only && (node->h_.autoclear_features & ~kAutoclearKnown)) {
    node->h_.autoclear_features &= kAutoclearKnown;
    auto hst = ctx.loop.run(node->write_header());
    VBLK_TRY(hst);
  }
  // An image left dirty by lazy refcounts is repaired before it is written
  // to (QEMU's qcow2_do_open): leaks and errors fixed, the bit cleared. Read
  // only, it is used as it is: reads do not depend on refcounts.
  if (node->dirty_flag() && !read_only && !ctx.check) {
    auto r = ctx.loop.run(node->check(kCheckFixLeaks | kCheckFixErrors));
    int err = !r ? r.error().code : (r->check_errors ? EIO : 0);
    if (err) return Error(err, std::string("Could not repair dirty image: ") + std::strerror(err));
  }
  // Persistent dirty bitmaps, after the repair (marking them in_use may
  // allocate clusters). `info` (no_io) loads them too, as QEMU does.
  if (!ctx.check) {
    auto bst = ctx.loop.run(node->load_bitmaps(read_only));
    VBLK_TRY(bst);
  }
  // Backing file: relative to this image's directory; format from the
  // header, or probed.
  if (!node->h_.backing_file.empty() && !no_backing) {
    std::string path = node->h_.backing_file;
    path = path_combine((*file)->filename(), path);
    // A chain that comes back to one of its own images never ends.
    auto chain = ctx.chain ? ctx.chain : std::make_shared<std::vector<std::string>>();
    if (chain->empty()) chain->push_back(real_path((*file)->filename()));
    std::string real = real_path(path);
    for (const auto& seen : *chain)
      if (seen == real) return Error(ELOOP, "Backing file '" + node->h_.backing_file + "' creates an infinite loop.");
    chain->push_back(real);
    ImageOpenOptions bo;
    bo.format = node->h_.backing_format;
    bo.read_only = true;
    bo.direct = ctx.cache_direct;
    OpenContext bctx = ctx;
    bctx.graph = nullptr;
    bctx.check = false;
    bctx.chain = chain;
    auto b = open_image(bctx, path, bo);
    if (!b) return b.error().prefixed("Could not open backing file");
    node->backing_ = b->get();
    node->add_child("backing", *b);
  }
  if (given_backing) {
    node->backing_ = given_backing.get();
    node->add_child("backing", std::move(given_backing));
  }
  if (*l2size) node->l2_cache_->set_capacity(**l2size / node->cs_);
  if (*rbsize) node->rb_cache_->set_capacity(**rbsize / node->cs_);
  if (*csize && !*l2size) {
    node->l2_cache_->set_capacity(**csize * 4 / 5 / node->cs_);
    node->rb_cache_->set_capacity(std::max<uint64_t>(4, **csize / 5 / node->cs_));
  }
  return std::shared_ptr<Node>(node);
}

Task<Status> Qcow2Node::do_close() {
  // A fatal corruption during a repair is QEMU's bs->drv = NULL: the close
  // writes nothing back (the caches' repairs are lost, as in qemu-img).
  if (read_only() || check_dead_) co_return Status{};
  if (!corrupt()) {
    auto g = co_await lock_.scoped();
    VBLK_CO_TRY(co_await store_bitmaps());
  }
  VBLK_CO_TRY(co_await flush());
  // QEMU clears the dirty bit on close only if the caches made it to disk.
  if (!corrupt()) VBLK_CO_TRY(co_await mark_clean());
  co_return Status{};
}

}  // namespace vblk::qcow2

namespace vblk::qcow2 {

std::optional<FormatInfo> Qcow2Node::format_info() const {
  Qcow2Info d;
  d.compat = h_.version >= 3 ? "1.1" : "0.10";
  if (h_.version >= 3) {
    d.lazy_refcounts = bool(h_.compatible_features & kCompatLazyRefcounts);
    d.corrupt = corrupt();
  }
  d.refcount_bits = refcount_bits_;
  d.encrypt = encrypt_info();
  d.bitmaps = bitmaps_info();
  d.compression_type = h_.compression_type == kCompressionZstd ? "zstd" : "zlib";
  if (h_.version >= 3) d.extended_l2 = h_.extended_l2();
  return d;
}

}  // namespace vblk::qcow2
