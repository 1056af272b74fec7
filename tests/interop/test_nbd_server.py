#!/usr/bin/env python3
"""Interop: `vblk nbd` against real NBD clients, beside qemu-nbd.

Clients: nbdinfo (--list, --map, --json, --content), nbdcopy, qemu-img
(info, map, compare, convert) and qemu-io (read/write/discard/write -z with
pattern checks). Every listing and map is compared with what qemu-nbd
serves for the same image and options.

Hostile clients speak the protocol by hand (Python sockets): malformed
handshakes and options, oversized lengths and names, requests past the end,
writes to a read-only export, a client vanishing mid-request, and 100
concurrent clients. The server must answer each with an error or a closed
connection, never crash, and keep serving the others.
"""

import json
import os
import re
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

from common import (MiB, InteropTestCase, VBLK, qemu, rand_bytes, run, wait_for_socket)  # noqa: E402

QEMU_NBD = shutil.which("qemu-nbd")
QEMU_IO = shutil.which("qemu-io")
NBDINFO = shutil.which("nbdinfo")
NBDCOPY = shutil.which("nbdcopy")

NBDMAGIC = 0x4e42444d41474943
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x3e889045565a9
REQ_MAGIC = 0x25609513
SIMPLE_MAGIC = 0x67446698
STRUCT_MAGIC = 0x668e33ef
OPT_EXPORT_NAME, OPT_ABORT, OPT_LIST, OPT_INFO, OPT_GO, OPT_STRUCTURED = 1, 2, 3, 6, 7, 8
OPT_LIST_META, OPT_SET_META = 9, 10
REP_ACK, REP_SERVER, REP_INFO, REP_META = 1, 2, 3, 4
ERR_UNSUP, ERR_INVALID, ERR_UNKNOWN, ERR_TOO_BIG = 2**31 + 1, 2**31 + 3, 2**31 + 6, 2**31 + 9
CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH, CMD_TRIM, CMD_CACHE, CMD_ZEROES, CMD_BS = range(8)
EPERM, EIO, EINVAL, ENOSPC = 1, 5, 22, 28




class Server:
    """A running NBD server process (vblk nbd or qemu-nbd) on a unix socket.
    The probe connection made while waiting for it counts as a client, so
    servers are always started persistent (-t) unless a test says so."""

    def __init__(self, tool, sock, image, *args, persistent=True, probe=True):
        self.sock = sock
        argv = ([VBLK, "nbd"] if tool == "vblk" else [QEMU_NBD]) + list(args) + ["-k", sock]
        if persistent:
            argv.append("-t")
        argv.append(image)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if probe:
            wait_for_socket(sock, self.proc)
        else:
            end = time.time() + 10
            while not os.path.exists(sock) and time.time() < end:
                time.sleep(0.02)

    def uri(self, name=""):
        return "nbd+unix:///%s?socket=%s" % (name, self.sock)

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.proc.returncode


def norm_uri(text, *socks):
    for s in socks:
        text = text.replace(s, "SOCK")
    return text


# ---------------------------------------------------------------------------
# a minimal hand-written client for hostile tests
# ---------------------------------------------------------------------------

