// The snapshot table as qemu-img prints it (bdrv_snapshot_dump), shared by
// `snapshot -l` and `info`.
#include <cstdio>
#include <ctime>

#include "common.h"

namespace vblk::cli {

void dump_snapshot_header() {
  std::printf("%-10s%-17s%8s%20s%13s%11s", "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT");
}

void dump_snapshot(const SnapshotInfo& sn) {
  char date[128], clock[128], icount[128] = {0};
  time_t t = static_cast<time_t>(sn.date_sec);
  struct tm tm;
  localtime_r(&t, &tm);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S", &tm);
  int64_t secs = static_cast<int64_t>(sn.vm_clock_nsec / 1000000000ull);
  std::snprintf(clock, sizeof clock, "%02d:%02d:%02d.%03d", static_cast<int>(secs / 3600),
                static_cast<int>((secs / 60) % 60), static_cast<int>(secs % 60),
                static_cast<int>((sn.vm_clock_nsec / 1000000) % 1000));
  if (sn.icount != UINT64_MAX) std::snprintf(icount, sizeof icount, "%lld", static_cast<long long>(sn.icount));
  std::printf("%-9s %-16s %8s%20s%13s%11s", sn.id.c_str(), sn.name.c_str(), size_to_str(sn.vm_state_size).c_str(), date,
              clock, icount);
}

void dump_snapshots(const std::vector<SnapshotInfo>& list) {
  if (list.empty()) return;
  std::printf("Snapshot list:\n");
  dump_snapshot_header();
  std::printf("\n");
  for (const auto& sn : list) {
    dump_snapshot(sn);
    std::printf("\n");
  }
}

}  // namespace vblk::cli
