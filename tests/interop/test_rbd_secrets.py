"""The rbd features that take secrets, beside qemu-img, qemu-io and
qemu-storage-daemon, on one cluster with cephx (ceph_cluster.py, cephx=True).

`user` + `key-secret`: client.vblk's key is in no conf: clients get the
monitor address and auth settings from `client_conf` and the key only from a
secret object, as QEMU's users do (`--object secret,id=sec0,data=<key>,
format=base64`: the secret holds the key's bytes, which the driver hands to
librados in base64). vblk writes and reads the image that way
(`--image-opts`) and qemu-img / qemu-io read and write it identically; a
wrong key, an unknown secret, a non-secret object and auth-client-required=
none fail with QEMU's texts; blockdev-add / object-del run the same on both
daemons.

`encrypt` (librbd's LUKS, QEMU 7.2's rbd encryption): images made by
cryptsetup with a cheap key derivation (librbd's own format spends seconds
on it: the one test that runs it wants VBLK_RBD_SLOW=1) and imported, read and written by vblk
and QEMU alike; info shows the header's format; refusals read as QEMU's.

Skipped, saying why, only when the Ceph daemons are not installed.
"""

import os
import shutil
import subprocess
import sys
import time
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


class RbdKeySecretTest(ceph_cluster.NeedsCluster, BothDaemons, InteropTestCase):

    def image(self, tag, size=4 * MiB):
        name = self.name(tag)
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

    def test_create_with_password_secret_as_qemu_img(self):
        """qemu-img's legacy create option: the secret is the connection's key."""
        names = []
        for tool in (vblk, qemu):
            names.append("rbd:%s/%s:conf=%s:id=%s" % (CLUSTER.pool, self.name("pw"),
                                                      CLUSTER.client_conf, CLUSTER.user))
            r = tool("create", "-f", "raw", *self.secret(), "-o", "password-secret=sec0", names[-1], "1M")
            self.assertEqual(r.rc, 0, r)
            self.assertEqual(r.stdout, "Formatting '%s', fmt=raw size=1048576 password-secret=sec0\n" % names[-1])
        listed = CLUSTER.rbd("ls", CLUSTER.pool).stdout.decode().split()
        self.assertIn(names[0].split("/")[1].split(":")[0], listed)
        v, q = both("create", "-f", "raw", *self.secret(), "-o", "password-secret=nosuch", names[0] + "x", "1M")
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 1, v)

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


PASS = "hunter2"
PW = ["--object", "secret,id=pw,data=" + PASS]


