#!/usr/bin/env bash
# Builds the libFuzzer targets with clang in build-fuzz/ and fuzzes the qcow2
# parser for SECONDS (default 60), starting from fresh qemu-img seeds plus
# the corpus kept from earlier runs (build-fuzz/corpus). Exit status is
# non-zero when the fuzzer found a crash, leak, timeout or sanitizer report;
# the reproducer is left in build-fuzz/artifacts/. See docs/fuzzing.md.
#   scripts/fuzz.sh [--build-only] [SECONDS] [libFuzzer flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=0
if [ "${1:-}" = "--build-only" ]; then
  build_only=1
  shift
fi
secs=${1:-60}
shift || true
CXX=${VBLK_FUZZ_CXX:-clang++} cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVBLK_FUZZ=ON >/dev/null
ninja -C build-fuzz -j "$(nproc)" fuzz_qcow2
[ "$build_only" = 1 ] && exit 0
seeds=build-fuzz/seeds
rm -rf "$seeds"
fuzz/make_seeds.sh "$seeds"
mkdir -p build-fuzz/corpus build-fuzz/artifacts
export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# First the recorded reproducers of fixed bugs (fuzz/regressions/), once
# each, then fuzzing.
if compgen -G "fuzz/regressions/*" >/dev/null; then
  build-fuzz/fuzz/fuzz_qcow2 -runs=0 fuzz/regressions/ >/dev/null 2>build-fuzz/regressions.log || {
    cat build-fuzz/regressions.log
    exit 1
  }
fi
exec build-fuzz/fuzz/fuzz_qcow2 -max_total_time="$secs" -timeout=30 -rss_limit_mb=2048 -max_len=131072 \
  -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/ "$@" build-fuzz/corpus "$seeds"
