#!/usr/bin/env python3
"""Records the NBD seed corpora from real traffic with qemu-nbd.

  fuzz/record_nbd_seeds.py OUTDIR

OUTDIR/nbd_server/: what real clients send (nbdinfo --list/--map/--size,
qemu-img info and map, qemu-io reads, writes, discards, zero writes,
flushes, and this script's own client below), taken by a proxy between
them and qemu-nbd: the fuzz_nbd_server input is the client's byte stream.

OUTDIR/nbd_client/: what qemu-nbd sends to a client that asks exactly what
fuzz/nbd_client_fuzz.cc's client asks, in its order and with its cookies
(1 to 7), so that fuzz_nbd_client replays a real server's replies:
structured and not, writable and read-only, over an image with data,
holes and zeroes. Byte 0 is the fuzz target's option byte.

The checked-in fuzz/seeds/ came from this script (qemu-nbd 7.2); it needs
qemu-img, qemu-io, qemu-nbd and nbdinfo.
"""

import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from nbd_wire import IHAVEOPT as OPT_MAGIC, REQ_MAGIC, recv_exact  # noqa: E402


def wait_socket(path):
    for _ in range(200):
        if os.path.exists(path):
            return
        time.sleep(0.02)
    raise RuntimeError("no socket " + path)


def qemu_nbd(image, sock, extra=()):
    p = subprocess.Popen(["qemu-nbd", "-f", "qcow2", "-k", sock, "-t", "-x", "", *extra, image],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_socket(sock)
    return p


def proxy_once(listen_path, upstream, record):
    """Accepts one client on listen_path, relays it to upstream; the
    client's bytes go to record (a list of bytes)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(listen_path)
    srv.listen(1)

    def run():
        c, _ = srv.accept()
        u = socket.socket(socket.AF_UNIX)
        u.connect(upstream)

        def pump(a, b, rec):
            while True:
                d = a.recv(65536)
                if not d:
                    break
                if rec is not None:
                    rec.append(d)
                try:
                    b.sendall(d)
                except OSError:
                    break
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        t = threading.Thread(target=pump, args=(u, c, None))
        t.start()
        pump(c, u, record)
        t.join()
        c.close()
        u.close()
        srv.close()

    t = threading.Thread(target=run)
    t.start()
    return t


def fuzz_client(sock, structured, record_in):
    """The requests fuzz/nbd_client_fuzz.cc's client makes; every byte the
    server sends is appended to record_in."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    got = []

    def rx(n):
        b = recv_exact(s, n)
        got.append(b)
        return b

    def opt(o, data):
        s.sendall(struct.pack(">QII", OPT_MAGIC, o, len(data)) + data)

    def opt_reply():
        h = rx(20)
        _, o, t, n = struct.unpack(">QIII", h)
        return t, rx(n) if n else b""

    g = rx(18)
    sflags = struct.unpack(">H", g[16:])[0]
    s.sendall(struct.pack(">I", 1 | (sflags & 2)))
    base_alloc = False
    if structured:
        opt(8, b"")
        t, _ = opt_reply()
        structured = t == 1
    if structured:
        q = b"base:allocation"
        opt(10, struct.pack(">I", 0) + struct.pack(">II", 1, len(q)) + q)
        while True:
            t, d = opt_reply()
            if t == 4:
                base_alloc = True
                continue
            break
    opt(7, struct.pack(">I", 0) + struct.pack(">HH", 1, 3))
    while True:
        t, d = opt_reply()
        if t != 3:
            break
    reqs = [(0, 0, 0, 4096, b""), (0, 0, 60 << 10, 8192, b"")]
    if base_alloc:
        reqs.append((7, 0, 0, 1 << 20, b""))
    reqs += [(1, 0, 0, 4096, b"\x5a" * 4096), (6, 2, 4096, 8192, b""), (4, 0, 16384, 4096, b""),
             (3, 0, 0, 0, b"")]
    for i, (typ, flags, off, n, payload) in enumerate(reqs):
        s.sendall(struct.pack(">IHHQQI", REQ_MAGIC, flags, typ, i + 1, off, n) + payload)
    # Read until every request has its (final) reply.
    pending = {i + 1: typ for i, (typ, *_r) in enumerate(reqs)}
    while pending:
        m = struct.unpack(">I", rx(4))[0]
        if m == 0x67446698:
            err, cookie = struct.unpack(">IQ", rx(12))
            typ = pending.pop(cookie)
            if typ == 0 and not err:
                rx(4096 if cookie == 1 else 8192)
        else:
            flags, typ, cookie, n = struct.unpack(">HHQI", rx(16))
            if n:
                rx(n)
            if flags & 1:
                pending.pop(cookie)
    s.sendall(struct.pack(">IHHQQI", REQ_MAGIC, 0, 2, 99, 0, 0))
    s.close()
    record_in.append(b"".join(got))


def main():
    out = sys.argv[1]
    for sub in ("nbd_server", "nbd_client"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        img = os.path.join(d, "img.qcow2")
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", img, "1M"], check=True)
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x11 0 64k", "-c", "write -z 128k 64k",
                        "-c", "write -P 0x22 512k 4k", img], check=True, stdout=subprocess.DEVNULL)
        sock = os.path.join(d, "nbd.sock")
        front = os.path.join(d, "front.sock")
        uri = "nbd+unix:///?socket=" + front
        clients = {
            "nbdinfo-list": ["nbdinfo", "--list", uri],
            "nbdinfo-map": ["nbdinfo", "--map", uri],
            "nbdinfo-size": ["nbdinfo", "--size", uri],
            "qemu-img-info": ["qemu-img", "info", uri],
            "qemu-img-map": ["qemu-img", "map", "--output=json", "-f", "raw", uri],
            "qemu-io-rw": ["qemu-io", "-f", "raw", "-c", "read 0 4k", "-c", "write -P 0x33 4k 4k",
                           "-c", "writev 1m-8k 512 512", "-c", "discard 64k 64k", "-c", "write -z 256k 8k",
                           "-c", "write -z -u 300k 4k", "-c", "flush", "-c", "aio_read 0 64k",
                           "-c", "aio_write -F 0 4k", "-c", "aio_flush", uri],
            "qemu-io-ro-unaligned": ["qemu-io", "-r", "-f", "raw", "-c", "read 1 511", "-c", "read 0 1m",
                                     "-c", "readv 512 1k 2k", uri],
        }
        for ro in (False, True):
            server = qemu_nbd(img, sock, ["-r"] if ro else [])
            try:
                for name, argv in clients.items():
                    if ro and not name.startswith(("qemu-io-ro", "nbdinfo-list")):
                        continue
                    rec = []
                    t = proxy_once(front, sock, rec)
                    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
                    t.join(10)
                    os.unlink(front)
                    with open(os.path.join(out, "nbd_server", name + ("-ro" if ro else "")), "wb") as f:
                        f.write(b"".join(rec))
                for structured in (True, False):
                    rec = []
                    fuzz_client(sock, structured, rec)
                    name = "qemu-nbd-%s%s" % ("structured" if structured else "simple", "-ro" if ro else "")
                    with open(os.path.join(out, "nbd_client", name), "wb") as f:
                        f.write(bytes([1 if structured else 0]) + rec[0])
            finally:
                server.terminate()
                server.wait()


if __name__ == "__main__":
    main()
