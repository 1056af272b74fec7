#!/usr/bin/env python3
"""Interop: the soak (scripts/soak_serve.py) for two minutes: `vblk serve`
under NBD clients that write, verify and hang up mid-request while backups
and mirrors start, pause, cancel and complete and exports come and go; at
the end every client's data reads back and RSS, descriptors and QMP latency
stayed flat. scripts/soak.sh runs it for 30 minutes.

Environment: VBLK (binary under test), VBLK_SOAK_SECONDS (default 120).
"""

import os
import subprocess
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import VBLK, InteropTestCase, vblk_has_serve  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "soak_serve.py")


class SoakTest(InteropTestCase):

    def test_soak(self):
        if not vblk_has_serve():
            self.skipTest("needs vblk serve")
        seconds = int(os.environ.get("VBLK_SOAK_SECONDS", "120"))
        r = subprocess.run([sys.executable, SCRIPT, "--seconds", str(seconds), "--clients", "4", "--vblk", VBLK],
                           capture_output=True, text=True, timeout=seconds + 600)
        self.assertEqual(r.returncode, 0, "soak failed:\n%s\n%s" % (r.stdout, r.stderr[-3000:]))
        self.assertIn('"problems": []', r.stdout)


if __name__ == "__main__":
    unittest.main()
