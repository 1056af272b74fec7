#!/usr/bin/env python3
"""Interop: every operation of docs/destructive-operations.md, made to fail
at its LAST fallible step (the last check before the irreversible one), and
the data shown unchanged afterwards.

For each row of the table: the sha256 of every image file before == after
(where the operation writes nothing it may keep), `qemu-img check` clean,
the exit status or QMP error asserted, and QEMU 7.2's words compared where
QEMU (qemu-img, qemu-storage-daemon) refuses the same thing:

- create over an image: a backing file that cannot be opened / has no
  format / is the image itself (with a size given), the write lock;
- blockdev-create over a node whose users do not share write and resize;
- resize: no --shrink, a size that is not positive, a v2 image with
  snapshots, the lock;
- snapshot -a / -d: missing snapshot, persistent bitmaps (-a), the lock,
  and a read error on the snapshot's L1 table (also when the snapshot's
  size differs: the resize must wait for that read); QMP
  blockdev-snapshot-delete-internal-sync of a missing snapshot;
- loadvm: the output cannot be opened; x-vblk-loadvm: nobody listens;
- savevm: a QEMU migration stream cut one byte short;
- commit (intermediate), stream, active commit's and mirror's complete: the
  flush before the relink / switch fails (blkdebug flush_to_disk);
- check -r: the lock, and a read error in the check pass before repairs;
- bitmap --remove / --clear / --merge: a missing bitmap, an inconsistent
  one, an incompatible merge source, the lock;
- backup: TARGET appears before the rename;
- convert -n into a smaller target.

Environment: VBLK (binary under test). Python standard library only.
"""

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (MiB, VBLK, InteropTestCase, lock_bytes, norm_qemu_err, norm_vblk_err,  # noqa: E402
                    qemu, run, storage_daemons, vblk, wait_unlocked, _BASE_ENV)
from qmp_driver import Daemon  # noqa: E402

QEMU_IO = shutil.which("qemu-io")
DAEMONS = storage_daemons()
VBLK_SERVE = [d for d in DAEMONS if d[0] == "vblk serve"]


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def shas(paths):
    return {os.path.basename(p): sha(p) for p in paths}


def l1_of_snapshots(path):
    """{name: (l1_table_offset, l1_size)} from a qcow2 snapshot table."""
    with open(path, "rb") as f:
        h = f.read(72)
        nb, off = struct.unpack(">IQ", h[60:72])
        out = {}
        for _ in range(nb):
            f.seek(off)
            e = f.read(40)
            l1off, l1size = struct.unpack(">QI", e[0:12])
            id_len, name_len = struct.unpack(">HH", e[12:16])
            extra = struct.unpack(">I", e[36:40])[0]
            f.seek(off + 40 + extra + id_len)
            out[f.read(name_len).decode()] = (l1off, l1size)
            off += (40 + extra + id_len + name_len + 7) & ~7
    return out


def l2_table_of(path, guest_offset):
    """Host offset of the L2 table covering guest_offset (64 KiB clusters)."""
    with open(path, "rb") as f:
        h = f.read(48)
        l1off = struct.unpack(">Q", h[40:48])[0]
        idx = guest_offset // (65536 * 8192)
        f.seek(l1off + 8 * idx)
        return struct.unpack(">Q", f.read(8))[0] & 0x00fffffffffffe00


def blkdebug_opts(path, rules):
    """--image-opts for a qcow2 over blkdebug over `path`; rules: [(event, sector)]."""
    s = "driver=qcow2,file.driver=blkdebug,file.image.driver=file,file.image.filename=%s" % path
    for i, (event, sector) in enumerate(rules):
        s += ",file.inject-error.%d.event=%s,file.inject-error.%d.errno=5" % (i, event, i)
        if sector is not None:
            s += ",file.inject-error.%d.sector=%d" % (i, sector)
    return s


def norm(res, prog=None):
    """stderr with the program's name (vblk, qemu-img, qemu-io) as PROG."""
    text = norm_vblk_err(res.stderr) if prog is None else norm_qemu_err(res.stderr)
    return text.replace("qemu-img: ", "PROG: ")


