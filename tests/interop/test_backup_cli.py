#!/usr/bin/env python3
"""Interop: `vblk backup`, the one-shot full and incremental backup, and its
restore, judged by QEMU's tools.

- A chain: a full backup that starts bitmap b, then ten rounds of random
  writes by qemu-io (QEMU records them in b) each followed by an incremental
  backup into a qcow2 overlay of the previous backup. Every point of the
  chain reads exactly as the source did at its moment (qemu-img compare
  against a copy taken then), checks clean, and restores (`vblk convert` of
  that point) to an image no more allocated than the source was.
- Refusals that keep the chain honest: a missing bitmap, an inconsistent one
  (its writer killed with SIGKILL while it held the image), an existing
  target, a bad -B; each exits 1 with a clear message, creates no target and
  leaves the source's bitmaps as they were.
- A failed full backup (its target on a 2 MiB tmpfs that fills up) leaves
  no target and no new bitmap.
- A full backup of an NBD export (qemu-nbd) equals the image.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, InteropTestCase, VBLK, qemu, run, wait_unlocked  # noqa: E402

QEMU_IO = shutil.which("qemu-io")
QEMU_NBD = shutil.which("qemu-nbd")
SIZE = 64 * MiB


@unittest.skipUnless(QEMU_IO and QEMU_NBD, "needs qemu-io and qemu-nbd")
class BackupCliTest(InteropTestCase):

    def io(self, img, cmds):
        argv = [QEMU_IO, "-f", "qcow2"]
        for c in cmds:
            argv += ["-c", c]
        r = run(argv + [img], timeout=120)
        self.assertEqual(r.rc, 0, r)

    def source(self, name="src.qcow2"):
        """A qcow2 with data, zeroes and holes."""
        img = os.path.join(self.tmp, name)
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", img, str(SIZE)).rc, 0)
        self.io(img, ["write -P 0x11 0 6M", "write -P 0x22 20M 3M", "write -z 21M 1M", "write -P 0x33 60M 64k"])
        return img

    def bitmaps(self, img):
        r = qemu("info", "-U", "--output=json", img)
        self.assertEqual(r.rc, 0, r)
        return json.loads(r.stdout)["format-specific"]["data"].get("bitmaps", [])

    def allocated(self, img, fmt):
        r = qemu("map", "-f", fmt, "--output=json", img)
        self.assertEqual(r.rc, 0, r)
        return sum(e["length"] for e in json.loads(r.stdout) if e.get("data"))

    def backup(self, *args):
        return run([VBLK, "backup"] + list(args), timeout=300)

    def compare(self, a, b, fmt_b="qcow2"):
        r = qemu("compare", "-f", "qcow2", "-F", fmt_b, a, b)
        return r.rc, r.stdout.strip()

    def check(self, img):
        r = qemu("check", img)
        self.assertEqual(r.rc, 0, r)

    def test_chain_of_ten_incrementals_restores_every_point(self):
        src = self.source()
        rng = random.Random(5)
        full = os.path.join(self.tmp, "b0.qcow2")
        r = self.backup("--bitmap", "b", src, full)
        self.assertEqual(r.rc, 0, r)
        self.assertEqual(r.stdout, "")
        points = [(full, os.path.join(self.tmp, "p0.qcow2"))]
        shutil.copy(src, points[0][1])
        self.assertEqual([b["name"] for b in self.bitmaps(src)], ["b"])
        self.assertEqual(self.bitmaps(src)[0]["flags"], ["auto"])
        prev = full
        for i in range(1, 11):
            cmds = []
            for _ in range(rng.randint(1, 12)):
                off = rng.randrange(0, SIZE - 256 * 1024) // 512 * 512
                ln = rng.randint(1, 512) * 512
                kind = rng.random()
                if kind < 0.15:
                    cmds.append("write -z %d %d" % (off, ln))
                elif kind < 0.25:
                    cmds.append("discard %d %d" % (off, ln))
                else:
                    cmds.append("write -P %d %d %d" % (rng.randint(1, 255), off, ln))
            self.io(src, cmds)
            top = os.path.join(self.tmp, "b%d.qcow2" % i)
            r = self.backup("--incremental", "--bitmap", "b", "-B", os.path.basename(prev), "-F", "qcow2", src, top)
            self.assertEqual(r.rc, 0, "round %d: %r" % (i, r))
            snap = os.path.join(self.tmp, "p%d.qcow2" % i)
            shutil.copy(src, snap)
            points.append((top, snap))
            # Only what the round wrote is in the overlay (64 KiB clusters
            # around at most 12 writes of at most 256 KiB).
            r = qemu("map", "--output=json", top)
            own = sum(e["length"] for e in json.loads(r.stdout) if e.get("depth") == 0 and e.get("data"))
            self.assertLessEqual(own, 12 * (256 + 128) * 1024, "round %d copied more than the bitmap had" % i)
            prev = top
        src_alloc = self.allocated(src, "qcow2")
        for i, (top, snap) in enumerate(points):
            with self.subTest(point=i):
                self.check(top)
                self.assertEqual(self.compare(snap, top), (0, "Images are identical."))
                restored = os.path.join(self.tmp, "r%d.raw" % i)
                r = run([VBLK, "convert", "-O", "raw", top, restored], timeout=120)
                self.assertEqual(r.rc, 0, r)
                self.assertEqual(self.compare(snap, restored, "raw"), (0, "Images are identical."))
                self.assertLessEqual(self.allocated(restored, "raw"),
                                     max(src_alloc, self.allocated(snap, "qcow2")) + 1 * MiB,
                                     "restore of point %d is more allocated than the source" % i)
                os.unlink(restored)
        self.check(src)

    def test_refusals_create_nothing(self):
        src = self.source()
        full = os.path.join(self.tmp, "full.qcow2")
        self.assertEqual(self.backup("--bitmap", "b", src, full).rc, 0)
        self.io(src, ["write -P 0x44 1M 64k"])
        before = self.bitmaps(src)
        inc = os.path.join(self.tmp, "inc.qcow2")
        cases = [
            (["--incremental", "--bitmap", "nope", "-B", full, src, inc], "does not exist"),
            (["--incremental", "-B", full, src, inc], "--incremental needs --bitmap"),
            (["--incremental", "--bitmap", "b", src, inc], "--incremental needs -B"),
            (["-B", full, src, inc], "-B is only for --incremental"),
            (["--bitmap", "b", src, full], "the file exists"),
            (["--incremental", "--bitmap", "b", "-B", full, "-O", "raw", src, inc], "qcow2 overlay"),
            (["--incremental", "--bitmap", "b", "-B", os.path.join(self.tmp, "none.qcow2"), "-F", "qcow2", src, inc],
             "none.qcow2"),
            ([src], "Expecting a source and a target"),
        ]
        for args, want in cases:
            with self.subTest(args=args):
                r = self.backup(*args)
                self.assertEqual(r.rc, 1, r)
                self.assertIn(want, r.stderr)
                self.assertFalse(os.path.exists(inc), "a refused backup left a target")
                self.assertEqual(self.bitmaps(src), before)
        # The full backup is untouched by the attempt to overwrite it.
        shutil.copy(src, os.path.join(self.tmp, "now.qcow2"))
        self.check(full)

    def test_inconsistent_bitmap_is_refused(self):
        """A writer killed while it held the image leaves bitmap b marked in
        use: the incremental backup must refuse it, not trust it."""
        src = self.source()
        full = os.path.join(self.tmp, "full.qcow2")
        self.assertEqual(self.backup("--bitmap", "b", src, full).rc, 0)
        writer = subprocess.Popen([QEMU_IO, "-f", "qcow2", src], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        writer.stdin.write("write -P 0x55 2M 64k\n")
        writer.stdin.flush()
        writer.stdout.readline()
        writer.stdout.readline()
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        wait_unlocked(src)
        self.assertIn("in-use", self.bitmaps(src)[0]["flags"])
        inc = os.path.join(self.tmp, "inc.qcow2")
        r = self.backup("--incremental", "--bitmap", "b", "-B", full, "-F", "qcow2", src, inc)
        self.assertEqual(r.rc, 1, r)
        self.assertIn("inconsistent", r.stderr)
        self.assertFalse(os.path.exists(inc))
        # The way out the message names: remove it, start a new chain.
        self.assertEqual(run([VBLK, "bitmap", "--remove", src, "b"]).rc, 0)
        full2 = os.path.join(self.tmp, "full2.qcow2")
        self.assertEqual(self.backup("--bitmap", "b", src, full2).rc, 0)
        self.assertEqual(self.compare(src, full2), (0, "Images are identical."))

    def test_failed_backup_leaves_no_target_and_no_new_bitmap(self):
        src = self.source()
        target = os.path.join(self.tmp, "t.qcow2")
        # A full disk: a 2 MiB tmpfs cannot hold the source's 9 MiB of data.
        small = self.subdir("small")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", small], capture_output=True)
        if r.returncode != 0:
            self.skipTest("cannot mount a tmpfs here: %s" % r.stderr.decode().strip())
        try:
            target = os.path.join(small, "t.qcow2")
            r = self.backup("--bitmap", "b", src, target)
            self.assertEqual(r.rc, 1, r)
            self.assertIn("backup failed", r.stderr)
            self.assertFalse(os.path.exists(target), "a failed backup left its target")
            self.assertEqual(self.bitmaps(src), [], "a failed full backup started a chain")
            self.check(src)
        finally:
            subprocess.run(["umount", small])

    def test_target_that_cannot_be_created_starts_no_chain(self):
        """A typo in the target's directory: the full backup fails before it
        copies anything, and must not leave the bitmap it would have started
        (an incremental on it would silently miss everything before it)."""
        src = self.source()
        r = self.backup("--bitmap", "b1", src, os.path.join(self.tmp, "nonexistent", "full.qcow2"))
        self.assertEqual(r.rc, 1, r)
        self.assertEqual(self.bitmaps(src), [], "a failed full backup left its bitmap")
        self.io(src, ["write -P 0x66 5M 64k"])
        prev = os.path.join(self.tmp, "prev.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", prev, str(SIZE)).rc, 0)
        inc = os.path.join(self.tmp, "inc.qcow2")
        r = self.backup("--incremental", "--bitmap", "b1", "-B", prev, "-F", "qcow2", src, inc)
        self.assertEqual(r.rc, 1, r)
        self.assertIn("does not exist", r.stderr)
        self.assertFalse(os.path.exists(inc))
        self.check(src)

    def test_killed_backup_leaves_nothing_that_looks_finished(self):
        """kill -9 at any instant: TARGET either does not exist or is the
        finished backup; what was being written carries the partial name,
        and the next backup to TARGET says so instead of overwriting it."""
        src = self.source()
        rng = random.Random(9)
        partials = 0
        for i in range(6):
            with self.subTest(round=i):
                target = os.path.join(self.tmp, "k%d.qcow2" % i)
                partial = target + ".vblk-partial"
                # ~9 MiB of data at 8 MiB/s: the kill lands mid-copy (a
                # loaded machine may still let the copy finish first).
                p = subprocess.Popen([VBLK, "backup", "-r", "8M", "--bitmap", "k%d" % i, src, target],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(rng.uniform(0.05, 0.4))
                p.send_signal(signal.SIGKILL)
                p.wait()
                wait_unlocked(src)
                if p.returncode == 0:
                    # It finished before the kill: then it is the whole backup.
                    self.assertEqual(self.compare(src, target), (0, "Images are identical."))
                    os.unlink(target)
                    continue
                self.assertFalse(os.path.exists(target), "a killed backup left a target that looks finished")
                if not os.path.exists(partial):
                    continue  # killed before it created anything
                partials += 1
                r = self.backup("--bitmap", "k%d" % i, src, target)
                self.assertEqual(r.rc, 1, r)
                self.assertIn(".vblk-partial' exists", r.stderr)
                self.assertFalse(os.path.exists(target))
                os.unlink(partial)
        self.assertGreater(partials, 0, "no round killed a backup mid-copy")
        # Killed mid-run, the bitmaps were left in use: never trusted later.
        for b in self.bitmaps(src):
            self.assertIn("in-use", b["flags"])
        r = qemu("check", "-r", "leaks", src)
        self.assertIn(r.rc, (0, 3), r)
        target = os.path.join(self.tmp, "done.qcow2")
        self.assertEqual(self.backup(src, target).rc, 0)
        self.assertFalse(os.path.exists(target + ".vblk-partial"))
        self.assertEqual(self.compare(src, target), (0, "Images are identical."))

    def test_backup_that_fails_at_the_end_keeps_the_bitmap(self):
        """The incremental copies everything, then cannot take its name (a
        file appeared at TARGET meanwhile): the bitmap the job reset must
        get its bits back, or the next incremental misses those writes."""
        src = self.source()
        full = os.path.join(self.tmp, "full.qcow2")
        self.assertEqual(self.backup("--bitmap", "b", src, full).rc, 0)
        self.io(src, ["write -P 0x77 7M 1M", "write -P 0x78 30M 2M"])
        inc = os.path.join(self.tmp, "inc.qcow2")
        p = subprocess.Popen([VBLK, "backup", "-r", "2M", "--incremental", "--bitmap", "b", "-B", full, "-F",
                              "qcow2", src, inc], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        while not os.path.exists(inc + ".vblk-partial") and time.time() < deadline:
            time.sleep(0.01)
        with open(inc, "w") as f:
            f.write("squatter")
        _, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 1, err)
        self.assertIn("Could not finish the backup", err)
        self.assertFalse(os.path.exists(inc + ".vblk-partial"))
        with open(inc) as f:
            self.assertEqual(f.read(), "squatter")
        inc2 = os.path.join(self.tmp, "inc2.qcow2")
        r = self.backup("--incremental", "--bitmap", "b", "-B", full, "-F", "qcow2", src, inc2)
        self.assertEqual(r.rc, 0, r)
        self.assertEqual(self.compare(src, inc2), (0, "Images are identical."))

    def test_full_backup_of_an_nbd_export(self):
        src = self.source()
        sock = os.path.join(self.tmp, "nbd.sock")
        pid = os.path.join(self.tmp, "nbd.pid")
        r = run([QEMU_NBD, "-r", "-f", "qcow2", "--socket", sock, "--fork", "--pid-file", pid, src])
        self.assertEqual(r.rc, 0, r)
        try:
            out = os.path.join(self.tmp, "from-nbd.qcow2")
            r = self.backup("-p", "nbd+unix:///?socket=" + sock, out)
            self.assertEqual(r.rc, 0, r)
            self.assertIn("100.00/100%", r.stdout)
            self.assertEqual(self.compare(src, out), (0, "Images are identical."))
            self.assertLessEqual(self.allocated(out, "qcow2"), self.allocated(src, "qcow2") + MiB)
        finally:
            with open(pid) as f:
                os.kill(int(f.read()), signal.SIGTERM)
            time.sleep(0.1)


if __name__ == "__main__":
    unittest.main()
