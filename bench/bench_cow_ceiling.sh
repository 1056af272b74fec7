#!/usr/bin/env bash
# The disk's own ceiling for a point-in-time backup under bench_guest.py's
# guest, with no vblk and no QEMU in the way: fio alone.
#
# bench_guest.py's guest writes 32 KiB at random offsets of a 2 GiB disk,
# iodepth 8; at its rate it overwrites every 64 KiB cluster within a few
# seconds of the backup's start, so whatever keeps the point in time must
# read the old data of nearly the whole disk (2 GiB) from the same disk in
# that window, and, if memory cannot hold it, write it to a local spill or
# fleecing file. This runs the guest for --runtime seconds (default 10)
#   1. alone,
#   2. beside 2 GiB of 64 KiB random reads (the old data), iodepth 4,
#   3. beside those reads and 1.4 GiB of 64 KiB spill writes, iodepth 4,
# each with O_DIRECT on files in DIR (default /var/tmp), and prints the
# guest's IOPS and p99 in each, and what it keeps of case 1.
# Usage: bench/bench_cow_ceiling.sh [DIR] [RUNTIME]
set -euo pipefail
dir=${1:-/var/tmp}
runtime=${2:-10}
work=$(mktemp -d "$dir/vblk-cow-ceiling-XXXXXX")
trap 'rm -rf "$work"' EXIT
dd if=/dev/urandom of="$work/guest.raw" bs=1M count=2048 status=none
dd if=/dev/urandom of="$work/old.raw" bs=1M count=2048 status=none
sync
guest=(--name=guest --filename="$work/guest.raw" --rw=randwrite --bs=32k --iodepth=8 --ioengine=libaio --direct=1
       --time_based --runtime="$runtime" --norandommap)
reads=(--name=cow-reads --filename="$work/old.raw" --rw=randread --bs=64k --iodepth=4 --ioengine=libaio --direct=1
       --size=2g --io_size=2g)
spill=(--name=spill-writes --filename="$work/spill.raw" --rw=write --bs=64k --iodepth=4 --ioengine=libaio --direct=1
       --size=1400m)
report() {
  python3 -c '
import json, sys
label, base = sys.argv[1], float(sys.argv[2])
d = json.load(sys.stdin)
for j in d["jobs"]:
    w, r = j["write"], j["read"]
    if j["jobname"] == "guest":
        iops = w["iops"]
        p99 = w["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e6
        kept = " kept %.1f %%" % (100 * iops / base) if base else ""
        print("%-44s guest %6.0f IOPS p99 %5.2f ms%s" % (label, iops, p99, kept))
        open(sys.argv[3], "w").write(str(iops))
    else:
        mbs = (r["bw_bytes"] + w["bw_bytes"]) / 1e6
        print("%-44s %-12s %5.0f MB/s over %.1f s" % ("", j["jobname"], mbs, j["job_runtime"] / 1000))
' "$1" "$2" "$work/iops"
}
echo "# command: bench/bench_cow_ceiling.sh $dir $runtime; $(date -Is); $(uname -sr); fio $(fio --version)"
echo "# load: $(cut -d' ' -f1-3 /proc/loadavg)"
fio --output-format=json "${guest[@]}" | report "1. guest alone" 0
base=$(cat "$work/iops")
fio --output-format=json "${guest[@]}" "${reads[@]}" | report "2. guest + reads of the old data (2 GiB)" "$base"
fio --output-format=json "${guest[@]}" "${reads[@]}" "${spill[@]}" | report "3. guest + old-data reads + spill writes" "$base"
