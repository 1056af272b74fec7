"""Backups into RBD while the cluster fails under them (`vblk serve`).

A three-OSD cluster, pool size 3, client op timeouts of a few seconds. The
source is a local raw image the daemon holds; the target an RBD image
(blockdev-add driver=rbd under raw); the backup runs at a limited speed so
that the faults land mid-job:

- one OSD killed (SIGKILL) mid-backup: the job completes, and the RBD image
  then reads as the source (qemu-img compare);
- the whole cluster frozen (SIGSTOP) mid-backup, on-target-error=report:
  the job ends with an error that says what happened (the librados timeout,
  ETIMEDOUT), not a hang;
- the same with on-target-error=stop: the job reports BLOCK_JOB_ERROR and
  pauses; once the cluster is back (SIGCONT), block-job-resume finishes it
  and the image reads as the source.

The source is never written by the job: its checksum is the same at the end.

Slow-ish (a cluster of three OSDs and two op timeouts): run only with
VBLK_RBD_FAULTS=1 (bench/ and the issue's report run it); skipped otherwise,
and, saying why, when the Ceph daemons are not installed.
"""

import hashlib
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import InteropTestCase, MiB, qemu, vblk, VBLK  # noqa: E402
import ceph_cluster  # noqa: E402

SIZE = 96 * MiB
SPEED = 24 * MiB
OP_TIMEOUT = 4
CLUSTER = None
ENABLED = os.environ.get("VBLK_RBD_FAULTS") == "1"


def setUpModule():
    global CLUSTER
    if not ENABLED or ceph_cluster.skip_reason():
        return
    CLUSTER = ceph_cluster.CephCluster(osds=3, pool_size=3, memstore_mib=512, op_timeout=OP_TIMEOUT)
    CLUSTER.start()


def tearDownModule():
    if CLUSTER:
        CLUSTER.stop()


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


class RbdFaultTest(InteropTestCase):
    n = 0

    def setUp(self):
        super().setUp()
        if not ENABLED:
            self.skipTest("set VBLK_RBD_FAULTS=1 to run the RBD fault tests (about a minute)")
        reason = ceph_cluster.skip_reason()
        if reason:
            self.skipTest(reason)

    def start(self, tag):
        from qmp_driver import Daemon
        RbdFaultTest.n += 1
        d = self.subdir("%s%d" % (tag, RbdFaultTest.n))
        src = os.path.join(d, "src.raw")
        with open(src, "wb") as f:
            for i in range(SIZE // MiB):
                f.write(bytes([(i * 7 + 1) & 0xff]) * (MiB // 2) + os.urandom(MiB // 2))
        image = "%s-%d" % (tag, RbdFaultTest.n)
        self.assertEqual(vblk("create", "-q", "-f", "raw", CLUSTER.spec(image), str(SIZE)).rc, 0)
        dm = Daemon([VBLK, "serve"], os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
        self.addCleanup(dm.kill)
        q = dm.qmp
        q.ok("blockdev-add", **{"driver": "raw", "node-name": "src", "file": {"driver": "file", "filename": src}})
        q.ok("blockdev-add", **{"driver": "raw", "node-name": "tgt",
                                "file": {"driver": "rbd", "pool": CLUSTER.pool, "image": image,
                                         "conf": CLUSTER.conf}})
        return dm, q, src, sha(src), image

    def backup(self, q, **kw):
        args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": SPEED}
        args.update(kw)
        q.ok("blockdev-backup", **args)
        time.sleep(1.0)  # well into the copy (24 MiB/s of 96 MiB)
        st = [j for j in q.ok("query-block-jobs") if j["device"] == "j"]
        self.assertTrue(st and st[0]["offset"] < SIZE, "the job ended before the fault: %r" % st)

    def verify(self, q, dm, src, digest, image):
        q.ok("blockdev-del", **{"node-name": "tgt"})
        dm.quit()
        r = qemu("compare", "-f", "raw", "-F", "raw", src, CLUSTER.spec(image))
        self.assertEqual(r.rc, 0, r)
        self.assertEqual(sha(src), digest, "the source changed")

    def test_1_one_osd_killed_mid_backup(self):
        dm, q, src, digest, image = self.start("kill")
        self.backup(q)
        CLUSTER.kill_osd(2)
        ev = q.event("BLOCK_JOB_COMPLETED", 120)
        self.assertNotIn("error", ev["data"], ev)
        self.assertEqual(ev["data"]["offset"], SIZE)
        self.verify(q, dm, src, digest, image)

    def test_2_cluster_stopped_report(self):
        dm, q, src, digest, image = self.start("report")
        self.backup(q, **{"on-target-error": "report"})
        CLUSTER.pause()
        try:
            ev = q.event("BLOCK_JOB_COMPLETED", OP_TIMEOUT * 10)
        finally:
            CLUSTER.resume()
        self.assertIn("error", ev["data"], ev)
        self.assertIn("timed out", ev["data"]["error"])
        self.assertLess(ev["data"]["offset"], SIZE)
        self.assertEqual(sha(src), digest, "the source changed")
        dm.quit()

    def test_3_cluster_stopped_stop_then_resume(self):
        dm, q, src, digest, image = self.start("stop")
        self.backup(q, **{"on-target-error": "stop"})
        CLUSTER.pause()
        try:
            err = q.event("BLOCK_JOB_ERROR", OP_TIMEOUT * 10)
            self.assertEqual(err["data"]["action"], "stop", err)
            self.assertEqual(err["data"]["operation"], "write", err)
            deadline = time.monotonic() + 30
            while True:
                st = [j for j in q.ok("query-block-jobs") if j["device"] == "j"][0]
                if st["status"] == "paused" or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            self.assertEqual(st["status"], "paused", st)
        finally:
            CLUSTER.resume()
        q.drain_events()
        q.ok("block-job-resume", device="j")
        ev = q.event("BLOCK_JOB_COMPLETED", 120)
        self.assertNotIn("error", ev["data"], ev)
        self.verify(q, dm, src, digest, image)


if __name__ == "__main__":
    unittest.main()
