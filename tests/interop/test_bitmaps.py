#!/usr/bin/env python3
"""Interop: named dirty bitmaps, vblk serve beside qemu-storage-daemon.

Every scenario runs against qemu-storage-daemon (QEMU 7.2) and `vblk serve`
with the same QMP commands on images made the same way at the same paths, and
asserts the same outcomes: every reply (error class and text included), the
`dirty-bitmaps` of query-named-block-nodes for the nodes the scenario named,
and the bitmaps' contents through x-debug-block-dirty-bitmap-sha256 after
writes through an NBD export.

Only the Python standard library is used.
"""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, InteropTestCase, VBLK, both, qemu, rand_bytes  # noqa: E402
from qmp_driver import Daemon  # noqa: E402  (bench/, on the path through common)

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
QEMU_IMG = shutil.which("qemu-img")
NBDINFO = shutil.which("nbdinfo")

DAEMONS = [("qemu-storage-daemon", [QSD])] if QSD else []
DAEMONS.append(("vblk serve", [VBLK, "serve"]))


def compare(a, b):
    r = subprocess.run([QEMU_IMG, "compare", "-f", "raw", "-F", "raw", a, b], capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def recorder(qmp, out):
    """c(command, **args): runs a QMP command and appends (command, args,
    reply) to `out`, the scenario's record of what the daemon answered."""
    def c(command, **args):
        out.append((command, args, qmp.cmd(command, args)))
    return c


def file_node(name, path, fmt="raw", **extra):
    n = {"driver": fmt, "node-name": name, "file": {"driver": "file", "filename": path}}
    n.update(extra)
    return n


@unittest.skipUnless(QSD and QEMU_IO, "needs qemu-storage-daemon and qemu-io")
class BitmapInteropTest(InteropTestCase):

    def setUp(self):
        super().setUp()
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            d.kill()
        super().tearDown()

    # -- helpers ----------------------------------------------------------
    def start(self, argv0):
        for p in ("qmp.sock", "nbd.sock"):
            if os.path.exists(os.path.join(self.tmp, p)):
                os.unlink(os.path.join(self.tmp, p))
        d = Daemon(argv0, os.path.join(self.tmp, "qmp.sock"), os.path.join(self.tmp, "daemon.log"))
        self.daemons.append(d)
        return d

    def stop(self, d):
        d.quit()
        self.daemons.remove(d)

    def images(self):
        """Fresh images at the same paths for each daemon."""
        paths = {}
        for name, fmt, size, opts in (("a", "raw", 4 * MiB, None), ("c", "raw", 8 * MiB, None),
                                      ("q", "qcow2", 4 * MiB, None), ("q512", "qcow2", 4 * MiB, "cluster_size=512"),
                                      ("q2m", "qcow2", 8 * MiB, "cluster_size=2M")):
            p = os.path.join(self.tmp, "%s.%s" % (name, fmt))
            if os.path.exists(p):
                os.unlink(p)
            args = ["create", "-q", "-f", fmt] + (["-o", opts] if opts else []) + [p, str(size)]
            r = qemu(*args)
            self.assertEqual(r.rc, 0, r)
            paths[name] = (p, fmt)
        with open(paths["a"][0], "r+b") as f:
            f.write(rand_bytes(MiB, "bitmaps"))
        return paths

    def bitmaps(self, d, names):
        """{node-name: named dirty-bitmaps or None} for the named nodes.
        QEMU also lists its internal anonymous bitmaps (a backup's successor
        and block-copy bitmap); vblk keeps those out of the list, so only
        named ones are compared."""
        out = {}
        for n in d.qmp.ok("query-named-block-nodes", {"flat": True}):
            if n["node-name"] in names:
                named = [b for b in n.get("dirty-bitmaps", []) if "name" in b]
                out[n["node-name"]] = named or None
        return out

    def both(self, scenario):
        """Runs scenario(daemon) for each daemon; asserts equal outcomes."""
        results = []
        for label, argv0 in DAEMONS:
            self.images()
            d = self.start(argv0)
            try:
                results.append((label, scenario(d)))
            finally:
                if d in self.daemons:
                    self.stop(d)
        if len(results) == 2:
            self.assertEqual(results[1][1], results[0][1], "vblk serve differs from qemu-storage-daemon")
        return results[0][1]

    def io(self, *cmds):
        """qemu-io commands against the NBD export `exp`."""
        argv = [QEMU_IO, "-f", "raw"]
        for c in cmds:
            argv += ["-c", c]
        argv.append("nbd+unix:///exp?socket=%s" % os.path.join(self.tmp, "nbd.sock"))
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r)
        self.assertNotIn("error", r.stdout + r.stderr, r)

    # -- scenarios --------------------------------------------------------
    def test_add_remove_and_errors(self):
        def scenario(d):
            out = []

            c = recorder(d.qmp, out)

            for name, (path, fmt) in sorted(self.images().items()):
                c("blockdev-add", **file_node(name, path, fmt))
            c("block-dirty-bitmap-add", node="a", name="b0")
            c("block-dirty-bitmap-add", node="a", name="b0")
            c("block-dirty-bitmap-add", node="a", name="")
            c("block-dirty-bitmap-add", node="nope", name="x")
            c("block-dirty-bitmap-add", node="a", name="g", granularity=100)
            c("block-dirty-bitmap-add", node="a", name="g", granularity=256)
            c("block-dirty-bitmap-add", node="a", name="g", granularity=2 ** 32)
            c("block-dirty-bitmap-add", node="a", name="g", granularity=-1)
            c("block-dirty-bitmap-add", node="a", name="g", granularity=2 ** 31)
            c("block-dirty-bitmap-add", node="a", name="s", granularity=512, disabled=True)
            c("block-dirty-bitmap-add", node="a", name="x" * 1024)
            c("block-dirty-bitmap-add", node="a", name="y" * 1023)
            c("block-dirty-bitmap-add", node="a", name="p", persistent=True)
            c("block-dirty-bitmap-add", node="a", name="z", foo=1)
            c("block-dirty-bitmap-add", node="a")
            c("block-dirty-bitmap-add", node="a", name=5)
            c("block-dirty-bitmap-add", node="a", name="d", disabled="yes")
            # Default granularity: the cluster size (at least 4 KiB), 64 KiB without one.
            c("block-dirty-bitmap-add", node="q", name="dq")
            c("block-dirty-bitmap-add", node="q512", name="dq")
            c("block-dirty-bitmap-add", node="q2m", name="dq")
            c("block-dirty-bitmap-add", node="c", name="dc", disabled=False, persistent=False)
            for verb in ("remove", "clear", "enable", "disable"):
                c("block-dirty-bitmap-" + verb, node="a", name="zz")
                c("block-dirty-bitmap-" + verb, node="zz", name="zz")
                c("block-dirty-bitmap-" + verb, node="a")
            c("block-dirty-bitmap-disable", node="a", name="b0")
            c("block-dirty-bitmap-disable", node="a", name="b0")
            c("block-dirty-bitmap-enable", node="a", name="s")
            c("block-dirty-bitmap-enable", node="a", name="s")
            c("block-dirty-bitmap-clear", node="a", name="s")
            out.append(self.bitmaps(d, {"a", "c", "q", "q512", "q2m"}))
            c("block-dirty-bitmap-remove", node="a", name="y" * 1023)
            c("block-dirty-bitmap-remove", node="a", name="g")
            c("block-dirty-bitmap-remove", node="a", name="g")
            c("block-dirty-bitmap-remove", node="c", name="dc")
            out.append(self.bitmaps(d, {"a", "c"}))
            c("x-debug-block-dirty-bitmap-sha256", node="a", name="b0")
            c("x-debug-block-dirty-bitmap-sha256", node="a", name="s")
            c("x-debug-block-dirty-bitmap-sha256", node="a", name="zz")
            return out

        self.both(scenario)

    def test_merge_validation(self):
        def scenario(d):
            out = []

            c = recorder(d.qmp, out)

            for name, (path, fmt) in sorted(self.images().items()):
                c("blockdev-add", **file_node(name, path, fmt))
            c("block-dirty-bitmap-add", node="a", name="b0")
            c("block-dirty-bitmap-add", node="q", name="qb")
            c("block-dirty-bitmap-add", node="c", name="cb")
            c("block-dirty-bitmap-merge", node="a", target="zz", bitmaps=["b0"])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=["zz"])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=[{"node": "q", "name": "zz"}])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=[{"node": "qq", "name": "zz"}])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=[{"node": "q", "name": "qb"}])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=[{"node": "c", "name": "cb"}])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=[{"node": "q"}])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=[{"node": "q", "name": "qb", "x": 1}])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=["b0", 5])
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps="b0")
            c("block-dirty-bitmap-merge", node="a", target="b0", bitmaps=["b0"])
            c("block-dirty-bitmap-merge", node="a", target="b0")
            return out

        self.both(scenario)

    def test_writes_through_nbd_export_mark(self):
        """Writes, write-zeroes and discards through an NBD export mark the
        node's enabled bitmaps; clear, disable, enable and merge act on them."""
        def scenario(d):
            out = []
            paths = self.images()
            q = d.qmp
            q.ok("blockdev-add", file_node("a", paths["a"][0], discard="unmap"))
            q.ok("blockdev-add", file_node("c", paths["c"][0]))
            q.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "a", "name": "exp", "writable": True})
            q.ok("block-dirty-bitmap-add", {"node": "a", "name": "b64k"})
            q.ok("block-dirty-bitmap-add", {"node": "a", "name": "b512", "granularity": 512})
            q.ok("block-dirty-bitmap-add", {"node": "a", "name": "off", "disabled": True})
            q.ok("block-dirty-bitmap-add", {"node": "c", "name": "other"})

            def snap(label):
                hashes = {n: q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "a", "name": n})["sha256"]
                          for n in ("b64k", "b512", "off")}
                out.append((label, self.bitmaps(d, {"a", "c"}), hashes))

            snap("clean")
            self.io("write -P 1 0 4k", "write -P 2 70000 100", "write -P 3 1M 1M",
                    "write -z 3M 64k", "write -z 2M 1000", "discard 3276800 66000", "read 2M 64k")
            snap("written")
            q.ok("block-dirty-bitmap-clear", {"node": "a", "name": "b64k"})
            q.ok("block-dirty-bitmap-disable", {"node": "a", "name": "b512"})
            q.ok("block-dirty-bitmap-enable", {"node": "a", "name": "off"})
            self.io("write -P 4 512k 8k", "write -P 5 4194000 304")
            snap("after clear/disable/enable")
            q.ok("block-dirty-bitmap-merge", {"node": "a", "target": "off", "bitmaps": ["b512", "b64k"]})
            q.ok("block-dirty-bitmap-add", {"node": "a", "name": "fine", "granularity": 4096})
            q.ok("block-dirty-bitmap-merge", {"node": "a", "target": "fine", "bitmaps": [{"node": "a", "name": "off"}]})
            out.append(q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "a", "name": "fine"}))
            snap("merged")
            q.ok("block-export-del", {"id": "e"})
            return out

        self.both(scenario)

    # -- persistent bitmaps in qcow2 ---------------------------------------
    def qcow2_info(self, path):
        r = qemu("info", "--output=json", "-f", "qcow2", path)
        self.assertEqual(r.rc, 0, r)
        return json.loads(r.stdout)["format-specific"]["data"].get("bitmaps")

    def qcow2_check(self, path):
        r = qemu("check", "--output=json", "-f", "qcow2", path)
        self.assertEqual(r.rc, 0, r)
        c = json.loads(r.stdout)
        return {k: c.get(k, 0) for k in ("corruptions", "leaks", "check-errors")}

    def test_persistent_bitmaps_stored_on_close(self):
        """Persistent bitmaps are stored at quit, show in qemu-img info, pass
        qemu-img check and load again with the same contents."""
        def scenario(d):
            out = []
            q = d.qmp
            path = self.images()["q"][0]
            v2 = os.path.join(self.tmp, "v2.qcow2")
            if os.path.exists(v2):
                os.unlink(v2)
            self.assertEqual(qemu("create", "-q", "-f", "qcow2", "-o", "compat=0.10", v2, "4M").rc, 0)

            c = recorder(q, out)

            c("blockdev-add", **file_node("q", path, "qcow2"))
            c("blockdev-add", **file_node("v2", v2, "qcow2"))
            c("block-dirty-bitmap-add", node="v2", name="p", persistent=True)
            c("block-dirty-bitmap-add", node="q", name="p1", persistent=True)
            c("block-dirty-bitmap-add", node="q", name="p2", persistent=True, granularity=4096, disabled=True)
            c("block-dirty-bitmap-add", node="q", name="p3", persistent=True, granularity=2 ** 31)
            c("block-dirty-bitmap-add", node="q", name="gone", persistent=True)
            c("block-dirty-bitmap-add", node="q", name="t")
            c("block-dirty-bitmap-add", node="q", name="x" * 1024, persistent=True)
            q.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "q", "name": "exp", "writable": True})
            self.io("write -P 1 0 4k", "write -P 2 1M 100k", "write -z 3M 64k")
            c("block-dirty-bitmap-enable", node="q", name="p2")
            self.io("write -P 3 2M 8k")
            c("block-dirty-bitmap-remove", node="q", name="gone")
            hashes = {n: q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "q", "name": n})["sha256"]
                      for n in ("p1", "p2", "p3")}
            out.append(("before", self.bitmaps(d, {"q"}), hashes))
            q.ok("block-export-del", {"id": "e"})
            self.stop(d)
            out.append(("info", self.qcow2_info(path)))
            out.append(("check", self.qcow2_check(path)))
            # Loaded again: the same bitmaps, contents and flags.
            d2 = self.start(d.argv[:len(d.argv) - 4])
            q2 = d2.qmp
            q2.ok("blockdev-add", file_node("q", path, "qcow2"))
            out.append(("info while open", self.qcow2_info_shared(path)))
            hashes2 = {n: q2.ok("x-debug-block-dirty-bitmap-sha256", {"node": "q", "name": n})["sha256"]
                       for n in ("p1", "p2", "p3")}
            out.append(("loaded", self.bitmaps(d2, {"q"}), hashes2 == hashes))
            out.append(q2.cmd("block-dirty-bitmap-add", {"node": "q", "name": "p1", "persistent": True}))
            out.append(q2.cmd("block-dirty-bitmap-remove", {"node": "q", "name": "p3"}))
            self.stop(d2)
            out.append(("info after remove", self.qcow2_info(path)))
            out.append(("check after remove", self.qcow2_check(path)))
            self.daemons.append(d)  # both() stops it: already gone
            return out

        self.both(scenario)

    def qcow2_info_shared(self, path):
        r = qemu("info", "-U", "--output=json", "-f", "qcow2", path)
        self.assertEqual(r.rc, 0, r)
        return json.loads(r.stdout)["format-specific"]["data"].get("bitmaps")

    def test_bitmaps_from_qemu_img_and_qemu_io_load(self):
        """Bitmaps made by qemu-img bitmap and dirtied by qemu-io load with the
        same extents; an in-use bitmap (a daemon killed) is inconsistent."""
        src = os.path.join(self.tmp, "src.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", src, "8M").rc, 0)
        for args in (["--add", src, "b0"], ["--add", "-g", "4096", src, "b1"], ["--add", "--disable", src, "b2"],
                     ["--add", "-g", "512", src, "b3"]):
            r = qemu("bitmap", *args)
            self.assertEqual(r.rc, 0, r)
        r = subprocess.run([QEMU_IO, "-f", "qcow2", "-c", "write -P 1 100k 300k", "-c", "write -z 5M 1M",
                            "-c", "write -P 2 8388000 100", src], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r)
        # The same image with b0 left in use: a daemon killed while it was open.
        crashed = os.path.join(self.tmp, "crashed.qcow2")
        shutil.copy(src, crashed)
        d = self.start([QSD])
        d.qmp.ok("blockdev-add", file_node("c", crashed, "qcow2"))
        d.kill()
        d.qmp.close()
        self.daemons.remove(d)
        self.assertEqual([b["flags"] for b in self.qcow2_info(crashed)].count(["in-use", "auto"]), 3)

        def scenario(d):
            out = []
            work = os.path.join(self.tmp, "work.qcow2")
            work_c = os.path.join(self.tmp, "work-crashed.qcow2")
            shutil.copy(src, work)
            shutil.copy(crashed, work_c)
            q = d.qmp
            q.ok("blockdev-add", file_node("w", work, "qcow2"))
            q.ok("blockdev-add", file_node("c", work_c, "qcow2"))
            out.append(self.bitmaps(d, {"w", "c"}))
            out.append({n: q.cmd("x-debug-block-dirty-bitmap-sha256", {"node": "w", "name": n})
                        for n in ("b0", "b1", "b2", "b3")})
            out.append(("info while open", self.qcow2_info_shared(work)))
            for verb in ("clear", "enable", "disable"):
                out.append(q.cmd("block-dirty-bitmap-" + verb, {"node": "c", "name": "b0"}))
            q.ok("block-dirty-bitmap-add", {"node": "c", "name": "m"})
            out.append(q.cmd("block-dirty-bitmap-merge", {"node": "c", "target": "m", "bitmaps": ["b0"]}))
            out.append(q.cmd("block-dirty-bitmap-merge", {"node": "c", "target": "b0", "bitmaps": ["m"]}))
            out.append(q.cmd("block-dirty-bitmap-remove", {"node": "c", "name": "b0"}))
            self.stop(d)
            self.daemons.append(d)
            out.append(("info", self.qcow2_info(work), self.qcow2_info(work_c)))
            out.append(("check", self.qcow2_check(work), self.qcow2_check(work_c)))
            return out

        self.both(scenario)

    def test_info_shows_bitmaps_like_qemu_img(self):
        img = os.path.join(self.tmp, "i.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", img, "8M").rc, 0)
        for args in (["--add", img, "b0"], ["--add", "-g", "4096", "--disable", img, "second"]):
            self.assertEqual(qemu("bitmap", *args).rc, 0)
        for fmt in ("human", "json"):
            v, q = both("info", "--output=" + fmt, "-f", "qcow2", img)
            self.assertSameResult(v, q)

    # -- blockdev-backup with bitmaps ----------------------------------------
    def backup_images(self):
        paths = {}
        for name, size in (("s", 16 * MiB), ("t", 16 * MiB), ("inc", 16 * MiB), ("t2", 8 * MiB)):
            p = os.path.join(self.tmp, name + ".raw")
            with open(p, "wb") as f:
                f.truncate(size)
            paths[name] = p
        with open(paths["s"], "r+b") as f:
            for i in range(0, 16 * MiB, 2 * MiB):
                f.seek(i)
                f.write(rand_bytes(MiB, "bk-%d" % i))
        return paths

    def test_backup_bitmap_validation(self):
        def scenario(d):
            out = []
            p = self.backup_images()

            c = recorder(d.qmp, out)

            for n in ("s", "t", "t2"):
                c("blockdev-add", **file_node(n, p[n]))
            c("block-dirty-bitmap-add", node="s", name="b")
            c("block-dirty-bitmap-add", node="t", name="other")
            B = {"device": "s", "target": "t", "job-id": "j"}
            c("blockdev-backup", sync="bitmap", **B)
            c("blockdev-backup", sync="incremental", **B)
            c("blockdev-backup", sync="incremental", bitmap="b", **{"bitmap-mode": "never"}, **B)
            c("blockdev-backup", sync="incremental", bitmap="zz", **B)
            c("blockdev-backup", sync="incremental", bitmap="other", **B)
            c("blockdev-backup", sync="bitmap", bitmap="b", **B)
            c("blockdev-backup", sync="none", bitmap="b", **{"bitmap-mode": "always"}, **B)
            c("blockdev-backup", sync="full", bitmap="b", **{"bitmap-mode": "never"}, **B)
            c("blockdev-backup", sync="top", bitmap="b", **{"bitmap-mode": "never"}, **B)
            c("blockdev-backup", sync="full", **{"bitmap-mode": "never"}, **B)
            c("blockdev-backup", sync="bitmap", bitmap="b", **{"bitmap-mode": "bogus"}, **B)
            c("blockdev-backup", sync="bitmap", bitmap="b", **{"bitmap-mode": "never"},
              device="s", target="t2", **{"job-id": "j"})
            out.append(self.bitmaps(d, {"s"}))
            return out

        self.both(scenario)

    def test_incremental_backup_copies_only_dirty_clusters(self):
        """A full backup that starts bitmap b, writes through an NBD export,
        then an incremental backup into an empty target: it holds exactly the
        dirty clusters, and full + incremental equals the source."""
        def scenario(d):
            out = []
            p = self.backup_images()
            q = d.qmp
            for n in ("s", "t", "inc"):
                q.ok("blockdev-add", file_node(n, p[n]))
            q.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "s", "name": "exp", "writable": True})
            q.ok("block-dirty-bitmap-add", {"node": "s", "name": "b"})
            self.io("write -P 9 3M 4k")  # before the full backup: not in the increment
            q.ok("blockdev-backup", {"device": "s", "target": "t", "job-id": "full", "sync": "full",
                                     "bitmap": "b", "bitmap-mode": "on-success"})
            e, _ = q.next_event({"BLOCK_JOB_COMPLETED"}, 60)
            out.append(("full", e["data"], self.bitmaps(d, {"s"})))
            self.io("write -P 7 0 4k", "write -P 8 5M 200k", "write -z 9M 64k", "write -P 6 16773120 4096")
            out.append(("dirty", self.bitmaps(d, {"s"}),
                        q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "s", "name": "b"})))
            q.ok("blockdev-backup", {"device": "s", "target": "inc", "job-id": "inc", "sync": "incremental",
                                     "bitmap": "b"})
            e, _ = q.next_event({"BLOCK_JOB_COMPLETED"}, 60)
            out.append(("incremental", e["data"], self.bitmaps(d, {"s"})))
            # A second increment with nothing written: nothing to copy.
            q.ok("blockdev-backup", {"device": "s", "target": "inc", "job-id": "inc2", "sync": "bitmap",
                                     "bitmap": "b", "bitmap-mode": "never"})
            e, _ = q.next_event({"BLOCK_JOB_COMPLETED"}, 60)
            out.append(("empty increment", e["data"]))
            q.ok("block-export-del", {"id": "e"})
            self.stop(d)
            # The increment holds the dirty clusters only, with the source's data.
            r = qemu("map", "--output=json", "-f", "raw", p["inc"])
            out.append(("inc map", [(m["start"], m["length"], m["data"]) for m in json.loads(r.stdout)]))
            with open(p["inc"], "rb") as f:
                inc = f.read()
            with open(p["s"], "rb") as f:
                src = f.read()
            for start, length in ((0, 64 * 1024), (5 * MiB, 256 * 1024), (16 * MiB - 64 * 1024, 64 * 1024)):
                self.assertEqual(inc[start:start + length], src[start:start + length])
            # Full, then the increment on top: the source.
            with open(p["t"], "r+b") as f:
                for m in json.loads(r.stdout):
                    if m["data"]:
                        f.seek(m["start"])
                        f.write(inc[m["start"]:m["start"] + m["length"]])
            out.append(("restored", compare(p["s"], p["t"])))
            return out

        self.both(scenario)

    def test_backup_cancel_and_never_keep_the_bitmap(self):
        """A cancelled on-success job and a finished `never` job leave the
        bitmap with its old bits plus the writes made meanwhile."""
        def scenario(d):
            out = []
            p = self.backup_images()
            q = d.qmp
            for n in ("s", "t"):
                q.ok("blockdev-add", file_node(n, p[n]))
            q.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "s", "name": "exp", "writable": True})
            q.ok("block-dirty-bitmap-add", {"node": "s", "name": "b"})
            self.io("write -P 1 1M 64k", "write -P 2 7M 1k")
            before = q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "s", "name": "b"})
            q.ok("blockdev-backup", {"device": "s", "target": "t", "job-id": "j", "sync": "bitmap",
                                     "bitmap": "b", "bitmap-mode": "on-success", "speed": 1})
            out.append(("running", self.bitmaps(d, {"s"})))
            for verb, args in (("remove", {}), ("clear", {}), ("enable", {}), ("disable", {})):
                out.append(q.cmd("block-dirty-bitmap-" + verb, dict(node="s", name="b", **args)))
            out.append(q.cmd("block-dirty-bitmap-merge", {"node": "s", "target": "b", "bitmaps": ["b"]}))
            out.append(q.cmd("blockdev-backup", {"device": "s", "target": "t", "job-id": "j2", "sync": "bitmap",
                                                 "bitmap": "b", "bitmap-mode": "always"}))
            self.io("write -P 3 12M 4k")
            q.ok("block-job-cancel", {"device": "j", "force": True})
            q.next_event({"BLOCK_JOB_CANCELLED"}, 60)
            out.append(("cancelled", self.bitmaps(d, {"s"}),
                        q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "s", "name": "b"}) != before))
            q.ok("block-dirty-bitmap-add", {"node": "s", "name": "want"})
            q.ok("block-dirty-bitmap-disable", {"node": "s", "name": "want"})
            q.ok("block-dirty-bitmap-merge", {"node": "s", "target": "want", "bitmaps": ["b"]})
            q.ok("blockdev-backup", {"device": "s", "target": "t", "job-id": "n", "sync": "bitmap",
                                     "bitmap": "b", "bitmap-mode": "never"})
            q.next_event({"BLOCK_JOB_COMPLETED"}, 60)
            out.append(("never", q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "s", "name": "b"}) ==
                        q.ok("x-debug-block-dirty-bitmap-sha256", {"node": "s", "name": "want"})))
            q.ok("blockdev-backup", {"device": "s", "target": "t", "job-id": "a", "sync": "full",
                                     "bitmap": "b", "bitmap-mode": "always"})
            q.next_event({"BLOCK_JOB_COMPLETED"}, 60)
            out.append(("always", self.bitmaps(d, {"s"})))
            q.ok("block-export-del", {"id": "e"})
            return out

        self.both(scenario)

    def test_copy_before_write_filter_with_bitmap(self):
        """A copy-before-write filter with `bitmap` copies old data only for
        the clusters that bitmap has dirty."""
        def scenario(d):
            out = []
            p = self.backup_images()
            q = d.qmp
            for n in ("s", "t", "t2"):
                q.ok("blockdev-add", file_node(n, p[n]))
            q.ok("block-dirty-bitmap-add", {"node": "s", "name": "b", "disabled": True})
            q.ok("block-dirty-bitmap-add", {"node": "t2", "name": "small"})
            cbw = {"driver": "copy-before-write", "node-name": "f", "file": "s", "target": "t"}
            for bad in ({"node": "zz", "name": "b"}, {"node": "s", "name": "zz"}, {"node": "t2", "name": "small"}):
                out.append(q.cmd("blockdev-add", dict(cbw, bitmap=bad)))
            # Clusters 1 and 5 (and part of 9) are to be copied before writes.
            q.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}}})
            q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "s", "name": "exp", "writable": True})
            q.ok("block-dirty-bitmap-enable", {"node": "s", "name": "b"})
            self.io("write -P 1 64k 4k", "write -P 2 320k 64k", "write -P 3 589824 1")
            q.ok("block-dirty-bitmap-disable", {"node": "s", "name": "b"})
            q.ok("block-export-del", {"id": "e0"})
            q.next_event({"BLOCK_EXPORT_DELETED"}, 30)
            out.append(q.cmd("blockdev-add", dict(cbw, bitmap={"node": "s", "name": "b"})))
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "f", "name": "exp", "writable": True})
            self.io("write -P 4 0 1M")
            q.ok("block-export-del", {"id": "e"})
            q.next_event({"BLOCK_EXPORT_DELETED"}, 30)
            self.stop(d)
            r = qemu("map", "--output=json", "-f", "raw", p["t"])
            out.append([(m["start"], m["length"], m["data"]) for m in json.loads(r.stdout)])
            with open(p["t"], "rb") as f:
                out.append(hashlib.sha256(f.read()).hexdigest())
            return out

        self.both(scenario)


    def test_killed_daemon_leaves_bitmaps_in_use_and_image_clean(self):
        """kill -9 while a qcow2 with bitmaps is open read-write: the stored
        bitmaps stay in_use (inconsistent next time), bitmaps added since are
        not stored, and qemu-img check finds the image clean; vblk check
        agrees with qemu-img check."""
        src = os.path.join(self.tmp, "src.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", src, "8M").rc, 0)
        self.assertEqual(qemu("bitmap", "--add", src, "b0").rc, 0)
        r = subprocess.run([QEMU_IO, "-f", "qcow2", "-c", "write -P 1 1M 64k", src], capture_output=True)
        self.assertEqual(r.returncode, 0, r)

        def scenario(d):
            out = []
            img = os.path.join(self.tmp, "k.qcow2")
            shutil.copy(src, img)
            q = d.qmp
            q.ok("blockdev-add", file_node("k", img, "qcow2"))
            q.ok("block-dirty-bitmap-add", {"node": "k", "name": "new", "persistent": True})
            q.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "k", "name": "exp", "writable": True})
            self.io("write -P 2 3M 128k", "flush")
            d.kill()
            d.qmp.close()
            self.daemons.remove(d)
            out.append(("info", self.qcow2_info(img)))
            out.append(("check", self.qcow2_check(img)))
            v, qi = both("check", "--output=json", "-f", "qcow2", img)
            out.append(("vblk check", v.rc == qi.rc, v.stdout == qi.stdout))
            d2 = self.start(d.argv[:len(d.argv) - 4])
            d2.qmp.ok("blockdev-add", file_node("k", img, "qcow2"))
            out.append(("reopened", self.bitmaps(d2, {"k"})))
            self.stop(d2)
            return out

        self.both(scenario)


    @unittest.skipUnless(NBDINFO, "needs nbdinfo")
    def test_nbd_export_offers_dirty_bitmap_context(self):
        """block-export-add `bitmaps`: the qemu:dirty-bitmap:NAME context
        lists and maps the bitmap's dirty extents (nbdinfo reads both)."""
        def scenario(d):
            out = []
            p = self.backup_images()
            q = d.qmp
            sock = os.path.join(self.tmp, "nbd.sock")
            q.ok("blockdev-add", file_node("s", p["s"]))
            q.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": sock}}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "s", "name": "exp", "writable": True})
            q.ok("block-dirty-bitmap-add", {"node": "s", "name": "b", "granularity": 4096})
            q.ok("block-dirty-bitmap-add", {"node": "s", "name": "c"})
            self.io("write -P 1 0 4k", "write -P 2 1M 100k", "write -P 3 16773120 4096")
            ro = {"type": "nbd", "id": "r", "node-name": "s", "name": "ro"}
            for bad in (["zz"], ["b", 5], [{"node": "s"}], [{"node": "zz", "name": "b"}], [{"node": "s", "name": "zz"}],
                        ["b"]):
                out.append(q.cmd("block-export-add", dict(ro, bitmaps=bad)))
            q.ok("block-dirty-bitmap-disable", {"node": "s", "name": "b"})
            out.append(q.cmd("block-export-add", dict(ro, bitmaps=["b"])))
            out.append(q.cmd("block-export-add", {"type": "nbd", "id": "w", "node-name": "s", "name": "rw",
                                                  "writable": True, "bitmaps": ["c", "b"]}))
            out.append(q.cmd("block-export-add", {"type": "nbd", "id": "w2", "node-name": "s", "name": "rw2",
                                                  "writable": True, "bitmaps": [{"node": "s", "name": "c"}]}))
            for exp, ctx in (("ro", "qemu:dirty-bitmap:b"), ("rw", "qemu:dirty-bitmap:c"),
                             ("rw2", "qemu:dirty-bitmap:c"), ("rw2", "base:allocation"), ("rw2", "qemu:dirty-bitmap:b")):
                uri = "nbd+unix:///%s?socket=%s" % (exp, sock)
                r = subprocess.run([NBDINFO, "--map=" + ctx, uri], capture_output=True, text=True, timeout=60)
                out.append((exp, ctx, r.returncode, r.stdout))
            r = subprocess.run([NBDINFO, "--list", "--json", "nbd+unix:///?socket=%s" % sock],
                               capture_output=True, text=True, timeout=60)
            out.append(sorted((e["export-name"], sorted(e.get("contexts", [])))
                              for e in json.loads(r.stdout)["exports"]))
            out.append(self.bitmaps(d, {"s"}))
            for e in ("e", "r", "w", "w2"):
                if "return" in q.cmd("block-export-del", {"id": e}):
                    q.next_event({"BLOCK_EXPORT_DELETED"}, 30)
            out.append(self.bitmaps(d, {"s"}))  # no longer busy
            return out

        self.both(scenario)



