"""The rbd driver against QEMU's (qemu-block-extra) on a throwaway cluster.

One single-OSD cluster (tests/interop/ceph_cluster.py: memstore, no cephx)
serves every test of this file. Images written by vblk read identically
through qemu-img and vice versa; `map`, `info` and the errors for a bad
pool, image or conf file read as qemu-img's.

Skipped, saying why, only when the Ceph daemons are not installed.
"""

import json
import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (VBLK, InteropTestCase, MiB, both, end_process, qemu, rand_bytes, storage_daemons,  # noqa: E402
                    vblk, wait_for_socket)
import ceph_cluster  # noqa: E402

CLUSTER = None


def setUpModule():
    global CLUSTER
    if ceph_cluster.skip_reason():
        return
    CLUSTER = ceph_cluster.CephCluster(osds=1, memstore_mib=256)
    CLUSTER.start()


def tearDownModule():
    if CLUSTER:
        CLUSTER.stop()


def write_pattern(path, size, pieces):
    """A sparse local file with data at the given (offset, length, seed)."""
    with open(path, "wb") as f:
        f.truncate(size)
        for off, n, seed in pieces:
            f.seek(off)
            f.write(rand_bytes(n, seed))


PIECES = [(0, 64 * 1024, 1), (5 * MiB + 4096, 300 * 1024, 2), (13 * MiB, 1 * MiB, 3)]


