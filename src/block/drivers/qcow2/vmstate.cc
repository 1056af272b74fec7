// The VM state area (QEMU's qcow2_save_vmstate / qcow2_load_vmstate).
//
// QEMU stores a snapshot's VM state as guest data past the disk: from the
// first L1 entry the virtual disk does not use (l1_vm_state_index) on, in
// clusters allocated through the active L1/L2 tables like any guest write.
// snapshot_create() copies the whole active L1 table, so the snapshot
// reaches the state too, then drops it from the active tables (it would
// only cost copy-on-write at the next snapshot). A snapshot's state is
// read back through that snapshot's own L1 table, at the offset its own
// disk size gives.
#include <fmt/format.h>

#include <cstring>

#include "drivers/qcow2/qcow2.h"

namespace vblk::qcow2 {

uint64_t Qcow2Node::vm_state_offset(uint64_t disk_size) const {
  const uint32_t shift = h_.cluster_bits + l2_bits_;
  return ((disk_size + (uint64_t{1} << shift) - 1) >> shift) << shift;
}

Task<Status> Qcow2Node::write_vmstate(uint64_t pos, std::span<const uint8_t> buf) {
  if (read_only()) co_return Error(EACCES);
  if (corrupt()) co_return Error(ENOMEDIUM);
  if (buf.empty()) co_return Status{};
  const uint32_t shift = h_.cluster_bits + l2_bits_;
  const uint64_t off = vm_state_offset(length()) + pos;
  if (pos > kMaxL1Bytes / 8 << shift || off + buf.size() < off) co_return Error(EFBIG);
  const uint64_t need = ((off + buf.size() - 1) >> shift) + 1;
  if (need > kMaxL1Bytes / 8) co_return Error(EFBIG);
  if (need > l1_.size()) {
    auto g = co_await lock_.scoped();
    if (need > l1_.size()) {
      // Grown by half at a time, as QEMU grows it for writes: a long
      // stream moves the table a few times, not once per L2 table.
      uint64_t size = std::max<uint64_t>(l1_.size(), 1);
      while (size < need) size = (size * 3 + 1) / 2;
      size = std::min<uint64_t>(size, kMaxL1Bytes / 8);
      VBLK_CO_TRY(co_await grow_l1_table(size));
    }
  }
  co_return co_await do_write(off, buf, 0);
}

Task<Status> Qcow2Node::read_vmstate(uint64_t pos, std::span<uint8_t> buf, const std::string& snapshot_id) {
  if (buf.empty()) co_return Status{};
  uint64_t disk = length();
  const std::vector<uint64_t>* l1 = nullptr;
  if (!snapshot_id.empty()) {
    const int idx = find_snapshot(snapshot_id, "");
    if (idx < 0) co_return Error(ENOENT, "Can't find the snapshot");
    const Snapshot& sn = snapshots_[static_cast<size_t>(idx)];
    if (uint64_t{sn.l1_size} > kMaxL1Bytes / 8 || sn.l1_table_offset % cs_)
      co_return Error(EFBIG, "Snapshot L1 table offset invalid");
    disk = sn.disk_size;
    auto g = co_await lock_.scoped();
    if (vmstate_l1_from_ != sn.l1_table_offset || vmstate_l1_.size() != sn.l1_size) {
      auto t = co_await read_l1(sn.l1_table_offset, sn.l1_size);
      if (!t) co_return t.take_error();
      vmstate_l1_ = std::move(*t);
      vmstate_l1_from_ = sn.l1_table_offset;
    }
    l1 = &vmstate_l1_;
  }
  const uint64_t base = vm_state_offset(disk) + pos;
  if (base < pos) co_return Error(EINVAL);
  size_t done = 0;
  while (done < buf.size()) {
    Mapping m;
    {
      co_await lock_.lock();
      auto r = co_await lookup(base + done, buf.size() - done, false, l1);
      lock_.unlock();
      if (!r) co_return r.take_error();
      m = *r;
    }
    const auto n = static_cast<size_t>(std::min<uint64_t>(m.bytes, buf.size() - done));
    auto out = buf.subspan(done, n);
    // Past the disk a backing file has nothing to show: unwritten state
    // reads as zeroes.
    if (m.type == ClusterType::Unallocated || m.type == ClusterType::UnallocatedAlloc)
      std::memset(out.data(), 0, out.size());
    else
      VBLK_CO_TRY(co_await read_mapping(base + done, m, out));
    done += n;
  }
  co_return Status{};
}

Task<Status> Qcow2Node::discard_vmstate(uint64_t bytes) {
  if (read_only()) co_return Error(EACCES);
  if (corrupt()) co_return Error(ENOMEDIUM);
  if (!bytes) co_return Status{};
  const uint64_t off = vm_state_offset(length());
  auto g = co_await lock_.scoped();
  co_return co_await discard_clusters(off, off + align_up(bytes, cs_), true);
}

}  // namespace vblk::qcow2