def _bitmap_dir(path):
    """(directory offset, size, nb_bitmaps, header-extension offset) of a
    qcow2 image's bitmaps extension."""
    with open(path, "rb") as f:
        h = f.read(65536)
    off = struct.unpack_from(">I", h, 100)[0]
    while off + 8 <= len(h):
        t, n = struct.unpack_from(">II", h, off)
        if t == 0:
            break
        if t == 0x23852875:
            nb, _, size, where = struct.unpack_from(">IIQQ", h, off + 8)
            return where, size, nb, off + 8
        off += 8 + (n + 7) // 8 * 8
    raise AssertionError("no bitmaps extension in " + path)


def _patch(path, off, fmt, value):
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(struct.pack(fmt, value))


def _entry_field(field):
    """A damage: sets a field of the first bitmap directory entry."""
    off, fmt = {"table_offset": (0, ">Q"), "table_size": (8, ">I"), "flags": (12, ">I"), "type": (16, ">B"),
                "granularity_bits": (17, ">B"), "name_size": (18, ">H"), "extra_data_size": (20, ">I")}[field]

    def damage(path, value):
        where = _bitmap_dir(path)[0]
        _patch(path, where + off, fmt, value)
    return damage


def _first_table_entry(path, value):
    where = _bitmap_dir(path)[0]
    with open(path, "rb") as f:
        f.seek(where)
        table = struct.unpack(">Q", f.read(8))[0]
    _patch(path, table, ">Q", value)


