#!/usr/bin/env python3
"""Interop: fleecing with vblk's COW buffer in front of the fleecing image.

The graph is QEMU 7.2's (copy-before-write over the source with a raw
fleecing image as target, snapshot-access over the filter, the guest's
writable export on the filter), with vblk's `x-cow-buffer-size` (and spill)
on the filter. The fleecing image sits under a throttle node so old data
stays in the buffer while the snapshot is read: reads of the snapshot must
then come from the buffer (memory or spill file), from the fleecing image
once drained, or from the source.

For pull (nbdcopy of the snapshot-access export) and push (blockdev-backup
from the snapshot-access node), repeated with random guest writes during the
copy, the copy must equal the disk at the moment the filter was added, bit
for bit, and query-named-block-nodes must show the buffer was used (so the
test cannot pass with the buffer idle). QEMU has no COW buffer: the same
graph without it runs against qemu-storage-daemon as the reference of the
outcome (the copy equals the point in time there too).

Environment: VBLK, VBLK_FLEECING_BUFFER_REPS (default 20).
"""

import os
import random
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, InteropTestCase, VBLK, rand_bytes  # noqa: E402
from qmp_driver import Daemon  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
NBDCOPY = shutil.which("nbdcopy")
REPS = int(os.environ.get("VBLK_FLEECING_BUFFER_REPS", "20"))
KiB = 1024


def uri(sock, name):
    return "nbd+unix:///%s?socket=%s" % (name, sock)


