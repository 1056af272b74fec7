#!/usr/bin/env python3
"""Interop: `convert`, vblk vs qemu-img.

Every conversion is checked with qemu-img itself: `qemu-img compare` says
the target equals the source, `qemu-img check` finds a qcow2 target clean,
and the target's allocation (`qemu-img map`, offsets ignored) equals that of
the target qemu-img convert makes from the same source with the same
options, so vblk's targets are as sparse as qemu-img's. Bad options give
qemu-img's exit code and message.
"""

import json
import os
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (KiB, MiB, InteropTestCase, both, make_image, qemu, rand_bytes,  # noqa: E402
                    read_range, vblk)


def allocation(path, fmt):
    """qemu-img map of path, offsets dropped and equal neighbours merged."""
    r = qemu("map", "--output=json", "-f", fmt, path)
    assert r.rc == 0, r
    out = []
    for e in json.loads(r.stdout):
        key = (e["data"], e["zero"], e["present"], e["depth"])
        if out and out[-1][2:] == key and out[-1][0] + out[-1][1] == e["start"]:
            out[-1] = (out[-1][0], out[-1][1] + e["length"]) + key
        else:
            out.append((e["start"], e["length"]) + key)
    return out


class ConvertTest(InteropTestCase):

    def setUp(self):
        super().setUp()
        d = self.tmp
        self.full = make_image(os.path.join(d, "full.raw"), 8 * MiB,
                               data=[(0, rand_bytes(8 * MiB, "convert-full"))])
        self.sparse = make_image(os.path.join(d, "sparse.raw"), 16 * MiB, data=[
            (0, rand_bytes(300 * KiB, 1)),
            (5 * MiB, rand_bytes(MiB, 2)),
            (9 * MiB + 4 * KiB, rand_bytes(4 * KiB, 3)),
            (15 * MiB, rand_bytes(64 * KiB, 4)),
        ])
        self.zeros = make_image(os.path.join(d, "zeros.raw"), 4 * MiB, zeros=[(0, 4 * MiB)],
                                data=[(2 * MiB, rand_bytes(4 * KiB, 5)), (3 * MiB + 512, b"x" * 100)])
        self.sparse_q = os.path.join(d, "sparse.qcow2")
        self.assertEqual(qemu("convert", "-O", "qcow2", self.sparse, self.sparse_q).rc, 0)
        # A backing chain: base (full data) <- top (a few writes, one zeroed range).
        self.base = os.path.join(d, "base.qcow2")
        self.assertEqual(qemu("convert", "-O", "qcow2", self.full, self.base).rc, 0)
        self.top = os.path.join(d, "top.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", self.top).rc, 0)
        r = run_qemu_io(self.top, "write -P 7 1M 128k", "write -z 3M 256k", "write -P 9 7M 4k")
        self.assertEqual(r.rc, 0, r)

    def sources(self):
        return [(self.full, "raw"), (self.sparse, "raw"), (self.zeros, "raw"),
                (self.sparse_q, "qcow2"), (self.top, "qcow2")]

    def check_target(self, src, src_fmt, out, out_fmt, ref=None):
        r = qemu("compare", "-f", src_fmt, "-F", out_fmt, src, out)
        self.assertEqual(r.rc, 0, r)
        if out_fmt == "qcow2":
            r = qemu("check", out)
            self.assertEqual(r.rc, 0, r)
        if ref:
            self.assertEqual(allocation(out, out_fmt), allocation(ref, out_fmt))

    def test_formats_and_sparseness(self):
        for src, src_fmt in self.sources():
            for out_fmt in ("raw", "qcow2"):
                with self.subTest(src=os.path.basename(src), out=out_fmt):
                    v_out = os.path.join(self.tmp, "v." + out_fmt)
                    q_out = os.path.join(self.tmp, "q." + out_fmt)
                    for p in (v_out, q_out):
                        if os.path.exists(p):
                            os.unlink(p)
                    v = vblk("convert", "-f", src_fmt, "-O", out_fmt, src, v_out)
                    self.assertEqual((v.rc, v.stdout, v.stderr), (0, "", ""), v)
                    self.assertEqual(qemu("convert", "-f", src_fmt, "-O", out_fmt, src, q_out).rc, 0)
                    self.check_target(src, src_fmt, v_out, out_fmt, q_out)

    def test_options_change_allocation_like_qemu(self):
        cases = [
            ["-S", "0"],              # fully allocated
            ["-S", "64k"],            # coarser zero detection
            ["-o", "cluster_size=4k"],
            ["-m", "1"],
            ["-m", "16", "-W"],
            ["-t", "none", "-T", "none"],
            ["-t", "writeback"],
            ["-r", "1G"],
        ]
        for extra in cases:
            for out_fmt in ("raw", "qcow2"):
                if "cluster_size=4k" in extra and out_fmt == "raw":
                    continue
                with self.subTest(extra=extra, out=out_fmt):
                    v_out = os.path.join(self.tmp, "v." + out_fmt)
                    q_out = os.path.join(self.tmp, "q." + out_fmt)
                    for p in (v_out, q_out):
                        if os.path.exists(p):
                            os.unlink(p)
                    v = vblk("convert", "-O", out_fmt, *extra, self.zeros, v_out)
                    self.assertEqual(v.rc, 0, v)
                    self.assertEqual(qemu("convert", "-O", out_fmt, *extra, self.zeros, q_out).rc, 0)
                    self.check_target(self.zeros, "raw", v_out, out_fmt, q_out)

    def test_backing_file_kept_with_B(self):
        v_out = os.path.join(self.tmp, "v.qcow2")
        q_out = os.path.join(self.tmp, "q.qcow2")
        for out, prog in ((v_out, vblk), (q_out, qemu)):
            r = prog("convert", "-O", "qcow2", "-B", "base.qcow2", "-F", "qcow2", self.top, out, cwd=self.tmp)
            self.assertEqual(r.rc, 0, r)
        info = json.loads(qemu("info", "--output=json", v_out).stdout)
        self.assertEqual(info["backing-filename"], "base.qcow2")
        self.assertEqual(info["backing-filename-format"], "qcow2")
        self.check_target(self.top, "qcow2", v_out, "qcow2", q_out)
        # Only the top layer's clusters were copied.
        alloc = [a for a in allocation(v_out, "qcow2") if a[4] and a[5] == 0]
        self.assertEqual(sum(a[1] for a in alloc if a[2]), 128 * KiB + 64 * KiB)

    def test_existing_target(self):
        for fmt in ("raw", "qcow2"):
            with self.subTest(fmt=fmt):
                out = os.path.join(self.tmp, "n." + fmt)
                self.assertEqual(qemu("create", "-q", "-f", fmt, out, "16M").rc, 0)
                # Garbage where the source has holes: -n must zero it.
                self.assertEqual(run_qemu_io(out, "write -P 0x55 0 16M", fmt=fmt).rc, 0)
                v = vblk("convert", "-n", "-O", fmt, self.sparse, out)
                self.assertEqual(v.rc, 0, v)
                self.check_target(self.sparse, "raw", out, fmt)
                # --target-is-zero on a fresh target writes no zeroes at all.
                os.unlink(out)
                self.assertEqual(qemu("create", "-q", "-f", fmt, out, "16M").rc, 0)
                v = vblk("convert", "-n", "--target-is-zero", "-O", fmt, self.sparse, out)
                self.assertEqual(v.rc, 0, v)
                self.check_target(self.sparse, "raw", out, fmt)

    def test_copy_offload(self):
        out = os.path.join(self.tmp, "c.raw")
        v = vblk("convert", "-C", "-O", "raw", self.sparse, out)
        self.assertEqual(v.rc, 0, v)
        self.check_target(self.sparse, "raw", out, "raw")
        # Through qcow2 there is no offload: the fallback copies.
        out2 = os.path.join(self.tmp, "c.qcow2")
        v = vblk("convert", "-C", "-O", "qcow2", self.sparse, out2)
        self.assertEqual(v.rc, 0, v)
        self.check_target(self.sparse, "raw", out2, "qcow2")

    def test_progress(self):
        v, q = both("convert", "-p", "-O", "raw", self.full, os.path.join(self.tmp, "p.raw"))
        self.assertEqual(v.rc, 0, v)
        self.assertTrue(v.stdout.startswith("    (0.00/100%)\r"), v.stdout)
        self.assertTrue(v.stdout.endswith("    (100.00/100%)\r\n"), v.stdout)
        self.assertEqual(q.stdout[:len("    (0.00/100%)\r")], v.stdout[:len("    (0.00/100%)\r")])
        v = vblk("convert", "-p", "-q", "-O", "raw", self.full, os.path.join(self.tmp, "p2.raw"))
        self.assertEqual((v.rc, v.stdout), (0, ""))

    def test_compressed_targets(self):
        """convert -c: compressed qcow2 targets equal to the source, clean,
        with the allocation and compressed-cluster count of qemu-img's own
        convert -c (a cluster that does not shrink is stored uncompressed:
        the random image; a partial last cluster; zstd; small clusters
        compressed on the loop thread)."""
        d = self.tmp
        text = b"".join(b"cluster %08d of a compressible image\n" % i for i in range(120000))
        comp = make_image(os.path.join(d, "comp.raw"), 5 * MiB + 12 * KiB, data=[
            (0, text[:2 * MiB]), (2 * MiB + 64 * KiB, rand_bytes(192 * KiB, 6)),
            (3 * MiB, text[:2 * MiB + 12 * KiB])])
        cases = [(src, fmt, []) for src, fmt in self.sources()] + [
            (comp, "raw", []),
            (comp, "raw", ["-o", "compression_type=zstd"]),
            (comp, "raw", ["-o", "cluster_size=4k"]),
            (self.sparse, "raw", ["-S", "0"]),
            (comp, "raw", ["-m", "1"]),
        ]
        for src, src_fmt, extra in cases:
            with self.subTest(src=os.path.basename(src), extra=extra):
                v_out = os.path.join(d, "vc.qcow2")
                q_out = os.path.join(d, "qc.qcow2")
                for p in (v_out, q_out):
                    if os.path.exists(p):
                        os.unlink(p)
                v = vblk("convert", "-c", "-f", src_fmt, "-O", "qcow2", *extra, src, v_out)
                self.assertEqual((v.rc, v.stdout, v.stderr), (0, "", ""), v)
                q = qemu("convert", "-c", "-f", src_fmt, "-O", "qcow2", *extra, src, q_out)
                self.assertEqual(q.rc, 0, q)
                self.check_target(src, src_fmt, v_out, "qcow2", q_out)
                cv = json.loads(qemu("check", "--output=json", v_out).stdout)
                cq = json.loads(qemu("check", "--output=json", q_out).stdout)
                for key in ("compressed-clusters", "allocated-clusters", "leaks", "corruptions"):
                    self.assertEqual(cv.get(key), cq.get(key), key)
                if src == comp:
                    self.assertGreater(cv["compressed-clusters"], 0)
                    # Packed: clearly smaller than the source's data.
                    self.assertLess(os.path.getsize(v_out), 2 * MiB)

    def test_bad_options_as_qemu(self):
        src = "full.raw"
        cases = [
            ["-m", "0", src, "o1"],
            ["-m", "17", src, "o1"],
            ["-m", "x", src, "o1"],
            ["-S", "100", src, "o1"],
            ["-S", "x", src, "o1"],
            ["-S", "32M", src, "o1"],
            ["--target-is-zero", src, "o1"],
            ["-O", "foo", src, "o1"],
            ["-t", "bogus", src, "o1"],
            ["-T", "bogus", src, "o1"],
            ["-C", "-c", src, "o1"],
            ["-C", "-S", "4k", src, "o1"],
            ["-c", src, "o1"],
            [src],
            ["-B", "base.raw", src, "o1"],
            ["-O", "qcow2", "-B", "base.qcow2", src, "o1"],
            ["-O", "qcow2", "-o", "cluster_size=3", src, "o1"],
            ["-n", "-o", "cluster_size=4k", src, src],
            ["nonexist.raw", "o1"],
            ["-n", src, "nonexist"],
            ["-n", "zeros.raw", "o1"],
            ["-n", src, "zeros.raw"],  # target smaller than the source
            ["-Z", src, "o1"],
            ["-O"],
        ]
        for argv in cases:
            with self.subTest(argv=argv):
                for p in ("o1",):
                    if os.path.exists(os.path.join(self.tmp, p)):
                        os.unlink(os.path.join(self.tmp, p))
                before = read_range(self.zeros, 0, 4 * MiB)
                v, q = both("convert", *argv, cwd=self.tmp)
                self.assertNotEqual(v.rc, 0, v)
                self.assertSameResult(v, q, stdout=False)
                self.assertEqual(read_range(self.zeros, 0, 4 * MiB), before)


def run_qemu_io(path, *cmds, fmt="qcow2"):
    from common import run
    argv = ["qemu-io", "-f", fmt]
    for c in cmds:
        argv += ["-c", c]
    return run(argv + [path])


if __name__ == "__main__":
    unittest.main()