class Raw:
    def __init__(self, path, timeout=10):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(timeout)
        self.s.connect(path)

    def close(self):
        self.s.close()

    def recv(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            if not chunk:
                raise EOFError("closed after %d of %d bytes" % (len(buf), n))
            buf += chunk
        return buf

    def closed(self):
        """True if the server closes the connection (EOF) within the timeout."""
        try:
            while True:
                if not self.s.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
        finally:
            self.s.close()

    def greet(self, flags=3):
        magic, opt, hflags = struct.unpack(">QQH", self.recv(18))
        assert (magic, opt) == (NBDMAGIC, IHAVEOPT), (magic, opt)
        self.s.sendall(struct.pack(">I", flags))
        return hflags

    def option(self, opt, data=b"", length=None):
        self.s.sendall(struct.pack(">QII", IHAVEOPT, opt, len(data) if length is None else length) + data)

    def reply(self):
        magic, opt, typ, ln = struct.unpack(">QIII", self.recv(20))
        assert magic == OPT_REPLY_MAGIC, hex(magic)
        return opt, typ, self.recv(ln)

    def replies_until_final(self):
        out = []
        while True:
            r = self.reply()
            out.append(r)
            if r[1] == REP_ACK or r[1] & 2**31:
                return out

    def go(self, name="", structured=False, meta=False):
        self.greet()
        if structured:
            self.option(OPT_STRUCTURED)
            assert self.reply()[1] == REP_ACK
        if meta:
            q = b"base:allocation"
            data = struct.pack(">I", len(name)) + name.encode() + struct.pack(">II", 1, len(q)) + q
            self.option(OPT_SET_META, data)
            self.replies_until_final()
        data = struct.pack(">I", len(name)) + name.encode() + struct.pack(">H", 0)
        self.option(OPT_GO, data)
        size = flags = None
        for _, typ, payload in self.replies_until_final():
            if typ == REP_INFO and struct.unpack(">H", payload[:2])[0] == 0:
                size, flags = struct.unpack(">QH", payload[2:12])
            assert not typ & 2**31, (typ, payload)
        return size, flags

    def request(self, cmd, offset, length, flags=0, cookie=1, payload=b""):
        self.s.sendall(struct.pack(">IHHQQI", REQ_MAGIC, flags, cmd, cookie, offset, length) + payload)

    def simple_reply(self, data_len=0):
        magic, err, cookie = struct.unpack(">IIQ", self.recv(16))
        assert magic == SIMPLE_MAGIC, hex(magic)
        data = self.recv(data_len) if err == 0 and data_len else b""
        return err, cookie, data

    def structured_chunks(self):
        chunks = []
        while True:
            hdr = self.recv(4)
            magic = struct.unpack(">I", hdr)[0]
            if magic == SIMPLE_MAGIC:
                err, cookie = struct.unpack(">IQ", self.recv(12))
                chunks.append(("simple", err, cookie, b""))
                return chunks
            assert magic == STRUCT_MAGIC, hex(magic)
            flags, typ, cookie, ln = struct.unpack(">HHQI", self.recv(16))
            chunks.append((typ, flags, cookie, self.recv(ln)))
            if flags & 1:
                return chunks


@unittest.skipUnless(QEMU_NBD and NBDINFO and QEMU_IO, "qemu-nbd, qemu-io and nbdinfo are needed")
class NbdServerTest(InteropTestCase):

    def setUp(self):
        super().setUp()
        self.servers = []

    def tearDown(self):
        for s in self.servers:
            s.stop()
        super().tearDown()

    def serve(self, tool, image, *args, name=None, **kw):
        sock = os.path.join(self.tmp, "%s-%d.sock" % (tool, len(self.servers)))
        s = Server(tool, sock, image, *args, **kw)
        self.servers.append(s)
        return s

    def make_qcow2(self, name="a.qcow2", size="64M", backing=None):
        path = os.path.join(self.tmp, name)
        args = ["create", "-q", "-f", "qcow2"]
        if backing:
            args += ["-b", backing, "-F", "qcow2"]
        r = qemu(*(args + [path, size]))
        self.assertEqual(r.rc, 0, r)
        return path

    def qemu_io(self, fmt, image, *cmds, expect_rc=0):
        argv = [QEMU_IO, "-f", fmt]
        for c in cmds:
            argv += ["-c", c]
        r = run(argv + [image])
        self.assertEqual(r.rc, expect_rc, r)
        self.assertNotIn("failed", r.stdout + r.stderr, r)
        return r

    def fill_layout(self, image, fmt="qcow2"):
        # data, a zero range, a discarded range, unallocated tail
        self.qemu_io(fmt, image, "write -P 0xab 0 1M", "write -P 0x11 1536k 64k",
                     "write -z 2M 1M", "write -P 0x22 4M 128k", "discard 4M 64k",
                     "write -P 0x33 10M 4k")

    # -- clients see the same thing from both servers -----------------------
    def both_servers(self, image, *args):
        v = self.serve("vblk", image, *args)
        q = self.serve("qemu", image, *args)
        return v, q

    def assertSameClientOutput(self, v, q, argv_fn, name=""):
        rv = run(argv_fn(v.uri(name)))
        rq = run(argv_fn(q.uri(name)))
        self.assertEqual(rq.rc, 0, rq)
        self.assertEqual(rv.rc, rq.rc, (rv, rq))
        self.assertEqual(norm_uri(rv.stdout, v.sock), norm_uri(rq.stdout, q.sock))
        return rv

    def test_nbdinfo_equal_to_qemu_nbd(self):
        img = self.make_qcow2()
        self.fill_layout(img)
        for args in ([], ["-r"], ["-x", "exp", "-D", "a description"], ["-e", "0"], ["-e", "3", "-r"]):
            with self.subTest(args=args):
                # images are opened by both servers at once: read-only sharing
                # is fine for qemu-nbd only with -r, so serve a copy each
                vimg = os.path.join(self.tmp, "v.qcow2")
                qimg = os.path.join(self.tmp, "q.qcow2")
                shutil.copy(img, vimg)
                shutil.copy(img, qimg)
                v = self.serve("vblk", vimg, "-f", "qcow2", *args)
                q = self.serve("qemu", qimg, "-f", "qcow2", *args)
                name = args[args.index("-x") + 1] if "-x" in args else ""
                for extra in ([], ["--map"], ["--json"], ["--map", "--json"], ["--map", "--totals"],
                              ["--size"], ["--is", "readonly"], ["--can", "multi-conn"]):
                    rv = run([NBDINFO] + extra + [v.uri(name)])
                    rq = run([NBDINFO] + extra + [q.uri(name)])
                    self.assertEqual(rv.rc, rq.rc, (extra, rv, rq))
                    self.assertEqual(norm_uri(rv.stdout, v.sock), norm_uri(rq.stdout, q.sock), extra)
                lv = run([NBDINFO, "--list", v.uri()])
                lq = run([NBDINFO, "--list", q.uri()])
                self.assertEqual(lv.rc, 0, lv)
                self.assertEqual(norm_uri(lv.stdout, v.sock), norm_uri(lq.stdout, q.sock))
                v.stop()
                q.stop()

    def test_map_through_backing_chain_and_raw(self):
        base = self.make_qcow2("base.qcow2", "16M")
        self.qemu_io("qcow2", base, "write -P 1 0 2M", "write -z 4M 1M", "write -P 2 8M 1M")
        top = self.make_qcow2("top.qcow2", "16M", backing="base.qcow2")
        self.qemu_io("qcow2", top, "write -P 3 1M 2M", "write -z 8M 64k", "discard 0 64k")
        raw = os.path.join(self.tmp, "r.raw")
        with open(raw, "wb") as f:
            f.truncate(8 * MiB)
            f.seek(MiB)
            f.write(b"x" * 65536)
        for img, fmt in ((top, "qcow2"), (raw, "raw")):
            with self.subTest(fmt=fmt):
                v, q = self.both_servers(img, "-f", fmt, "-r")
                for extra in (["--map"], ["--map", "--json"]):
                    self.assertSameClientOutput(v, q, lambda u: [NBDINFO] + extra + [u])
                self.assertSameClientOutput(v, q, lambda u: [QEMU_IMG_PATH, "map", "--output=json", "-f", "raw", u])
                self.assertSameClientOutput(v, q, lambda u: [QEMU_IMG_PATH, "map", "-f", "raw", u])

    def test_qemu_img_info_compare_convert(self):
        img = self.make_qcow2()
        self.fill_layout(img)
        v, q = self.both_servers(img, "-f", "qcow2", "-r")
        self.assertSameClientOutput(v, q, lambda u: [QEMU_IMG_PATH, "info", "--output=json", u])
        r = qemu("compare", "-f", "qcow2", "-F", "raw", img, v.uri())
        self.assertEqual((r.rc, r.stdout), (0, "Images are identical.\n"), r)
        out = os.path.join(self.tmp, "out.qcow2")
        r = qemu("convert", "-f", "raw", "-O", "qcow2", v.uri(), out)
        self.assertEqual(r.rc, 0, r)
        r = qemu("compare", img, out)
        self.assertEqual(r.rc, 0, r)
        # the converted image is as sparse as the source
        mv = json.loads(qemu("map", "--output=json", out).stdout)
        mq = json.loads(qemu("map", "--output=json", img).stdout)
        data = lambda m: [(e["start"], e["length"]) for e in m if e["data"]]  # noqa: E731
        self.assertEqual(data(mv), data(mq))

    @unittest.skipUnless(NBDCOPY, "nbdcopy is needed")
    def test_nbdcopy_both_ways(self):
        img = self.make_qcow2()
        self.fill_layout(img)
        s = self.serve("vblk", img, "-f", "qcow2", "-r", "-e", "0")
        out = os.path.join(self.tmp, "copy.raw")
        r = run([NBDCOPY, s.uri(), out])
        self.assertEqual(r.rc, 0, r)
        r = qemu("compare", "-f", "qcow2", "-F", "raw", img, out)
        self.assertEqual(r.rc, 0, r)
        s.stop()
        # into a writable export, with several connections (multi-conn)
        dst = self.make_qcow2("dst.qcow2")
        d = self.serve("vblk", dst, "-f", "qcow2", "-e", "0")
        r = run([NBDCOPY, "--connections=4", out, d.uri()])
        self.assertEqual(r.rc, 0, r)
        self.assertEqual(d.stop(), 0)
        r = qemu("compare", "-f", "qcow2", "-F", "raw", dst, out)
        self.assertEqual((r.rc, r.stdout), (0, "Images are identical.\n"), r)
        c = qemu("check", dst)
        self.assertEqual(c.rc, 0, c)

    def test_qemu_io_read_write_discard_zero(self):
        for fmt in ("raw", "qcow2"):
            with self.subTest(fmt=fmt):
                img = os.path.join(self.tmp, "w." + fmt)
                r = qemu("create", "-q", "-f", fmt, img, "32M")
                self.assertEqual(r.rc, 0, r)
                s = self.serve("vblk", img, "-f", fmt)
                ops = ["write -P 0x5a 0 1M", "write -P 0x6b 100000 70000", "write -z 512k 128k",
                       "write -z -u 2M 1M", "discard 8M 1M", "write -P 0x7c -f 16M 4k", "flush",
                       "read -P 0x5a 0 100000", "read -P 0x6b 100000 70000", "read -P 0 512k 128k",
                       "read -P 0x7c 16M 4k", "read -P 0 20M 1M"]
                # qemu-io over NBD names the format of the export: raw
                argv = [QEMU_IO, "-f", "raw"]
                for o in ops:
                    argv += ["-c", o]
                r = run(argv + [s.uri()])
                self.assertEqual(r.rc, 0, r)
                self.assertNotIn("fail", r.stdout + r.stderr, r)
                # a mismatching pattern is noticed (the check can fail)
                r = run([QEMU_IO, "-f", "raw", "-c", "read -P 0x5a 0 2M", s.uri()])
                self.assertIn("Pattern verification failed", r.stdout + r.stderr)
                self.assertEqual(s.stop(), 0)
                # the same operations on a local copy give the same image
                ref = os.path.join(self.tmp, "ref.raw")
                with open(ref, "wb") as f:
                    f.truncate(32 * MiB)
                argv = [QEMU_IO, "-f", "raw"]
                for o in ops:
                    argv += ["-c", o.replace(" -f ", " ")]
                r = run(argv + [ref])
                self.assertEqual(r.rc, 0, r)
                r = qemu("compare", "-f", fmt, "-F", "raw", img, ref)
                self.assertEqual((r.rc, r.stdout), (0, "Images are identical.\n"), r)
                if fmt == "qcow2":
                    c = qemu("check", img)
                    self.assertEqual(c.rc, 0, c)

    # -- lifetime -------------------------------------------------------------
    def test_exits_after_last_client_without_persistent(self):
        img = self.make_qcow2()
        sock = os.path.join(self.tmp, "once.sock")
        s = Server("vblk", sock, img, "-f", "qcow2", persistent=False, probe=False)
        self.servers.append(s)
        r = run([NBDINFO, "--size", s.uri()])
        self.assertEqual((r.rc, r.stdout), (0, "%d\n" % (64 * MiB)), r)
        self.assertEqual(s.proc.wait(10), 0)
        self.assertFalse(os.path.exists(sock))

    def test_fork_and_pid_file_and_sigterm(self):
        img = self.make_qcow2()
        sock = os.path.join(self.tmp, "f.sock")
        pidf = os.path.join(self.tmp, "pid")
        r = run([VBLK, "nbd", "--fork", "--pid-file", pidf, "-t", "-f", "qcow2", "-k", sock, img])
        self.assertEqual(r.rc, 0, r)
        pid = int(open(pidf).read())
        try:
            self.assertTrue(os.path.exists(sock))
            r = run([NBDINFO, "--size", "nbd+unix:///?socket=" + sock])
            self.assertEqual(r.stdout, "%d\n" % (64 * MiB), r)
        finally:
            os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            if not os.path.exists(pidf):
                break
            time.sleep(0.05)
        self.assertFalse(os.path.exists(pidf))
        self.assertFalse(os.path.exists(sock))

    def test_iotests_invocation_verbose(self):
        # qemu-iotests' common.rc starts every NBD server this way; -v is a
        # no-op without a kernel device, for qemu-nbd and vblk alike.
        img = self.make_qcow2()
        for tool in ("vblk", QEMU_NBD):
            with self.subTest(tool=tool):
                sock = os.path.join(self.tmp, "v-%s.sock" % os.path.basename(tool))
                s = Server(tool, sock, img, "-v", "-f", "qcow2", "-e", "42", "-x", "")
                self.servers.append(s)
                r = run([NBDINFO, "--size", s.uri()])
                self.assertEqual((r.rc, r.stdout), (0, "%d\n" % (64 * MiB)), r)
                self.assertEqual(s.stop(), 0)

    def test_tcp_binds_loopback_by_default(self):
        img = self.make_qcow2()
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        p = subprocess.Popen([VBLK, "nbd", "-t", "-p", str(port), "-x", "t", "-f", "qcow2", img],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            r = None
            for _ in range(200):
                r = run([NBDINFO, "--size", "nbd://127.0.0.1:%d/t" % port])
                if r.rc == 0:
                    break
                time.sleep(0.05)
            self.assertEqual(r.stdout, "%d\n" % (64 * MiB), r)
            with open("/proc/net/tcp") as f:
                listening = [l.split()[1] for l in f.readlines()[1:] if l.split()[3] == "0A"]
            self.assertIn("0100007F:%04X" % port, listening)
        finally:
            p.terminate()
            self.assertEqual(p.wait(10), 0)
            p.stderr.close()

    def test_fork_reports_open_failure(self):
        r = run([VBLK, "nbd", "--fork", "-k", os.path.join(self.tmp, "x.sock"),
                 os.path.join(self.tmp, "missing.qcow2")])
        q = run([QEMU_NBD, "--fork", "-k", os.path.join(self.tmp, "y.sock"),
                 os.path.join(self.tmp, "missing.qcow2")])
        self.assertEqual(r.rc, 1, r)
        self.assertEqual(q.rc, 1, q)
        self.assertIn("Could not open", r.stderr)

    def test_argument_errors_like_qemu_nbd(self):
        for args in ([], ["-x"], ["--bogus", "a"], ["-p", "99999", "a"], ["-e", "x", "a"],
                     ["--cache=bogus", "a"], ["--aio=bogus", "a"], ["a", "b"],
                     ["-k", "s", "-p", "1", "a"]):
            with self.subTest(args=args):
                rv = run([VBLK, "nbd"] + args, cwd=self.tmp)
                rq = run([QEMU_NBD] + args, cwd=self.tmp)
                self.assertEqual(rv.rc, rq.rc, (rv, rq))
                self.assertNotEqual(rv.rc, 0)
                self.assertTrue(rv.stderr.strip(), rv)
        r = run([VBLK, "nbd", "-k", os.path.join(self.tmp, "z.sock"), os.path.join(self.tmp, "nope")])
        q = run([QEMU_NBD, "-k", os.path.join(self.tmp, "z.sock"), os.path.join(self.tmp, "nope")])
        self.assertEqual(r.rc, q.rc)
        self.assertIn("Could not open '%s': No such file or directory" % os.path.join(self.tmp, "nope"), r.stderr)

    # -- hostile clients ------------------------------------------------------
    def hostile_server(self, *args, size="8M"):
        img = self.make_qcow2("h.qcow2", size)
        self.qemu_io("qcow2", img, "write -P 0x42 0 1M")
        return img, self.serve("vblk", img, "-f", "qcow2", "-e", "0", *args)

    def assertServing(self, s, expect=b"\x42"):
        """The server is alive and a well-behaved client still gets data."""
        self.assertTrue(s.alive(), "server died")
        c = Raw(s.sock)
        size, _ = c.go()
        c.request(CMD_READ, 0, 4096, cookie=77)
        err, cookie, data = c.simple_reply(4096)
        self.assertEqual((err, cookie, data), (0, 77, expect * 4096))
        c.close()

    def test_hostile_handshakes(self):
        _, s = self.hostile_server()
        # unknown client flags: closed
        c = Raw(s.sock)
        c.greet(flags=0xff00)
        self.assertTrue(c.closed())
        # bad option magic: closed
        c = Raw(s.sock)
        c.greet()
        c.s.sendall(struct.pack(">QII", 0x1234, OPT_GO, 0))
        self.assertTrue(c.closed())
        # option length beyond what the server reads: closed without reading it
        c = Raw(s.sock)
        c.greet()
        c.option(OPT_GO, b"", length=2**31)
        self.assertTrue(c.closed())
        # a large (but skippable) option: TOO_BIG, and the session goes on
        c = Raw(s.sock)
        c.greet()
        c.option(OPT_GO, b"\0" * (100 * 1024))
        self.assertEqual(c.reply()[1], ERR_TOO_BIG)
        c.option(OPT_LIST)
        self.assertEqual(c.replies_until_final()[-1][1], REP_ACK)
        c.close()
        # name length pointing past the payload, too-long names, trailing junk
        for data in (struct.pack(">I", 100) + b"abc", struct.pack(">I", 5000) + b"a" * 5000 + b"\0\0",
                     struct.pack(">IH", 0, 0) + b"junk", struct.pack(">IH", 0, 5) + b"\0\0"):
            c = Raw(s.sock)
            c.greet()
            c.option(OPT_GO, data)
            self.assertEqual(c.reply()[1], ERR_INVALID, data[:16])
            c.close()
        # unknown export by GO: ERR_UNKNOWN; by EXPORT_NAME: closed
        c = Raw(s.sock)
        c.greet()
        c.option(OPT_GO, struct.pack(">I", 4) + b"nope" + struct.pack(">H", 0))
        self.assertEqual(c.reply()[1], ERR_UNKNOWN)
        c.option(OPT_EXPORT_NAME, b"nope")
        self.assertTrue(c.closed())
        # unknown option: UNSUP; meta context without structured replies: INVALID
        c = Raw(s.sock)
        c.greet()
        c.option(99, b"x")
        self.assertEqual(c.reply()[1], ERR_UNSUP)
        c.option(OPT_SET_META, struct.pack(">II", 0, 0))
        self.assertEqual(c.reply()[1], ERR_INVALID)
        c.option(OPT_LIST, b"x")
        self.assertEqual(c.reply()[1], ERR_INVALID)
        c.option(OPT_ABORT)
        self.assertEqual(c.reply()[1], REP_ACK)
        self.assertTrue(c.closed())
        # a client that says nothing at all, and one that vanishes mid-greeting
        idle = Raw(s.sock)
        c = Raw(s.sock)
        c.recv(5)
        c.close()
        self.assertServing(s)
        idle.close()
        self.assertServing(s)

    def test_hostile_requests(self):
        _, s = self.hostile_server()
        size = 8 * MiB
        c = Raw(s.sock)
        self.assertEqual(c.go()[0], size)
        cases = [
            (CMD_READ, size - 4096, 8192, 0, EINVAL),       # past the end
            (CMD_READ, 2**63, 1, 0, EINVAL),                # offset overflow
            (CMD_READ, 0, 64 * MiB, 0, EINVAL),             # above the buffer limit
            (CMD_WRITE, size, 0, 0, 0),                     # zero-length write at the end
            (CMD_ZEROES, size - 512, 1024, 0, ENOSPC),
            (CMD_TRIM, size + 1, 1, 0, EINVAL),
            (CMD_READ, 0, 4096, 0x80, EINVAL),              # unknown flag
            (CMD_READ, 0, 4096, 4, EINVAL),                 # DF without structured replies
            (CMD_BS, 0, 4096, 0, EINVAL),                   # no meta context
            (42, 0, 4096, 0, EINVAL),                       # unknown command
            (CMD_READ, 1, 4097, 0, 0),                      # misaligned: fine
        ]
        for i, (cmd, off, ln, flags, want) in enumerate(cases):
            with self.subTest(case=i):
                c.request(cmd, off, ln, flags=flags, cookie=1000 + i)
                err, cookie, data = c.simple_reply(ln if cmd == CMD_READ else 0)
                self.assertEqual((err, cookie), (want, 1000 + i))
                if cmd == CMD_READ and want == 0:
                    self.assertEqual(data, b"\x42" * ln)
        # a write past the end still has its payload consumed
        c.request(CMD_WRITE, size - 10, 20, cookie=5, payload=b"z" * 20)
        self.assertEqual(c.simple_reply()[:2], (ENOSPC, 5))
        c.request(CMD_FLUSH, 0, 0, cookie=6)
        self.assertEqual(c.simple_reply()[:2], (0, 6))
        # bad request magic: closed
        c.s.sendall(struct.pack(">IHHQQI", 0xdeadbeef, 0, 0, 1, 0, 512))
        self.assertTrue(c.closed())
        # a write longer than the server buffers: closed
        c = Raw(s.sock)
        c.go()
        c.request(CMD_WRITE, 0, 2**31)
        self.assertTrue(c.closed())
        # a client vanishing in the middle of a write payload and after
        # sending requests without reading replies
        c = Raw(s.sock)
        c.go()
        c.request(CMD_WRITE, 0, 65536, payload=b"q" * 1000)
        c.close()
        c = Raw(s.sock)
        c.go()
        c.s.sendall(b"".join(struct.pack(">IHHQQI", REQ_MAGIC, 0, CMD_READ, i, 0, 65536)
                             for i in range(200)))
        c.close()
        self.assertServing(s)
        # the half-sent write changed nothing
        c = Raw(s.sock)
        c.go()
        c.request(CMD_READ, 0, 1000, cookie=9)
        self.assertEqual(c.simple_reply(1000)[2], b"\x42" * 1000)
        c.close()

    def test_read_only_export_refuses_writes(self):
        _, s = self.hostile_server("-r")
        c = Raw(s.sock)
        size, flags = c.go()
        self.assertTrue(flags & 2, "READ_ONLY flag")
        for i, cmd in enumerate((CMD_WRITE, CMD_ZEROES, CMD_TRIM)):
            payload = b"w" * 512 if cmd == CMD_WRITE else b""
            c.request(cmd, 0, 512, cookie=i, payload=payload)
            self.assertEqual(c.simple_reply()[:2], (EPERM, i))
        c.request(CMD_READ, 0, 512, cookie=50)
        self.assertEqual(c.simple_reply(512)[2], b"\x42" * 512)
        c.close()

    def test_structured_replies_and_block_status(self):
        _, s = self.hostile_server()
        c = Raw(s.sock)
        c.go(structured=True, meta=True)
        c.request(CMD_READ, 4096, 8192, flags=4, cookie=3)      # DF
        chunks = c.structured_chunks()
        self.assertEqual(len(chunks), 1)
        typ, flags, cookie, payload = chunks[0]
        self.assertEqual((typ, flags & 1, cookie), (1, 1, 3))
        self.assertEqual(struct.unpack(">Q", payload[:8])[0], 4096)
        self.assertEqual(payload[8:], b"\x42" * 8192)
        c.request(CMD_READ, 8 * MiB - 100, 200, cookie=4)       # error chunk with a message
        typ, flags, cookie, payload = c.structured_chunks()[0]
        self.assertEqual((typ, cookie), (2**15 + 1, 4))
        err, mlen = struct.unpack(">IH", payload[:6])
        self.assertEqual(err, EINVAL)
        self.assertEqual(len(payload), 6 + mlen)
        c.request(CMD_BS, 0, 8 * MiB, cookie=5)
        typ, flags, cookie, payload = c.structured_chunks()[0]
        self.assertEqual((typ, cookie), (5, 5))
        ctx = struct.unpack(">I", payload[:4])[0]
        ext = [struct.unpack(">II", payload[i:i + 8]) for i in range(4, len(payload), 8)]
        self.assertEqual(ext, [(MiB, 0), (7 * MiB, 3)], ctx)
        c.request(CMD_BS, 0, 8 * MiB, flags=8, cookie=6)        # REQ_ONE
        typ, flags, cookie, payload = c.structured_chunks()[0]
        self.assertEqual(len(payload), 12)
        c.close()

    def test_many_requests_in_flight_replied_out_of_order_ok(self):
        img, s = self.hostile_server()
        c = Raw(s.sock)
        c.go()
        data = rand_bytes(64 * 4096, 7)
        for i in range(64):
            c.request(CMD_WRITE, i * 4096, 4096, cookie=i, payload=data[i * 4096:(i + 1) * 4096])
        got = set()
        for _ in range(64):
            err, cookie, _ = c.simple_reply()
            self.assertEqual(err, 0)
            got.add(cookie)
        self.assertEqual(got, set(range(64)))
        for i in range(64):
            c.request(CMD_READ, i * 4096, 4096, cookie=100 + i)
        for _ in range(64):
            magic, err, cookie = struct.unpack(">IIQ", c.recv(16))
            self.assertEqual(err, 0)
            i = cookie - 100
            self.assertEqual(c.recv(4096), data[i * 4096:(i + 1) * 4096])
        c.close()

    def test_hundred_concurrent_clients(self):
        img = self.make_qcow2("m.qcow2", "16M")
        s = self.serve("vblk", img, "-f", "qcow2", "-e", "0")
        errors = []

        def client(k):
            try:
                c = Raw(s.sock, timeout=60)
                c.go()
                blob = bytes([k]) * 8192
                c.request(CMD_WRITE, k * 8192 * 2, 8192, cookie=k, payload=blob)
                if c.simple_reply()[0] != 0:
                    errors.append((k, "write"))
                c.request(CMD_READ, k * 8192 * 2, 8192, cookie=k)
                if c.simple_reply(8192)[2] != blob:
                    errors.append((k, "read"))
                if k % 3 == 0:
                    c.request(CMD_DISC, 0, 0)
                c.close()
            except Exception as e:  # noqa: BLE001
                errors.append((k, repr(e)))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertServing(s, expect=b"\0")  # client 0 wrote zeroes at 0
        self.assertEqual(s.stop(), 0)
        c = qemu("check", img)
        self.assertEqual(c.rc, 0, c)
        for k in (0, 37, 99):
            r = run([QEMU_IO, "-f", "qcow2", "-c", "read -P %d %d 8192" % (k, k * 16384), img])
            self.assertNotIn("fail", r.stdout, r)


QEMU_IMG_PATH = shutil.which("qemu-img")

if __name__ == "__main__":
    unittest.main()
