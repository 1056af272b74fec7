#!/usr/bin/env bash
# The built-in demo: installs what is missing, builds, and runs vblk's main
# job on a sample image: `vblk serve` exports a 1 GiB disk over NBD, a full
# backup runs through QMP while a writer rewrites the disk through the
# export, and the backup is verified to equal the disk at backup start
# (scripts/demo_backup.py prints the throughput line). Then a fio guest
# writes through the export for 3 s alone, 3 s during a backup to a 50 MB/s
# target without a buffer and 3 s with vblk's copy-before-write buffer
# (256 MiB + spill file; scripts/demo_guest.py: three lines of IOPS). Then
# it measures 4 KiB and 1 MiB reads beside qemu-img on the same image.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh --vblk-only
V=$PWD/build/vblk
dir=$(mktemp -d /var/tmp/vblk-demo.XXXXXX)
trap 'rm -rf "$dir"' EXIT

echo "== the main job: a live point-in-time backup of a disk that is being written"
python3 scripts/demo_backup.py "$V" "$dir" 1024
echo "== what the guest feels: its write rate alone, during a backup to a slow target, and with a COW buffer"
python3 scripts/demo_guest.py "$V" "$dir" 512 3 50
img=$dir/disk.raw
echo "== vblk info of the sample disk"
$V info "$img"
echo "== 4 KiB random-ish reads, queue depth 32, O_DIRECT: vblk vs qemu-img on the same image"
rate() {  # prints "N IOPS, M MB/s" from a bench run of $2 requests of $3 bytes
  local out secs
  out=$("${@:4}")
  secs=$(sed -n 's/Run completed in \([0-9.]*\) seconds./\1/p' <<<"$out")
  awk -v s="$secs" -v n="$2" -v b="$3" -v who="$1" \
    'BEGIN { printf "%-9s %8.0f IOPS  %7.1f MB/s  (%s s)\n", who, n/s, n*b/s/1e6, s }'
}
args=(bench -f raw -t none -i io_uring -c 100000 -d 32 -S 1069056)
rate vblk 100000 4096 "$V" "${args[@]}" "$img"
rate qemu-img 100000 4096 qemu-img "${args[@]}" "$img"
echo "== 1 MiB sequential reads, queue depth 8, O_DIRECT"
args=(bench -f raw -t none -i io_uring -c 2048 -d 8 -s 1M)
rate vblk 2048 1048576 "$V" "${args[@]}" "$img"
rate qemu-img 2048 1048576 qemu-img "${args[@]}" "$img"
