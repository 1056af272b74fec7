#!/usr/bin/env bash
# ThreadSanitizer over the code where threads meet (issue 25): builds
# build-tsan/ (-DVBLK_TSAN=ON) and runs, with TSan halting on the first
# report,
#   - the unit tests twice: over io_uring (blocking calls, compressed
#     cluster inflation and lseek still go to the thread pool) and with
#     VBLK_NO_IO_URING=1 (every file read, write, flush and fallocate runs
#     on the pool's workers, completions posted back to the loop);
#   - the interop tests that drive the daemon and the CLI through the
#     pool, with and without io_uring: serve without io_uring (NBD + QMP
#     backup + quit), compressed reads, convert;
#   - the NBD server and QMP tests (the stop-signal thread posts to the
#     loop) and rbd on a throwaway cluster (librbd's callback threads).
# Not part of ctest: a TSan build is a third full build, beyond CI's budget.
#   scripts/tsan.sh [--build-only]
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DVBLK_TSAN=ON -DCMAKE_CXX_FLAGS=-O1 \
      -DCMAKE_CXX_FLAGS_DEBUG=-g1 >/dev/null
ninja -C build-tsan -j "$(nproc)" vblk vblk_unit_tests
[ "${1:-}" = "--build-only" ] && exit 0
# Every process's reports go to files of their own (a daemon's stderr is
# often not shown); Ceph's own libraries are suppressed (scripts/tsan.supp).
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:exitcode=66:log_path=$reports/r:suppressions=$PWD/scripts/tsan.supp"
status=0
run() {
  echo "== ${*//$PWD\//}"
  if ! "$@"; then echo "tsan.sh: FAILED: $*"; status=1; fi
}
run build-tsan/tests/vblk_unit_tests --gtest_brief=1
run env VBLK_NO_IO_URING=1 build-tsan/tests/vblk_unit_tests --gtest_brief=1
for t in test_no_io_uring test_compressed_read test_convert; do
  run env VBLK="$PWD/build-tsan/vblk" python3 tests/interop/$t.py
  run env VBLK="$PWD/build-tsan/vblk" VBLK_NO_IO_URING=1 python3 tests/interop/$t.py
done
# Signal threads posting to the loop (SIGTERM to vblk nbd / serve), and
# librbd's callback threads (skipped without Ceph's binaries).
for t in test_nbd_server test_qmp test_rbd; do
  run env VBLK="$PWD/build-tsan/vblk" python3 tests/interop/$t.py
done
if compgen -G "$reports/r.*" >/dev/null; then
  echo "tsan.sh: ThreadSanitizer reports:"
  cat "$reports"/r.*
  status=1
fi
[ $status = 0 ] && echo "tsan.sh: clean"
exit $status
