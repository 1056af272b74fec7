#!/usr/bin/env python3
"""Interop: issue 14's libvirt-style incremental backup chain over ten rounds,
with the daemon stopped and restarted between rounds and killed once.

A qcow2 source is served by the daemon with a writable NBD export. One
`transaction` starts a full backup and adds a persistent checkpoint bitmap;
then every round writes at random through the export (data, zeroes and
overwrites, no discards), keeps a reference copy of the source at that point,
and takes an incremental backup: one transaction adds the next checkpoint,
disables the previous one and runs blockdev-backup sync=bitmap of the
previous one into a blockdev-create'd qcow2 overlay whose backing file is the
previous backup. Between rounds the daemon quits, so the checkpoints must
come back from the image and be used.

Once (KILL_ROUND) the daemon is killed with SIGKILL after the writes instead:
the bitmaps it had open for writing keep their IN_USE flag, which qemu-img
info shows as "in-use" and the restarted daemon as "inconsistent"; a backup
asked to use one is refused with QEMU's error and nothing is copied. As
libvirt does, the checkpoints are then removed and the chain restarts with a
new full backup plus a new checkpoint.

Every point of the chain restores (qemu-img convert of its top) to exactly
the reference of its moment, no more allocated than the source was; every
overlay holds only the clusters its round touched (the bitmap was used, not a
full copy) and passes qemu-img check.

The scenario runs against qemu-storage-daemon and `vblk serve` in turn in the
same directory: replies, events and qemu-img info of the killed state must be
equal, round by round.
"""

import json
import os
import random
import subprocess
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_common import (DAEMONS, QEMU_IO, Daemon, GraphTestCase, Recorder, bitmaps, compare,  # noqa: E402
                          data_bytes, export_point, img, img_info, new_qcow2, norm, qnode, tx)

KiB = 1 << 10
MiB = 1 << 20
SIZE = 32 * MiB
CLUSTER = 64 * KiB
ROUNDS = 10
KILL_ROUND = 4  # within the rounds both daemons run
QSD_ROUNDS = int(os.environ.get("VBLK_CHAIN_QSD_ROUNDS", ROUNDS))


