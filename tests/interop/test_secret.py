"""Secret objects (QEMU's qom `secret`) beside QEMU 7.2: `--object secret,...`
of the qemu-img style commands against qemu-img, `vblk serve --object` against
qemu-storage-daemon's command line, and QMP object-add / object-del against
qemu-storage-daemon. No cluster: what the secrets unlock (rbd's key-secret) is
tested in test_rbd_secrets.py. A secret's value never shows in vblk's output.
"""

import base64
import os
import re
import shutil
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BothDaemons, InteropTestCase, MiB, VBLK, both, run, storage_daemons  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
MARK = "Xy7SECRETVALUE"


def aes_cbc(key, iv, plain, pad=True):
    """AES-256-CBC as QEMU's encrypted secrets expect (PKCS#7 padding)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    if pad:
        n = 16 - len(plain) % 16
        plain += bytes([n]) * n
    e = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    return e.update(plain) + e.finalize()


def b64(b):
    return base64.b64encode(b).decode()


KEY = bytes(range(32))
IV = bytes(range(16, 32))
MASTER = "secret,id=master,format=base64,data=" + b64(KEY)


def encrypted(ct, iv=IV, extra=""):
    s = "secret,id=s1,keyid=master,format=base64,data=" + b64(ct)
    if iv is not None:
        s += ",iv=" + b64(iv)
    return s + extra


class SecretCliTest(InteropTestCase):
    def setUp(self):
        super().setUp()
        self.img = os.path.join(self.tmp, "a.raw")
        with open(self.img, "wb") as f:
            f.truncate(MiB)
        self.file = os.path.join(self.tmp, "secret.txt")
        with open(self.file, "w") as f:
            f.write(MARK)

    def test_object_secret_as_qemu_img(self):
        """Accepted and refused definitions, with qemu-img's texts."""
        cases = [
            ["secret,id=s0,data=" + MARK],
            ["secret,id=s0,data=12345"],                      # stays a string
            ["secret,id=s0,file=" + self.file],
            ["secret,id=s0,data=" + b64(MARK.encode()) + ",format=base64"],
            ["secret,id=s0,data=,format=raw"],
            ["secret,id=s0,data=x,loaded=on"],
            ["secret,id=s0,data=x,loaded=maybe"],
            ["secret,id=s0,data=x,keyid="],
            ["secret,id=s0"],
            ["secret,id=s0,data=" + MARK + ",file=" + self.file],
            ["secret,id=s0,data=" + MARK + "!!,format=base64"],
            ["secret,id=s0,data=x,format=hex"],
            ["secret,id=s0,file=/nonexistent/secret"],
            ["secret,id=s0,file=" + self.tmp],
            ["secret,id=s0,data=x,bogus=1"],
            ["secret,data=x"],
            ["secret,id=0s,data=x"],
            ["secret,id=s0,data=x", "secret,id=s0,data=y"],
            ["secret,id=s0,data=x", "throttle-group,id=s0"],
            # Encrypted with another secret as the AES-256 key.
            [MASTER, encrypted(aes_cbc(KEY, IV, MARK.encode()))],
            [MASTER, encrypted(aes_cbc(KEY, IV, MARK.encode()), iv=None)],
            [MASTER, encrypted(aes_cbc(KEY, IV, MARK.encode()), iv=IV[:8])],
            [MASTER, encrypted(aes_cbc(KEY, IV, b"A" * 15 + b"\x20", pad=False))],
            ["secret,id=master,data=short", encrypted(aes_cbc(KEY, IV, b"x"))],
            [encrypted(aes_cbc(KEY, IV, b"x"))],                # no such key
            ["throttle-group,id=master", encrypted(aes_cbc(KEY, IV, b"x"))],
        ]
        for objs in cases:
            args = []
            for o in objs:
                args += ["--object", o]
            for cmd in (["info"], ["map", "--output=json"], ["check"], ["compare", self.img]):
                v, q = both(*(cmd[:1] + args + cmd[1:] + [self.img]))
                self.assertSameResult(v, q, "%s %s" % (cmd, objs))
                self.assertNotIn(MARK, v.stdout + v.stderr)
            if any("bogus" in o or "id=0s" in o for o in objs):
                self.assertNotEqual(v.rc, 0)

    def test_other_commands_take_object(self):
        """convert, create, backup and nbd take --object as well."""
        out = os.path.join(self.tmp, "o.qcow2")
        for argv in (["convert", "--object", "secret,id=s0,data=x", "-O", "qcow2", self.img, out],
                     ["create", "--object", "secret,id=s0,data=x", "-f", "qcow2", out, "1M"]):
            v, q = both(*argv)
            self.assertSameResult(v, q, argv)
            self.assertEqual(v.rc, 0, v)
        b = os.path.join(self.tmp, "b.raw")
        v = run([VBLK, "backup", "--object", "secret,id=s0,data=" + MARK, "-O", "raw", self.img, b])
        self.assertEqual(v.rc, 0, v)
        for argv in (["backup", self.img, b], ["nbd", self.img]):
            v = run([VBLK, argv[0], "--object", "secret,id=s0,data=" + MARK + "*,format=base64"] + argv[1:])
            self.assertEqual(v.rc, 1, v)
            self.assertIn("Base64 data contains invalid characters", v.stderr)
            self.assertNotIn(MARK, v.stdout + v.stderr)


