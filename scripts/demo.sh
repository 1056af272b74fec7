#!/usr/bin/env bash
# The built-in demo of what vblk does today: installs what is missing, builds,
# makes a sample image, writes scattered data into it through vblk's io_uring
# engine, inspects it the way qemu-img would, verifies a copy with
# `vblk compare`, and measures throughput beside qemu-img on the same image.
# (It grows into the live point-in-time backup demo as the backup job lands.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
V=$PWD/build/vblk
dir=$(mktemp -d /var/tmp/vblk-demo.XXXXXX)
trap 'rm -rf "$dir"' EXIT
img=$dir/sample.img

echo "== create a 1 GiB sample image"
$V create -f raw "$img" 1G
echo "== write 256 MiB of data in 64 KiB pieces every 256 KiB (O_DIRECT, io_uring)"
$V bench -w -f raw -t none -c 4096 -d 32 -s 64k -S 256k --pattern=0xa5 "$img"
echo "== vblk info"
$V info "$img"
echo "== vblk map (first extents)"
$V map -f raw "$img" >"$dir/map.txt"; head -5 "$dir/map.txt"; echo "... $(($(wc -l <"$dir/map.txt") - 1)) data extents"
echo "== copy it and verify the copy with vblk compare"
cp --sparse=always "$img" "$dir/copy.img"
$V compare -f raw -F raw "$img" "$dir/copy.img"
qemu-img compare -f raw -F raw "$img" "$dir/copy.img" >/dev/null && echo "qemu-img agrees: identical"
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
