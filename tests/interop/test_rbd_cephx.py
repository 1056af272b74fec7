"""rbd's `user` + `key-secret` on a cluster with cephx, beside qemu-img and
qemu-storage-daemon.

The cluster (ceph_cluster.py, cephx=True) has a user client.vblk whose key
is in no conf: clients get the monitor address and auth settings from
`client_conf` and the key only from a secret object, as QEMU's users do
(`--object secret,id=sec0,data=<key>,format=base64`: the secret holds the
key's bytes, which the driver hands to librados in base64). vblk writes and
reads the image that way (`--image-opts`) and qemu-img / qemu-io read and
write it identically; a wrong key, an
unknown secret, a non-secret object and auth-client-required=none fail with
QEMU's texts; blockdev-add / object-del run the same on both daemons.

Skipped, saying why, only when the Ceph daemons are not installed.
"""

import os
import shutil
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import VBLK, BothDaemons, InteropTestCase, MiB, both, qemu, run, vblk  # noqa: E402
import ceph_cluster  # noqa: E402

CLUSTER = None


def setUpModule():
    global CLUSTER
    if ceph_cluster.skip_reason():
        return
    CLUSTER = ceph_cluster.CephCluster(osds=1, memstore_mib=128, cephx=True)
    CLUSTER.start()


def tearDownModule():
    if CLUSTER:
        CLUSTER.stop()