class RbdTest(ceph_cluster.NeedsCluster, InteropTestCase):
    def spec(self, image):
        return CLUSTER.spec(image)

    def local(self, name, size=16 * MiB, pieces=PIECES):
        p = os.path.join(self.tmp, name)
        write_pattern(p, size, pieces)
        return p

    def assertSameFile(self, a, b):
        with open(a, "rb") as fa, open(b, "rb") as fb:
            self.assertTrue(fa.read() == fb.read(), "%s and %s differ" % (a, b))

    # ---- create / info
    def test_create_and_info_read_as_qemu_img(self):
        img = self.name("create")
        v = vblk("create", "-f", "raw", self.spec(img), "10000")
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(v.stdout, "Formatting '%s', fmt=raw size=10000\n" % self.spec(img))
        for args in (["info"], ["info", "--output=json"], ["info", "-f", "raw"]):
            v, q = both(*(args + [self.spec(img)]))
            self.assertSameResult(v, q, str(args))
        self.assertIn('"driver": "rbd"', v.stdout)
        self.assertIn("virtual size: 10 KiB (10240 bytes)", v.stdout)
        # The same name again: librbd's EEXIST, worded as qemu-img words it.
        v = vblk("create", "-f", "raw", self.spec(img), "1M")
        q = qemu("create", "-f", "raw", self.spec(img), "1M")
        self.assertNotEqual(v.rc, 0)
        self.assertSameResult(v, q)
        # With an object size: qemu-img sees vblk's choice.
        img2 = self.name("objsize")
        v = vblk("create", "-f", "raw", "-o", "cluster_size=1M", self.spec(img2), "8M")
        self.assertEqual(v.rc, 0, v)
        q = qemu("info", "--output=json", self.spec(img2))
        self.assertEqual(json.loads(q.stdout)["cluster-size"], 1 * MiB)

    # ---- data both ways
    def test_vblk_writes_qemu_reads(self):
        src = self.local("src.raw")
        img = self.name("vw")
        v = vblk("convert", "-O", "raw", src, self.spec(img))
        self.assertEqual(v.rc, 0, v)
        out = os.path.join(self.tmp, "back.raw")
        q = qemu("convert", "-O", "raw", self.spec(img), out)
        self.assertEqual(q.rc, 0, q)
        self.assertSameFile(src, out)
        q = qemu("compare", src, self.spec(img))
        self.assertEqual(q.rc, 0, q)
        # The json: names info prints (raw over rbd, and rbd alone) open again.
        raw_name = json.loads(qemu("info", "--output=json", self.spec(img)).stdout)["filename"]
        rbd_name = "json:" + json.dumps({"driver": "rbd", "pool": CLUSTER.pool, "image": img, "conf": CLUSTER.conf})
        for name in (raw_name, rbd_name):
            v, q = both("info", name)
            self.assertSameResult(v, q, name)
            self.assertEqual(v.rc, 0, v)
        v = vblk("compare", src, rbd_name)
        self.assertEqual(v.rc, 0, v)

    def test_qemu_writes_vblk_reads(self):
        src = self.local("src.raw")
        img = self.name("qw")
        q = qemu("convert", "-O", "raw", src, self.spec(img))
        self.assertEqual(q.rc, 0, q)
        out = os.path.join(self.tmp, "back.raw")
        v = vblk("convert", "-O", "raw", self.spec(img), out)
        self.assertEqual(v.rc, 0, v)
        self.assertSameFile(src, out)
        # And into qcow2 through vblk, checked by qemu-img.
        out2 = os.path.join(self.tmp, "back.qcow2")
        v = vblk("convert", "-O", "qcow2", self.spec(img), out2)
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(qemu("check", out2).rc, 0)
        self.assertEqual(qemu("compare", src, out2).rc, 0)

    def test_rbd_to_rbd_and_io(self):
        src = self.local("src.raw")
        a, b = self.name("a"), self.name("b")
        self.assertEqual(qemu("convert", "-O", "raw", src, self.spec(a)).rc, 0)
        v = vblk("convert", "-O", "raw", self.spec(a), self.spec(b))
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(qemu("compare", self.spec(a), self.spec(b)).rc, 0)
        # Unaligned writes, write-zeroes and discard through `vblk io`,
        # read back by qemu-io's twin (qemu-img compare against a local copy).
        v = vblk("io", "-f", "raw", "-c", "write -P 0x5a 1000 7000", "-c", "write -z 2M 1M",
                 "-c", "discard 12M 1M", self.spec(b))
        self.assertEqual(v.rc, 0, v)
        with open(src, "r+b") as f:
            f.seek(1000)
            f.write(b"\x5a" * 7000)
            f.seek(2 * MiB)
            f.write(b"\0" * MiB)
            f.seek(12 * MiB)
            f.write(b"\0" * MiB)
        q = qemu("compare", src, self.spec(b))
        self.assertEqual(q.rc, 0, q)

    # ---- map
    def _map_both(self, img):
        for fmt in ("human", "json"):
            v, q = both("map", "--output=" + fmt, self.spec(img))
            self.assertSameResult(v, q, fmt)
        return json.loads(v.stdout) if fmt == "json" else None

    def test_map_fast_diff(self):
        img = self.name("fd")
        self.assertEqual(qemu("convert", "-O", "raw", self.local("s.raw"), self.spec(img)).rc, 0)
        m = self._map_both(img)
        # Objects with data and objects without: the diff was used.
        self.assertTrue(any(e["data"] for e in m) and any(not e["data"] for e in m), m)

    def test_map_without_fast_diff(self):
        img = self.name("nofd")
        CLUSTER.rbd("create", "--size", "16M", "--image-feature", "layering", "%s/%s" % (CLUSTER.pool, img))
        v = vblk("convert", "-n", "-O", "raw", self.local("s.raw"), self.spec(img))
        self.assertEqual(v.rc, 0, v)
        m = self._map_both(img)
        self.assertEqual(len(m), 1)
        self.assertTrue(m[0]["data"])

    # ---- blockdev-create
    def test_blockdev_create_as_qemu_storage_daemon(self):
        from qmp_driver import Daemon
        seen = {}
        for name, cmd in storage_daemons():
            d = self.subdir(name.replace(" ", "_"))
            dm = Daemon(cmd, os.path.join(d, "qmp.sock"), os.path.join(d, "log"))
            self.addCleanup(dm.kill)
            q = dm.qmp
            img = self.name("bc")
            loc = {"pool": CLUSTER.pool, "image": img, "conf": CLUSTER.conf}
            outcome = []
            for _ in range(2):  # the second one finds the image there
                q.ok("blockdev-create", **{"job-id": "c", "options": {
                    "driver": "rbd", "location": loc, "size": 8 * MiB, "cluster-size": MiB}})
                while True:
                    j = [x for x in q.ok("query-jobs") if x["id"] == "c"][0]
                    if j["status"] == "concluded":
                        break
                    time.sleep(0.02)
                outcome.append(j.get("error"))
                q.ok("job-dismiss", id="c")
            dm.quit()
            info = json.loads(qemu("info", "--output=json", self.spec(img)).stdout)
            seen[name] = (outcome, info["virtual-size"], info["cluster-size"])
        self.assertIn("vblk serve", seen)
        self.assertEqual(seen["vblk serve"], ([None, "error rbd create: File exists"], 8 * MiB, MiB))
        for v in seen.values():
            self.assertEqual(v, seen["vblk serve"])

    # ---- snapshots
    def test_snapshots_as_qemu_img(self):
        """-c/-l/-a/-d on an RBD image (QEMU's rbd_snap_*), both tools taking
        turns on the same image; @snap and snapshot= read a snapshot."""
        img = self.name("snap")
        a = self.local("a.raw", size=8 * MiB, pieces=[(0, 1 * MiB, 11), (6 * MiB, 64 * 1024, 12)])
        b = self.local("b.raw", size=8 * MiB, pieces=[(512 * 1024, 2 * MiB, 13)])
        self.assertEqual(vblk("convert", "-O", "raw", a, self.spec(img)).rc, 0)
        v = vblk("snapshot", "-c", "s1", self.spec(img))
        self.assertEqual(vblk("convert", "-n", "-f", "raw", "-O", "raw", b, self.spec(img)).rc, 0)
        q = qemu("snapshot", "-c", "s2", self.spec(img))
        self.assertSameResult(v, q)  # rc 0, the probing warning
        self.assertEqual(v.rc, 0, v)
        for args in (["snapshot", "-l"], ["info"]):
            v, q = both(*args, self.spec(img))
            self.assertSameResult(v, q, args)
        self.assertIn("s1", v.stdout)
        # A snapshot reads as it was, read-only, through either spelling.
        at = "rbd:%s/%s@s1:conf=%s" % (CLUSTER.pool, img, CLUSTER.conf)
        opt = "driver=rbd,pool=%s,image=%s,conf=%s,snapshot=s1" % (CLUSTER.pool, img, CLUSTER.conf)
        for name in ([at], ["--image-opts", opt]):
            for tool, out in ((vblk, "v.raw"), (qemu, "q.raw")):
                r = tool("convert", "-O", "raw", *name, os.path.join(self.tmp, out))
                self.assertEqual(r.rc, 0, r)
                self.assertSameFile(os.path.join(self.tmp, out), a)
        # Refusals: an existing name, a missing one, a snapshot opened for writing.
        for args in (["-c", "s1"], ["-a", "nosuch"], ["-d", "nosuch"], ["-c", "x" * 130]):
            v, q = both("snapshot", *args, self.spec(img))
            self.assertSameResult(v, q, args)
            self.assertEqual(v.rc, 1, v)
        v, q = both("snapshot", "-c", "s3", at)
        self.assertSameResult(v, q)
        # Apply s1 (vblk), then delete s2 (vblk) and s1 (qemu-img).
        v, q = both("snapshot", "-a", "s1", self.spec(img))
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 0, v)
        r = qemu("convert", "-O", "raw", self.spec(img), os.path.join(self.tmp, "now.raw"))
        self.assertEqual(r.rc, 0, r)
        self.assertSameFile(os.path.join(self.tmp, "now.raw"), a)
        self.assertEqual(vblk("snapshot", "-d", "s2", self.spec(img)).rc, 0)
        v, q = both("snapshot", "-l", self.spec(img))
        self.assertSameResult(v, q)
        self.assertNotIn("s2", v.stdout)
        self.assertEqual(qemu("snapshot", "-d", "s1", self.spec(img)).rc, 0)
        v, q = both("snapshot", "-l", self.spec(img))
        self.assertSameResult(v, q)
        self.assertEqual(v.stdout, "")

    def test_internal_snapshot_commands_as_qemu_storage_daemon(self):
        """blockdev-snapshot-internal-sync / -delete-internal-sync on an rbd
        node, and the snapshots query-named-block-nodes lists."""
        from qmp_driver import Daemon
        seen = {}
        for name, cmd in storage_daemons():
            d = self.subdir(name.replace(" ", "_"))
            dm = Daemon(cmd, os.path.join(d, "qmp.sock"), os.path.join(d, "log"))
            self.addCleanup(dm.kill)
            q = dm.qmp
            img = self.name("qs")
            CLUSTER.rbd("create", "--size", "4M", "%s/%s" % (CLUSTER.pool, img))
            out = [q.cmd("blockdev-add", {"driver": "rbd", "node-name": "r0", "pool": CLUSTER.pool, "image": img,
                                          "conf": CLUSTER.conf})]
            out += [q.cmd("blockdev-snapshot-internal-sync", {"device": "r0", "name": "s1"}) for _ in range(2)]
            out.append([n["image"].get("snapshots") for n in q.cmd("query-named-block-nodes")["return"]])
            for a in ({"device": "r0", "name": "s1"}, {"device": "r0", "name": "s1"},
                      {"device": "r0", "id": "x", "name": "s1"}):
                out.append(q.cmd("blockdev-snapshot-delete-internal-sync", a))
            dm.quit()
            seen[name] = out
        self.assertIn("vblk serve", seen)
        self.assertEqual(seen["vblk serve"][3][0][0]["name"], "s1")
        for v in seen.values():
            self.assertEqual(v, seen["vblk serve"])

    def test_an_rbd_node_loads_librbd(self):
        img = self.name("maps")
        self.assertEqual(vblk("create", "-f", "raw", self.spec(img), "4M").rc, 0)
        self.assertIn("librbd", maps_of_server(self, self.spec(img)))

    # ---- errors
    def test_errors_read_as_qemu_img(self):
        conf = CLUSTER.conf
        for name in ("rbd:nopool/x:conf=%s" % conf,
                     "rbd:%s/noimage:conf=%s" % (CLUSTER.pool, conf),
                     "rbd:%s/x:conf=/nonexistent.conf" % CLUSTER.pool,
                     "rbd:%s/x:conf=%s:no_such_option=1" % (CLUSTER.pool, conf),
                     "rbd:%s" % CLUSTER.pool):
            v, q = both("info", name)
            self.assertNotEqual(v.rc, 0, v)
            self.assertSameResult(v, q, name)
        v = vblk("convert", "-O", "raw", "rbd:nopool/x:conf=%s" % conf, os.path.join(self.tmp, "o"))
        self.assertNotEqual(v.rc, 0)
        self.assertIn("error opening pool nopool", v.stderr)


