#!/usr/bin/env python3
"""Interop: qcow2 metadata overlap protection (QEMU's `overlap-check`).

Images are made with qemu-img/qemu-io and then corrupted with struct edits
the way a hostile or broken writer would: an L2 entry (with OFLAG_COPIED, so
a guest write goes in place) pointing into the L1 table, an L2 table, the
refcount table, a refcount block, the snapshot table, a snapshot's L1 table,
the bitmap directory; an L1 table offset pointing at the header. Each image
is written with `vblk io` and, on an identical copy, with qemu-io (the
oracle): the write is refused with QEMU's message, the image is marked
corrupt, the structure that would have been overwritten keeps its bytes,
and a later write is refused. `vblk serve` is driven beside
qemu-storage-daemon over NBD and their BLOCK_IMAGE_CORRUPTED events are
compared field by field.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import VBLK, InteropTestCase, qemu, run  # noqa: E402
import qmp_driver  # noqa: E402  (common.py puts bench/ on the path)

QEMU_IO = shutil.which("qemu-io")
QSD = shutil.which("qemu-storage-daemon")
CS = 65536
PATTERN = 0x2b


def be64(b, off):
    return struct.unpack_from(">Q", b, off)[0]


class Layout:
    """Where a qcow2 image keeps its metadata (read from the file)."""

    def __init__(self, path):
        with open(path, "rb") as f:
            b = f.read()
        self.l1 = be64(b, 40)
        self.rt = be64(b, 48)
        self.snapshots = be64(b, 64)
        self.l2 = be64(b, self.l1) & 0x00fffffffffffe00
        self.rb = be64(b, self.rt) & ~0x1ff
        self.bitmap_dir = 0
        self.snap_l1 = be64(b, self.snapshots) if self.snapshots else 0
        # Header extensions after the v3 header: the bitmaps extension
        # gives the directory offset.
        pos = struct.unpack_from(">I", b, 100)[0]
        while pos + 8 <= CS:
            typ, ln = struct.unpack_from(">II", b, pos)
            if typ == 0:
                break
            if typ == 0x23852875:
                self.bitmap_dir = be64(b, pos + 8 + 16)
            pos += 8 + (ln + 7) // 8 * 8
        self.snap_l2 = 0
        if self.snap_l1:
            self.snap_l2 = be64(b, self.snap_l1) & 0x00fffffffffffe00


def read_at(path, off, n):
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def write_at(path, off, data):
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def lines(r):
    """A tool's stdout without the timing lines qemu-io prints."""
    return [ln for ln in r.stdout.splitlines() if " ops; " not in ln]


def corrupt_bit(path):
    j = json.loads(qemu("info", "--output=json", "-U", path).stdout)
    return j["format-specific"]["data"]["corrupt"]


def io_tool(tool, path, *cmds, opts=None):
    """`vblk io` or qemu-io on path (or --image-opts with extra options)."""
    argv = [VBLK, "io"] if tool == "vblk" else [QEMU_IO]
    if opts:
        argv += ["--image-opts"]
        target = "driver=qcow2,file.filename=%s,%s" % (path, opts)
    else:
        argv += ["-f", "qcow2"]
        target = path
    for c in cmds:
        argv += ["-c", c]
    return run(argv + [target], timeout=60)


