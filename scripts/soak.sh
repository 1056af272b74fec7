#!/usr/bin/env bash
# The long runs CI's time budget leaves out: the randomized interop tests
# with many repetitions (crash kills, point-in-time backups and fleecing
# under guest writes, COW-buffer reps) in the optimised build, power cut at
# 1,250 instants under qcow2 and 1,200 under jobs (docs/power-loss.md), the
# Ceph fault tests, 30 minutes of vblk serve under everything at once
# (scripts/soak_serve.py), and a ten-minute fuzz run. Exit status is
# non-zero on the first failure.
#   scripts/soak.sh [SCALE]   SCALE multiplies the repetitions (default 1:
#                             500 kills, 100 reps each, fuzz 10 min)
set -euo pipefail
cd "$(dirname "$0")/.."
scale=${1:-1}
[ -x build/vblk ] || scripts/build.sh
export VBLK="$PWD/build/vblk" VBLK_CRASH_WRITER="$PWD/build/tests/vblk_crash_writer"
export VBLK_CRASH_ROUNDS=$((500 * scale)) VBLK_COW_REPS=$((100 * scale)) \
       VBLK_FLEECING_REPS=$((100 * scale)) VBLK_FLEECING_BUFFER_REPS=$((100 * scale)) \
       VBLK_BACKUP_PIT_REPS=$((100 * scale))
for t in test_crash test_backup test_fleecing test_fleecing_buffer test_cow_buffer; do
  echo "== $t"
  python3 "tests/interop/$t.py"
done
echo "== power loss"
build/tests/vblk_power_loss --points $((1250 * scale)) --seed "${VBLK_POWER_SEED:-7}"
echo "== power loss under jobs"
build/tests/vblk_power_loss_jobs --points $((1200 * scale)) --seed "${VBLK_POWER_SEED:-7}"
# The Ceph fault tests (an OSD killed, the cluster stopped mid-backup) take
# about a minute, so the suite skips them unless asked.
echo "== test_rbd_faults"
VBLK_RBD_FAULTS=1 python3 tests/interop/test_rbd_faults.py
echo "== soak: vblk serve under clients, jobs and export churn"
python3 scripts/soak_serve.py --seconds $((1800 * scale)) --clients 6
echo "== fuzz"
scripts/fuzz.sh $((600 * scale))