def maps_of_server(testcase, image, fmt="raw"):
    """The shared objects mapped by a `vblk nbd` serving `image`."""
    sock = os.path.join(testcase.tmp, "nbd-%d.sock" % len(os.listdir(testcase.tmp)))
    argv = [VBLK, "nbd", "-f", fmt, "-k", sock, image]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_socket(sock, proc)
        with open("/proc/%d/maps" % proc.pid) as f:
            return f.read()
    finally:
        end_process(proc, argv, signal.SIGTERM)


class LazyLibrbd(InteropTestCase):
    """librbd is opened by the first rbd node, not by every vblk process
    (src/block/drivers/rbd/rbd_lib.h); without it, rbd fails clearly and
    nothing else changes. No cluster needed."""

    def test_a_server_of_a_local_image_does_not_load_librbd(self):
        img = os.path.join(self.tmp, "local.raw")
        write_pattern(img, 4 * MiB, PIECES[:1])
        maps = maps_of_server(self, img)
        self.assertIn("vblk", maps)
        self.assertNotIn("librbd", maps)
        self.assertNotIn("librados", maps)

    def test_without_librbd_rbd_fails_clearly_and_the_rest_works(self):
        env = dict(os.environ, VBLK_LIBRBD="libvblk-test-no-such-librbd.so.1")
        img = os.path.join(self.tmp, "local.raw")
        write_pattern(img, 4 * MiB, PIECES[:1])
        for argv in (["info", "rbd:rbd/img"], ["create", "-f", "raw", "rbd:rbd/img", "1M"],
                     ["convert", "-O", "raw", img, "rbd:rbd/img"]):
            p = subprocess.run([VBLK] + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=60)
            self.assertEqual(p.returncode, 1, (argv, p.stderr))
            self.assertIn("could not load librbd: libvblk-test-no-such-librbd.so.1", p.stderr, argv)
        p = subprocess.run([VBLK, "info", "--output=json", img], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout)["virtual-size"], 4 * MiB)


if __name__ == "__main__":
    unittest.main()
