#!/usr/bin/env python3
"""The README's main-job demo (scripts/demo_backup.py) runs and verifies.

The demo is the live point-in-time backup: it must exit 0 only when the
backup equals the disk at backup start while the disk did change. Run here on
a small disk so that the suite stays short; a broken copy-before-write path
makes it fail (the writer's data would reach the backup).
"""
import os
import subprocess
import sys
import unittest

from common import VBLK, InteropTestCase

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "demo_backup.py")


class DemoTest(InteropTestCase):
    def test_live_backup_demo(self):
        r = subprocess.run([sys.executable, DEMO, VBLK, self.tmp, "128", "4"], capture_output=True, text=True,
                           timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        last = r.stdout.strip().splitlines()[-1]
        self.assertIn("point in time verified: OK", last)
        self.assertIn("disk changed by the writer: yes; backup equals the disk at backup start: yes", r.stdout)


if __name__ == "__main__":
    unittest.main()