@unittest.skipUnless(QSD, "qemu-storage-daemon is not installed")
class SecretDaemonTest(BothDaemons, InteropTestCase):
    def test_serve_object_errors_as_qemu_storage_daemon(self):
        for obj in ("secret,id=s0", "secret,id=s0,data=" + MARK + ",file=/x", "secret,id=s0,data=x,loaded=on",
                    "secret,id=s0,data=x,loaded=maybe", "secret,id=s0,data=" + MARK + ",keyid=nosuch",
                    "secret,id=s0,data=" + MARK + "*,format=base64", "secret,id=s0,file=/nonexistent/x",
                    "secret,id=s0,data=x,format=bad", "secret,id=s0,data=x,nope=1"):
            q = run([QSD, "--object", obj], timeout=30)
            v = run([VBLK, "serve", "--object", obj], timeout=30)
            self.assertEqual(v.rc, q.rc, (obj, v, q))
            self.assertNotEqual(v.rc, 0)
            qerr = re.sub(r"(?m)^\S*qemu-storage-daemon: ", "DAEMON: ", q.stderr)
            # qsd echoes the option with the secret in it; vblk masks it.
            qerr = re.sub(r"data=[^,:]*", "data=******", qerr)
            verr = re.sub(r"(?m)^\S*%s: " % re.escape(os.path.basename(VBLK)), "DAEMON: ", v.stderr)
            self.assertEqual(verr, qerr, obj)
            self.assertNotIn(MARK, v.stdout + v.stderr)

    def test_object_add_and_del_as_qemu_storage_daemon(self):
        sec = {"qom-type": "secret"}

        def scenario(qmp, d):
            out = [qmp.cmd("object-add", a) for a in (
                dict(sec, id="s0", data=MARK), dict(sec, id="s0", data="y"),
                dict(sec, id="s1"), dict(sec, id="s1", data="x", file="/x"),
                dict(sec, id="s1", data=MARK + "*", format="base64"), dict(sec, id="s1", data=5),
                dict(sec, id="s1", data="x", format="hex"), dict(sec, id="s1", data="x", nope=1),
                dict(sec, id="s1", file="/nonexistent/x"), dict(sec, id="s1", data="x", loaded=True),
                dict(sec, id="m", format="base64", data=b64(KEY)),
                dict(sec, id="s2", keyid="m", format="base64", iv=b64(IV),
                     data=b64(aes_cbc(KEY, IV, MARK.encode()))),
                dict(sec, id="s3", keyid="nosuch", data="x"),
                {"qom-type": "throttle-group", "id": "s1"}, {"qom-type": "iothread", "id": "s0"})]
            for i in ("s0", "s0", "s1", "s2", "m", "nosuch"):
                out.append(qmp.cmd("object-del", {"id": i}))
            out.append(qmp.cmd("object-add", dict(sec, id="s0", data="again")))
            return out

        seen = self.each_daemon(scenario)
        self.assertIn("vblk serve", seen)
        self.assertSame(seen)
        self.assertNotIn(MARK, repr(seen["vblk serve"]))


if __name__ == "__main__":
    unittest.main()
