#!/usr/bin/env python3
"""Interop: `resize --preallocation=metadata|falloc|full`, vblk vs qemu-img.

The same image (made by qemu-img, partly written by qemu-io) is resized by
each tool in its own directory. Afterwards both must have printed the same,
exited the same, and left the same layout: `qemu-img map --output=json`
equal (offsets included), equal file sizes, allocation on disk within a
margin, `qemu-img check` clean and `qemu-img compare` identical. Raw images
too (falloc/full allocate the new area; metadata is refused with qemu-img's
message). Creation with preallocation is covered by test_qcow2.py's create
combinations.
"""
import json
import os
import shutil
import subprocess
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MiB, QEMU_IMG, InteropTestCase, qemu, shm_dir, vblk  # noqa: E402

QEMU_IO = os.environ.get("QEMU_IO") or os.path.join(os.path.dirname(QEMU_IMG), "qemu-io")

# (name, create options, initial size, qemu-io writes, resize argument)
QCOW2_CASES = [
    ("metadata_grow", "cluster_size=65536", "1M", ["write -P 1 0 100k"], "+3M"),
    ("metadata_unaligned_old", "cluster_size=65536", "1000k", ["write -P 2 900k 100k"], "5M"),
    ("metadata_cs4k_many_l2", "cluster_size=4096", "1M", ["write -P 3 0 8k"], "12M"),
    ("falloc_grow", "cluster_size=65536", "1M", ["write -P 4 64k 64k"], "+6M"),
    ("falloc_cs4k_refblocks", "cluster_size=4096", "2M", ["write -P 5 1M 4k"], "+18M"),
    ("falloc_unaligned_old", "cluster_size=65536", "1000k", [], "+1M"),
    ("full_grow", "cluster_size=65536", "3M", ["write -P 6 0 3M"], "+2M"),
    ("full_cs512_rb1", "cluster_size=512,refcount_bits=1", "64k", ["write -P 7 0 4k"], "+1M"),
    ("full_empty", "cluster_size=65536", "0", [], "+2M"),
    ("falloc_big_l1_growth", "cluster_size=512", "1M", ["write -P 8 0 1k"], "+2M"),
]


class PreallocResizeTest(InteropTestCase):
    def setUp(self):
        super().setUp()
        base = shm_dir()
        if base:
            self.tmp = self.subdir_in(base)

    def subdir_in(self, base):
        import tempfile
        d = tempfile.mkdtemp(prefix="vblk-prealloc-", dir=base)
        self.addCleanup(shutil.rmtree, d, True)
        return d

    def _pair(self, name, fmt, opts, size, writes):
        # Made twice the same way rather than copied: a copy would not keep
        # the holes, and map shows them.
        dv, dq = self.subdir("v_" + name), self.subdir("q_" + name)
        img = "i." + fmt
        for d in (dv, dq):
            r = qemu("create", "-q", "-f", fmt, *(["-o", opts] if opts else []),
                     os.path.join(d, img), size)
            self.assertEqual(r.rc, 0, r)
            if writes:
                argv = [QEMU_IO, "-f", fmt]
                for w in writes:
                    argv += ["-c", w]
                subprocess.run(argv + [os.path.join(d, img)], check=True, capture_output=True)
        return dv, dq, img

    def _same_layout(self, dv, dq, img, fmt):
        pv, pq = os.path.join(dv, img), os.path.join(dq, img)
        sv, sq = os.stat(pv), os.stat(pq)
        self.assertEqual(sv.st_size, sq.st_size, "file size differs")
        self.assertAlmostEqual(sv.st_blocks * 512, sq.st_blocks * 512,
                               delta=max(MiB, sq.st_blocks * 512 // 10), msg="allocation differs")
        mv = qemu("map", "--output=json", "-f", fmt, pv)
        mq = qemu("map", "--output=json", "-f", fmt, pq)
        self.assertEqual(mv.rc, 0, mv)
        self.assertEqual(json.loads(mv.stdout), json.loads(mq.stdout), "map differs")
        c = qemu("compare", "-f", fmt, "-F", fmt, pv, pq)
        self.assertEqual(c.rc, 0, c)
        if fmt == "qcow2":
            chk = qemu("check", pv)
            self.assertEqual(chk.rc, 0, chk)
            iv = json.loads(qemu("info", "--output=json", pv).stdout)
            iq = json.loads(qemu("info", "--output=json", pq).stdout)
            for k in ("virtual-size", "cluster-size", "format-specific"):
                self.assertEqual(iv.get(k), iq.get(k), k)

    def _resize_both(self, dv, dq, img, fmt, args):
        v = vblk("resize", "-f", fmt, *args[:-1], img, args[-1], cwd=dv, timeout=120)
        q = qemu("resize", "-f", fmt, *args[:-1], img, args[-1], cwd=dq, timeout=120)
        self.assertSameResult(v, q)
        return v, q

    def test_qcow2(self):
        for name, opts, size, writes, new in QCOW2_CASES:
            mode = name.split("_")[0]
            with self.subTest(case=name):
                dv, dq, img = self._pair(name, "qcow2", opts, size, writes)
                v, q = self._resize_both(dv, dq, img, "qcow2", ["--preallocation=" + mode, new])
                self.assertEqual(q.rc, 0, q)
                self._same_layout(dv, dq, img, "qcow2")

    def test_raw(self):
        for mode in ("falloc", "full", "off"):
            with self.subTest(mode=mode):
                dv, dq, img = self._pair("raw_" + mode, "raw", None, "1M", [])
                v, q = self._resize_both(dv, dq, img, "raw", ["--preallocation=" + mode, "+3M"])
                self.assertEqual(q.rc, 0, q)
                self._same_layout(dv, dq, img, "raw")
                if mode != "off":
                    self.assertGreaterEqual(os.stat(os.path.join(dv, img)).st_blocks * 512, 3 * MiB)

    def test_refused(self):
        # Both refuse, with the same message, and change nothing.
        cases = [("raw", ["--preallocation=metadata", "+1M"]),
                 ("qcow2", ["--preallocation=falloc", "--shrink", "512k"]),
                 ("qcow2", ["--preallocation=full", "1M"]),
                 ("qcow2", ["--preallocation=bogus", "+1M"])]
        for i, (fmt, args) in enumerate(cases):
            with self.subTest(fmt=fmt, args=args):
                dv, dq, img = self._pair("ref%d" % i, fmt, None, "1M", [])
                before = open(os.path.join(dv, img), "rb").read()
                v, q = self._resize_both(dv, dq, img, fmt, args)
                self.assertNotEqual(q.rc, 0, q)
                if fmt == "qcow2":
                    self.assertEqual(open(os.path.join(dv, img), "rb").read(), before)


if __name__ == "__main__":
    unittest.main()
