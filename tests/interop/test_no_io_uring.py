#!/usr/bin/env python3
"""Interop: `vblk serve` on a machine without io_uring (VBLK_NO_IO_URING=1:
the epoll + thread-pool fallback, as under an old kernel or a seccomp
policy that forbids io_uring).

The daemon serves an NBD export that qemu-io writes and reads back, takes a
QMP backup, and then `quit` ends it: the NBD server's listener, shut down to
wake its pending accept, must end that accept (it once spun in accept4 and
the daemon never exited).
"""

import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, VBLK, InteropTestCase, make_tempdir, qemu, run, shm_dir  # noqa: E402
import qmp_driver  # noqa: E402  (bench/, put on the path by common)


class NoIoUring(InteropTestCase):

    def test_serve_exports_backs_up_and_quits(self):
        d = make_tempdir(self, base=shm_dir())
        img, tgt = os.path.join(d, "d.qcow2"), os.path.join(d, "t.raw")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "16M").rc, 0)
        with open(tgt, "wb") as f:
            f.truncate(16 * MiB)
        sock = os.path.join(d, "nbd.sock")
        argv = [VBLK, "serve",
                "--blockdev", "driver=qcow2,node-name=disk,file.driver=file,file.filename=%s" % img,
                "--blockdev", "driver=file,node-name=tgt,filename=%s" % tgt,
                "--nbd-server", "addr.type=unix,addr.path=%s" % sock,
                "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]
        old = os.environ.get("VBLK_NO_IO_URING")
        os.environ["VBLK_NO_IO_URING"] = "1"
        try:
            dm = qmp_driver.Daemon(argv, os.path.join(d, "qmp.sock"), os.path.join(d, "log"))
        finally:
            if old is None:
                del os.environ["VBLK_NO_IO_URING"]
            else:
                os.environ["VBLK_NO_IO_URING"] = old
        try:
            uri = "nbd+unix:///disk?socket=%s" % sock
            r = run(["qemu-io", "-f", "raw", "-c", "write -P 0x5c 1M 2M", "-c", "read -P 0x5c 1M 2M", uri])
            self.assertEqual(r.rc, 0, r)
            self.assertNotIn("fail", r.stdout, r)
            q = dm.qmp
            q.ok("blockdev-backup", {"job-id": "b", "device": "disk", "target": "tgt", "sync": "full"})
            e = q.event("BLOCK_JOB_COMPLETED", timeout=60)
            self.assertNotIn("error", e["data"])
            t = dm.quit(timeout=20)
            self.assertLess(t, 20)
            self.assertEqual(dm.proc.returncode, 0, dm.log_tail())
        finally:
            dm.kill()
        r = qemu("compare", "-f", "qcow2", "-F", "raw", img, tgt)
        self.assertEqual(r.rc, 0, r)


if __name__ == "__main__":
    unittest.main()