@unittest.skipUnless(QEMU_IO, "qemu-io is not installed")
class OverlapTest(InteropTestCase):

    def base(self, name, full=True):
        """A 64 MiB image whose first cluster is written; full: with a
        snapshot taken before a second write (a snapshot table, an inactive
        L1 table, an L2 table only the snapshot reaches) and a persistent
        bitmap (a bitmap directory)."""
        path = os.path.join(self.tmp, name)
        r = qemu("create", "-q", "-f", "qcow2", path, "64M")
        self.assertEqual(r.rc, 0, r)
        r = io_tool("qemu", path, "write -P 1 0 64k")
        self.assertEqual(r.rc, 0, r)
        if full:
            r = qemu("snapshot", "-c", "s1", path)
            self.assertEqual(r.rc, 0, r)
            r = io_tool("qemu", path, "write -P 2 0 64k")
            self.assertEqual(r.rc, 0, r)
            r = qemu("bitmap", "--add", path, "b0")
            self.assertEqual(r.rc, 0, r)
        return path

    def point_l2_entry_at(self, path, target):
        """The first L2 entry of the active table now says guest cluster 0
        lives, writable in place, at `target`."""
        lay = Layout(path)
        write_at(path, lay.l2, struct.pack(">Q", target | (1 << 63)))

    def copies(self, path):
        v = path + ".v"
        q = path + ".q"
        shutil.copyfile(path, v)
        shutil.copyfile(path, q)
        return v, q

    def assert_refused(self, path, what, target, size=CS, opts=None):
        """A guest write through vblk io and qemu-io (on a copy) is refused
        the same way; the image is marked corrupt; `size` bytes at `target`
        keep what they held before; a second write is refused too."""
        v, q = self.copies(path)
        before = read_at(path, target, size)
        msg = ("qcow2: Marking image as corrupt: Preventing invalid write on metadata (overlaps with %s); "
               "further corruption events will be suppressed" % what)
        cmds = ("write -P %d 0 4k" % PATTERN, "write -P %d 4k 4k" % PATTERN)
        rv = io_tool("vblk", v, *cmds, opts=opts)
        rq = io_tool("qemu", q, *cmds, opts=opts)
        self.assertIn(msg, rq.stderr, rq)
        self.assertIn(msg, rv.stderr, rv)
        self.assertEqual(rv.rc, rq.rc, (rv, rq))
        self.assertNotEqual(rv.rc, 0, rv)
        # The first write fails with EIO, the one after it finds the image
        # gone (QEMU dropped the driver): "No medium found".
        self.assertEqual(lines(rv), lines(rq))
        self.assertEqual(rv.stdout.count("write failed: Input/output error"), 1, rv)
        self.assertEqual(rv.stdout.count("write failed: No medium found"), 1, rv)
        for p in (v, q):
            self.assertTrue(corrupt_bit(p), p)
            self.assertEqual(read_at(p, target, size), before, "%s: %s was overwritten" % (p, what))
        # Marked corrupt: refused read-write from now on, by both tools.
        rv = io_tool("vblk", v, "write 0 512")
        rq = io_tool("qemu", q, "write 0 512")
        self.assertNotEqual(rv.rc, 0, rv)
        self.assertNotEqual(rq.rc, 0, rq)
        self.assertIn("Image is corrupt; cannot be opened read/write", rv.stderr)
        self.assertIn("Image is corrupt; cannot be opened read/write", rq.stderr)
        return v, q

    def test_l2_entry_into_active_l1(self):
        path = self.base("l1.qcow2")
        lay = Layout(path)
        self.point_l2_entry_at(path, lay.l1)
        self.assert_refused(path, "active L1 table", lay.l1, 8)

    def test_l2_entry_into_active_l2(self):
        path = self.base("l2.qcow2")
        lay = Layout(path)
        self.point_l2_entry_at(path, lay.l2)
        # The table itself, the first entry (the corrupt one) aside.
        self.assert_refused(path, "active L2 table", lay.l2)

    def test_l2_entry_into_refcount_table(self):
        path = self.base("rt.qcow2")
        lay = Layout(path)
        self.point_l2_entry_at(path, lay.rt)
        self.assert_refused(path, "refcount table", lay.rt)

    def test_l2_entry_into_refcount_block(self):
        path = self.base("rb.qcow2")
        lay = Layout(path)
        self.point_l2_entry_at(path, lay.rb)
        self.assert_refused(path, "refcount block", lay.rb)

    def test_l2_entry_into_snapshot_table(self):
        path = self.base("sn.qcow2")
        lay = Layout(path)
        self.assertTrue(lay.snapshots)
        self.point_l2_entry_at(path, lay.snapshots)
        self.assert_refused(path, "snapshot table", lay.snapshots, 512)

    def test_l2_entry_into_inactive_l1(self):
        path = self.base("snl1.qcow2")
        lay = Layout(path)
        self.assertTrue(lay.snap_l1)
        self.point_l2_entry_at(path, lay.snap_l1)
        self.assert_refused(path, "inactive L1 table", lay.snap_l1, 8)

    def test_l2_entry_into_bitmap_directory(self):
        path = self.base("bmd.qcow2")
        lay = Layout(path)
        self.assertTrue(lay.bitmap_dir)
        self.point_l2_entry_at(path, lay.bitmap_dir)
        # Both tools rewrite the directory in place at open (the in_use
        # flag), so compare with qemu-io's copy: same bytes, no guest data.
        v, q = self.copies(path)
        rv = io_tool("vblk", v, "write -P %d 0 4k" % PATTERN)
        rq = io_tool("qemu", q, "write -P %d 0 4k" % PATTERN)
        msg = "Preventing invalid write on metadata (overlaps with bitmap directory)"
        self.assertIn(msg, rq.stderr, rq)
        self.assertIn(msg, rv.stderr, rv)
        self.assertEqual((rv.rc, lines(rv)), (rq.rc, lines(rq)))
        dv = read_at(v, lay.bitmap_dir, 512)
        self.assertEqual(dv, read_at(q, lay.bitmap_dir, 512))
        self.assertNotIn(bytes([PATTERN]) * 64, dv)
        self.assertTrue(corrupt_bit(v))

    def test_inactive_l2_only_with_all(self):
        # The snapshot's own L2 table: only overlap-check=all knows it (QEMU
        # reads the snapshots' L1 tables for it); "cached" lets the write
        # through in both tools.
        path = self.base("snl2.qcow2")
        lay = Layout(path)
        self.assertTrue(lay.snap_l2)
        self.assertNotEqual(lay.snap_l2, lay.l2)
        self.point_l2_entry_at(path, lay.snap_l2)
        self.assert_refused(path, "inactive L2 table", lay.snap_l2, opts="overlap-check=all")
        v, q = self.copies(path)
        rv = io_tool("vblk", v, "write -P %d 0 4k" % PATTERN)
        rq = io_tool("qemu", q, "write -P %d 0 4k" % PATTERN)
        self.assertEqual((rv.rc, lines(rv)), (rq.rc, lines(rq)))
        self.assertEqual(rv.rc, 0, rv)
        self.assertFalse(corrupt_bit(v))
        self.assertEqual(read_at(v, lay.snap_l2, 4096), read_at(q, lay.snap_l2, 4096))

    def test_zero_write_into_active_l1(self):
        # Zeroes that must be written (the rest of the cluster holds data)
        # take the same in-place path.
        path = self.base("l1z.qcow2", full=False)
        lay = Layout(path)
        self.point_l2_entry_at(path, lay.l1)
        v, q = self.copies(path)
        rv = io_tool("vblk", v, "write -z 0 512")
        rq = io_tool("qemu", q, "write -z 0 512")
        msg = "Preventing invalid write on metadata (overlaps with active L1 table)"
        self.assertIn(msg, rq.stderr, rq)
        self.assertIn(msg, rv.stderr, rv)
        self.assertEqual((rv.rc, lines(rv)), (rq.rc, lines(rq)))
        self.assertEqual(read_at(v, lay.l1, 8), read_at(path, lay.l1, 8))
        self.assertTrue(corrupt_bit(v))

    def test_allocation_where_refcounts_say_free(self):
        # Refcounts that call the L1 table's cluster free: new clusters
        # (plain or compressed) would land on it.
        for cmd in ("write -c -P %d 1M 64k" % PATTERN, "write -P %d 1M 64k" % PATTERN):
            with self.subTest(cmd=cmd):
                path = self.base("free.qcow2", full=False)
                lay = Layout(path)
                write_at(path, lay.rb + 2 * (lay.l1 // CS), b"\0\0")
                v, q = self.copies(path)
                rv = io_tool("vblk", v, cmd)
                rq = io_tool("qemu", q, cmd)
                msg = "Preventing invalid write on metadata (overlaps with active L1 table)"
                self.assertIn(msg, rq.stderr, rq)
                self.assertIn(msg, rv.stderr, rv)
                self.assertEqual((rv.rc, lines(rv)), (rq.rc, lines(rq)))
                self.assertEqual(read_at(v, lay.l1, CS), read_at(path, lay.l1, CS))
                self.assertTrue(corrupt_bit(v))

    def test_l1_offset_at_header(self):
        # A corrupt L1 table offset: the table "is" the header. The write
        # that would link a new L2 table writes the L1 entry there: refused,
        # the header is not overwritten (only the corrupt bit changes).
        path = self.base("hdr.qcow2", full=False)
        write_at(path, 40, struct.pack(">Q", 0))
        v, q = self.copies(path)
        before = read_at(path, 0, CS)
        msg = ("qcow2: Marking image as corrupt: Preventing invalid write on metadata (overlaps with qcow2_header); "
               "further corruption events will be suppressed")
        rv = io_tool("vblk", v, "write -P %d 0 4k" % PATTERN)
        rq = io_tool("qemu", q, "write -P %d 0 4k" % PATTERN)
        self.assertIn(msg, rq.stderr, rq)
        self.assertIn(msg, rv.stderr, rv)
        self.assertEqual((rv.rc, lines(rv)), (rq.rc, lines(rq)))
        for p in (v, q):
            after = read_at(p, 0, CS)
            self.assertEqual(after[:72] + after[80:], before[:72] + before[80:], p)
            self.assertTrue(corrupt_bit(p), p)

    def test_unaligned_l2_offset(self):
        path = self.base("l2un.qcow2", full=False)
        lay = Layout(path)
        write_at(path, lay.l1, struct.pack(">Q", (lay.l2 + 512) | (1 << 63)))
        v, q = self.copies(path)
        rv = io_tool("vblk", v, "write -P %d 0 4k" % PATTERN, "read 0 4k")
        rq = io_tool("qemu", q, "write -P %d 0 4k" % PATTERN, "read 0 4k")
        msg = ("qcow2: Marking image as corrupt: L2 table offset %#x unaligned (L1 index: 0); "
               "further corruption events will be suppressed" % (lay.l2 + 512))
        self.assertIn(msg, rq.stderr, rq)
        self.assertIn(msg, rv.stderr, rv)
        self.assertEqual(lines(rv)[0], lines(rq)[0])
        self.assertTrue(corrupt_bit(v))

    def test_unaligned_data_cluster(self):
        # The write path's own message (QEMU's handle_copied).
        path = self.base("dataun.qcow2", full=False)
        lay = Layout(path)
        write_at(path, lay.l2, struct.pack(">Q", (lay.rt + 0x8000) | (1 << 63)))
        v, q = self.copies(path)
        rv = io_tool("vblk", v, "write -P %d 0 4k" % PATTERN)
        rq = io_tool("qemu", q, "write -P %d 0 4k" % PATTERN)
        msg = ("qcow2: Marking image as corrupt: Data cluster offset %#x unaligned (guest offset: 0); "
               "further corruption events will be suppressed" % (lay.rt + 0x8000))
        self.assertIn(msg, rq.stderr, rq)
        self.assertIn(msg, rv.stderr, rv)
        self.assertEqual((rv.rc, lines(rv)), (rq.rc, lines(rq)))
        self.assertTrue(corrupt_bit(v))

    def test_overlap_check_none_lets_the_write_through(self):
        path = self.base("none.qcow2", full=False)
        lay = Layout(path)
        # Into the L1 table's cluster, past its one entry: the image stays
        # usable, but QEMU compares whole clusters, so "cached" refuses it.
        self.point_l2_entry_at(path, lay.l1)
        target = lay.l1 + CS // 2
        v, q = self.copies(path)
        cmd = "write -P %d 32k 4k" % PATTERN
        rv = io_tool("vblk", v, cmd)
        self.assertIn("overlaps with active L1 table", rv.stderr)
        v, q = self.copies(path)
        rv = io_tool("vblk", v, cmd, opts="overlap-check=none")
        rq = io_tool("qemu", q, cmd, opts="overlap-check=none")
        self.assertEqual(rq.rc, 0, rq)
        self.assertEqual((rv.rc, rv.stdout.splitlines()[0]), (rq.rc, rq.stdout.splitlines()[0]))
        self.assertNotIn("corrupt", rv.stderr)
        for p in (v, q):
            self.assertEqual(read_at(p, target, 4096), bytes([PATTERN]) * 4096, p)
            self.assertFalse(corrupt_bit(p), p)
        # Per-kind switches on top of a template, as QEMU has them.
        v, q = self.copies(path)
        opts = "overlap-check.template=cached,overlap-check.active-l1=off"
        rv = io_tool("vblk", v, cmd, opts=opts)
        rq = io_tool("qemu", q, cmd, opts=opts)
        self.assertEqual((rv.rc, rv.stdout.splitlines()[0]), (rq.rc, rq.stdout.splitlines()[0]))
        self.assertEqual(rv.rc, 0, rv)

    def test_bad_option_values(self):
        path = self.base("opts.qcow2", full=False)
        for opts, want in (
            ("overlap-check=bar", "Unsupported value 'bar' for qcow2 option 'overlap-check'. Allowed are any of "
                                  "the following: none, constant, cached, all"),
            ("overlap-check.template=bar", "Unsupported value 'bar' for qcow2 option 'overlap-check'. Allowed are "
                                           "any of the following: none, constant, cached, all"),
            ("overlap-check.active-l2=maybe", "Parameter 'overlap-check.active-l2' expects 'on' or 'off'"),
            ("overlap-check.foo=on", "Block format 'qcow2' does not support the option 'overlap-check.foo'"),
        ):
            with self.subTest(opts=opts):
                rv = io_tool("vblk", path, "read 0 512", opts=opts)
                rq = io_tool("qemu", path, "read 0 512", opts=opts)
                self.assertNotEqual(rq.rc, 0, rq)
                self.assertIn(want, rq.stderr)
                self.assertIn(want, rv.stderr)
                self.assertEqual(rv.rc, rq.rc, (rv, rq))


@unittest.skipUnless(QSD and QEMU_IO, "qemu-storage-daemon or qemu-io is not installed")
class ServeOverlapTest(InteropTestCase):

    def run_daemon(self, argv0, img):
        sock = os.path.join(self.tmp, "qmp.sock")
        nbd = os.path.join(self.tmp, "nbd.sock")
        for p in (sock, nbd):
            if os.path.exists(p):
                os.unlink(p)
        d = qmp_driver.Daemon(argv0 + [
            "--blockdev", json.dumps({"driver": "qcow2", "node-name": "disk0",
                                      "file": {"driver": "file", "filename": img}}),
            "--nbd-server", "addr.type=unix,addr.path=" + nbd,
            "--export", "type=nbd,id=e0,node-name=disk0,name=disk,writable=on"],
            sock, os.path.join(self.tmp, "daemon.log"))
        try:
            url = "nbd+unix:///disk?socket=" + nbd
            w1 = run([QEMU_IO, "-f", "raw", "-c", "write -P %d 0 4k" % PATTERN, url])
            ev = d.qmp.event("BLOCK_IMAGE_CORRUPTED", timeout=10)
            w2 = run([QEMU_IO, "-f", "raw", "-c", "write -P %d 64k 4k" % PATTERN, url])
            # One event only: further corruption events are suppressed.
            extra = [e for e in d.qmp.drain_events(0.2) if e["event"] == "BLOCK_IMAGE_CORRUPTED"]
            d.quit()
        finally:
            d.kill()
        return ev, w1, w2, extra, d.log_tail()

    def test_block_image_corrupted_event(self):
        src = os.path.join(self.tmp, "src.qcow2")
        r = qemu("create", "-q", "-f", "qcow2", src, "64M")
        self.assertEqual(r.rc, 0, r)
        r = io_tool("qemu", src, "write -P 1 0 64k")
        self.assertEqual(r.rc, 0, r)
        lay = Layout(src)
        write_at(src, lay.l2, struct.pack(">Q", lay.l1 | (1 << 63)))
        before = read_at(src, lay.l1, 8)
        out = {}
        for name, argv0 in (("qsd", [QSD]), ("vblk", [VBLK, "serve"])):
            img = os.path.join(self.tmp, name + ".qcow2")
            shutil.copyfile(src, img)
            out[name] = self.run_daemon(argv0, img)
            self.assertTrue(corrupt_bit(img), name)
            self.assertEqual(read_at(img, lay.l1, 8), before, name)
        (qe, qw1, qw2, qx, qlog), (ve, vw1, vw2, vx, vlog) = out["qsd"], out["vblk"]
        self.assertEqual(qe["data"], {"device": "", "node-name": "disk0",
                                      "msg": "Preventing invalid write on metadata (overlaps with active L1 table)",
                                      "offset": lay.l1, "size": 4096, "fatal": True})
        self.assertEqual(ve["data"], qe["data"])
        self.assertEqual(sorted(ve["timestamp"]), sorted(qe["timestamp"]))
        self.assertEqual((vw1.rc, vw1.stdout), (qw1.rc, qw1.stdout))
        self.assertEqual((vw2.rc, vw2.stdout), (qw2.rc, qw2.stdout))
        self.assertEqual(vx, qx)
        self.assertIn("Marking image as corrupt", vlog)

    def test_blockdev_add_overlap_check_values(self):
        img = os.path.join(self.tmp, "ok.qcow2")
        r = qemu("create", "-q", "-f", "qcow2", img, "1M")
        self.assertEqual(r.rc, 0, r)
        values = ["bar", 5, {"template": "bar"}, {"template": 1}, {"active-l2": "x"}, {"foo": True},
                  "all", {"template": "constant", "inactive-l2": True}, "none"]
        out = {}
        for name, argv0 in (("qsd", [QSD]), ("vblk", [VBLK, "serve"])):
            sock = os.path.join(self.tmp, "qmp.sock")
            d = qmp_driver.Daemon(argv0, sock, os.path.join(self.tmp, "daemon.log"))
            try:
                replies = []
                for i, v in enumerate(values):
                    r = d.qmp.cmd("blockdev-add", {"driver": "qcow2", "node-name": "n%d" % i, "overlap-check": v,
                                                   "file": {"driver": "file", "filename": img}, "read-only": True})
                    replies.append(r)
                d.quit()
            finally:
                d.kill()
            out[name] = replies
        self.assertEqual(out["vblk"], out["qsd"])
        self.assertIn("error", out["qsd"][0])
        self.assertIn("return", out["qsd"][-1])


if __name__ == "__main__":
    unittest.main()