class RbdCephxTest(BothDaemons, InteropTestCase):
    counter = 0

    def setUp(self):
        super().setUp()
        reason = ceph_cluster.skip_reason()
        if reason:
            self.skipTest(reason)

    def image(self, tag, size=4 * MiB):
        RbdCephxTest.counter += 1
        name = "%s-%d" % (tag, RbdCephxTest.counter)
        CLUSTER.rbd("create", "--size", "%dM" % (size // MiB), "%s/%s" % (CLUSTER.pool, name))
        return name

    def opts(self, image, secret="sec0", **extra):
        o = {"driver": "rbd", "pool": CLUSTER.pool, "image": image, "conf": CLUSTER.client_conf,
             "user": CLUSTER.user, "key-secret": secret}
        o.update(extra)
        return o

    def image_opts(self, image, acr=None, **kw):
        """--image-opts text (both tools take it; vblk has no json: names)."""
        text = ",".join("%s=%s" % kv for kv in self.opts(image, **kw).items())
        for i, mode in enumerate(acr or []):
            text += ",auth-client-required.%d=%s" % (i, mode)
        return text

    @staticmethod
    def secret(key=None):
        return ["--object", "secret,id=sec0,format=base64,data=" + (key or CLUSTER.user_key)]

    def test_key_secret_writes_and_reads_as_qemu(self):
        img = self.image("rw")
        expect = bytearray(4 * MiB)
        expect[0:MiB] = b"\x5a" * MiB
        expect[2 * MiB:2 * MiB + 65536] = b"\xa5" * 65536
        r = run([VBLK, "io", *self.secret(), "--image-opts", "-c", "write -P 0x5a 0 1M",
                 "-c", "write -P 0xa5 2M 64k", self.image_opts(img)])
        self.assertEqual(r.rc, 0, r)
        self.assertNotIn("error", r.stdout + r.stderr)
        for tool, out in ((vblk, "v.raw"), (qemu, "q.raw")):
            r = tool("convert", *self.secret(), "--image-opts", "-O", "raw", self.image_opts(img),
                     os.path.join(self.tmp, out))
            self.assertEqual(r.rc, 0, r)
            with open(os.path.join(self.tmp, out), "rb") as f:
                self.assertTrue(f.read() == bytes(expect), "%s read other bytes" % tool.__name__)
        # qemu-io writes with the key, vblk reads it back.
        r = run([shutil.which("qemu-io"), *self.secret(), "--image-opts", "-c", "write -P 0x33 1M 4k",
                 self.image_opts(img)])
        self.assertEqual(r.rc, 0, r)
        expect[MiB:MiB + 4096] = b"\x33" * 4096
        r = vblk("convert", *self.secret(), "--image-opts", "-O", "raw", self.image_opts(img),
                 os.path.join(self.tmp, "v2.raw"))
        self.assertEqual(r.rc, 0, r)
        with open(os.path.join(self.tmp, "v2.raw"), "rb") as f:
            self.assertTrue(f.read() == bytes(expect), "vblk did not read qemu-io's write")
        # The node's name leaves key-secret out, as QEMU's does.
        v, q = both("info", *self.secret(), "--image-opts", self.image_opts(img))
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 0, v)
        self.assertNotIn("sec0", v.stdout)
        self.assertNotIn(CLUSTER.user_key, v.stdout + v.stderr)
        # The key in a file works as well.
        kf = os.path.join(self.tmp, "key")
        with open(kf, "w") as f:
            f.write(CLUSTER.user_key)
        v, q = both("map", "--output=json", "--object", "secret,id=sec0,format=base64,file=" + kf,
                    "--image-opts", self.image_opts(img))
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 0, v)

    def test_refusals_read_as_qemu(self):
        img = self.image("bad")
        other_key = CLUSTER.gen_key()
        plain = ",".join("%s=%s" % kv for kv in self.opts(img).items() if kv[0] != "key-secret")
        cases = [
            (self.secret(other_key), self.image_opts(img)),                      # wrong key
            (self.secret(), self.image_opts(img, secret="nosuch")),              # unknown secret
            (["--object", "throttle-group,id=tg"], self.image_opts(img, secret="tg")),
            (["--object", "secret,id=sec0,data=" + CLUSTER.user_key], self.image_opts(img)),  # raw: not the key
            (self.secret(), self.image_opts(img, acr=["none"])),
            ([], plain),                                                        # no key at all
        ]
        for objs, opts in cases:
            v, q = both("info", *objs, "--image-opts", opts)
            self.assertSameResult(v, q, (objs, opts))
            self.assertEqual(v.rc, 1, v)
            self.assertNotIn(CLUSTER.user_key, v.stdout + v.stderr)
            self.assertNotIn(other_key, v.stdout + v.stderr)
        # cephx or none: cephx is offered, so the right key connects.
        v, q = both("info", *self.secret(), "--image-opts", self.image_opts(img, acr=["cephx", "none"]))
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 0, v)

    def test_blockdev_add_with_key_secret_as_qemu_storage_daemon(self):
        img = self.image("qmp")

        def scenario(qmp, d):
            out = [qmp.cmd("blockdev-add", dict(self.opts(img), **{"node-name": "r0"})),
                   qmp.cmd("object-add", {"qom-type": "secret", "id": "sec0", "format": "base64",
                                          "data": CLUSTER.user_key}),
                   qmp.cmd("blockdev-add", dict(self.opts(img), **{"node-name": "r0"}))]
            # The node keeps its connection when the secret goes.
            out.append(qmp.cmd("object-del", {"id": "sec0"}))
            nodes = qmp.cmd("query-named-block-nodes")["return"]
            out.append(sorted((n["node-name"], n["drv"], n["image"]["virtual-size"]) for n in nodes))
            out.append(qmp.cmd("blockdev-add", dict(self.opts(img), **{"node-name": "r1"})))
            out.append(qmp.cmd("blockdev-del", {"node-name": "r0"}))
            return out

        seen = self.each_daemon(scenario)
        self.assertIn("vblk serve", seen)
        self.assertSame(seen)
        self.assertEqual(seen["vblk serve"][2], {"return": {}})
        self.assertEqual(seen["vblk serve"][4], [("r0", "rbd", 4 * MiB)])
        self.assertNotIn(CLUSTER.user_key, repr(seen["vblk serve"]))


if __name__ == "__main__":
    unittest.main()
