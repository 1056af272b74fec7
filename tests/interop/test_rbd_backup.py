"""Backups into RBD: a full backup and ten incremental ones, restored exactly.

The daemon (`vblk serve`, and qemu-storage-daemon with the same QMP as the
anchor) holds a local qcow2 source with a writable NBD export and an RBD
image as the backup target, opened with blockdev-add driver=rbd under a raw
node behind a throttle node; vblk's backup also runs with its COW buffer
(x-perf.cow-buffer-size). Round 0 is a full backup that starts a dirty
bitmap; each of the ten rounds after it writes through the export (qemu-io:
data and zeroes), copies the source as the reference of that moment, and
runs blockdev-backup sync=incremental of the bitmap into the same RBD image,
then takes an RBD snapshot of it. Every snapshot must read (qemu-img compare
rbd:pool/image@snap) exactly as its reference did, and the extents RBD saw
change between two snapshots (rbd diff) must be a small part of the image:
the bitmap was used, not a full copy.

Also: `vblk backup` (the one-shot CLI) into an rbd: target.

Skipped, saying why, only when the Ceph daemons are not installed.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import InteropTestCase, MiB, qemu, vblk, storage_daemons  # noqa: E402
import ceph_cluster  # noqa: E402

SIZE = 32 * MiB
OBJECT = 4 * MiB  # RBD's default object size: the backup's cluster size too
ROUNDS = 10
# qemu-storage-daemon (the anchor) runs the first QSD_ROUNDS rounds only,
# to keep the file well under 30 s.
QSD_ROUNDS = int(os.environ.get("VBLK_RBD_QSD_ROUNDS", 1))
QEMU_IO = shutil.which("qemu-io")
CLUSTER = None


def setUpModule():
    global CLUSTER
    if ceph_cluster.skip_reason():
        return
    CLUSTER = ceph_cluster.CephCluster(osds=1, memstore_mib=512)
    CLUSTER.start()


def tearDownModule():
    if CLUSTER:
        CLUSTER.stop()


def rbd_file(image, snapshot=None):
    f = {"driver": "rbd", "pool": CLUSTER.pool, "image": image, "conf": CLUSTER.conf}
    if snapshot:
        f["snapshot"] = snapshot
    return f


def round_writes(rnd):
    """qemu-io commands of round `rnd` and the RBD objects (4 MiB) they touch."""
    rng = random.Random(1500 + rnd)
    cmds, objects = [], set()
    for i in range(rng.randint(3, 6)):
        length = rng.choice((4096, 65536, 100 * 1024, 512 * 1024))
        off = rng.randrange(0, SIZE - length) & ~511
        if i % 3 == 2:
            cmds += ["-c", "write -z %d %d" % (off, length)]
        else:
            cmds += ["-c", "write -P %d %d %d" % (rng.randint(1, 255), off, length)]
        objects.update(range(off // OBJECT, (off + length - 1) // OBJECT + 1))
    return cmds, objects


class RbdBackupTest(InteropTestCase):

    def setUp(self):
        super().setUp()
        reason = ceph_cluster.skip_reason()
        if reason:
            self.skipTest(reason)
        if not QEMU_IO:
            self.skipTest("needs qemu-io")

    def source(self, d):
        src = os.path.join(d, "src.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", src, str(SIZE)).rc, 0)
        r = subprocess.run([QEMU_IO, "-f", "qcow2", "-c", "write -P 0x11 0 3M", "-c", "write -P 0x22 9M 5M",
                            "-c", "write -P 0x33 30M 1M", src], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r)
        return src

    def wait_job(self, q):
        ev = q.event("BLOCK_JOB_COMPLETED", 120)
        self.assertNotIn("error", ev["data"], ev)
        return ev

    def chain(self, name, cmd, rounds):
        from qmp_driver import Daemon
        d = self.subdir(name.replace(" ", "_"))
        image = "chain-%s" % name.replace(" ", "-")
        self.assertEqual(vblk("create", "-q", "-f", "raw", CLUSTER.spec(image), str(SIZE)).rc, 0)
        src = self.source(d)
        dm = Daemon(cmd, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
        self.addCleanup(dm.kill)
        q = dm.qmp
        q.ok("blockdev-add", **{"driver": "qcow2", "node-name": "src",
                                "file": {"driver": "file", "filename": src}})
        q.ok("object-add", **{"qom-type": "throttle-group", "id": "tg", "limits": {"bps-total": 256 * MiB}})
        q.ok("blockdev-add", **{"driver": "throttle", "throttle-group": "tg", "node-name": "tgt",
                                "file": {"driver": "raw", "file": rbd_file(image)}})
        sock = os.path.join(d, "nbd.sock")
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        q.ok("block-export-add", type="nbd", id="e0", **{"node-name": "src"}, writable=True)
        uri = "nbd+unix:///src?socket=" + sock
        vblk_daemon = cmd[0] != shutil.which("qemu-storage-daemon")
        events = []
        touched = {}
        for rnd in range(rounds + 1):
            if rnd:
                cmds, touched[rnd] = round_writes(rnd)
                r = subprocess.run([QEMU_IO, "-f", "raw"] + cmds + [uri],
                                   capture_output=True, text=True, timeout=60)
                self.assertEqual(r.returncode, 0, r)
            ref = os.path.join(d, "ref%d.raw" % rnd)
            self.assertEqual(qemu("convert", "-O", "raw", uri, ref).rc, 0)
            args = {"job-id": "j%d" % rnd, "device": "src", "target": "tgt"}
            if rnd == 0:
                q.ok("transaction", actions=[
                    {"type": "block-dirty-bitmap-add", "data": {"node": "src", "name": "b0"}},
                    {"type": "blockdev-backup", "data": dict(args, sync="full")}])
            else:
                args.update(sync="incremental", bitmap="b0")
                if vblk_daemon:
                    args["x-perf"] = {"cow-buffer-size": 8 * MiB}
                q.ok("blockdev-backup", **args)
            ev = self.wait_job(q)
            events.append((ev["data"]["len"], ev["data"]["offset"]))
            CLUSTER.rbd("snap", "create", "--skip-quiesce", "--no-progress", "%s/%s@s%d" % (CLUSTER.pool, image, rnd))
        q.ok("blockdev-del", **{"node-name": "tgt"})
        dm.quit()
        # Every point restores exactly.
        for rnd in range(rounds + 1):
            snap = "rbd:%s/%s@s%d:conf=%s" % (CLUSTER.pool, image, rnd, CLUSTER.conf)
            r = qemu("compare", "-f", "raw", "-F", "raw", os.path.join(d, "ref%d.raw" % rnd), snap)
            self.assertEqual(r.rc, 0, "round %d: %r" % (rnd, r))
            if rnd and vblk_daemon:  # (the anchor's extents: its len per round, compared below)
                p = CLUSTER.rbd("diff", "--format", "json", "--from-snap", "s%d" % (rnd - 1),
                                "%s/%s@s%d" % (CLUSTER.pool, image, rnd))
                changed = {e["offset"] // OBJECT for e in json.loads(p.stdout)}
                self.assertLessEqual(changed, touched[rnd], "round %d copied more than its writes" % rnd)
        # vblk reads the snapshots too (the driver's snapshot option).
        out = os.path.join(d, "restore.raw")
        snap = "rbd:%s/%s@s%d:conf=%s" % (CLUSTER.pool, image, rounds, CLUSTER.conf)
        r = vblk("convert", "-O", "raw", snap, out)
        self.assertEqual(r.rc, 0, r)
        self.assertEqual(qemu("compare", out, os.path.join(d, "ref%d.raw" % rounds)).rc, 0)
        return events

    def test_full_and_ten_incremental_backups_restore(self):
        seen = {}
        for name, cmd in storage_daemons():
            with self.subTest(daemon=name):
                seen[name] = self.chain(name, cmd, ROUNDS if name == "vblk serve" else QSD_ROUNDS)
        self.assertIn("vblk serve", seen)
        # The same amount copied per round (len, offset of each job).
        vals = list(seen.values())
        for v in vals[1:]:
            n = min(len(v), len(vals[0]))
            self.assertEqual(v[:n], vals[0][:n])

    def test_vblk_backup_cli_into_rbd(self):
        d = self.subdir("cli")
        src = self.source(d)
        target = CLUSTER.spec("cli-full")
        r = vblk("backup", "-O", "raw", src, target)
        self.assertEqual(r.rc, 0, r)
        r = qemu("compare", "-f", "qcow2", "-F", "raw", src, target)
        self.assertEqual(r.rc, 0, r)
        # A backup that fails (a read error on the source) takes back the
        # RBD image it created, as it removes a file target.
        failing = ("driver=qcow2,file.driver=blkdebug,file.image.driver=file,file.image.filename=%s,"
                   "file.inject-error.0.event=read_aio,file.inject-error.0.errno=5" % src)
        r = vblk("backup", "-O", "raw", "--image-opts", failing, CLUSTER.spec("cli-failed"))
        self.assertNotEqual(r.rc, 0, r)
        self.assertIn("Input/output error", r.stderr)
        images = CLUSTER.rbd("ls", CLUSTER.pool).stdout.decode().split()
        self.assertIn("cli-full", images)
        self.assertNotIn("cli-failed", images)


if __name__ == "__main__":
    unittest.main()
