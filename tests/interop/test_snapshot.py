#!/usr/bin/env python3
"""Interop: qcow2 internal snapshots, vblk vs qemu-img / qemu-io.

A. Round trips, per image option set (cluster_size 512/64k/2M,
   refcount_bits 1 and 64, extended_l2, compat=0.10, a backing file):
   data written with qemu-io and with ``vblk bench -w --pattern`` between
   snapshots made alternately by qemu-img and vblk; snapshots applied and
   deleted alternately by both.  After every step: ``qemu-img check``
   clean, the image equal (``qemu-img compare``) to a raw reference kept
   here, and ``snapshot -l``, ``info`` (human and JSON) and ``map``
   (human and JSON) of vblk equal to qemu-img's.

B. The command line: errors, exit codes and output of ``snapshot`` equal
   qemu-img's (mixed actions, missing names, -f (7.2 has none), raw images,
   -U with a writing action, refcount_bits=1 where a snapshot cannot be
   made).

C. Hostile snapshot tables (misaligned, too many entries, past EOF, too much
   extra data, snapshot L1 tables misaligned / too large / past EOF /
   overlapping metadata): ``info``, ``snapshot -l`` and ``check`` as
   qemu-img; ``snapshot -a/-c/-d`` with qemu-img's messages and exit code,
   and the check afterwards as qemu-img's where QEMU's outcome is defined.

Sanity check for the suite itself: ``VBLK=$(which qemu-img)`` passes.
"""

import json
import os
import shutil
import struct
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (KiB, MiB, QEMU_IMG, InteropTestCase, make_image,  # noqa: E402
                    make_tempdir, norm_qemu_err, norm_vblk_err, qemu, run,
                    shm_dir, vblk)

QEMU_IO = os.environ.get("QEMU_IO") or os.path.join(os.path.dirname(QEMU_IMG), "qemu-io")
if not os.access(QEMU_IO, os.X_OK):
    QEMU_IO = shutil.which("qemu-io")
if not QEMU_IO:
    sys.stderr.write("interop tests: qemu-io not found (set $QEMU_IO)\n")
    sys.exit(2)

IDENTICAL = "Images are identical.\n"
NO_ERRORS = "No errors were found on the image.\n"
TMP_BASE = shm_dir()


def qemu_io(d, img, ops):
    argv = [QEMU_IO, "-f", "qcow2"]
    for op in ops:
        argv += ["-c", op]
    argv.append(img)
    r = run(argv, cwd=d, timeout=120)
    if r.rc != 0 or r.stderr or "failed" in r.stdout or "error" in r.stdout.lower():
        raise AssertionError("qemu-io failed: %r" % r)


class SnapshotCase(InteropTestCase):
    def setUp(self):
        super().setUp()
        self.tmp = make_tempdir(self, base=TMP_BASE)

    def ok(self, r):
        self.assertEqual(r.rc, 0, r)
        return r

    def assert_clean(self, d, img, what):
        c = qemu("check", img, cwd=d)
        self.assertEqual(c.rc, 0, "qemu-img check after %s:\n%r" % (what, c))
        self.assertTrue(c.stdout.startswith(NO_ERRORS), "after %s: %s" % (what, c.stdout))

    def assert_content(self, d, img, ref, what):
        make_image(os.path.join(d, "ref.raw"), len(ref), data=[(0, bytes(ref))])
        c = qemu("compare", "-f", "qcow2", "-F", "raw", img, "ref.raw", cwd=d)
        self.assertEqual((c.rc, c.stdout, c.stderr), (0, IDENTICAL, ""), "after %s: %r" % (what, c))

    def assert_same_views(self, d, img, what):
        for args in (["snapshot", "-l"], ["info"], ["info", "--output=json"],
                     ["map"], ["map", "--output=json"], ["check"], ["check", "--output=json"]):
            v = vblk(*args, img, cwd=d)
            q = qemu(*args, img, cwd=d)
            self.assertEqual((v.rc, v.stdout, norm_vblk_err(v.stderr)),
                             (q.rc, q.stdout, norm_qemu_err(q.stderr)),
                             "%s after %s" % (args, what))


