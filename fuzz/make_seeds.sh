#!/usr/bin/env bash
# Writes a seed corpus of small qcow2 images into DIR, made by qemu-img and
# filled by qemu-io with varied options: every cluster kind the parser knows
# (normal, zero, compressed zlib/zstd, subclusters), v2 and v3, refcount
# widths, a backing file name, internal snapshots, a dirty (lazy refcount)
# image. Generated at test time so no binaries live in the tree.
#   fuzz/make_seeds.sh DIR
set -euo pipefail
out=$1
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
qemu-img create -q -f raw "$tmp/base.img" 64k
n=0
seed() {  # seed CREATE_OPTS SIZE [qemu-io commands...]
  local opts=$1 size=$2
  shift 2
  n=$((n + 1))
  local img="$tmp/s$n.qcow2"
  qemu-img create -q -f qcow2 -o "$opts" "$img" "$size"
  local args=()
  for c in "$@"; do args+=(-c "$c"); done
  # (|| true: the lazy-refcount seed ends with qemu-io's "abort")
  if [ ${#args[@]} -gt 0 ]; then (qemu-io -f qcow2 "${args[@]}" "$img" >/dev/null 2>&1) 2>/dev/null || true; fi
  cp "$img" "$out/seed-$n.qcow2"
}
w="write -P 0x5a 0 3k"
seed cluster_size=512 64k
seed cluster_size=512 64k "$w" "write -z 8k 2k" "discard 1k 512"
seed cluster_size=512,refcount_bits=1 128k "$w" "write -P 1 100k 4k"
seed cluster_size=512,refcount_bits=64 128k "$w" "write -c -P 2 16k 512"
seed cluster_size=1024,compat=0.10 64k "$w" "write -c -P 3 8k 1k"
seed cluster_size=512,compression_type=zstd 64k "write -c -P 4 0 2k" "$w"
seed cluster_size=4096 1M "$w" "write -c -P 6 64k 8k" "write -z 128k 4k"
seed cluster_size=16384,extended_l2=on 1M "write -P 7 0 3k" "write -z 5k 1k" "write -P 8 20k 2k"
seed cluster_size=512,lazy_refcounts=on 64k "$w" "abort"
seed cluster_size=512,backing_file=base.img,backing_fmt=raw 64k
seed cluster_size=512,refcount_bits=4 2M "$w" "write -P 9 1M 64k"
seed cluster_size=65536 256k "write -P 10 0 64k"
# Internal snapshots: a snapshot table and shared (refcount 2) clusters.
n=$((n + 1))
img="$tmp/s$n.qcow2"
qemu-img create -q -f qcow2 -o cluster_size=512 "$img" 64k
qemu-io -c "$w" "$img" >/dev/null
qemu-img snapshot -c snap1 "$img"
qemu-io -c "write -P 0x11 1k 1k" "$img" >/dev/null
cp "$img" "$out/seed-$n.qcow2"