def round_writes(rnd):
    """The qemu-io commands of round `rnd` (seeded: the same for both
    daemons) and the clusters they touch."""
    rng = random.Random(1400 + rnd)
    cmds, touched = [], set()
    for i in range(rng.randint(4, 8)):
        length = rng.choice((4 * KiB, 16 * KiB, 64 * KiB, 100 * KiB, 256 * KiB))
        off = rng.randrange(0, SIZE - length) & ~511
        if i % 3 == 2:
            cmds.append("write -z %d %d" % (off, length))
        else:
            cmds.append("write -P %d %d %d" % (rng.randint(1, 255), off, length))
        touched.update(range(off // CLUSTER, (off + length - 1) // CLUSTER + 1))
    return cmds, touched


class BackupChainTest(GraphTestCase):

    def io(self, target, cmds, fmt="raw"):
        argv = [QEMU_IO, "-f", fmt]
        for c in cmds:
            argv += ["-c", c]
        argv.append(target)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r)
        self.assertNotIn("error", r.stdout + r.stderr, r)

    def prepare(self):
        """A source with data, a zeroed range and holes."""
        P = self.path
        img("create", "-q", "-f", "qcow2", "-o", "cluster_size=%d" % CLUSTER, P("disk.qcow2"), str(SIZE))
        self.io(P("disk.qcow2"), ["write -P 1 0 3M", "write -z 3M 1M", "write -P 2 10M 2M",
                                  "write -P 3 20M 512k"], fmt="qcow2")

    def scenario(self, argv, rounds, log):
        """The chain against one daemon. Returns (observations, points):
        points[i] = (reference raw, chain top, source allocation, overlay
        touched clusters or None for a full backup)."""
        P = self.path
        sock = os.path.join(self.tmp, "nbd.sock")
        uri = "nbd+unix:///exp?socket=%s" % sock
        qmp_sock = os.path.join(self.tmp, "qmp.sock")
        out, points = [], []
        state = {}

        def start():
            dm = Daemon(argv, qmp_sock, log)
            state["dm"] = dm
            c = Recorder(dm.qmp, out)
            c("blockdev-add", **qnode("disk", P("disk.qcow2")))
            c("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            c("block-export-add", type="nbd", id="e", name="exp", writable=True, **{"node-name": "disk"})
            out.append(("bitmaps", bitmaps(dm.qmp, "disk")))
            return dm.qmp, c

        def full_backup(c, name, checkpoint):
            new_qcow2(c, P(name + ".qcow2"), name, SIZE)
            c("transaction", **tx(
                ("blockdev-backup", {"job-id": "b-" + name, "device": "disk", "target": name, "sync": "full"}),
                ("block-dirty-bitmap-add", {"node": "disk", "name": checkpoint, "persistent": True})))
            c.wait_job("b-" + name, "null")

        q, c = start()
        alloc = export_point(uri, P("pt0.raw"))
        full_backup(c, "full0", "c1")
        points.append((P("pt0.raw"), P("full0.qcow2"), alloc, None))
        prev, ck = "full0", 1
        try:
            for rnd in range(1, rounds + 1):
                # Stopped and started again: the checkpoints come back from
                # the image, the recording one IN_USE while the daemon runs.
                state["dm"].quit()
                q, c = start()
                cmds, touched = round_writes(rnd)
                self.io(uri, cmds)
                ref = P("pt%d.raw" % rnd)
                alloc = export_point(uri, ref)
                # The checkpoint loaded from the image records the writes.
                bm = {b["name"]: b for b in bitmaps(q, "disk")}
                self.assertTrue(bm["c%d" % ck]["recording"], bm)
                self.assertEqual(bm["c%d" % ck]["count"], len(touched) * CLUSTER, bm)
                if rnd == KILL_ROUND:
                    # Killed while checkpoint c<ck> records: the image keeps
                    # its bitmaps IN_USE.
                    state["dm"].kill()
                    state["dm"].qmp.close()
                    info = img_info(P("disk.qcow2"))
                    out.append(("killed", info))
                    flags = {b["name"]: b["flags"] for b in info["format-specific"]["data"]["bitmaps"]}
                    self.assertIn("in-use", flags["c%d" % ck], flags)
                    q, c = start()
                    bm = {b["name"]: b for b in bitmaps(q, "disk")}
                    self.assertTrue(bm["c%d" % ck].get("inconsistent"), bm)
                    cur = "inc%d" % rnd
                    new_qcow2(c, P(cur + ".qcow2"), cur, SIZE, P(prev + ".qcow2"))
                    r = c("transaction", **tx(
                        ("block-dirty-bitmap-add", {"node": "disk", "name": "c%d" % (ck + 1), "persistent": True}),
                        ("block-dirty-bitmap-disable", {"node": "disk", "name": "c%d" % ck}),
                        ("blockdev-backup", {"job-id": "b" + cur, "device": "disk", "target": cur,
                                             "sync": "bitmap", "bitmap": "c%d" % ck, "bitmap-mode": "never"})))
                    self.assertIn("Bitmap 'c%d' is inconsistent and cannot be used" % ck,
                                  r.get("error", {}).get("desc", ""), r)
                    r = c("blockdev-backup", device="disk", target=cur, sync="incremental", bitmap="c%d" % ck,
                          **{"job-id": "b" + cur})
                    self.assertIn("error", r)
                    c.ev()
                    out.append(("bitmaps", bitmaps(q, "disk")))
                    # Nothing was copied into the refused backup's target.
                    c("blockdev-del", **{"node-name": cur})
                    c("blockdev-del", **{"node-name": cur + "-f"})
                    m = json.loads(img("map", "--output=json", "-U", P(cur + ".qcow2")).stdout)
                    self.assertEqual([e for e in m if e["depth"] == 0 and (e["data"] or e["zero"])], [])
                    # libvirt: drop the checkpoints, start over with a full backup.
                    for name in sorted(bm):
                        c("block-dirty-bitmap-remove", node="disk", name=name)
                    ck += 1
                    cur = "full%d" % rnd
                    full_backup(c, cur, "c%d" % ck)
                    points.append((ref, P(cur + ".qcow2"), alloc, None))
                    prev = cur
                    continue
                cur = "inc%d" % rnd
                new_qcow2(c, P(cur + ".qcow2"), cur, SIZE, P(prev + ".qcow2"))
                c("transaction", **tx(
                    ("block-dirty-bitmap-add", {"node": "disk", "name": "c%d" % (ck + 1), "persistent": True}),
                    ("block-dirty-bitmap-disable", {"node": "disk", "name": "c%d" % ck}),
                    ("blockdev-backup", {"job-id": "b" + cur, "device": "disk", "target": cur, "sync": "bitmap",
                                         "bitmap": "c%d" % ck, "bitmap-mode": "never"})))
                c.wait_job("b" + cur, "null")
                out.append(("bitmaps", bitmaps(q, "disk")))
                points.append((ref, P(cur + ".qcow2"), alloc, touched))
                prev, ck = cur, ck + 1
        finally:
            state["dm"].quit()
        out.append(("final", img_info(P("disk.qcow2"))))
        return norm(out), points

    def check_points(self, name, points):
        """Every point restores to its reference, sparse; every overlay holds
        only what its round touched."""
        for i, (ref, top, alloc, touched) in enumerate(points):
            what = (name, i, os.path.basename(top))
            self.assertEqual(img("check", "-U", top, check=False).returncode, 0, what)
            restored = self.path("restored%d.qcow2" % i)
            img("convert", "-U", "-O", "qcow2", top, restored)
            self.assertEqual(compare(ref, restored, "raw", "qcow2"), (0, "Images are identical."), what)
            m = json.loads(img("map", "--output=json", restored).stdout)
            self.assertLessEqual(data_bytes(m), alloc, what)
            own = json.loads(img("map", "--output=json", "-U", top).stdout)
            own = [e for e in own if e["depth"] == 0 and (e["data"] or e["zero"])]
            if touched is None:
                self.assertGreater(data_bytes(own), 0, what)
                continue
            got = set()
            for e in own:
                got.update(range(e["start"] // CLUSTER, (e["start"] + e["length"] - 1) // CLUSTER + 1))
            self.assertTrue(got, what)
            self.assertLessEqual(got, touched, what)

    def test_chain(self):
        seen = {}
        for name, argv in DAEMONS:
            self.clean_work()
            self.prepare()
            rounds = ROUNDS if name == "vblk serve" else QSD_ROUNDS
            log = os.path.join(self.tmp, name.replace(" ", "_") + ".log")
            out, points = self.scenario(argv, rounds, log)
            self.assertEqual(len(points), rounds + 1)
            self.check_points(name, points)
            seen[name] = (rounds, out)
        # The same replies and events while both ran.
        (ra, a), (rb, b) = seen["qemu-storage-daemon"], seen["vblk serve"]
        n = len(a) if ra <= rb else len(b)
        for i in range(n):
            if a[i][0] == "final":
                break
            self.assertEqual(b[i], a[i], "step %d: vblk serve differs from qemu-storage-daemon" % i)
        if ra == rb:
            self.assertEqual(b, a)


if __name__ == "__main__":
    unittest.main()