# name, create args, virtual size, backing
COMBOS = [
    ("cs64k", [], 4 * MiB, False),
    ("cs512", ["-o", "cluster_size=512"], 2 * MiB, False),
    ("cs2M", ["-o", "cluster_size=2M"], 8 * MiB, False),
    ("rb64", ["-o", "refcount_bits=64"], 4 * MiB, False),
    ("rb4", ["-o", "refcount_bits=4,cluster_size=4k"], 4 * MiB, False),
    ("extl2", ["-o", "extended_l2=on,cluster_size=32k"], 4 * MiB, False),
    ("compat010", ["-o", "compat=0.10"], 4 * MiB, False),
    ("backing", ["-o", "cluster_size=16k", "-b", "base.raw", "-F", "raw"], 4 * MiB, True),
]


class RoundTripTest(SnapshotCase):
    def _run(self, args, size, backing):
        d = self.tmp
        img = "t.qcow2"
        ref = bytearray(size)
        if backing:
            base = bytes((i * 7 + 3) & 0xff for i in range(256)) * (size // 256)
            make_image(os.path.join(d, "base.raw"), size, data=[(0, base)])
            ref[:] = base
        self.ok(qemu("create", "-q", "-f", "qcow2", *args, img, str(size), cwd=d))
        step = "create"

        def qwrite(pattern, off, length):
            qemu_io(d, img, ["write -P %d %d %d" % (pattern, off, length)])
            ref[off:off + length] = bytes([pattern]) * length

        def vwrite(pattern, off, length, count=1, depth=1):
            r = vblk("bench", "-w", "-f", "qcow2", "-c", str(count), "-d", str(depth),
                     "-s", str(length), "-o", str(off), "--pattern=%d" % pattern, img, cwd=d)
            self.assertEqual((r.rc, r.stderr), (0, ""), r)
            for i in range(count):
                o = off + i * length
                ref[o:o + length] = bytes([pattern]) * length

        def verify(what):
            self.assert_clean(d, img, what)
            self.assert_content(d, img, ref, what)

        # Data, then a snapshot by qemu-img.
        qwrite(0x11, 0, size // 2)
        qwrite(0x12, size // 2 + 4096 + 512, 70000)
        refs = {}
        self.ok(qemu("snapshot", "-c", "q1", img, cwd=d))
        refs["q1"] = bytes(ref)
        # vblk overwrites shared clusters (partial and whole), then snapshots.
        vwrite(0x21, 1000, 3000)
        vwrite(0x22, size // 4, 65536, count=8, depth=8)
        vwrite(0x23, size - 100000, 100000)
        verify("vblk writes over a qemu-img snapshot")
        r = self.ok(vblk("snapshot", "-c", "v2", img, cwd=d))
        self.assertEqual((r.stdout, r.stderr), ("", ""))
        refs["v2"] = bytes(ref)
        verify("vblk snapshot -c")
        self.assert_same_views(d, img, "vblk snapshot -c")
        # qemu-io writes over vblk's snapshot.
        qwrite(0x31, 0, 8192)
        qwrite(0x32, size // 4 + 65536 * 2, 65536 * 3)
        verify("qemu-io writes over a vblk snapshot")
        self.ok(vblk("snapshot", "-c", "v3", img, cwd=d))
        refs["v3"] = bytes(ref)
        # vblk applies qemu-img's snapshot.
        self.ok(vblk("snapshot", "-a", "q1", img, cwd=d))
        ref[:] = refs["q1"]
        verify("vblk snapshot -a q1")
        self.assert_same_views(d, img, "vblk snapshot -a")
        vwrite(0x41, 0, 4096, count=4)
        verify("vblk writes after -a")
        # qemu-img applies vblk's snapshot (by id).
        self.ok(qemu("snapshot", "-a", "2", img, cwd=d))
        ref[:] = refs["v2"]
        verify("qemu-img snapshot -a v2")
        vwrite(0x51, size // 2, 65536 * 2)
        # vblk deletes the qemu-img snapshot, qemu-img a vblk one.
        self.ok(vblk("snapshot", "-d", "q1", img, cwd=d))
        verify("vblk snapshot -d q1")
        self.assert_same_views(d, img, "vblk snapshot -d")
        self.ok(qemu("snapshot", "-d", "v2", img, cwd=d))
        verify("qemu-img snapshot -d v2")
        # The remaining one still holds its data.
        self.ok(vblk("snapshot", "-a", "v3", img, cwd=d))
        ref[:] = refs["v3"]
        verify("vblk snapshot -a v3")
        self.ok(vblk("snapshot", "-d", "v3", img, cwd=d))
        verify("vblk snapshot -d v3 (the last one)")
        self.assert_same_views(d, img, "deleting every snapshot")
        # With no snapshot left, every cluster is exclusive again: writes go
        # in place (no new clusters).
        before = json.loads(qemu("check", "--output=json", img, cwd=d).stdout)
        vwrite(0x61, 0, 65536)
        after = json.loads(qemu("check", "--output=json", img, cwd=d).stdout)
        self.assertEqual(before["allocated-clusters"], after["allocated-clusters"])
        verify("in-place write after the last delete")
        del step


def _make(name, args, size, backing):
    def test(self):
        self._run(args, size, backing)
    test.__name__ = "test_" + name
    return test


for _c in COMBOS:
    setattr(RoundTripTest, "test_" + _c[0], _make(*_c))


class DamagedCheckTest(SnapshotCase):
    """vblk check counts clusters reached only through snapshots."""

    def _refcount_slot(self, path, cluster):
        # refcount table -> block 0 (16-bit refcounts, 64k clusters)
        with open(path, "rb") as f:
            data = f.read()
        rt = struct.unpack(">Q", data[48:56])[0]
        rb = struct.unpack(">Q", data[rt:rt + 8])[0]
        return rb + 2 * cluster

    def test_damaged_refcounts(self):
        d = self.tmp
        self.ok(qemu("create", "-q", "-f", "qcow2", "t.qcow2", "4M", cwd=d))
        qemu_io(d, "t.qcow2", ["write -P 1 0 256k"])
        self.ok(vblk("snapshot", "-c", "a", "t.qcow2", cwd=d))
        qemu_io(d, "t.qcow2", ["write -P 2 0 128k"])  # now 2 clusters are snapshot-only
        self.assert_same_views(d, "t.qcow2", "snapshot-only clusters")
        path = os.path.join(d, "t.qcow2")
        with open(path, "rb") as f:
            data = f.read()
        # Data clusters of the snapshot (its L1 -> L2 tables), minus the
        # active image's: the ones only the snapshot reaches.
        nb, off = struct.unpack(">IQ", data[60:72])
        sl1, sl1_size = struct.unpack(">QI", data[off:off + 12])
        snap_data = set()
        for i in range(sl1_size):
            l2 = struct.unpack(">Q", data[sl1 + 8 * i:sl1 + 8 * i + 8])[0] & 0x00fffffffffffe00
            for j in range(8192) if l2 else ():
                e = struct.unpack(">Q", data[l2 + 8 * j:l2 + 8 * j + 8])[0] & 0x00fffffffffffe00
                if e:
                    snap_data.add(e)
        active = [(e["offset"], e["length"]) for e in
                  json.loads(qemu("map", "--output=json", "t.qcow2", cwd=d).stdout) if e.get("offset") is not None]
        only = sorted(o for o in snap_data if not any(a <= o < a + n for a, n in active))
        self.assertEqual(len(only), 2, (snap_data, active))
        # Damage: the first of them loses its reference.
        with open(path, "r+b") as f:
            f.seek(self._refcount_slot(path, only[0] // 65536))
            self.assertEqual(struct.unpack(">H", f.read(2))[0], 1)
            f.seek(self._refcount_slot(path, only[0] // 65536))
            f.write(struct.pack(">H", 0))
        for args in (["check"], ["check", "--output=json"]):
            v = vblk(*args, "t.qcow2", cwd=d)
            q = qemu(*args, "t.qcow2", cwd=d)
            self.assertEqual(q.rc, 2, q)
            self.assertEqual((v.rc, v.stdout, norm_vblk_err(v.stderr)),
                             (q.rc, q.stdout, norm_qemu_err(q.stderr)), args)
        # Repair by both gives the same, clean image state.
        shutil.copy(path, os.path.join(d, "q.qcow2"))
        v = vblk("check", "-r", "all", "t.qcow2", cwd=d)
        q = qemu("check", "-r", "all", "q.qcow2", cwd=d)
        self.assertEqual((v.rc, v.stdout), (q.rc, q.stdout))
        self.assert_clean(d, "t.qcow2", "vblk check -r all")


class GrowShrinkTest(SnapshotCase):
    def test_apply_restores_disk_size(self):
        d = self.tmp
        self.ok(qemu("create", "-q", "-f", "qcow2", "t.qcow2", "1M", cwd=d))
        qemu_io(d, "t.qcow2", ["write -P 7 0 1M"])
        self.ok(vblk("snapshot", "-c", "small", "t.qcow2", cwd=d))
        self.ok(qemu("resize", "t.qcow2", "300M", cwd=d))
        qemu_io(d, "t.qcow2", ["write -P 8 200M 1M"])
        self.ok(qemu("snapshot", "-c", "big", "t.qcow2", cwd=d))
        self.ok(vblk("snapshot", "-a", "small", "t.qcow2", cwd=d))
        self.assert_clean(d, "t.qcow2", "apply to a smaller disk size")
        self.assert_content(d, "t.qcow2", b"\x07" * MiB, "apply small")
        self.assert_same_views(d, "t.qcow2", "apply small")
        self.ok(vblk("snapshot", "-a", "big", "t.qcow2", cwd=d))
        self.assert_clean(d, "t.qcow2", "apply to a bigger disk size")
        info = json.loads(vblk("info", "--output=json", "t.qcow2", cwd=d).stdout)
        self.assertEqual(info["virtual-size"], 300 * MiB)
        r = qemu_io(d, "t.qcow2", ["read -P 8 200M 1M", "read -P 7 0 1M"])
        del r


    def test_v2_with_snapshots_cannot_resize(self):
        d = self.tmp
        for tool in ("v", "q"):
            self.ok(qemu("create", "-q", "-f", "qcow2", "-o", "compat=0.10", tool + ".qcow2", "1M", cwd=d))
            qemu_io(d, tool + ".qcow2", ["write -P 4 0 1M"])
            self.ok(qemu("snapshot", "-c", "s", tool + ".qcow2", cwd=d))
        for args in (["resize"], ["resize", "--shrink"]):
            v = vblk(*args, "v.qcow2", "512k", cwd=d)
            q = qemu(*args, "q.qcow2", "512k", cwd=d)
            self.assertEqual((v.rc, v.stdout, norm_vblk_err(v.stderr).replace("v.qcow2", "X")),
                             (q.rc, q.stdout, norm_qemu_err(q.stderr).replace("q.qcow2", "X")), args)
        # Applying a snapshot of another size needs a resize: refused too.
        for tool, run_ in (("v", vblk), ("q", qemu)):
            self.ok(qemu("create", "-q", "-f", "qcow2", "-o", "compat=0.10", tool + "2.qcow2", "1M", cwd=d))
            self.ok(qemu("snapshot", "-c", "s", tool + "2.qcow2", cwd=d))
            # (grow the header's size behind QEMU's back: v2 cannot resize)
            _patch(os.path.join(d, tool + "2.qcow2"), 24, ">Q", 2 * MiB)
        v = vblk("snapshot", "-a", "s", "v2.qcow2", cwd=d)
        q = qemu("snapshot", "-a", "s", "q2.qcow2", cwd=d)
        self.assertEqual((v.rc, norm_vblk_err(v.stderr)), (q.rc, norm_qemu_err(q.stderr)))
        self.assertEqual(v.rc, 1)


class CliTest(SnapshotCase):
    def _img(self, name="t.qcow2"):
        r = qemu("create", "-q", "-f", "qcow2", name, "1M", cwd=self.tmp)
        self.assertEqual(r.rc, 0, r)
        return name

    def compare(self, *args, fresh=True):
        """Runs the same snapshot command through both on copies of one image."""
        d = self.tmp
        src = self._img("src.qcow2") if fresh else "src.qcow2"
        if fresh:
            self.ok(qemu("snapshot", "-c", "one", src, cwd=d))
        shutil.copy(os.path.join(d, src), os.path.join(d, "t.qcow2"))
        v = vblk("snapshot", *args, cwd=d)
        v_after = qemu("snapshot", "-l", "t.qcow2", cwd=d).stdout
        shutil.copy(os.path.join(d, src), os.path.join(d, "t.qcow2"))
        q = qemu("snapshot", *args, cwd=d)
        q_after = qemu("snapshot", "-l", "t.qcow2", cwd=d).stdout
        # dates differ between two creations: compare without them
        strip = lambda s: [l[:27] for l in s.splitlines()]  # noqa: E731
        self.assertEqual((v.rc, v.stdout, norm_vblk_err(v.stderr), strip(v_after)),
                         (q.rc, q.stdout, norm_qemu_err(q.stderr), strip(q_after)), args)
        return v

    def test_errors_and_actions(self):
        cases = [
            ["-l", "t.qcow2"],
            ["t.qcow2"],                      # no action: opens, does nothing
            ["-l", "-c", "x", "t.qcow2"],
            ["-a", "x", "-d", "y", "t.qcow2"],
            ["-l"],
            ["-l", "t.qcow2", "extra"],
            ["-c"],
            ["t.qcow2", "-c"],
            ["-f", "qcow2", "-l", "t.qcow2"],  # 7.2 has no -f
            ["-l", "-fqcow2", "t.qcow2"],
            ["-x", "t.qcow2"],
            ["-a", "nosuch", "t.qcow2"],
            ["-d", "nosuch", "t.qcow2"],
            ["-d", "1", "t.qcow2"],           # -d looks up names only
            ["-a", "1", "t.qcow2"],           # -a: id first
            ["-a", "one", "t.qcow2"],
            ["-d", "one", "t.qcow2"],
            ["-q", "-c", "two", "t.qcow2"],
            ["-c", "one", "t.qcow2"],         # duplicate names are allowed
            ["-c", "n" * 300, "t.qcow2"],     # names are cut at 255 bytes
            ["-U", "-l", "t.qcow2"],
            ["-U", "-c", "x", "t.qcow2"],
            ["-l", "missing.qcow2"],
            ["--image-opts", "-l", "driver=qcow2,file.filename=t.qcow2"],
            ["--image-opts", "-c", "io", "driver=qcow2,file.filename=t.qcow2"],
        ]
        for c in cases:
            with self.subTest(args=c):
                self.compare(*c)

    def test_help(self):
        v = vblk("snapshot", "-h", cwd=self.tmp)
        self.assertEqual(v.rc, 0)
        self.assertIn("snapshot [--image-opts] [-U] [-q] [-l | -a snapshot | -c snapshot | -d snapshot] "
                      "filename", v.stdout)

    def test_raw_image(self):
        d = self.tmp
        make_image(os.path.join(d, "r.raw"), MiB)
        for args in (["-l"], ["-c", "x"], ["-a", "x"], ["-d", "x"]):
            with self.subTest(args=args):
                v = vblk("snapshot", *args, "r.raw", cwd=d)
                q = qemu("snapshot", *args, "r.raw", cwd=d)
                self.assertEqual((v.rc, v.stdout, norm_vblk_err(v.stderr)),
                                 (q.rc, q.stdout, norm_qemu_err(q.stderr)))

    def test_apply_refused_with_bitmaps(self):
        d = self.tmp
        self._img("src.qcow2")
        self.ok(qemu("snapshot", "-c", "one", "src.qcow2", cwd=d))
        self.ok(qemu("bitmap", "--add", "src.qcow2", "b0", cwd=d))
        self.compare("-a", "one", "t.qcow2", fresh=False)
        self.compare("-d", "one", "t.qcow2", fresh=False)

    def test_refcount_bits_1_cannot_share(self):
        d = self.tmp
        for tool in ("v", "q"):
            self.ok(qemu("create", "-q", "-f", "qcow2", "-o", "refcount_bits=1", tool + ".qcow2", "1M", cwd=d))
            qemu_io(d, tool + ".qcow2", ["write -P 3 0 64k"])
        v = vblk("snapshot", "-c", "s", "v.qcow2", cwd=d)
        q = qemu("snapshot", "-c", "s", "q.qcow2", cwd=d)
        self.assertEqual((v.rc, norm_vblk_err(v.stderr).replace("v.qcow2", "X")),
                         (q.rc, norm_qemu_err(q.stderr).replace("q.qcow2", "X")))
        self.assertEqual(v.rc, 1)
        # vblk checks before it changes anything: nothing leaks, nothing breaks.
        self.assert_clean(d, "v.qcow2", "a refused snapshot")
        self.assert_content(d, "v.qcow2", b"\x03" * 65536 + bytes(MiB - 65536), "refused snapshot")
        self.assertEqual(qemu("snapshot", "-l", "v.qcow2", cwd=d).stdout, "")

    def test_unknown_extra_data_is_kept(self):
        d = self.tmp
        self._img()
        self.ok(qemu("snapshot", "-c", "a", "t.qcow2", cwd=d))
        # Grow entry 0's extra data from 24 to 40 bytes with a marker, by
        # rewriting the table in place at the end of the file.
        path = os.path.join(d, "t.qcow2")
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            nb, off = struct.unpack(">IQ", data[60:72])
            h = data[off:off + 40]
            id_len, name_len = struct.unpack(">HH", h[12:16])
            extra = data[off + 40:off + 64] + b"UNKNOWN-EXTRA-16"
            names = data[off + 64:off + 64 + id_len + name_len]
            h[36:40] = struct.pack(">I", 40)
            entry = bytes(h) + bytes(extra) + bytes(names)
            new_off = (len(data) + 65535) // 65536 * 65536
            f.seek(new_off)
            f.write(entry + bytes(65536 - len(entry)))
            f.seek(64)
            f.write(struct.pack(">Q", new_off))
        # (the new cluster has no refcount: repair that leak-in-reverse first)
        self.ok(qemu("check", "-r", "all", "t.qcow2", cwd=d))
        self.ok(vblk("snapshot", "-c", "b", "t.qcow2", cwd=d))
        self.assert_clean(d, "t.qcow2", "create with unknown extra data")
        with open(path, "rb") as f:
            data = f.read()
        nb, off = struct.unpack(">IQ", data[60:72])
        self.assertEqual(nb, 2)
        self.assertEqual(struct.unpack(">I", data[off + 36:off + 40])[0], 40)
        self.assertEqual(data[off + 64:off + 80], b"UNKNOWN-EXTRA-16")
        self.assert_same_views(d, "t.qcow2", "unknown extra data")


# ---- hostile snapshot tables

def _hdr(path):
    with open(path, "rb") as f:
        d = f.read(72)
    return struct.unpack(">IQ", d[60:72])


def _patch(path, pos, fmt, *v):
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(struct.pack(fmt, *v))


def _first_l1(path):
    nb, off = _hdr(path)
    with open(path, "rb") as f:
        f.seek(off)
        return struct.unpack(">Q", f.read(8))[0]


def _active_l1(path):
    with open(path, "rb") as f:
        f.seek(40)
        return struct.unpack(">Q", f.read(8))[0]


HOSTILE = {
    "table_misaligned": lambda p: _patch(p, 64, ">Q", _hdr(p)[1] + 8),
    "too_many": lambda p: _patch(p, 60, ">I", 65537),
    "table_past_eof": lambda p: _patch(p, 64, ">Q", 1 << 30),
    "more_entries_than_written": lambda p: _patch(p, 60, ">I", 3),
    "too_much_extra": lambda p: _patch(p, _hdr(p)[1] + 36, ">I", 2000),
    "max_extra": lambda p: _patch(p, _hdr(p)[1] + 36, ">I", 1024),
    "no_extra": lambda p: _patch(p, _hdr(p)[1] + 36, ">I", 0),
    "l1_misaligned": lambda p: _patch(p, _hdr(p)[1], ">Q", _first_l1(p) + 512),
    "l1_too_large": lambda p: _patch(p, _hdr(p)[1] + 8, ">I", 0x1000000),
    "l1_past_eof": lambda p: _patch(p, _hdr(p)[1], ">Q", 1 << 30),
    "l1_is_active_l1": lambda p: _patch(p, _hdr(p)[1], ">Q", _active_l1(p)),
    "l1_is_refcount_table": lambda p: _patch(p, _hdr(p)[1], ">Q", 0x10000),
}

# Operations on garbage whose outcome is QEMU-internal detail (which clusters
# leak, which errno surfaces): vblk must end without a signal, and check
# must still be able to describe the image.
LOOSE = {("l1_is_active_l1", "-d"), ("l1_is_refcount_table", "-a"), ("l1_is_refcount_table", "-d")}


class HostileTest(SnapshotCase):
    def _make(self, d, name, fn):
        path = os.path.join(d, name + ".qcow2")
        self.ok(qemu("create", "-q", "-f", "qcow2", path, "1M", cwd=d))
        qemu_io(d, path, ["write -P 5 0 128k"])
        self.ok(qemu("snapshot", "-c", "s1", path, cwd=d))
        fn(path)
        return path

    def test_read_only_views(self):
        d = self.tmp
        for name, fn in HOSTILE.items():
            img = os.path.basename(self._make(d, name, fn))
            for args in (["info"], ["info", "--output=json"], ["snapshot", "-l"], ["check"]):
                with self.subTest(image=name, args=args):
                    v = vblk(*args, img, cwd=d, timeout=30)
                    q = qemu(*args, img, cwd=d, timeout=30)
                    self.assertEqual((v.rc, v.stdout, norm_vblk_err(v.stderr)),
                                     (q.rc, q.stdout, norm_qemu_err(q.stderr)))

    def test_operations(self):
        d = self.tmp
        for name, fn in HOSTILE.items():
            src = self._make(d, name, fn)
            for op in (["-a", "s1"], ["-d", "s1"], ["-c", "s2"]):
                with self.subTest(image=name, op=op):
                    img = os.path.join(d, "t.qcow2")
                    shutil.copy(src, img)
                    v = vblk("snapshot", *op, "t.qcow2", cwd=d, timeout=30)
                    vc = qemu("check", "t.qcow2", cwd=d)
                    shutil.copy(src, img)
                    q = qemu("snapshot", *op, "t.qcow2", cwd=d, timeout=30)
                    qc = qemu("check", "t.qcow2", cwd=d)
                    self.assertIn(v.rc, (0, 1), v)  # no signal, no abort
                    if (name, op[0]) in LOOSE:
                        self.assertIn(vc.rc, (0, 2, 3), vc)  # check still runs to the end
                        continue
                    self.assertEqual((v.rc, v.stdout, norm_vblk_err(v.stderr)),
                                     (q.rc, q.stdout, norm_qemu_err(q.stderr)))
                    self.assertEqual((vc.rc, vc.stdout), (qc.rc, qc.stdout), (vc, qc))


if __name__ == "__main__":
    unittest.main()
