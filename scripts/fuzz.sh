#!/usr/bin/env bash
# Builds the libFuzzer targets with clang in build-fuzz/ and fuzzes one of
# them (TARGET, default qcow2: see docs/fuzzing.md for the list) for SECONDS
# (default 60), starting from its seeds (fresh qemu-img images for qcow2,
# fuzz/seeds/TARGET/ for the others) plus the corpus kept from earlier runs
# (build-fuzz/corpus/TARGET). Exit status is non-zero when the fuzzer found
# a crash, leak, timeout or sanitizer report; the reproducer is left in
# build-fuzz/artifacts/TARGET/.
#   scripts/fuzz.sh [--build-only] [--target TARGET] [SECONDS] [libFuzzer flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=0
target=qcow2
targets="qcow2 nbd_server nbd_client qmp options migration_stream"
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) build_only=1; shift ;;
    --target) target=$2; shift 2 ;;
    *) break ;;
  esac
done
case " $targets " in
  *" $target "*) ;;
  *) echo "fuzz.sh: unknown target '$target' (one of: $targets)" >&2; exit 2 ;;
esac
secs=${1:-60}
shift || true
CXX=${VBLK_FUZZ_CXX:-clang++} cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVBLK_FUZZ=ON >/dev/null
if [ "$build_only" = 1 ]; then
  ninja -C build-fuzz -j "${VBLK_FUZZ_JOBS:-$(nproc)}" $(printf 'fuzz_%s ' $targets)
  exit 0
fi
ninja -C build-fuzz -j "${VBLK_FUZZ_JOBS:-$(nproc)}" "fuzz_$target"
seeds=build-fuzz/seeds/$target
rm -rf "$seeds"
if [ "$target" = qcow2 ]; then
  fuzz/make_seeds.sh "$seeds"
else
  mkdir -p "$(dirname "$seeds")"
  cp -r "fuzz/seeds/$target" "$seeds"
fi
corpus=build-fuzz/corpus/$target
artifacts=build-fuzz/artifacts/$target
mkdir -p "$corpus" "$artifacts"
# Per target: the longest input worth mutating.
case "$target" in
  qcow2) max_len=131072 ;;
  migration_stream) max_len=8192 ;;
  *) max_len=16384 ;;
esac
dict=()
[ -f "fuzz/$target.dict" ] && dict=(-dict="fuzz/$target.dict")
export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# First the recorded reproducers of fixed bugs (fuzz/regressions/TARGET/),
# once each, then fuzzing.
if compgen -G "fuzz/regressions/$target/*" >/dev/null; then
  "build-fuzz/fuzz/fuzz_$target" -runs=0 "fuzz/regressions/$target/" >/dev/null 2>"build-fuzz/regressions-$target.log" || {
    cat "build-fuzz/regressions-$target.log"
    exit 1
  }
fi
exec "build-fuzz/fuzz/fuzz_$target" -max_total_time="$secs" -timeout=30 -rss_limit_mb=2048 -max_len="$max_len" \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "${dict[@]}" "$@" "$corpus" "$seeds"