def _nb_bitmaps(path, value):
    _patch(path, _bitmap_dir(path)[3], ">I", value)


class BitmapConstraintsTest(InteropTestCase):
    """iotest 242 and QEMU's check_dir_entry / bitmap_table_load /
    load_bitmap_data: a bitmap directory entry that breaks the format's
    constraints makes the image fail to open, with QEMU's message, for
    `info` and for a read; neither tool writes anything to such an image."""

    CASES = [
        ("unknown_flag", _entry_field("flags"), 2 | 4),
        ("granularity_8", _entry_field("granularity_bits"), 8),
        ("granularity_32", _entry_field("granularity_bits"), 32),
        ("type_2", _entry_field("type"), 2),
        ("table_size_0", _entry_field("table_size"), 0),
        ("table_size_big", _entry_field("table_size"), 0x8000001),
        ("table_size_2", _entry_field("table_size"), 2),     # the disk needs 1: refused at load
        ("table_offset_0", _entry_field("table_offset"), 0),
        ("table_offset_unaligned", _entry_field("table_offset"), 0x30200),
        ("extra_data", _entry_field("extra_data_size"), 8),
        ("table_entry_reserved", _first_table_entry, 1 << 60),
        ("table_entry_all_ones_with_offset", _first_table_entry, 0x50000 | 1),
        ("table_entry_unaligned", _first_table_entry, 0x50200),
        ("nb_bitmaps_more", _nb_bitmaps, 3),
        ("nb_bitmaps_less", _nb_bitmaps, 1),
    ]

    def _image(self, d):
        img = os.path.join(d, "img.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", img, "1M").rc, 0)
        for args in (["--add", "-g", "16k", img, "bitmap-0"], ["--add", img, "bitmap-1"]):
            r = qemu("bitmap", *args)
            self.assertEqual(r.rc, 0, r)
        r = subprocess.run([QEMU_IO, "-c", "write -P 1 0 64k", img], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r)
        return img

    @unittest.skipUnless(QEMU_IO, "needs qemu-io")
    def test_broken_entries_refused(self):
        good = self._image(self.tmp)
        for name, damage, value in self.CASES:
            with self.subTest(case=name):
                img = os.path.join(self.tmp, name + ".qcow2")
                shutil.copy(good, img)
                damage(img, value)
                with open(img, "rb") as f:
                    before = f.read()
                v, q = both("info", "-f", "qcow2", img)
                self.assertNotEqual(q.rc, 0, q)
                self.assertSameResult(v, q)
                rv = subprocess.run([VBLK, "io", "-f", "qcow2", "-c", "read 0 512", img],
                                    capture_output=True, text=True)
                rq = subprocess.run([QEMU_IO, "-f", "qcow2", "-c", "read 0 512", img],
                                    capture_output=True, text=True)
                self.assertNotEqual(rq.returncode, 0, rq)
                self.assertEqual(rv.returncode, rq.returncode, (rv, rq))
                self.assertEqual(rv.stderr.replace("vblk:", "qemu-io:").replace(VBLK, "qemu-io"), rq.stderr)
                with open(img, "rb") as f:
                    self.assertEqual(f.read(), before, "the image was written to")

    @unittest.skipUnless(QEMU_IO, "needs qemu-io")
    def test_good_entries_still_load(self):
        img = self._image(self.tmp)
        v, q = both("info", "--output=json", "-f", "qcow2", img)
        self.assertEqual(q.rc, 0, q)
        self.assertSameResult(v, q)


if __name__ == "__main__":
    unittest.main()
