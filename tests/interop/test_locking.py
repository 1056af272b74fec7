"""Image locking: vblk takes QEMU's OFD locks, so vblk and QEMU exclude each
other both ways, and vblk instances exclude each other.

Oracle: QEMU 7.2 itself. For every holder (a daemon, qemu-io, qemu-nbd and
their vblk counterparts keeping an image open) the lock bytes seen in
/proc/locks must be QEMU's, and every command run against the held image
must end as the QEMU tool ends against QEMU's holder: refused with the same
message ('Failed to get "write" lock' and its hint), or allowed. A refused
command changes nothing in the image.
"""

import os
import shutil
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (VBLK, QEMU_IMG, InteropTestCase, file_state, lock_bytes, run,  # noqa: E402
                    norm_vblk_err)
from qmp_driver import Daemon  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
QEMU_NBD = shutil.which("qemu-nbd")


def wait_locked(path, proc, timeout=20):
    """Waits until somebody holds a lock on `path` and the set is stable."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError("holder exited early: %r" % proc.args)
        cur = lock_bytes(path)
        if cur and cur == last:
            return cur
        last = cur
        time.sleep(0.1)
    raise AssertionError("no stable locks on %s" % path)


class Holder:
    """A process that keeps `img` open: kind is serve, io or nbd; `vblk`
    picks vblk's program or QEMU's."""

    def __init__(self, tc, kind, vblk, fmt, img, rw, export=False):
        self.tc, self.img = tc, img
        d = tc.tmp
        sock = os.path.join(d, "h.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        self.sock = sock
        ro = "off" if rw else "on"
        if kind == "serve":
            argv = [VBLK, "serve"] if vblk else [QSD]
            argv += ["--blockdev", f"driver=file,filename={img},node-name=f,read-only={ro}",
                     "--blockdev", f"driver={fmt},file=f,node-name=n,read-only={ro}"]
            mon = os.path.join(d, "h.qmp")
            argv += ["--chardev", f"socket,path={mon},server=on,wait=off,id=m", "--monitor", "chardev=m"]
            if export:
                argv += ["--nbd-server", f"addr.type=unix,addr.path={sock}",
                         "--export", f"type=nbd,id=e,node-name=n,writable={'on' if rw else 'off'}"]
            stdin = subprocess.DEVNULL
        elif kind == "io":
            argv = [VBLK, "io"] if vblk else [QEMU_IO]
            argv += ["-f", fmt] + ([] if rw else ["-r"]) + [img]
            stdin = subprocess.PIPE
        else:
            argv = [VBLK, "nbd"] if vblk else [QEMU_NBD]
            argv += ["-f", fmt, "-k", sock] + ([] if rw else ["-r"]) + [img]
            stdin = subprocess.DEVNULL
        self.log = open(os.path.join(d, "holder.log"), "wb")
        self.proc = subprocess.Popen(argv, stdin=stdin, stdout=self.log, stderr=self.log)
        self.locks = wait_locked(img, self.proc)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def qemu_tool(argv):
    """The QEMU program for a vblk command line: `io` is qemu-io."""
    if argv[0] == "io":
        return [QEMU_IO] + argv[1:]
    return [QEMU_IMG] + argv


def norm(res):
    text = norm_vblk_err(res.stderr)
    for p in ("qemu-io: ", "qemu-img: "):
        text = text.replace(p, "PROG: ")
    return text.replace(os.path.basename(VBLK) + ": ", "PROG: ")


@unittest.skipUnless(QSD and QEMU_IO and QEMU_NBD, "needs qemu-storage-daemon, qemu-io and qemu-nbd")
class LockingTest(InteropTestCase):
    def setUp(self):
        super().setUp()
        self.tmp = self.subdir("lock")

    def fresh(self, fmt, name="img"):
        img = os.path.join(self.tmp, f"{name}.{fmt}")
        if os.path.exists(img):
            os.unlink(img)
        r = run([QEMU_IMG, "create", "-q", "-f", fmt, img, "16M"])
        self.assertEqual(r.rc, 0, r)
        r = run([QEMU_IO, "-f", fmt, "-c", "write -P 7 0 64k", img])
        self.assertEqual(r.rc, 0, r)
        return img

    # Commands a careless operator runs against an image in use. {img} is the
    # held image, {out} a scratch target. Each runs as vblk and as QEMU's tool.
    COMMANDS = [
        ["info", "-f", "{fmt}", "{img}"],
        ["info", "-U", "-f", "{fmt}", "{img}"],
        ["map", "--output=json", "-f", "{fmt}", "{img}"],
        ["check", "-f", "{fmt}", "{img}"],
        ["check", "-r", "all", "-f", "{fmt}", "{img}"],
        ["compare", "-f", "{fmt}", "-F", "{fmt}", "{img}", "{img}"],
        ["convert", "-f", "{fmt}", "-O", "raw", "{img}", "{out}"],
        ["convert", "-U", "-f", "{fmt}", "-O", "raw", "{img}", "{out}"],
        ["snapshot", "-c", "s1", "{img}"],
        ["bench", "-w", "-c", "1", "-f", "{fmt}", "{img}"],
        ["io", "-f", "{fmt}", "-c", "write -P 9 0 4k", "{img}"],
        ["io", "-f", "{fmt}", "-r", "-c", "read 0 4k", "{img}"],
        ["io", "-f", "{fmt}", "-r", "-U", "-c", "read 0 4k", "{img}"],
        ["resize", "-f", "{fmt}", "{img}", "32M"],
        ["create", "-f", "{fmt}", "{img}", "16M"],
    ]

    HOLDERS = [
        ("serve", "qcow2", True, False),
        ("serve", "qcow2", False, False),
        ("serve", "raw", True, True),
        ("serve", "raw", False, True),
        ("io", "qcow2", True, False),
        ("io", "raw", True, False),
        ("io", "qcow2", False, False),
        ("nbd", "raw", True, False),
        ("nbd", "qcow2", False, False),
    ]

    def run_cmd(self, tool_vblk, cmd, fmt, img):
        out = os.path.join(self.tmp, "out.raw")
        argv = [a.format(img=img, out=out, fmt=fmt) for a in cmd]
        return run([VBLK] + argv if tool_vblk else qemu_tool(argv))

    def test_holders_lock_like_qemu_and_commands_end_the_same(self):
        for kind, fmt, rw, export in self.HOLDERS:
            label = f"{kind} {fmt} {'rw' if rw else 'ro'}"
            with self.subTest(holder=label):
                img = self.fresh(fmt)
                hq = Holder(self, kind, False, fmt, img, rw, export)
                try:
                    expect = {}
                    for cmd in self.COMMANDS:
                        before = file_state(img, with_mtime=False)
                        q = self.run_cmd(False, cmd, fmt, img)
                        v = self.run_cmd(True, cmd, fmt, img)
                        expect[tuple(cmd)] = q
                        what = f"{' '.join(cmd)} against QEMU's {label}"
                        self.assertEqual(v.rc != 0, q.rc != 0, f"{what}\nvblk: {v}\nqemu: {q}")
                        if q.rc != 0 and "lock" in q.stderr:
                            self.assertEqual(norm(v), norm(q), what)
                            self.assertEqual(file_state(img, with_mtime=False), before, what + ": changed the image")
                finally:
                    hq.stop()
                img = self.fresh(fmt)
                hv = Holder(self, kind, True, fmt, img, rw, export)
                try:
                    # The same bytes as QEMU's holder took.
                    self.assertEqual(hv.locks, hq.locks, f"lock bytes of vblk's {label}")
                    for cmd in self.COMMANDS:
                        q = self.run_cmd(False, cmd, fmt, img)
                        e = expect[tuple(cmd)]
                        what = f"QEMU's {' '.join(cmd)} against vblk's {label}"
                        self.assertEqual(q.rc != 0, e.rc != 0, f"{what}\n{q}\nexpected like {e}")
                        if e.rc != 0 and "lock" in e.stderr:
                            self.assertEqual(norm(q), norm(e), what)
                finally:
                    hv.stop()

    def test_two_daemons_on_one_image(self):
        """Two storage daemons never both write one image, whichever is first."""
        img = self.fresh("qcow2")
        args = ["--blockdev", f"driver=file,filename={img},node-name=f",
                "--blockdev", "driver=qcow2,file=f,node-name=n"]
        results = {}
        for first_vblk in (False, True):
            for second_vblk in (False, True):
                first = Holder(self, "serve", first_vblk, "qcow2", img, True)
                try:
                    argv = ([VBLK, "serve"] if second_vblk else [QSD]) + args + [
                        "--chardev", f"socket,path={self.tmp}/2.qmp,server=on,wait=off,id=m", "--monitor", "chardev=m"]
                    r = run(argv, timeout=20)
                    results[(first_vblk, second_vblk)] = r
                    self.assertEqual(r.rc, 1, r)
                    self.assertIn('Failed to get "write" lock', r.stderr)
                finally:
                    first.stop()
        q = results[(False, False)]
        for key, r in results.items():
            self.assertEqual(norm(r).replace("qemu-storage-daemon: ", "PROG: "),
                             norm(q).replace("qemu-storage-daemon: ", "PROG: "), key)

    def test_qmp_blockdev_add_refused_like_qsd(self):
        """blockdev-add of an image another process writes fails with
        qemu-storage-daemon's error, and the node does not appear."""
        img = self.fresh("qcow2")
        holder = Holder(self, "io", False, "qcow2", img, True)
        try:
            replies = {}
            for name, argv0 in (("qsd", [QSD]), ("vblk", [VBLK, "serve"])):
                d = Daemon(argv0, os.path.join(self.tmp, f"{name}.qmp"), os.path.join(self.tmp, f"{name}.log"))
                try:
                    rw = d.qmp.cmd("blockdev-add", {"driver": "qcow2", "node-name": "n",
                                                    "file": {"driver": "file", "filename": img}})
                    ro = d.qmp.cmd("blockdev-add", {"driver": "qcow2", "node-name": "r", "read-only": True,
                                                    "file": {"driver": "file", "filename": img}})
                    fs = d.qmp.cmd("blockdev-add", {"driver": "qcow2", "node-name": "s", "read-only": True,
                                                    "force-share": True,
                                                    "file": {"driver": "file", "filename": img}})
                    bad = d.qmp.cmd("blockdev-add", {"driver": "file", "node-name": "w", "force-share": True,
                                                     "filename": img})
                    nodes = sorted(x["node-name"] for x in d.qmp.cmd("query-named-block-nodes")["return"]
                                   if not x["node-name"].startswith("#"))
                    replies[name] = (rw, ro, fs, bad, nodes)
                finally:
                    d.quit()
            self.assertEqual(replies["vblk"], replies["qsd"])
            self.assertEqual(replies["qsd"][0]["error"]["desc"], 'Failed to get "write" lock')
        finally:
            holder.stop()

    def test_refused_writer_loses_nothing(self):
        """The issue's lost-write scenario: while qemu-storage-daemon holds an
        image, vblk's write is refused (not silently lost later)."""
        img = self.fresh("qcow2")
        holder = Holder(self, "serve", False, "qcow2", img, True)
        try:
            before = file_state(img, with_mtime=False)
            r = run([VBLK, "io", "-c", "write -P 5 0 64k", img])
            self.assertEqual(r.rc, 1, r)
            self.assertIn('Failed to get "write" lock', r.stderr)
            self.assertIn(f"Is another process using the image [{img}]?", r.stderr)
            self.assertEqual(file_state(img, with_mtime=False), before)
            r = run([VBLK, "create", "-f", "qcow2", img, "1M"])
            self.assertEqual(r.rc, 1, r)
            self.assertEqual(file_state(img, with_mtime=False), before)
        finally:
            holder.stop()
        # Once the daemon is gone, the image is vblk's to write.
        r = run([VBLK, "io", "-c", "write -P 5 0 64k", img])
        self.assertEqual(r.rc, 0, r)
        r = run([QEMU_IO, "-r", "-c", "read -P 5 0 64k", img])
        self.assertEqual(r.rc, 0, r)
        self.assertNotIn("Pattern verification failed", r.stdout)

    def test_locking_off_and_bad_value(self):
        """locking=off opens regardless, as QEMU's does; a bad value is refused."""
        img = self.fresh("raw")
        holder = Holder(self, "io", False, "raw", img, False)
        try:
            opts_ok = f"driver=raw,file.driver=file,file.filename={img},file.locking=off"
            v = run([VBLK, "io", "--image-opts", "-c", "write 0 4k", opts_ok])
            q = run([QEMU_IO, "--image-opts", "-c", "write 0 4k", opts_ok])
            self.assertEqual((v.rc, q.rc), (0, 0), (v, q))
            # qemu-io -r holds "consistent read" only: a plain raw writer is fine too.
            opts_bad = f"driver=raw,file.driver=file,file.filename={img},file.locking=maybe"
            v = run([VBLK, "info", "--image-opts", opts_bad])
            q = run([QEMU_IMG, "info", "--image-opts", opts_bad])
            self.assertEqual(v.rc, q.rc)
            self.assertEqual(norm(v), norm(q))
        finally:
            holder.stop()
        self.assertGreater(os.path.getsize(img), 0)


if __name__ == "__main__":
    unittest.main()