@unittest.skipUnless(QEMU_IO, "needs qemu-io")
class DestructiveLastStepTest(InteropTestCase):

    # -- helpers -------------------------------------------------------------
    def sh(self, *argv, cwd=None):
        r = run(list(argv), cwd=cwd, timeout=120)
        self.assertEqual(r.rc, 0, r)
        return r

    def qcow2(self, name, size="8M", writes=("write -P 0x11 0 1M", "write -P 0x22 3M 64k"), opts=None):
        img = os.path.join(self.tmp, name)
        self.sh("qemu-img", "create", "-q", "-f", "qcow2", *(["-o", opts] if opts else []), img, size)
        if writes:
            argv = [QEMU_IO, "-f", "qcow2"]
            for w in writes:
                argv += ["-c", w]
            self.sh(*argv, img)
        return img

    def raw(self, name, size=4 * MiB, byte=0x5a):
        img = os.path.join(self.tmp, name)
        with open(img, "wb") as f:
            f.write(bytes([byte]) * size)
        return img

    def view(self, img):
        """What an image holds, for images whose bytes a read-write open
        rewrites even when nothing changes (persistent bitmaps: marked in
        use at open and stored again at close, by QEMU as by vblk): the
        guest's data, the snapshot table, each bitmap's flags and dirty
        areas."""
        raw = os.path.join(self.tmp, "view.raw")
        self.sh("qemu-img", "convert", "-U", "-f", "qcow2", "-O", "raw", img, raw)
        out = {"data": sha(raw)}
        os.unlink(raw)
        out["snapshots"] = [l.split()[:2] for l in qemu("snapshot", "-l", "-U", img).stdout.splitlines()[2:]]
        info = json.loads(qemu("info", "-U", "--output=json", img).stdout)
        bitmaps = info["format-specific"]["data"].get("bitmaps", [])
        out["bitmaps"] = bitmaps
        for b in bitmaps:
            if "in-use" in b["flags"]:
                continue
            sock = os.path.join(self.tmp, "view.sock")
            p = subprocess.Popen([shutil.which("qemu-nbd"), "-r", "-f", "qcow2", "-B", b["name"], "-k", sock, img],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                end = time.monotonic() + 20
                while not os.path.exists(sock):
                    self.assertLess(time.monotonic(), end, "qemu-nbd did not start")
                    time.sleep(0.02)
                r = qemu("map", "--output=json", "--image-opts",
                         "driver=nbd,server.type=unix,server.path=%s,x-dirty-bitmap=qemu:dirty-bitmap:%s"
                         % (sock, b["name"]))
                self.assertEqual(r.rc, 0, r)
                out["dirty:" + b["name"]] = r.stdout
            finally:
                p.terminate()
                p.wait()
            wait_unlocked(img)
        return out

    def assertClean(self, img, what=""):
        r = qemu("check", "-U", img)
        self.assertEqual(r.rc, 0, "%s: %r" % (what, r))
        self.assertTrue(r.stdout.startswith("No errors were found on the image."), "%s: %r" % (what, r))

    def assertSameRefusal(self, args, cwd=None, rc=1, qemu_argv=None):
        """vblk and qemu-img run `args`; both refuse with the same exit status
        and words. Returns vblk's result."""
        v = vblk(*args, cwd=cwd)
        q = qemu(*(qemu_argv or args), cwd=cwd)
        self.assertEqual(v.rc, rc, v)
        self.assertEqual((v.rc, v.stdout, norm(v)), (q.rc, q.stdout, norm(q, "qemu")), args)
        return v

    @contextlib.contextmanager
    def held(self, img, fmt="qcow2"):
        """qemu-io keeps `img` open for writing (QEMU's locks held)."""
        p = subprocess.Popen([QEMU_IO, "-f", fmt, img], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        try:
            end = time.monotonic() + 20
            while not lock_bytes(img):
                self.assertIsNone(p.poll(), "qemu-io exited")
                self.assertLess(time.monotonic(), end, "qemu-io took no lock")
                time.sleep(0.02)
            # The locks come before the open is done (qcow2 marks its
            # bitmaps in use after them): qemu-io answers a command only
            # once the image is open.
            p.stdin.write(b"read 0 512\n")
            p.stdin.flush()
            while b"read 512/512" not in p.stdout.readline():
                self.assertIsNone(p.poll(), "qemu-io exited")
            yield p
        finally:
            try:
                p.communicate(b"quit\n", timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            wait_unlocked(img)

    def daemon(self, argv, d):
        return Daemon(argv, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))

    def job_end(self, q, job, complete=False):
        """Events of a block job up to BLOCK_JOB_COMPLETED; completes it when
        ready if asked. Returns [(event, operation or error)]."""
        seen = []
        while True:
            e, _ = q.next_event(("BLOCK_JOB_READY", "BLOCK_JOB_ERROR", "BLOCK_JOB_COMPLETED"), 60)
            name, data = e["event"], e["data"]
            if name == "BLOCK_JOB_ERROR":
                seen.append((name, data["operation"]))
            elif name == "BLOCK_JOB_READY":
                seen.append((name, None))
                if complete:
                    q.ok("block-job-complete", device=job)
            else:
                seen.append((name, data.get("error")))
                return seen

    def chain(self):
        """base <- mid <- top, each layer with data of its own, and the raw
        content the top reads (ref.raw)."""
        p = lambda n: os.path.join(self.tmp, n)  # noqa: E731
        self.qcow2("base.qcow2", writes=("write -P 0x01 0 8M",))
        self.sh("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", p("mid.qcow2"))
        self.sh(QEMU_IO, "-f", "qcow2", "-c", "write -P 0x02 1M 2M", p("mid.qcow2"))
        self.sh("qemu-img", "create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", p("top.qcow2"))
        self.sh(QEMU_IO, "-f", "qcow2", "-c", "write -P 0x03 2M 64k", "-c", "write -P 0x04 6M 512k", p("top.qcow2"))
        self.sh("qemu-img", "convert", "-f", "qcow2", "-O", "raw", p("top.qcow2"), p("ref.raw"))
        return p("base.qcow2"), p("mid.qcow2"), p("top.qcow2"), p("ref.raw")

    def assertReadsAs(self, img, ref):
        r = qemu("compare", "-U", "-f", "qcow2", "-F", "raw", img, ref)
        self.assertEqual((r.rc, r.stdout.strip()), (0, "Images are identical."), r)

    def backing_of(self, img):
        r = qemu("info", "-U", "--output=json", img)
        self.assertEqual(r.rc, 0, r)
        return json.loads(r.stdout).get("backing-filename")

    @staticmethod
    def node(driver, path, name, backing=False, inject=None, states=None):
        f = {"driver": "file", "filename": path}
        if inject is not None:
            f = {"driver": "blkdebug", "image": f, "inject-error": inject}
            if states:
                f["set-state"] = states
        args = {"driver": driver, "node-name": name, "file": f}
        if backing is not False:
            args["backing"] = backing
        return args

    # -- create over an existing image ---------------------------------------
    def test_create_backing_unopenable_keeps_the_image(self):
        """The backing file is opened (QEMU's bdrv_img_create) even with a
        size given: missing, without -F, or the image itself, the old image
        stays byte for byte (vblk used to format over it)."""
        img = self.qcow2("img.qcow2")
        self.qcow2("base.qcow2", writes=())
        before = shas([img])
        for args in (["-b", "missing.qcow2", "-F", "qcow2"], ["-b", "base.qcow2"],
                     ["-b", "img.qcow2", "-F", "qcow2"], ["-b", "", "-F", "qcow2"]):
            with self.subTest(args=args):
                self.assertSameRefusal(["create", "-f", "qcow2"] + args + ["img.qcow2", "1M"], cwd=self.tmp)
                self.assertEqual(shas([img]), before)
                self.assertClean(img)
        # -u does not open it: the image is formatted, as qemu-img does.
        r = vblk("create", "-q", "-f", "qcow2", "-u", "-b", "missing.qcow2", "-F", "qcow2", "img.qcow2", "1M",
                 cwd=self.tmp)
        self.assertEqual(r.rc, 0, r)
        self.assertEqual(self.backing_of(img), "missing.qcow2")

    def test_create_over_locked_image_keeps_it(self):
        """The write lock is create's last check before it truncates. (A raw
        image qemu-io holds is not refused: qemu-io's raw node shares write
        and resize, and qemu-img formats over it too.)"""
        for fmt in ("qcow2",):
            with self.subTest(fmt=fmt):
                img = self.qcow2("l.qcow2") if fmt == "qcow2" else self.raw("l.raw")
                before = shas([img])
                with self.held(img, fmt):
                    self.assertSameRefusal(["create", "-f", fmt, img, "1M"])
                    self.assertEqual(shas([img]), before)
                self.assertEqual(shas([img]), before)
                if fmt == "qcow2":
                    self.assertClean(img)

    # -- blockdev-create over a node -----------------------------------------
    @unittest.skipUnless(len(DAEMONS) == 2, "needs qemu-storage-daemon and vblk serve")
    def test_blockdev_create_over_a_used_node(self):
        """The node's users (a qcow2 node on it; another process's lock)
        do not share write and resize: the create job fails, the image is
        as it was, and the job's error is qemu-storage-daemon's."""
        seen = {}
        for name, argv in DAEMONS:
            d = self.subdir(name.replace(" ", "_"))
            img = os.path.join(d, "x.qcow2")
            self.sh("qemu-img", "create", "-q", "-f", "qcow2", img, "4M")
            self.sh(QEMU_IO, "-c", "write -P 7 0 64k", img)
            before = shas([img])
            dm = self.daemon(argv, d)
            try:
                q = dm.qmp
                q.ok("blockdev-add", driver="file", filename=img, **{"node-name": "f"})
                q.ok("blockdev-add", driver="qcow2", file="f", **{"node-name": "n"})
                errors = []
                for jid, opts in (("j1", {"driver": "qcow2", "file": "f", "size": MiB}),
                                  ("j2", {"driver": "file", "filename": img, "size": MiB})):
                    q.ok("blockdev-create", **{"job-id": jid, "options": opts})
                    while True:
                        e, _ = q.next_event(("JOB_STATUS_CHANGE",), 60)
                        if e["data"]["id"] == jid and e["data"]["status"] == "concluded":
                            break
                    errors.append(q.ok("query-jobs")[0].get("error"))
                    q.ok("job-dismiss", id=jid)
                seen[name] = errors
            finally:
                dm.quit()
            self.assertEqual(shas([img]), before, name)
            self.assertClean(img, name)
        self.assertEqual(seen["vblk serve"], seen["qemu-storage-daemon"])
        self.assertIn("Permission conflict on node 'f'", seen["vblk serve"][0])
        self.assertEqual(seen["vblk serve"][1], 'Failed to get "write" lock')

    # -- resize --shrink -----------------------------------------------------
    def test_resize_refusals_keep_the_image(self):
        """--shrink missing, a size that is not positive (the checks after
        the image is opened), a v2 image with snapshots (the driver's own
        check), the lock: refused as qemu-img refuses, the image unchanged."""
        img = self.qcow2("r.qcow2")
        rawimg = self.raw("r.raw")
        v2 = self.qcow2("v2.qcow2", opts="compat=0.10")
        self.sh("qemu-img", "snapshot", "-c", "s", v2)
        files = [img, rawimg, v2]
        before = shas(files)
        cases = [["resize", "-f", "qcow2", img, "4M"], ["resize", "-f", "raw", rawimg, "1M"],
                 ["resize", "-f", "qcow2", img, "--", "-8M"], ["resize", "-f", "qcow2", img, "0"],
                 ["resize", "--shrink", "-f", "qcow2", v2, "4M"], ["resize", "-f", "qcow2", v2, "16M"]]
        for args in cases:
            with self.subTest(args=args):
                self.assertSameRefusal(args)
                self.assertEqual(shas(files), before)
        with self.held(img):
            self.assertSameRefusal(["resize", "--shrink", "-f", "qcow2", img, "4M"])
        self.assertEqual(shas(files), before)
        self.assertClean(img)
        self.assertClean(v2)

    # -- snapshot -a / -d ----------------------------------------------------
    def test_snapshot_refusals_keep_the_image(self):
        img = self.qcow2("s.qcow2")
        self.sh("qemu-img", "snapshot", "-c", "one", img)
        self.sh(QEMU_IO, "-c", "write -P 0x33 0 64k", img)
        bm = self.qcow2("b.qcow2")
        self.sh("qemu-img", "snapshot", "-c", "one", bm)
        self.sh("qemu-img", "bitmap", "--add", bm, "b0")
        before = shas([img])
        view = self.view(bm)
        for args in (["-a", "nosuch", img], ["-d", "nosuch", img], ["-a", "one", bm]):
            with self.subTest(args=args):
                self.assertSameRefusal(["snapshot"] + args)
                self.assertEqual(shas([img]), before)
                self.assertEqual(self.view(bm), view)
        with self.held(img):
            for args in (["-a", "one", img], ["-d", "one", img]):
                with self.subTest(args=args, held=True):
                    self.assertSameRefusal(["snapshot"] + args)
        self.assertEqual(shas([img]), before)
        self.assertClean(img)
        self.assertClean(bm)

    def test_snapshot_l1_read_error_keeps_the_image(self):
        """The last reads before -a / -d change anything: the snapshot's L1
        table. A read error there leaves the image as it was, also when the
        snapshot's disk size differs from the image's (vblk resized first,
        as QEMU does, and kept the new size when the read then failed).
        vblk only: QEMU's blkdebug fires read_aio on guest data reads, not
        on this metadata read."""
        for size in ("8M", "4M", "12M"):
            with self.subTest(current_size=size):
                img = self.qcow2("l1-%s.qcow2" % size, writes=("write -P 0x05 0 6M",))
                self.sh("qemu-img", "snapshot", "-c", "one", img)
                self.sh(QEMU_IO, "-c", "write -P 0x06 0 64k", img)
                if size != "8M":
                    self.sh("qemu-img", "resize", "-q", "--shrink", img, size)
                l1off = l1_of_snapshots(img)["one"][0]
                before = shas([img])
                opts = blkdebug_opts(img, [("read_aio", l1off // 512)])
                r = vblk("snapshot", "-a", "one", "--image-opts", opts)
                self.assertEqual((r.rc, norm(r)), (1, "PROG: Could not apply snapshot 'one': Failed to load "
                                                      "snapshot: Input/output error\n"), r)
                self.assertEqual(shas([img]), before)
                r = vblk("snapshot", "-d", "one", "--image-opts", opts)
                self.assertEqual((r.rc, norm(r)), (1, "PROG: Could not delete snapshot 'one': Input/output error\n"),
                                 r)
                self.assertEqual(shas([img]), before)
                self.assertClean(img)
                # Without the fault the snapshot applies.
                r = vblk("snapshot", "-a", "one", img)
                self.assertEqual(r.rc, 0, r)
                r = run([QEMU_IO, "-r", "-f", "qcow2", "-c", "read -P 0x05 0 6M", img])
                self.assertNotIn("fail", r.stdout, r)
                self.assertClean(img)

    @unittest.skipUnless(len(DAEMONS) == 2, "needs qemu-storage-daemon and vblk serve")
    def test_qmp_internal_snapshot_refusals_keep_the_image(self):
        seen = {}
        for name, argv in DAEMONS:
            d = self.subdir(name.replace(" ", "_"))
            img = os.path.join(d, "i.qcow2")
            self.sh("qemu-img", "create", "-q", "-f", "qcow2", img, "4M")
            self.sh(QEMU_IO, "-c", "write -P 7 0 64k", img)
            self.sh("qemu-img", "snapshot", "-c", "one", img)
            before = shas([img])
            dm = self.daemon(argv, d)
            try:
                q = dm.qmp
                q.ok("blockdev-add", self.node("qcow2", img, "n"))
                seen[name] = [q.cmd("blockdev-snapshot-delete-internal-sync", {"device": "n", "name": "nosuch"}),
                              q.cmd("blockdev-snapshot-delete-internal-sync",
                                    {"device": "n", "id": "9", "name": "one"}),
                              q.cmd("blockdev-snapshot-internal-sync", {"device": "n", "name": "one"})]
            finally:
                dm.quit()
            self.assertEqual(shas([img]), before, name)
            self.assertClean(img, name)
        self.assertEqual(seen["vblk serve"], seen["qemu-storage-daemon"])
        self.assertIn("error", seen["vblk serve"][0])

    # -- loadvm / savevm -----------------------------------------------------
    def test_loadvm_output_unopenable_keeps_the_disk(self):
        img = self.qcow2("v.qcow2")
        state = os.path.join(self.tmp, "state")
        with open(state, "wb") as f:
            f.write(os.urandom(3 * MiB))
        r = vblk("savevm", "--vmstate", state, img, "s1")
        self.assertEqual(r.rc, 0, r)
        self.sh(QEMU_IO, "-c", "write -P 0x44 0 2M", img)  # what a revert would lose
        before = shas([img])
        r = vblk("loadvm", "--vmstate-out", os.path.join(self.tmp, "nodir", "x"), img, "s1")
        self.assertEqual(r.rc, 1, r)
        self.assertIn("Could not open '%s': No such file or directory" % os.path.join(self.tmp, "nodir", "x"),
                      r.stderr)
        r = vblk("loadvm", "--vmstate-out", os.path.join(self.tmp, "out"), img, "nosuch")
        self.assertEqual(r.rc, 1, r)
        self.assertIn("Snapshot 'nosuch' does not exist", r.stderr)
        self.assertEqual(shas([img]), before)
        self.assertClean(img)

    @unittest.skipUnless(VBLK_SERVE, "needs vblk serve")
    def test_x_vblk_loadvm_nobody_listening_keeps_the_disk(self):
        img = self.qcow2("v.qcow2")
        state = os.path.join(self.tmp, "state")
        with open(state, "wb") as f:
            f.write(os.urandom(MiB))
        self.assertEqual(vblk("savevm", "--vmstate", state, img, "s1").rc, 0)
        self.sh(QEMU_IO, "-c", "write -P 0x44 0 2M", img)
        before = shas([img])
        dm = self.daemon(VBLK_SERVE[0][1], self.tmp)
        try:
            q = dm.qmp
            q.ok("blockdev-add", self.node("qcow2", img, "disk"))
            typo = os.path.join(self.tmp, "typo.sock")
            r = q.cmd("x-vblk-loadvm", {"job-id": "ld", "tag": "s1", "vmstate": "disk", "devices": ["disk"],
                                        "addr": {"type": "unix", "path": typo}})
            self.assertEqual(r.get("error", {}).get("desc"),
                             "Failed to connect to '%s': No such file or directory" % typo)
            self.assertEqual(q.ok("query-jobs"), [])
        finally:
            dm.quit()
        self.assertEqual(shas([img]), before)
        self.assertClean(img)

    def test_savevm_cut_stream_makes_no_snapshot(self):
        """A QEMU migration stream one byte short of its end: no snapshot,
        the disk reads as before, no cluster leaked. The state written
        while the stream was read is discarded (its clusters freed), so the
        file's bytes may differ; the guest's data and the snapshot table do
        not."""
        try:
            from migration_stream import qemu_migration_stream
            data = qemu_migration_stream(random_mib=1)
        except (ImportError, RuntimeError) as e:
            self.skipTest(str(e))
        img = self.qcow2("c.qcow2")
        self.sh("qemu-img", "snapshot", "-c", "old", img)
        ref = os.path.join(self.tmp, "ref.raw")
        self.sh("qemu-img", "convert", "-O", "raw", img, ref)
        snaps = qemu("snapshot", "-l", img).stdout
        cut = os.path.join(self.tmp, "cut")
        with open(cut, "wb") as f:
            f.write(data[:-1])
        r = vblk("savevm", "--vmstate", cut, img, "s1")
        self.assertEqual(r.rc, 1, r)
        self.assertIn("Invalid VM state stream", r.stderr)
        self.assertIn("ends early", r.stderr)
        self.assertEqual(qemu("snapshot", "-l", img).stdout, snaps)
        self.assertReadsAs(img, ref)
        self.assertClean(img)

    # -- commit, stream, mirror complete -------------------------------------
    FLUSH_ONCE = [{"event": "flush_to_disk", "errno": 5, "once": True}]
    # The first flush moves the state machine on; the second fails.
    FLUSH_SECOND = ([{"event": "flush_to_disk", "errno": 5, "state": 2}],
                    [{"event": "flush_to_disk", "state": 1, "new_state": 2}])

    @unittest.skipUnless(VBLK_SERVE, "needs vblk serve")
    def test_commit_relink_flush_fails_nothing_relinked(self):
        """block-commit of mid into base: the copy into base is flushed
        before top's header stops naming mid; that flush fails, so top
        still names mid and the chain reads as before. (QEMU 7.2 does not
        flush there: it relinks, the window vblk closes.)"""
        base, mid, top, ref = self.chain()
        before = shas([mid, top])
        dm = self.daemon(VBLK_SERVE[0][1], self.tmp)
        try:
            q = dm.qmp
            q.ok("blockdev-add", self.node("qcow2", base, "base", None, self.FLUSH_ONCE))
            q.ok("blockdev-add", self.node("qcow2", mid, "mid", "base"))
            q.ok("blockdev-add", self.node("qcow2", top, "top", "mid"))
            q.ok("block-commit", device="top", **{"job-id": "c", "top-node": "mid", "base-node": "base"})
            self.assertEqual(self.job_end(q, "c"), [("BLOCK_JOB_ERROR", "write"),
                                                    ("BLOCK_JOB_COMPLETED", "Input/output error")])
        finally:
            dm.quit()
        self.assertEqual(shas([mid, top]), before)
        self.assertEqual(self.backing_of(top), "mid.qcow2")
        self.assertReadsAs(top, ref)
        for img in (base, mid, top):
            self.assertClean(img)

    @unittest.skipUnless(VBLK_SERVE, "needs vblk serve")
    def test_stream_relink_flush_fails_backing_kept(self):
        """block-stream into top: the copied data is flushed before top's
        header drops its backing file; that flush fails: top keeps mid, the
        chain reads as before (top's own file has the copied clusters)."""
        base, mid, top, ref = self.chain()
        before = shas([base, mid])
        dm = self.daemon(VBLK_SERVE[0][1], self.tmp)
        try:
            q = dm.qmp
            q.ok("blockdev-add", self.node("qcow2", base, "base", None))
            q.ok("blockdev-add", self.node("qcow2", mid, "mid", "base"))
            q.ok("blockdev-add", self.node("qcow2", top, "top", "mid", self.FLUSH_ONCE))
            q.ok("block-stream", device="top", **{"job-id": "s"})
            self.assertEqual(self.job_end(q, "s"), [("BLOCK_JOB_ERROR", "write"),
                                                    ("BLOCK_JOB_COMPLETED", "Input/output error")])
        finally:
            dm.quit()
        self.assertEqual(shas([base, mid]), before)
        self.assertEqual(self.backing_of(top), "mid.qcow2")
        self.assertReadsAs(top, ref)
        for img in (base, mid, top):
            self.assertClean(img)

    @unittest.skipUnless(VBLK_SERVE, "needs vblk serve")
    def test_active_commit_complete_flush_fails_nothing_switched(self):
        """Active commit: ready, then block-job-complete; the last flush of
        base before the switch fails (the second flush; the first made it
        ready): the job ends with the error, top and mid untouched."""
        base, mid, top, ref = self.chain()
        before = shas([mid, top])
        inject, states = self.FLUSH_SECOND
        dm = self.daemon(VBLK_SERVE[0][1], self.tmp)
        try:
            q = dm.qmp
            q.ok("blockdev-add", self.node("qcow2", base, "base", None, inject, states))
            q.ok("blockdev-add", self.node("qcow2", mid, "mid", "base"))
            q.ok("blockdev-add", self.node("qcow2", top, "top", "mid"))
            q.ok("block-commit", device="top", **{"job-id": "a"})
            self.assertEqual(self.job_end(q, "a", complete=True),
                             [("BLOCK_JOB_READY", None), ("BLOCK_JOB_ERROR", "write"),
                              ("BLOCK_JOB_COMPLETED", "Input/output error")])
        finally:
            dm.quit()
        self.assertEqual(shas([mid, top]), before)
        self.assertEqual(self.backing_of(top), "mid.qcow2")
        self.assertReadsAs(top, ref)
        for img in (base, mid, top):
            self.assertClean(img)

    @unittest.skipUnless(VBLK_SERVE, "needs vblk serve")
    def test_mirror_complete_flush_fails_source_stays(self):
        """blockdev-mirror: the flush of the target before the switch fails;
        the export still writes the source afterwards."""
        src = self.qcow2("src.qcow2")
        tgt = os.path.join(self.tmp, "tgt.raw")
        with open(tgt, "wb") as f:
            f.truncate(8 * MiB)
        inject, states = self.FLUSH_SECOND
        sock = os.path.join(self.tmp, "nbd.sock")
        dm = self.daemon(VBLK_SERVE[0][1], self.tmp)
        try:
            q = dm.qmp
            q.ok("blockdev-add", self.node("qcow2", src, "src"))
            q.ok("blockdev-add", self.node("raw", tgt, "tgt", inject=inject, states=states))
            q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "src", "writable": True, "name": "src"})
            q.ok("blockdev-mirror", device="src", target="tgt", sync="full", **{"job-id": "m"})
            self.assertEqual(self.job_end(q, "m", complete=True),
                             [("BLOCK_JOB_READY", None), ("BLOCK_JOB_ERROR", "write"),
                              ("BLOCK_JOB_COMPLETED", "Input/output error")])
            self.assertEqual(q.ok("query-block-jobs"), [])
            uri = "nbd+unix:///src?socket=%s" % sock
            r = run([QEMU_IO, "-f", "raw", "-c", "write -P 0x77 5M 64k", uri])
            self.assertEqual(r.rc, 0, r)
        finally:
            dm.quit()
        # The guest's write went to the source: no switch happened.
        r = run([QEMU_IO, "-r", "-f", "qcow2", "-c", "read -P 0x77 5M 64k", "-c", "read -P 0x11 0 1M", src])
        self.assertNotIn("fail", r.stdout, r)
        r = run([QEMU_IO, "-r", "-f", "raw", "-c", "read -P 0 5M 64k", tgt])
        self.assertNotIn("fail", r.stdout, r)
        self.assertClean(src)

    # -- check -r ------------------------------------------------------------
    def leaky(self, name):
        """A qcow2 with one leaked cluster: the L2 entry of guest 1M zeroed."""
        img = self.qcow2(name, writes=("write -P 0x11 0 64k", "write -P 0x22 1M 64k"))
        l2 = l2_table_of(img, 0)
        with open(img, "r+b") as f:
            f.seek(l2 + 16 * 8)
            f.write(bytes(8))
        r = qemu("check", img)
        self.assertEqual(r.rc, 3, r)
        return img, l2

    def test_check_repair_locked_keeps_the_image(self):
        img, _ = self.leaky("k.qcow2")
        before = shas([img])
        with self.held(img):
            for mode in ("leaks", "all"):
                self.assertSameRefusal(["check", "-r", mode, img])
        self.assertEqual(shas([img]), before)

    def test_check_repair_read_error_in_check_pass_repairs_nothing(self):
        """The check pass before the repairs reads every L2 table: one that
        cannot be read fails the command before any repair is written.
        vblk only (QEMU's blkdebug fires no read_aio for this read)."""
        img, l2 = self.leaky("k.qcow2")
        before = shas([img])
        for mode in ("leaks", "all"):
            with self.subTest(mode=mode):
                r = vblk("check", "-r", mode, "--image-opts", blkdebug_opts(img, [("read_aio", l2 // 512)]))
                self.assertEqual(r.rc, 1, r)
                self.assertIn("Check failed", r.stderr)
                self.assertEqual(shas([img]), before)
        # Without the fault the leak is repaired.
        r = vblk("check", "-r", "leaks", img)
        self.assertEqual(r.rc, 0, r)
        self.assertClean(img)

    # -- bitmap --------------------------------------------------------------
    def inconsistent(self, img, name):
        """Leaves bitmap `name` of img in use: its writer killed."""
        self.sh("qemu-img", "bitmap", "--add", img, name)
        p = subprocess.Popen([QEMU_IO, "-f", "qcow2", img], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        p.stdin.write(b"write -P 0x55 2M 64k\n")
        p.stdin.flush()
        p.stdout.readline()
        p.stdout.readline()
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdin.close()
        p.stdout.close()
        wait_unlocked(img)

    def test_bitmap_refusals_keep_the_image(self):
        """Each action's last check before it writes: the bitmap exists
        (--remove, --clear, --merge's source), it is consistent (--clear),
        the merge source is compatible; and the lock. As qemu-img does,
        the image stays as it was."""
        img = self.qcow2("b.qcow2")
        self.sh("qemu-img", "bitmap", "--add", img, "b0")
        self.sh(QEMU_IO, "-c", "write -P 0x66 0 128k", img)
        other = self.qcow2("o.qcow2", size="16M")
        self.sh("qemu-img", "bitmap", "--add", other, "x")
        bad = self.qcow2("i.qcow2")
        self.inconsistent(bad, "b1")
        files = [other, bad]
        before = shas(files)
        view = self.view(img)
        self.assertIn("dirty:b0", view)
        cases = [["--remove", img, "nosuch"], ["--clear", img, "nosuch"],
                 ["--merge", "nosuch", img, "b0"], ["--merge", "x", "-b", other, "-F", "qcow2", img, "b0"],
                 ["--clear", bad, "b1"], ["--merge", "b1", "-b", bad, "-F", "qcow2", img, "b0"],
                 ["--disable", "--remove", img, "nosuch"]]
        for args in cases:
            with self.subTest(args=args):
                self.assertSameRefusal(["bitmap"] + args)
                self.assertEqual(shas(files), before)
                self.assertEqual(self.view(img), view)
        with self.held(img):
            before_held = shas([img])  # qemu-io marked the bitmap in use
            self.assertSameRefusal(["bitmap", "--remove", img, "b0"])
            self.assertEqual(shas([img]), before_held)
        self.assertEqual(shas(files), before)
        self.assertEqual(self.view(img), view)
        self.assertClean(img)
        self.assertClean(other)

    # -- backup --------------------------------------------------------------
    def test_backup_rename_refused_keeps_target_and_source(self):
        """The last step before a backup takes its name is the rename
        (RENAME_NOREPLACE): a file that appears at TARGET meanwhile stays,
        the partial file goes, the bitmap the backup would start is not
        left behind and the source is byte for byte as before."""
        src = self.qcow2("src.qcow2", size="32M", writes=("write -P 0x11 0 8M",))
        before = shas([src])
        target = os.path.join(self.tmp, "t.qcow2")
        p = subprocess.Popen([VBLK, "backup", "-r", "4M", "--bitmap", "b", src, target], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=_BASE_ENV)
        end = time.time() + 30
        while not os.path.exists(target + ".vblk-partial") and time.time() < end:
            time.sleep(0.01)
        with open(target, "wb") as f:
            f.write(b"squatter")
        squat = shas([target])
        _, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 1, err)
        self.assertIn(b"Could not finish the backup", err)
        self.assertFalse(os.path.exists(target + ".vblk-partial"))
        self.assertEqual(shas([target]), squat)
        r = qemu("info", "--output=json", src)
        self.assertNotIn("bitmaps", json.loads(r.stdout)["format-specific"]["data"])
        self.assertEqual(shas([src]), before)
        self.assertClean(src)

    # -- convert -n ----------------------------------------------------------
    def test_convert_n_into_smaller_target_keeps_it(self):
        src = self.qcow2("src.qcow2", size="8M")
        tq = self.qcow2("tq.qcow2", size="4M", writes=("write -P 0x99 0 1M",))
        tr = self.raw("tr.raw", 4 * MiB)
        before = shas([tq, tr])
        for args in (["convert", "-n", "-f", "qcow2", "-O", "qcow2", src, tq],
                     ["convert", "-n", "-f", "qcow2", "-O", "raw", src, tr]):
            with self.subTest(args=args):
                self.assertSameRefusal(args)
                self.assertEqual(shas([tq, tr]), before)
        with self.held(tq):
            self.assertSameRefusal(["convert", "-n", "-f", "qcow2", "-O", "qcow2", src, tq])
        self.assertEqual(shas([tq, tr]), before)
        self.assertClean(tq)


if __name__ == "__main__":
    unittest.main()
