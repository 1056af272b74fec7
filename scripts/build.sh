#!/usr/bin/env bash
# Builds vblk: build/ (optimised) and, with --asan, build-asan/ (AddressSanitizer
# + UndefinedBehaviorSanitizer over the whole test suite). --vblk-only builds
# just the vblk binary in build/ (the demo's first run needs nothing else:
# the unit tests and benches are most of the build).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# -g1 (line tables): symbolised stack traces and perf profiles need no
# more, and full debug info costs a quarter of the compile time.
# Unity batches (CMakeLists.txt, VBLK_UNITY_BUILD): a cold build takes
# less than half the CPU, which is most of what a fresh clone (CI) pays.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
      -DVBLK_UNITY_BUILD=ON >/dev/null
if [ "${1:-}" = "--vblk-only" ]; then
  exec ninja -C build -j "$jobs" vblk
fi
ninja -C build -j "$jobs"
if [ "${1:-}" = "--asan" ]; then
  # -O1 keeps coroutine symmetric transfer a tail call (deep task chains at -O0 overflow the stack).
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DVBLK_SANITIZE=ON -DCMAKE_CXX_FLAGS=-O1 \
        -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DVBLK_UNITY_BUILD=ON >/dev/null
  ninja -C build-asan -j "$jobs"
fi
