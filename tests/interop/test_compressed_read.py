#!/usr/bin/env python3
"""Interop: reading compressed qcow2 clusters QEMU wrote (zlib and zstd),
with many reads in flight at once (their clusters inflate on the thread
pool, several per read), and a corrupt compressed cluster.

Images come from `qemu-img convert -c` of semi-compressible data (compressed
clusters of varying length, incompressible ones stored plain, zero ones
left out). Every read is checked bit-exact against the source:
  - vblk convert to raw (16 parallel 1 MiB chunks of 16 clusters each);
  - vblk nbd read by nbdcopy with 64 requests in flight, in whole-cluster
    requests and in 4 KiB requests (parts of clusters) on four connections.
A cluster whose stored bytes do not inflate fails the read with EIO, as in
qemu-img, and the clusters around it still read.
"""

import filecmp
import os
import shutil
import signal
import struct
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (KiB, MiB, VBLK, InteropTestCase, both, end_process, make_image, qemu,  # noqa: E402
                    run, semi_compressible, vblk, wait_for_socket)

NBDCOPY = shutil.which("nbdcopy")
SIZE = 6 * MiB


def l2_entry(path, guest_cluster):
    """The raw L2 entry of a guest cluster (first L2 table only)."""
    with open(path, "rb") as f:
        hdr = f.read(72)
        cluster_bits = struct.unpack(">I", hdr[20:24])[0]
        l1_offset = struct.unpack(">Q", hdr[40:48])[0]
        f.seek(l1_offset)
        l2_offset = struct.unpack(">Q", f.read(8))[0] & 0x00fffffffffffe00
        f.seek(l2_offset + 8 * guest_cluster)
        return struct.unpack(">Q", f.read(8))[0], cluster_bits


class CompressedReadTest(InteropTestCase):

    def make(self, ctype):
        src = make_image(os.path.join(self.tmp, "src.raw"), SIZE, data=[(0, semi_compressible(SIZE, ctype))])
        img = os.path.join(self.tmp, "c-%s.qcow2" % ctype)
        r = qemu("convert", "-c", "-f", "raw", "-O", "qcow2", "-o", "compression_type=" + ctype, src, img)
        self.assertEqual(r.rc, 0, r)
        return src, img

    def assertSameFile(self, a, b):
        with open(a, "rb") as fa, open(b, "rb") as fb:
            self.assertTrue(fa.read() == fb.read(), "%s differs from %s" % (a, b))

    def check_convert(self, ctype):
        src, img = self.make(ctype)
        # Most clusters of the image are compressed ones.
        entries = [l2_entry(img, i)[0] for i in range(SIZE // (64 * KiB))]
        self.assertGreater(sum(1 for e in entries if e >> 62 & 1), len(entries) // 2)
        out = os.path.join(self.tmp, "out.raw")
        r = vblk("convert", "-f", "qcow2", "-O", "raw", img, out)
        self.assertEqual(r.rc, 0, r)
        self.assertSameFile(out, src)

    def test_convert_zlib(self):
        self.check_convert("zlib")

    def test_convert_zstd(self):
        self.check_convert("zstd")

    @unittest.skipUnless(NBDCOPY, "nbdcopy is needed")
    def test_nbd_many_requests_in_flight(self):
        for ctype in ("zlib", "zstd"):
            with self.subTest(ctype):
                src, img = self.make(ctype)
                sock = os.path.join(self.tmp, "nbd.sock")
                p = subprocess.Popen([VBLK, "nbd", "-f", "qcow2", "-r", "-e", "0", "-t", "-k", sock, img],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                try:
                    wait_for_socket(sock, p)
                    uri = "nbd+unix:///?socket=" + sock
                    for args in (["--request-size=65536"], ["--request-size=4096", "--connections=4"]):
                        out = os.path.join(self.tmp, "out.raw")
                        r = run([NBDCOPY, "--requests=64", "--flush"] + args + [uri, out])
                        self.assertEqual(r.rc, 0, r)
                        self.assertSameFile(out, src)
                        os.unlink(out)
                finally:
                    end_process(p, "vblk nbd", signal.SIGTERM)

    def test_corrupt_cluster(self):
        # At 0 the stream's header is garbage. A zstd frame of one cluster
        # is 4 bytes of magic, a descriptor and a 2-byte content size, so at
        # 7 it keeps its header (vblk decodes it in one shot) and its first
        # block header is garbage: that must fail as in QEMU. At 32 only
        # block content changes: whatever it decodes to must be what QEMU
        # reads too.
        for ctype, at in (("zlib", 0), ("zstd", 0), ("zstd", 7), ("zstd", 32)):
            with self.subTest(ctype=ctype, at=at):
                src, img = self.make(ctype)
                # The first compressed cluster: its stored bytes become garbage.
                for i in range(SIZE // (64 * KiB)):
                    entry, cluster_bits = l2_entry(img, i)
                    if entry >> 62 & 1:
                        break
                else:
                    self.fail("no compressed cluster")
                host = entry & ((1 << (62 - (cluster_bits - 8))) - 1)
                with open(img, "r+b") as f:
                    f.seek(host + at)
                    f.write(b"\xff" * 64)
                out = os.path.join(self.tmp, "out.raw")
                if at == 32:
                    out_q = os.path.join(self.tmp, "out-q.raw")
                    v = vblk("convert", "-f", "qcow2", "-O", "raw", img, out)
                    q = run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", img, out_q])
                    self.assertEqual((v.rc, v.stderr), (q.rc, q.stderr))
                    if v.rc == 0:
                        self.assertTrue(filecmp.cmp(out, out_q, shallow=False))
                    continue
                v, q = both("convert", "-f", "qcow2", "-O", "raw", img, out)
                self.assertEqual(v.rc, 1, v)
                self.assertEqual(v.rc, q.rc)
                self.assertIn("Input/output error", v.stderr)
                self.assertEqual(v.stderr.replace(os.path.basename(VBLK), "qemu-img"), q.stderr)
                # Reading the cluster fails as in qemu-io; the clusters after
                # it still read.
                bad = "read %d 64k" % (i * 64 * KiB)
                good = "read %d 512k" % ((i + 1) * 64 * KiB)
                rv = vblk("io", "-r", "-f", "qcow2", "-c", bad, "-c", good, img)
                rq = run(["qemu-io", "-r", "-f", "qcow2", "-c", bad, "-c", good, img])
                first = lambda r: (r.stdout + r.stderr).splitlines()[0]  # noqa: E731
                self.assertEqual(first(rv), "read failed: Input/output error")
                self.assertEqual(first(rv), first(rq))
                self.assertIn("read 524288/524288 bytes", rv.stdout)

if __name__ == "__main__":
    unittest.main()
