#!/usr/bin/env bash
# Records the migration_stream seeds from qemu-system-x86_64 (TCG, never
# run): a machine without RAM (-M none: configuration, device sections,
# vmdesc) and an ISA PC with 1 MiB of RAM and an all-zero 64 KiB BIOS (RAM
# blocks, zero and data pages), 3 KiB and 33 KiB. Byte 0 is the fuzz
# target's piece size (0: the whole stream in one feed).
#   fuzz/record_migration_seeds.sh OUTDIR
set -euo pipefail
out=$1
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
head -c 65536 /dev/zero >"$tmp/bios"
record() {  # NAME PIECE QEMU-ARGS...
  local name=$1 piece=$2
  shift 2
  printf 'migrate "exec:cat > %s"\nquit\n' "$tmp/s" |
    qemu-system-x86_64 -nodefaults -display none -accel tcg -S -monitor stdio "$@" >/dev/null 2>&1
  { printf "\\x$(printf %02x "$piece")"; cat "$tmp/s"; } >"$out/$name"
}
record none-whole 0 -M none
record none-pieces 7 -M none
record isapc-whole 0 -M isapc -m 1 -bios "$tmp/bios"
record isapc-pieces 200 -M isapc -m 1 -bios "$tmp/bios"