@unittest.skipUnless(QEMU_IO and NBDCOPY, "needs qemu-io and nbdcopy")
class FleecingBufferTest(InteropTestCase):

    def run_reps(self, argv, buffered, push, spill=False):
        d = self.subdir(("vblk" if buffered else "qsd") + ("-push" if push else "-pull") + ("-spill" if spill else ""))
        dm = Daemon(argv, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
        q = dm.qmp
        peaks = []
        try:
            size = 16 * MiB
            src = os.path.join(d, "src.raw")
            with open(src, "wb") as f:
                f.write(rand_bytes(size, 5))
            sock = os.path.join(d, "nbd.sock")
            spill_dir = os.path.join(d, "spill")
            os.mkdir(spill_dir)
            # Reads of the source are slowed so the copy takes a while; the
            # fleecing image is slow so buffered data stays buffered.
            q.ok("object-add", **{"qom-type": "throttle-group", "id": "rd", "limits": {"bps-read": 48 * MiB}})
            q.ok("object-add", **{"qom-type": "throttle-group", "id": "fl", "limits": {"bps-write": 4 * MiB}})
            q.ok("blockdev-add", **{"driver": "raw", "node-name": "src",
                                    "file": {"driver": "throttle", "throttle-group": "rd",
                                             "file": {"driver": "file", "filename": src}}})
            q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            rng = random.Random(99)
            out = os.path.join(d, "copy.raw")
            for rep in range(REPS):
                with open(src, "rb") as f:
                    before = f.read()
                fleece = os.path.join(d, "fleece.raw")
                with open(fleece, "wb") as f:
                    f.truncate(size)
                q.ok("blockdev-add", **{"driver": "throttle", "node-name": "temp", "throttle-group": "fl",
                                        "file": {"driver": "file", "filename": fleece}})
                cbw = {"driver": "copy-before-write", "node-name": "fl-cbw", "file": "src", "target": "temp"}
                if buffered:
                    cbw["x-cow-buffer-size"] = 256 * KiB if spill else 8 * MiB
                    if spill:
                        cbw.update({"x-cow-spill-size": 16 * MiB, "x-cow-spill-dir": spill_dir})
                q.ok("blockdev-add", **cbw)
                q.ok("blockdev-add", **{"driver": "snapshot-access", "node-name": "fl-access", "file": "fl-cbw"})
                q.ok("block-export-add", {"type": "nbd", "id": "guest", "node-name": "fl-cbw", "name": "guest",
                                          "writable": True})
                cmds = []
                for _ in range(24):
                    n = rng.randint(1, 512 * 1024)
                    off = rng.randrange(0, size - n)
                    cmds += ["-c", "write -P 0x%02x %d %d" % (rng.randint(1, 255), off, n)]
                if push:
                    with open(out, "wb") as f:
                        f.truncate(size)
                    q.ok("blockdev-add", **{"driver": "file", "node-name": "tgt", "filename": out})
                    q.ok("blockdev-backup", **{"job-id": "j", "device": "fl-access", "target": "tgt",
                                               "sync": "full", "speed": 32 * MiB})
                    w = subprocess.run([QEMU_IO, "-f", "raw"] + cmds + [uri(sock, "guest")],
                                       capture_output=True, text=True, timeout=120)
                    self.assertEqual(w.returncode, 0, w.stderr)
                    peaks.append(self.buffer_peaks(q, buffered))
                    done = q.event("BLOCK_JOB_COMPLETED", 120)
                    self.assertNotIn("error", done["data"])
                    q.ok("blockdev-del", **{"node-name": "tgt"})
                else:
                    q.ok("block-export-add", {"type": "nbd", "id": "snap", "node-name": "fl-access", "name": "snap"})
                    if os.path.exists(out):
                        os.unlink(out)
                    cp = subprocess.Popen([NBDCOPY, uri(sock, "snap"), out], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE)
                    w = subprocess.run([QEMU_IO, "-f", "raw"] + cmds + [uri(sock, "guest")],
                                       capture_output=True, text=True, timeout=120)
                    self.assertEqual(w.returncode, 0, w.stderr)
                    _, err = cp.communicate(timeout=120)
                    self.assertEqual(cp.returncode, 0, err)
                    peaks.append(self.buffer_peaks(q, buffered))
                with open(out, "rb") as f:
                    self.assertTrue(f.read() == before, "rep %d: the copy is not the point-in-time image" % rep)
                with open(src, "rb") as f:
                    self.assertFalse(f.read() == before, "rep %d: the guest's writes did not land" % rep)
                for e in (["guest"] if push else ["guest", "snap"]):
                    q.ok("block-export-del", id=e)
                    q.event("BLOCK_EXPORT_DELETED", 30)
                for n in ("fl-access", "fl-cbw", "temp"):
                    q.ok("blockdev-del", **{"node-name": n})
                q.drain_events(0.01)
                q.events.clear()
                # The spill file has no name: nothing is ever left behind.
                self.assertEqual(os.listdir(spill_dir), [])
        finally:
            dm.quit()
        return peaks

    def buffer_peaks(self, q, buffered):
        nodes = {n["node-name"]: n for n in q.ok("query-named-block-nodes")}
        xb = nodes["fl-cbw"].get("x-cow-buffer")
        if not buffered:
            self.assertIsNone(xb)
            return None
        self.assertIsNotNone(xb, nodes["fl-cbw"])
        return xb["used-peak"], xb["spilled-peak"], xb["sync-copies"]

    def check(self, push, spill=False):
        if QSD:
            self.run_reps([QSD], False, push)  # the reference: QEMU's graph holds the point in time
        peaks = self.run_reps([VBLK, "serve"], True, push, spill)
        if os.environ.get("VBLK_VERBOSE"):
            print(peaks, file=sys.stderr)
        # The buffer held old data in every repetition, and spilled when small.
        self.assertTrue(all(p[0] > 0 for p in peaks), peaks)
        if spill:
            self.assertTrue(any(p[1] > 0 for p in peaks), peaks)

    def test_refused_where_the_target_is_read_directly(self):
        """A buffer would hide old data from those who read the target
        itself: a fleecing image backed by the source (QEMU's graph (b)),
        or a backup with sync=none. Both are refused and leave nothing."""
        d = self.subdir("refused")
        dm = Daemon([VBLK, "serve"], os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
        q = dm.qmp
        try:
            src = os.path.join(d, "src.raw")
            with open(src, "wb") as f:
                f.truncate(4 * MiB)
            fleece = os.path.join(d, "fleece.qcow2")
            subprocess.run(["qemu-img", "create", "-f", "qcow2", fleece, "4M"], check=True, capture_output=True)
            q.ok("blockdev-add", **{"driver": "raw", "node-name": "src",
                                    "file": {"driver": "file", "filename": src}})
            q.ok("blockdev-add", **{"driver": "qcow2", "node-name": "temp", "backing": "src",
                                    "file": {"driver": "file", "filename": fleece}})
            r = q.cmd("blockdev-add", **{"driver": "copy-before-write", "node-name": "fl-cbw", "file": "src",
                                         "target": "temp", "x-cow-buffer-size": MiB})
            self.assertIn("backed by the source", r["error"]["desc"])
            r = q.cmd("blockdev-backup", **{"job-id": "j", "device": "src", "target": "temp", "sync": "none",
                                            "x-perf": {"cow-buffer-size": MiB}})
            self.assertIn("sync mode 'none'", r["error"]["desc"])
            names = sorted(n["node-name"] for n in q.ok("query-named-block-nodes"))
            self.assertNotIn("fl-cbw", names)
            self.assertEqual(q.ok("query-jobs"), [])
        finally:
            dm.quit()

    def test_pull(self):
        self.check(push=False)

    def test_push(self):
        self.check(push=True)

    def test_pull_spill(self):
        self.check(push=False, spill=True)


if __name__ == "__main__":
    unittest.main()
