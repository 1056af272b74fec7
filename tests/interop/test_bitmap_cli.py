#!/usr/bin/env python3
"""Interop: `vblk bitmap` beside `qemu-img bitmap`.

Each case runs the same arguments through qemu-img and vblk on two copies of
one image (made by QEMU's tools) and asserts the same outcome: exit code,
error text (program name and QEMU's generated node names normalised), the
image's bitmaps as `qemu-img info` reports them (names, flags, granularity),
the bitmaps' dirty extents as QEMU itself reads them back (qemu-nbd -B,
nbdinfo --map), and an image that `qemu-img check`s clean. Bitmaps vblk
changed must record guest writes afterwards as QEMU's do (qemu-io writes to
both copies after the command).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import InteropTestCase, VBLK, norm_qemu_err, norm_vblk_err, qemu, run  # noqa: E402

QEMU_IO = shutil.which("qemu-io")
QEMU_NBD = shutil.which("qemu-nbd")
NBDINFO = shutil.which("nbdinfo")


def norm(text):
    # QEMU names nodes it opens itself "#blockNNN"; vblk has its own scheme.
    return re.sub(r"#block\d+", "#node", text)


@unittest.skipUnless(QEMU_IO and QEMU_NBD and NBDINFO, "needs qemu-io, qemu-nbd and nbdinfo")
class BitmapCliTest(InteropTestCase):

    def base(self, name="base.qcow2", size="4M", cluster=None):
        """A qcow2 with bitmap b0 (enabled; dirty: 64k@64k, 4k@1M, 640k@3M)
        and b1 (disabled, clean), made with QEMU's tools."""
        img = os.path.join(self.tmp, name)
        opts = ["-o", "cluster_size=%d" % cluster] if cluster else []
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", *opts, img, size).rc, 0)
        self.assertEqual(qemu("bitmap", "--add", img, "b0").rc, 0)
        self.assertEqual(qemu("bitmap", "--add", "--disable", img, "b1").rc, 0)
        self.io(img, "write 64k 64k", "write 1M 4k", "write 3M 640k")
        return img

    def io(self, img, *cmds):
        argv = [QEMU_IO, "-f", "qcow2"]
        for c in cmds:
            argv += ["-c", c]
        r = run(argv + [img])
        self.assertEqual(r.rc, 0, r)

    def copies(self, img, label):
        """Two copies of img (and of any *.qcow2 source beside it), for
        qemu-img and for vblk, in directories of their own."""
        out = []
        for who in ("qemu", "vblk"):
            d = self.subdir("%s-%s" % (label, who))
            for f in os.listdir(self.tmp):
                p = os.path.join(self.tmp, f)
                if os.path.isfile(p) and f.endswith(".qcow2"):
                    shutil.copy(p, os.path.join(d, f))
            out.append(d)
        return out

    def bitmaps(self, img):
        r = qemu("info", "-U", "--output=json", img)
        self.assertEqual(r.rc, 0, r)
        return json.loads(r.stdout)["format-specific"]["data"].get("bitmaps", [])

    def dirty(self, img, name):
        """The bitmap's dirty extents as QEMU reads them (qemu-nbd -B)."""
        self.nbd_runs = getattr(self, "nbd_runs", 0) + 1
        sock = os.path.join(os.path.dirname(img), "nbd%d.sock" % self.nbd_runs)
        pid = os.path.join(os.path.dirname(img), "nbd%d.pid" % self.nbd_runs)
        r = run([QEMU_NBD, "-r", "-f", "qcow2", "-B", name, "--socket", sock, "--fork", "--pid-file", pid, img])
        self.assertEqual(r.rc, 0, r)
        try:
            m = run([NBDINFO, "--map=qemu:dirty-bitmap:" + name, "nbd+unix:///?socket=" + sock])
            self.assertEqual(m.rc, 0, m)
            return m.stdout
        finally:
            with open(pid) as f:
                p = int(f.read())
            os.kill(p, 15)
            for _ in range(500):  # gone (or a zombie nobody reaps), and its image lock with it
                try:
                    with open("/proc/%d/stat" % p) as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            break
                except FileNotFoundError:
                    break
                time.sleep(0.01)

    def state(self, img):
        rc = qemu("check", "-U", img)
        names = [b["name"] for b in self.bitmaps(img)]
        return {"check": (rc.rc, rc.stdout), "bitmaps": self.bitmaps(img),
                "dirty": {n: self.dirty(img, n) for n in names}}

    def same(self, label, args, image="base.qcow2", after_io=()):
        """Runs `bitmap ARGS` (image path relative to the copy's dir) through
        both programs; asserts the same outcome; returns it."""
        dq, dv = self.copies(os.path.join(self.tmp, image), label)
        q = run(["qemu-img", "bitmap"] + list(args), cwd=dq)
        v = run([VBLK, "bitmap"] + list(args), cwd=dv)
        msg = "bitmap %s" % " ".join(args)
        self.assertEqual(v.rc, q.rc, "%s: exit code\nvblk: %r\nqemu: %r" % (msg, v, q))
        self.assertEqual(norm(norm_vblk_err(v.stderr)), norm(norm_qemu_err(q.stderr)), msg)
        self.assertEqual(v.stdout, q.stdout, msg)
        if after_io:
            self.io(os.path.join(dq, image), *after_io)
            self.io(os.path.join(dv, image), *after_io)
        sq, sv = self.state(os.path.join(dq, image)), self.state(os.path.join(dv, image))
        self.assertEqual(sv, sq, msg)
        self.assertEqual(sv["check"][0], 0, sv["check"])
        return q.rc, sq

    def test_usage_errors(self):
        self.base()
        for args in ([], ["base.qcow2"], ["base.qcow2", "b0"], ["--add", "base.qcow2"],
                     ["--add", "base.qcow2", "b", "c"], ["-g", "4096", "--clear", "base.qcow2", "b0"],
                     ["-g", "4096", "-b", "x", "--clear", "base.qcow2", "b0"],
                     ["-b", "x", "--clear", "base.qcow2", "b0"], ["-F", "qcow2", "--merge", "b0", "base.qcow2", "b1"],
                     ["-F", "raw", "-b", "x", "--clear", "base.qcow2", "b0"],
                     ["-g", "abc", "--add", "base.qcow2", "b5"], ["-g", "-5", "--add", "base.qcow2", "b5"],
                     ["--bogus", "base.qcow2", "b5"], ["-x", "base.qcow2", "b5"], ["--merge"],
                     ["--add", "nonexist.qcow2", "b"]):
            with self.subTest(args=args):
                rc, _ = self.same("usage", args) if args[-1:] != ["--merge"] else (None, None)
                if rc is not None:
                    self.assertEqual(rc, 1)
                else:
                    q = run(["qemu-img", "bitmap"] + args)
                    v = run([VBLK, "bitmap"] + args)
                    self.assertEqual((v.rc, norm_vblk_err(v.stderr)), (q.rc, norm_qemu_err(q.stderr)))

    def test_add_remove_clear_enable_disable(self):
        self.base()
        cases = [
            (["--add", "base.qcow2", "n"], 0),
            (["--add", "-g", "4k", "base.qcow2", "n"], 0),
            (["--add", "-g", "2M", "base.qcow2", "n"], 0),
            (["--add", "-g", "0", "base.qcow2", "n"], 0),
            (["--add", "-g", "1000", "base.qcow2", "n"], 1),
            (["--add", "-g", "256", "base.qcow2", "n"], 1),
            (["--add", "-g", "4G", "base.qcow2", "n"], 1),
            (["--add", "base.qcow2", "b0"], 1),
            (["--add", "base.qcow2", ""], 1),
            (["--add", "base.qcow2", "x" * 1100], 1),
            (["--add", "--disable", "base.qcow2", "n"], 0),
            (["--remove", "base.qcow2", "b0"], 0),
            (["--remove", "base.qcow2", "nope"], 1),
            (["--remove", "--add", "base.qcow2", "b0"], 0),
            (["--clear", "base.qcow2", "b0"], 0),
            (["--clear", "base.qcow2", "nope"], 1),
            (["--disable", "base.qcow2", "b0"], 0),
            (["--enable", "base.qcow2", "b1"], 0),
            (["--enable", "--disable", "--enable", "base.qcow2", "b1"], 0),
            # The first action holds when a later one fails.
            (["--enable", "--add", "base.qcow2", "b1"], 1),
            (["--clear", "--remove", "--remove", "base.qcow2", "b0"], 1),
            (["-f", "qcow2", "--add", "base.qcow2", "n"], 0),
        ]
        for args, want in cases:
            with self.subTest(args=args):
                # Writes after the command: enabled bitmaps must record them
                # in both copies, disabled ones must not.
                rc, st = self.same("a%d" % cases.index((args, want)), args, after_io=("write 2M 64k",))
                self.assertEqual(rc, want, st)

    def test_merge(self):
        self.base()
        cases = [
            (["--merge", "b0", "base.qcow2", "b1"], 0),
            (["--add", "--merge", "b0", "--disable", "base.qcow2", "m"], 0),
            (["--merge", "b0", "base.qcow2", "nodst"], 1),
            (["--merge", "nope", "base.qcow2", "b1"], 1),
            (["--merge", "b0", "--merge", "b1", "base.qcow2", "b1"], 0),
            (["--clear", "--merge", "b0", "base.qcow2", "b1"], 0),
        ]
        for args, want in cases:
            with self.subTest(args=args):
                rc, st = self.same("m%d" % cases.index((args, want)), args)
                self.assertEqual(rc, want, st)
                if args[:3] == ["--merge", "b0", "base.qcow2"] and want == 0:
                    self.assertEqual(st["dirty"]["b1"], st["dirty"]["b0"], "merge did not copy b0's bits")

    def test_merge_from_another_image(self):
        self.base()
        other = os.path.join(self.tmp, "other.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", other, "4M").rc, 0)
        self.assertEqual(qemu("bitmap", "--add", other, "s").rc, 0)
        self.io(other, "write 0 4k", "write 2M 128k")
        small = os.path.join(self.tmp, "small.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", small, "2M").rc, 0)
        self.assertEqual(qemu("bitmap", "--add", small, "s").rc, 0)
        for args, want in ((["--merge", "s", "-b", "other.qcow2", "-F", "qcow2", "base.qcow2", "b1"], 0),
                           (["--merge", "s", "-b", "other.qcow2", "base.qcow2", "b1"], 0),
                           (["--merge", "b0", "-b", "other.qcow2", "-F", "qcow2", "base.qcow2", "b1"], 1),
                           (["--merge", "s", "-b", "small.qcow2", "-F", "qcow2", "base.qcow2", "b1"], 1),
                           (["--merge", "s", "-b", "nonexist.qcow2", "base.qcow2", "b1"], 1)):
            with self.subTest(args=args):
                rc, st = self.same("o%d" % len(args) + args[1] + args[3], args)
                self.assertEqual(rc, want, st)

    def test_locked_image_is_refused_and_unchanged(self):
        """An image a writer holds: both refuse, nothing changes."""
        img = self.base()
        before = self.state(img)
        holder = subprocess.Popen([QEMU_IO, "-f", "qcow2", img], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            holder.stdin.write("write 0 4k\n")
            holder.stdin.flush()
            holder.stdout.readline()
            holder.stdout.readline()
            q = run(["qemu-img", "bitmap", "--add", img, "z"])
            v = run([VBLK, "bitmap", "--add", img, "z"])
            self.assertEqual(v.rc, q.rc)
            self.assertNotEqual(v.rc, 0)
            self.assertEqual(norm(norm_vblk_err(v.stderr)), norm(norm_qemu_err(q.stderr)))
        finally:
            holder.stdin.write("quit\n")
            holder.stdin.flush()
            holder.wait(30)
        after = self.state(img)
        self.assertEqual([b["name"] for b in after["bitmaps"]], [b["name"] for b in before["bitmaps"]])

    def test_cluster_sizes_default_granularity(self):
        for cs in (512, 4096, 2 << 20):
            with self.subTest(cluster=cs):
                name = "c%d.qcow2" % cs
                self.base(name, cluster=cs)
                rc, st = self.same("c%d" % cs, ["--add", name, "n"], image=name)
                self.assertEqual(rc, 0)
                os.unlink(os.path.join(self.tmp, name))


if __name__ == "__main__":
    unittest.main()
