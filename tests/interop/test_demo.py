#!/usr/bin/env python3
"""The README's demos (scripts/demo_backup.py, scripts/demo_guest.py) run.

The main-job demo is the live point-in-time backup: it must exit 0 only when the
backup equals the disk at backup start while the disk did change. Run here on
a small disk so that the suite stays short; a broken copy-before-write path
makes it fail (the writer's data would reach the backup).

The guest demo prints the fio guest's IOPS alone, during a backup without a
buffer and during one with a COW buffer (or, for a vblk without the buffer
option, says it is not in this build); checked here on a small disk.
"""
import os
import re
import shutil
import subprocess
import sys
import unittest

from common import VBLK, InteropTestCase

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
DEMO = os.path.join(SCRIPTS, "demo_backup.py")
DEMO_GUEST = os.path.join(SCRIPTS, "demo_guest.py")


class DemoTest(InteropTestCase):
    def test_live_backup_demo(self):
        r = subprocess.run([sys.executable, DEMO, VBLK, self.tmp, "128", "4"], capture_output=True, text=True,
                           timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        last = r.stdout.strip().splitlines()[-1]
        self.assertIn("point in time verified: OK", last)
        self.assertIn("disk changed by the writer: yes; backup equals the disk at backup start: yes", r.stdout)

    @unittest.skipUnless(shutil.which("fio"), "needs fio")
    def test_guest_demo(self):
        r = subprocess.run([sys.executable, DEMO_GUEST, VBLK, self.tmp, "64", "1", "20"], capture_output=True,
                           text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        iops = r" +[0-9]+ IOPS  mean +[0-9.]+ ms  p99 +[0-9.]+ ms"
        self.assertRegex(r.stdout, r"\nguest alone:" + iops + "\n")
        self.assertRegex(r.stdout, r"\nduring a backup, no buffer:" + iops + r"  \([0-9.]+ % of alone\)\n")
        self.assertRegex(r.stdout, r"\nduring a backup, COW buffer \+ spill: +(" + iops
                         + r"  \([0-9.]+ % of alone\)|not in this build \(.*(is unexpected|does not accept).*\))\n")
        self.assertEqual(len(re.findall(r"IOPS|not in this build", r.stdout)), 3, r.stdout)


if __name__ == "__main__":
    unittest.main()
