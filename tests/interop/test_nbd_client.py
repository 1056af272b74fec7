#!/usr/bin/env python3
"""Interop: vblk's NBD client (the `nbd` driver and nbd:// URIs on the
command line) against qemu-nbd, nbdkit (memory and file plugins, with and
without structured replies) and vblk nbd itself.

For each server, `vblk info`, `vblk map` and `vblk compare` must print what
qemu-img prints for the same URI, and data written by `vblk bench -w`
through NBD must land in the image.
"""

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, InteropTestCase, VBLK, both, qemu, run, wait_for_socket  # noqa: E402
from nbd_wire import recv_exact  # noqa: E402  (common.py puts bench/ on the path)

QEMU_NBD = shutil.which("qemu-nbd")
QEMU_IO = shutil.which("qemu-io")
NBDKIT = shutil.which("nbdkit")


@unittest.skipUnless(QEMU_NBD and NBDKIT and QEMU_IO, "qemu-nbd, nbdkit and qemu-io are needed")
class NbdClientTest(InteropTestCase):

    def setUp(self):
        super().setUp()
        self.procs = []
        self.image = os.path.join(self.tmp, "src.qcow2")
        r = qemu("create", "-q", "-f", "qcow2", self.image, "32M")
        self.assertEqual(r.rc, 0, r)
        r = run([QEMU_IO, "-f", "qcow2", "-c", "write -P 0xab 0 1M", "-c", "write -P 0xcd 5M 64k",
                 "-c", "write -z 8M 1M", "-c", "write -P 0x11 20M 4k", self.image])
        self.assertEqual(r.rc, 0, r)
        self.raw = os.path.join(self.tmp, "src.raw")
        r = qemu("convert", "-f", "qcow2", "-O", "raw", self.image, self.raw)
        self.assertEqual(r.rc, 0, r)

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            p.stderr.close()
        super().tearDown()

    def start(self, argv, sock):
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(p)
        wait_for_socket(sock, p)
        return "nbd+unix:///?socket=" + sock

    def servers(self):
        """(name, uri) for every server kind, each over its own copy."""
        out = []
        for name, argv_fn in (
                ("qemu-nbd", lambda img, s: [QEMU_NBD, "-t", "-f", "qcow2", "-k", s, img]),
                ("vblk-nbd", lambda img, s: [VBLK, "nbd", "-t", "-e", "0", "-f", "qcow2", "-k", s, img]),
                ("nbdkit-file", lambda img, s: [NBDKIT, "-f", "-U", s, "file", img]),
                ("nbdkit-file-nosr", lambda img, s: [NBDKIT, "-f", "--no-sr", "-U", s, "file", img])):
            img = os.path.join(self.tmp, name + (".raw" if "nbdkit" in name else ".qcow2"))
            shutil.copy(self.raw if "nbdkit" in name else self.image, img)
            sock = os.path.join(self.tmp, name + ".sock")
            out.append((name, self.start(argv_fn(img, sock), sock)))
        return out

    def test_info_map_compare_equal_to_qemu_img(self):
        for name, uri in self.servers():
            with self.subTest(server=name):
                for argv in (["info", uri], ["info", "--output=json", uri],
                             ["map", "--output=json", uri], ["map", uri],
                             ["map", "--output=json", "-f", "raw", uri],
                             ["compare", "-F", "raw", uri, self.raw],
                             ["compare", "-f", "raw", "-F", "qcow2", uri, self.image]):
                    v, q = both(*argv)
                    self.assertEqual(q.rc, 0, q)
                    self.assertSameResult(v, q, "(%s)" % " ".join(argv[:2]))

    def test_write_through_nbd(self):
        for name, uri in self.servers():
            with self.subTest(server=name):
                r = run([VBLK, "bench", "-w", "-f", "raw", "-c", "64", "-d", "16", "-s", "65536",
                         "-S", "131072", "-o", "3M", "--pattern=0x5e", uri])
                self.assertEqual(r.rc, 0, r)
                r = run([QEMU_IO, "-f", "raw", "-c", "read -P 0x5e 3M 64k",
                         "-c", "read -P 0x5e %d 64k" % (3 * MiB + 63 * 131072),
                         "-c", "read -P 0xab 0 1M", "-c", "read -P 0 %d 65536" % (3 * MiB + 65536), uri])
                self.assertEqual(r.rc, 0, r)
                self.assertNotIn("fail", r.stdout, r)

    def test_nbdkit_memory_and_errors(self):
        sock = os.path.join(self.tmp, "mem.sock")
        uri = self.start([NBDKIT, "-f", "-U", sock, "memory", "16M"], sock)
        r = run([VBLK, "bench", "-w", "-f", "raw", "-c", "16", "-s", "1M", "--pattern=7", uri])
        self.assertEqual(r.rc, 0, r)
        v, q = both("compare", "-f", "raw", "-F", "raw", uri, self.raw)
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 1, v)   # differ, same report as qemu-img
        # an export that is not there (nbdkit serves any name; qemu-nbd does not)
        qsock = os.path.join(self.tmp, "named.sock")
        qimg = os.path.join(self.tmp, "named.qcow2")
        shutil.copy(self.image, qimg)
        self.start([QEMU_NBD, "-t", "-x", "named", "-f", "qcow2", "-k", qsock, qimg], qsock)
        bad = "nbd+unix:///nosuch?socket=" + qsock
        v, q = both("info", bad)
        self.assertEqual((v.rc, q.rc), (1, 1), (v, q))
        self.assertIn("Requested export not available", v.stderr)
        # a server that is not there
        v, q = both("info", "nbd+unix:///?socket=" + os.path.join(self.tmp, "missing.sock"))
        self.assertEqual((v.rc, q.rc), (1, 1), (v, q))
        # reads past the end of the export fail cleanly
        r = run([VBLK, "bench", "-f", "raw", "-c", "2", "-o", "16M", uri])
        self.assertEqual(r.rc, 1, r)

    def test_server_dies_mid_session(self):
        sock = os.path.join(self.tmp, "die.sock")
        # The server must die after vblk connected: on a loaded machine (or
        # under the sanitizers) connecting can take longer than the first
        # wait, so a kill before the connection is retried with a longer one.
        for delay in (0.5, 2, 5):
            uri = self.start([NBDKIT, "-f", "-U", sock, "memory", "64M"], sock)
            p = subprocess.Popen([VBLK, "bench", "-f", "raw", "-c", "2000000", "-d", "4", uri],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            time.sleep(delay)
            self.procs[-1].kill()
            self.procs[-1].wait()
            out, err = p.communicate(timeout=60)
            if b"Could not open" not in err:
                break
            if os.path.exists(sock):
                os.unlink(sock)
        self.assertEqual(p.returncode, 1, (out, err))
        self.assertIn(b"Failed request", err)

    def test_read_reply_cut_short(self):
        # A server without structured replies that dies in the middle of a
        # read's data: the read fails with EIO, and vblk exits with an
        # error instead of waiting forever (the read used to leave the
        # pending list before its data arrived; found by fuzz_nbd_client).
        sock = os.path.join(self.tmp, "cut.sock")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(sock)
        srv.listen(1)

        def serve():
            c, _ = srv.accept()
            c.sendall(b"NBDMAGICIHAVEOPT" + struct.pack(">H", 3))
            c.recv(4)
            while True:
                _, opt, n = struct.unpack(">QII", recv_exact(c, 16))
                recv_exact(c, n)
                if opt != 7:  # anything but GO: unsupported
                    c.sendall(struct.pack(">QIII", 0x3e889045565a9, opt, 0x80000001, 0))
                    continue
                info = struct.pack(">HQH", 0, 1 << 20, 1 | 2)
                c.sendall(struct.pack(">QIII", 0x3e889045565a9, 7, 3, len(info)) + info +
                          struct.pack(">QIII", 0x3e889045565a9, 7, 1, 0))
                break
            _, _, _, cookie, _, length = struct.unpack(">IHHQQI", recv_exact(c, 28))
            c.sendall(struct.pack(">IIQ", 0x67446698, 0, cookie) + b"\0" * (length // 2))
            c.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            r = run([VBLK, "bench", "-f", "raw", "-c", "1", "-d", "1", "-s", "64k",
                     "nbd+unix:///?socket=" + sock], timeout=30)
        finally:
            srv.close()
            t.join(10)
        self.assertEqual(r.rc, 1, r)

    def test_connections_option_spreads_over_multi_conn(self):
        sock = os.path.join(self.tmp, "mc.sock")
        img = os.path.join(self.tmp, "mc.qcow2")
        shutil.copy(self.image, img)
        self.start([VBLK, "nbd", "-t", "-e", "0", "-f", "qcow2", "-k", sock, img], sock)
        opts = "driver=raw,file.driver=nbd,file.server.type=unix,file.server.path=%s,file.connections=4" % sock
        r = run([VBLK, "bench", "-w", "--image-opts", "-c", "256", "-d", "32", "-s", "4096", "-o", "1M",
                 "--pattern=9", opts])
        self.assertEqual(r.rc, 0, r)
        r = run([QEMU_IO, "-f", "raw", "-c", "read -P 9 1M 1M", "nbd+unix:///?socket=" + sock])
        self.assertNotIn("fail", r.stdout, r)


if __name__ == "__main__":
    unittest.main()
