#!/usr/bin/env python3
"""bench/bench_backup.py runs end to end on tiny images.

The benchmark drives qemu-storage-daemon and `vblk serve` with the same QMP
commands; this test keeps that path working (a QMP option vblk stops
accepting, an NBD node it cannot open, a wrong backup) without timing
anything: 4 MiB images, one run, qemu-backup and vblk-backup on every case.
Every target must pass `qemu-img compare`. A daemon that cannot run must make
the script fail, not print a table of nothing.
"""
import json
import os
import shutil
import subprocess
import sys
import unittest

from common import VBLK, InteropTestCase

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "bench_backup.py")
TOOLS = ("qemu-storage-daemon", "qemu-nbd", "qemu-img")


@unittest.skipUnless(all(shutil.which(t) for t in TOOLS), "needs " + ", ".join(TOOLS))
class BenchBackupTest(InteropTestCase):
    def bench(self, vblk, *extra):
        out = os.path.join(self.tmp, "r.json")
        r = subprocess.run([sys.executable, BENCH, "--vblk", vblk, "--size", "4M", "--runs", "1",
                            "--envs", "^(qemu|vblk)-backup$", "--json", out] + list(extra),
                           capture_output=True, text=True, timeout=600)
        with open(out) as f:
            return r, json.load(f)

    def test_every_case_verifies(self):
        r, res = self.bench(VBLK)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        cases = [c["case"] for c in res["results"]]
        self.assertEqual(cases, ["raw-raw", "qcow2-qcow2", "raw-nbd", "nbd-raw"])
        for c in res["results"]:
            self.assertEqual(c["errors"], {}, c["case"])
            self.assertEqual(c["verified"], {"qemu-backup": True, "vblk-backup": True}, c["case"])
            for env in ("qemu-backup", "vblk-backup"):
                self.assertEqual(len(c["seconds"][env]), 1)
                self.assertGreater(c["seconds"][env][0], 0)
        # Only two environments: the goal needs qemu-mirror too.
        self.assertIsNone(res["meta"]["goal"]["met"])
        self.assertIn("goal not measured", r.stdout)

    def test_broken_daemon_fails_the_run(self):
        r, res = self.bench(shutil.which("false"), "--only", "raw-raw")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        case = res["results"][0]
        self.assertIn("did not start", case["errors"]["vblk-backup"])
        self.assertEqual(case["seconds"]["vblk-backup"], [])
        self.assertEqual(case["verified"], {"qemu-backup": True})
        self.assertIn("FAILED: raw-raw/vblk-backup", r.stdout)


if __name__ == "__main__":
    unittest.main()
