#!/usr/bin/env python3
"""bench/bench_guest.py runs end to end on a small image.

The benchmark starts qemu-storage-daemon and `vblk serve` with the same
throttle-group, throttle node, NBD export and blockdev-backup (stock, with
vblk's copy-before-write buffer and spill, and QEMU 7.2's fleecing graph:
copy-before-write + snapshot-access), and runs a fio guest through the export
with and without the backup. This test keeps that path working (a
command-line word or QMP argument vblk stops accepting, a fio that cannot
connect, a backup that does not complete) without judging the numbers.

A vblk row may be skipped only because vblk says it does not know the option
or driver yet (the COW buffer and snapshot-access are being built); any other
failure of a row fails the test.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import unittest

from common import VBLK, InteropTestCase

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "bench_guest.py")
TOOLS = ("qemu-storage-daemon", "fio")
ALWAYS = ("qemu", "qemu-fleece", "vblk")  # must be measured
MAYBE = ("vblk-buf64M", "vblk-spill", "vblk-fleece", "vblk-fleece-buf1G")  # measured or skipped as unknown
UNKNOWN = re.compile(r"is unexpected|does not accept value")
MiB = 1 << 20


@unittest.skipUnless(all(shutil.which(t) for t in TOOLS), "needs " + ", ".join(TOOLS))
class BenchGuestTest(InteropTestCase):
    def test_environments_measured(self):
        out = os.path.join(self.tmp, "r.json")
        # 64 MiB at 20 MB/s: the backup takes ~3 s, so it outlasts the 1 s
        # phase and is still timed to completion quickly.
        r = subprocess.run([sys.executable, BENCH, "--vblk", VBLK, "--size", "64M", "--runs", "1", "--runtime", "1",
                            "--target-rate", "20000000", "--envs", ",".join(ALWAYS + MAYBE), "--dir", self.tmp,
                            "--json", out],
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(out) as f:
            res = json.load(f)["results"]
        self.assertEqual(res["failed"], {})
        for env in ALWAYS:
            self.assertNotIn(env, res["skipped"])
        for env, why in res["skipped"].items():
            self.assertIn(env, MAYBE)
            self.assertRegex(why, UNKNOWN, env)
        for env in ALWAYS + MAYBE:
            runs = res["runs"][env]
            if env in res["skipped"]:
                self.assertEqual(runs, [], env)
                continue
            self.assertEqual(len(runs), 1, env)
            run = runs[0]
            self.assertGreater(run["idle_iops"], 0, env)
            self.assertGreater(run["idle_p99_ms"], 0, env)
            self.assertGreater(run["backup_iops"], 0, env)
            self.assertGreater(run["backup_mean_ms"], 0, env)
            # Whether the backup outlasted the phase depends on the machine
            # here; the bench reports it, this test only checks it is there.
            self.assertIsInstance(run["backup_outlasted_phase"], bool, env)
            self.assertFalse(run["backup_cancelled"], env)
            self.assertGreater(run["backup_seconds"], 0, env)
            self.assertGreater(run["peak_rss_mib"], 0, env)
            self.assertGreaterEqual(run["peak_rss_mib"], run["idle_rss_mib"], env)
            if env in ("vblk-buf64M", "vblk-spill"):
                cow = run["cow_buffer"]
                self.assertIsNotNone(cow, f"{env}: no x-cow-buffer in query-block-jobs")
                for k in ("size", "used-peak", "spill-size", "spilled-peak", "sync-copies"):
                    self.assertIn(k, cow, env)
                self.assertEqual(cow["size"], (64 if env == "vblk-buf64M" else 256) * MiB, env)
                if env == "vblk-spill":
                    self.assertEqual(cow["spill-size"], 64 * MiB, env)
            if env == "vblk-fleece-buf1G":
                cow = run["cow_buffer"]
                self.assertIsNotNone(cow, f"{env}: no x-cow-buffer for fl-cbw in query-named-block-nodes")
                self.assertEqual(cow["size"], 1 << 30, env)
        self.assertIn("IOPS kept", r.stdout)
        self.assertIn("no backup", r.stdout)
        self.assertRegex(r.stdout, r"\nbar (not judged|\(vblk-)")


if __name__ == "__main__":
    unittest.main()
