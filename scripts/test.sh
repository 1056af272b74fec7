#!/usr/bin/env bash
# Installs what is missing, builds (optimised and sanitized), and runs the
# suite: each interop test in one of the two builds (tests/CMakeLists.txt),
# the unit tests in both. Exit status is the tests'.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh --asan
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
echo "== sanitizer build (ASan + UBSan)"
(cd build-asan && ctest --output-on-failure -j 2)
echo "== optimised build"
(cd build && ctest --output-on-failure -j 2)