class RbdEncryptionTest(ceph_cluster.NeedsCluster, BothDaemons, InteropTestCase):

    def luks_image(self, tag, fmt):
        """An RBD image with a LUKS header made by cryptsetup (1000 PBKDF2
        iterations; the payload after 4 MiB, luks2 8 MiB, as librbd lays it
        out) and 8 MiB of payload no object holds yet."""
        if not shutil.which("cryptsetup"):
            self.skipTest("cryptsetup is not installed (Debian: cryptsetup-bin)")
        name = self.name(tag)
        path = os.path.join(self.tmp, name)
        key = os.path.join(self.tmp, "pass")
        with open(key, "w") as f:
            f.write(PASS)
        header = 4 * MiB if fmt == "luks" else 8 * MiB
        with open(path, "wb") as f:
            f.truncate(header)
        args = ["--type", "luks1", "--align-payload", "8192"] if fmt == "luks" else [
            "--type", "luks2", "--pbkdf", "pbkdf2", "--sector-size", "4096", "--offset", "16384",
            "--luks2-metadata-size", "16k", "--luks2-keyslots-size", "4m"]
        # The header alone ("too small for activation" is only a warning).
        subprocess.run(["cryptsetup", "luksFormat", "--batch-mode", "--pbkdf-force-iterations", "1000",
                        "--key-file", key] + args + [path], check=True, capture_output=True)
        CLUSTER.rbd("import", "--no-progress", path, "%s/%s" % (CLUSTER.pool, name))
        CLUSTER.rbd("resize", "--no-progress", "--size", "%dM" % ((header >> 20) + 8), "%s/%s" % (CLUSTER.pool, name))
        return name

    def opts(self, image, fmt=None, secret="pw", extra=""):
        o = "driver=rbd,pool=%s,image=%s,conf=%s" % (CLUSTER.pool, image, CLUSTER.conf)
        if fmt:
            o += ",encrypt.format=%s" % fmt
        if secret:
            o += ",encrypt.key-secret=%s" % secret
        return o + extra

    def assertSameBytes(self, got, expect, msg=""):
        if got != expect:
            first = next((i for i in range(min(len(got), len(expect))) if got[i] != expect[i]), None)
            self.fail("%s: %d bytes read, %d expected, first difference at %s" % (msg, len(got), len(expect), first))

    def read_back(self, tool, image, fmt, out):
        r = tool("convert", *PW, "--image-opts", "-O", "raw", self.opts(image, fmt), os.path.join(self.tmp, out))
        self.assertEqual(r.rc, 0, r)
        with open(os.path.join(self.tmp, out), "rb") as f:
            return f.read()

    def test_luks_written_by_vblk_read_by_qemu(self):
        img = self.luks_image("l1", "luks")
        r = run([VBLK, "io", *PW, "--image-opts", "-c", "write -P 0x5a 0 1M", "-c", "write -P 0xa5 3M 64k",
                 self.opts(img, "luks")])
        self.assertEqual(r.rc, 0, r)
        # What librbd makes of the rest of a written object (a hole before
        # the write decrypts to noise) is librbd's: both tools read the same.
        q = self.read_back(qemu, img, "luks", "q.raw")
        v = self.read_back(vblk, img, "luks", "v.raw")
        self.assertSameBytes(v, q, "vblk against qemu-img")
        self.assertEqual(len(v), 8 * MiB)
        self.assertTrue(v[:MiB] == b"\x5a" * MiB and v[3 * MiB:3 * MiB + 65536] == b"\xa5" * 65536)
        for args in (["info", "--image-opts", self.opts(img, secret=None)],      # the header: luks
                     ["info", "--output=json", *PW, "--image-opts", self.opts(img, "luks")],
                     ["map", "--output=json", *PW, "--image-opts", self.opts(img, "luks")]):
            v, q = both(*args)
            self.assertSameResult(v, q, args)
            self.assertEqual(v.rc, 0, v)
        self.assertIn('"virtual-size": %d' % (8 * MiB), both("info", "--output=json", *PW, "--image-opts",
                                                             self.opts(img, "luks"))[0].stdout)
        # Refusals, in QEMU's words.
        for objs, opts in ((["--object", "secret,id=pw,data=wrong"], self.opts(img, "luks")),
                           (PW, self.opts(img, "luks2")), (PW, self.opts(img, "luks", secret="nosuch")),
                           (PW, self.opts(img, "luks", secret=None)), (PW, self.opts(img, secret="pw")),
                           (PW, self.opts(img, "luks3")), (PW, self.opts(img, "luks", extra=",encrypt.x=1"))):
            v, q = both("info", *objs, "--image-opts", opts)
            self.assertSameResult(v, q, opts)
            self.assertEqual(v.rc, 1, v)
            self.assertNotIn(PASS, v.stdout + v.stderr)

    def test_luks2_written_by_qemu_read_by_vblk(self):
        img = self.luks_image("l2", "luks2")
        r = run([shutil.which("qemu-io"), *PW, "--image-opts", "-c", "write -P 0x77 512k 1M",
                 self.opts(img, "luks2")])
        self.assertEqual(r.rc, 0, r)
        v = self.read_back(vblk, img, "luks2", "v.raw")
        self.assertSameBytes(v, self.read_back(qemu, img, "luks2", "q.raw"), "vblk against qemu-img")
        self.assertTrue(v[512 * 1024:512 * 1024 + MiB] == b"\x77" * MiB)
        v, q = both("info", "--image-opts", self.opts(img, secret=None))
        self.assertSameResult(v, q)
        self.assertIn("encryption format: luks2", v.stdout)

    def test_create_encrypted_as_qemu_img(self):
        spec = CLUSTER.spec(self.name("c"))
        # Refused after the image was made: QEMU removes it again.
        for o in ("encrypt.format=luks,encrypt.key-secret=pw,encrypt.cipher-alg=des",
                  "encrypt.format=luks,encrypt.key-secret=nosuch", "encrypt.format=luks",
                  "encrypt.format=luks2,encrypt.key-secret=pw,encrypt.cipher-alg=sm4",
                  "encrypt.format=luks,encrypt.key-secret=pw,encrypt.bad=1"):
            v, q = both("create", "-f", "raw", *PW, "-o", o, spec, "8M")
            self.assertSameResult(v, q, o)
            self.assertEqual(v.rc, 1, v)
        self.assertNotIn(spec.split("/")[1].split(":")[0], CLUSTER.rbd("ls", CLUSTER.pool).stdout.decode())

    @unittest.skipUnless(os.environ.get("VBLK_RBD_SLOW"), "librbd's LUKS format costs seconds of key "
                         "derivation: set VBLK_RBD_SLOW=1")
    def test_create_formats_luks(self):
        """A real format: the header is there and the image grew by it, as
        qemu-img sees it; qemu-io opens it with the passphrase."""
        spec = CLUSTER.spec(self.name("f"))
        v = vblk("create", "-f", "raw", *PW, "-o", "encrypt.format=luks,encrypt.key-secret=pw,"
                 "encrypt.cipher-alg=aes-128", spec, "8M")
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(v.stdout, "Formatting '%s', fmt=raw size=8388608 encrypt.format=luks "
                         "encrypt.cipher-alg=aes-128 encrypt.key-secret=pw\n" % spec)
        v, q = both("info", "-f", "raw", spec)
        self.assertSameResult(v, q)
        self.assertIn("12 MiB", v.stdout)
        img = spec.split("/")[1].split(":")[0]
        v, q = both("info", "--image-opts", self.opts(img, secret=None))
        self.assertSameResult(v, q)
        self.assertIn("encryption format: luks", v.stdout)
        r = run([shutil.which("qemu-io"), *PW, "--image-opts", "-c", "write -P 0x11 0 4k", "-c", "read -P 0x11 0 4k",
                 self.opts(img, "luks")])
        self.assertEqual(r.rc, 0, r)
        self.assertNotIn("fail", r.stdout + r.stderr)

    def test_blockdev_add_encrypted_as_qemu_storage_daemon(self):
        img = self.luks_image("qa", "luks")

        def scenario(qmp, d):
            loc = {"driver": "rbd", "pool": CLUSTER.pool, "image": img, "conf": CLUSTER.conf}
            out = [qmp.cmd("object-add", {"qom-type": "secret", "id": "pw", "data": PASS})]
            for enc in ({"format": "luks"}, {"format": "luks", "key-secret": "nosuch"}, {"key-secret": "pw"},
                        {"format": "luks2", "key-secret": "pw"}, {"format": "luks", "key-secret": "pw", "y": 1},
                        {"format": "luks", "key-secret": "pw"}):
                out.append(qmp.cmd("blockdev-add", dict(loc, **{"node-name": "e0", "encrypt": enc})))
            nodes = qmp.cmd("query-named-block-nodes")["return"]
            out.append([(n["node-name"], n["image"]["virtual-size"], n["image"].get("format-specific"))
                        for n in nodes])
            return out

        seen = self.each_daemon(scenario)
        self.assertIn("vblk serve", seen)
        self.assertSame(seen)
        self.assertEqual(seen["vblk serve"][-1], [("e0", 8 * MiB, {"type": "rbd", "data": {}})])

    def test_blockdev_create_encrypt_refusals_as_qemu_storage_daemon(self):
        def scenario(qmp, d):
            qmp.cmd("object-add", {"qom-type": "secret", "id": "pw", "data": PASS})
            out = []
            for enc in ({"format": "luks"}, {"format": "luks", "key-secret": "pw", "cipher-alg": "des"},
                        {"format": "bogus", "key-secret": "pw"}, {"format": "luks", "key-secret": "nosuch"},
                        {"format": "luks", "key-secret": "pw", "x": 1}, 5):
                r = qmp.cmd("blockdev-create", {"job-id": "c", "options": {
                    "driver": "rbd", "size": 8 * MiB, "encrypt": enc,
                    "location": {"pool": CLUSTER.pool, "image": self.name("qc"), "conf": CLUSTER.conf}}})
                if "error" in r:
                    out.append(r)
                    continue
                while True:
                    j = [x for x in qmp.cmd("query-jobs")["return"] if x["id"] == "c"][0]
                    if j["status"] == "concluded":
                        break
                    time.sleep(0.02)
                out.append(j.get("error"))
                qmp.cmd("job-dismiss", {"id": "c"})
            return out

        seen = self.each_daemon(scenario)
        self.assertIn("vblk serve", seen)
        self.assertSame(seen)
        self.assertEqual(seen["vblk serve"][3], "No secret with id 'nosuch'")
        self.assertNotIn("qc-", CLUSTER.rbd("ls", CLUSTER.pool).stdout.decode())


if __name__ == "__main__":
    unittest.main()
