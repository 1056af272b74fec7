#!/usr/bin/env python3
"""The `luks` format beside QEMU 7.2 (block/crypto.c, crypto/block-luks.c).

A LUKS image is probed as luks by every command that probes, and without
key-secret it opens only to be described (info), so nothing writes its
header by accident; with the key, vblk reads what qemu-io wrote and qemu-io
reads what vblk wrote, byte for byte; hostile headers are refused with
QEMU's words; vblk create -f luks makes images qemu-img and cryptsetup open.
"""

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import InteropTestCase, MiB, QEMU_IMG, both, qemu, rand_bytes, run, vblk  # noqa: E402
from graph_common import DAEMONS, GraphTestCase, comparable_luks_nodes, create_luks_job, run_retrying_flakes  # noqa: E402

QEMU_IO = shutil.which("qemu-io")
CRYPTSETUP = shutil.which("cryptsetup")
SECRET = "secret,id=s0,data=pw"


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def opts(path, key="s0"):
    return "driver=luks,key-secret=%s,file.filename=%s" % (key, path)


def qemu_create(path, size, extra=""):
    """qemu-img create -f luks; QEMU's iteration timing fails now and then
    ("Unable to get accurate CPU usage") on a busy machine: retried."""
    o = "key-secret=s0,iter-time=10" + ("," + extra if extra else "")
    for _ in range(5):
        r = qemu("create", "-q", "-f", "luks", "--object", SECRET, "-o", o, path, str(size))
        if r.rc == 0:
            return
    raise AssertionError(r)


def qemu_io(path, *cmds, secret=SECRET):
    argv = [QEMU_IO, "--object", secret, "--image-opts", opts(path)]
    for c in cmds:
        argv += ["-c", c]
    r = run(argv)
    assert r.rc == 0 and "fail" not in r.stdout.lower(), r
    return r


def cryptsetup_format(path, size, cipher, key_size):
    with open(path, "wb") as f:
        f.truncate(size)
    r = subprocess.run([CRYPTSETUP, "luksFormat", "-q", "--type", "luks1", "--cipher", cipher,
                        "--key-size", str(key_size), "--hash", "sha256", "--pbkdf-force-iterations", "1000",
                        path, "-"], input=b"pw", capture_output=True)
    assert r.returncode == 0, r


class LuksTest(InteropTestCase):

    def p(self, name):
        return os.path.join(self.tmp, name)

    def images(self):
        """A qemu-img-made image and (with cryptsetup) a cryptsetup-made one."""
        imgs = [self.p("q.luks")]
        qemu_create(imgs[0], 4 * MiB)
        if CRYPTSETUP:
            imgs.append(self.p("c.luks"))
            cryptsetup_format(imgs[1], 4 * MiB, "aes-xts-plain64", 512)
        return imgs

    # -- 1. probing: nothing opens a LUKS image as raw ----------------------
    def test_probed_as_luks_and_refused_without_key(self):
        for img in self.images():
            before = digest(img)
            for out in ([], ["--output=json"]):
                v, q = both("info", *out, img)
                self.assertSameResult(v, q, img)
            self.assertIn("file format: luks", vblk("info", img).stdout)
            v, q = both("convert", "-O", "raw", img, self.p("out.raw"))
            self.assertSameResult(v, q)
            self.assertEqual(v.rc, 1)
            self.assertIn("Parameter 'key-secret' is required for cipher", v.stderr)
            v, q = both("compare", img, img)
            self.assertSameResult(v, q)
            # An export would have served the header, writable.
            r = vblk("nbd", "-t", "-k", self.p("s.sock"), img, timeout=10)
            self.assertEqual(r.rc, 1, r)
            self.assertIn("Parameter 'key-secret' is required for cipher", r.stderr)
            # -f raw is the operator's explicit choice, as in QEMU.
            r = vblk("info", "-f", "raw", img)
            self.assertIn("file format: raw", r.stdout)
            self.assertEqual(digest(img), before, img)

    @unittest.skipUnless(CRYPTSETUP, "cryptsetup not installed")
    def test_luks2_is_not_luks1(self):
        """QEMU 7.2 reads LUKS1 only: a LUKS2 image probes as raw there,
        and so in vblk."""
        img = self.p("l2.img")
        with open(img, "wb") as f:
            f.truncate(20 * MiB)
        r = subprocess.run([CRYPTSETUP, "luksFormat", "-q", "--type", "luks2", "--pbkdf", "pbkdf2",
                            "--pbkdf-force-iterations", "1000", img, "-"], input=b"pw", capture_output=True)
        self.assertEqual(r.returncode, 0, r)
        v, q = both("info", img)
        self.assertSameResult(v, q)
        self.assertIn("file format: raw", v.stdout)

    # -- 2. reads and writes bit-exact with QEMU ----------------------------
    def check_roundtrip(self, img):
        """qemu-io's writes read the same in vblk; vblk's in qemu-io."""
        qemu_io(img, "write -P 0xab 0 1M", "write -P 0x5c 2500k 300k", "write -z 3M 64k")
        a, b = self.p("a.raw"), self.p("b.raw")
        v = vblk("convert", "--object", SECRET, "--image-opts", opts(img), "-O", "raw", a)
        self.assertEqual(v.rc, 0, v)
        q = qemu("convert", "--object", SECRET, "--image-opts", opts(img), "-O", "raw", b)
        self.assertEqual(q.rc, 0, q)
        with open(a, "rb") as fa, open(b, "rb") as fb:
            self.assertEqual(fa.read(), fb.read(), img)
        # vblk writes, unaligned and across sector and MiB bounds.
        data = rand_bytes(1300 * 1024 + 7, img)
        ref = self.p("data.bin")
        with open(ref, "wb") as f:
            f.write(data)
        r = vblk("io", "--object", SECRET, "--image-opts", opts(img),
                 "-c", "write -P 0x77 1000 70001", "-c", "write -P 0x11 3M 1M")
        self.assertEqual(r.rc, 0, r)
        qemu_io(img, "read -P 0x77 1000 70001", "read -P 0x11 3M 1M", "read -P 0xab 0 1000",
                "read -P 0xab 71001 977575")
        for x, y in ((opts(img), "driver=raw,file.filename=" + a), ("driver=raw,file.filename=" + a, opts(img))):
            v, q = both("compare", "--object", SECRET, "--image-opts", x, y)
            self.assertEqual(v.rc, 1, v)  # vblk wrote since a.raw was taken
            self.assertSameResult(v, q)
        v = vblk("convert", "--object", SECRET, "--image-opts", opts(img), "-O", "raw", a)
        self.assertEqual(v.rc, 0, v)
        for x, y in ((opts(img), "driver=raw,file.filename=" + a), ("driver=raw,file.filename=" + a, opts(img))):
            v, q = both("compare", "--object", SECRET, "--image-opts", x, y)
            self.assertEqual(v.rc, 0, v)
            self.assertSameResult(v, q)

    def test_roundtrip_qemu_ciphers(self):
        for extra in ("", "cipher-alg=aes-128,cipher-mode=cbc,ivgen-alg=essiv",
                      "cipher-alg=aes-256,cipher-mode=cbc,ivgen-alg=plain,hash-alg=sha1",
                      "cipher-alg=aes-128,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha512",
                      "cipher-alg=aes-256,cipher-mode=ctr,ivgen-alg=plain64"):
            # (aes-192: 96000 bytes of key material, not whole sectors;
            # qemu-img 7.2 aborts on it, so there is nothing to compare.)
            with self.subTest(extra=extra):
                img = self.p("r.luks")
                qemu_create(img, 5 * MiB, extra)
                self.check_roundtrip(img)

    @unittest.skipUnless(CRYPTSETUP, "cryptsetup not installed")
    def test_roundtrip_cryptsetup(self):
        for cipher, ks in (("aes-xts-plain64", 512), ("aes-cbc-essiv:sha256", 256), ("aes-cbc-plain", 128)):
            with self.subTest(cipher=cipher):
                img = self.p("c.luks")
                cryptsetup_format(img, 8 * MiB, cipher, ks)
                self.check_roundtrip(img)

    def test_wrong_or_missing_secret(self):
        img = self.p("q.luks")
        qemu_create(img, MiB)
        before = digest(img)
        for obj, o in (("secret,id=s0,data=wrong", opts(img)), (SECRET, opts(img, "nope")),
                       (SECRET, "driver=luks,file.filename=" + img),
                       ("secret,id=s0,data=\\xff", opts(img))):
            v, q = both("convert", "--object", obj, "--image-opts", o, "-O", "raw", self.p("o.raw"))
            self.assertEqual(v.rc, 1, v)
            self.assertSameResult(v, q)
        self.assertIn("Invalid password, cannot unlock any keyslot",
                      vblk("convert", "--object", "secret,id=s0,data=wrong", "--image-opts", opts(img),
                           "-O", "raw", self.p("o.raw")).stderr)
        self.assertEqual(digest(img), before)

    def test_info_and_map_with_key(self):
        img = self.p("q.luks")
        qemu_create(img, MiB)
        for args in (["info"], ["info", "--output=json"], ["map", "--output=json"]):
            v, q = both(*args, "--object", SECRET, "--image-opts", opts(img))
            self.assertEqual(v.rc, 0, v)
            self.assertSameResult(v, q, args)

    # -- hostile headers ----------------------------------------------------
    def test_hostile_headers(self):
        good = self.p("good.luks")
        qemu_create(good, MiB)
        with open(good, "rb") as f:
            hdr = bytearray(f.read(592))
        size = os.path.getsize(good)
        slot = lambda i: 208 + 48 * i  # noqa: E731

        def be32(off, v):
            return lambda h: h.__setitem__(slice(off, off + 4), struct.pack(">I", v))

        cases = {
            "version 2": lambda h: h.__setitem__(slice(6, 8), b"\0\2"),
            "cipher name without NUL": lambda h: h.__setitem__(slice(8, 40), b"a" * 32),
            "unknown cipher": lambda h: h.__setitem__(slice(8, 16), b"foo\0\0\0\0\0"),
            "unknown hash": lambda h: h.__setitem__(slice(72, 80), b"sha2566\0"),
            "bad mode string": lambda h: h.__setitem__(slice(40, 52), b"xtsplain64\0\0"),
            "unknown ivgen": lambda h: h.__setitem__(slice(40, 52), b"xts-plain65\0"),
            "key bytes huge": be32(108, 0xFFFFFFF0),
            "payload over header": be32(104, 2),
            "master key iterations 0": be32(164, 0),
            "stripes 0": be32(slot(0) + 44, 0),
            "slot iterations 0": be32(slot(0) + 4, 0),
            "slot state": be32(slot(2), 1),
            "slot in header": be32(slot(0) + 40, 1),
            "slot past payload": be32(slot(7) + 40, 4000),
            "slots overlap": be32(slot(5) + 40, 8 + 504 * 4),
            "payload past EOF": be32(104, 0xFFFFFFF0),
        }
        for name, mutate in cases.items():
            with self.subTest(name):
                img = self.p("bad.luks")
                h = bytearray(hdr)
                mutate(h)
                shutil.copyfile(good, img)
                with open(img, "r+b") as f:
                    f.write(h)
                before = digest(img)
                v = vblk("convert", "--object", SECRET, "--image-opts", opts(img), "-O", "raw", self.p("o.raw"))
                self.assertEqual(v.rc, 1, v)
                self.assertEqual(len(v.stderr.strip().splitlines()), 1, v)
                q = qemu("convert", "--object", SECRET, "--image-opts", opts(img), "-O", "raw", self.p("o.raw"))
                if name == "payload past EOF":
                    # QEMU opens it and fails later; vblk says why at open.
                    self.assertIn("beyond the end of the file (%d bytes)" % size, v.stderr)
                else:
                    self.assertSameResult(v, q, name)
                # info (no key) checks the header as well.
                v = vblk("info", img)
                if name != "payload past EOF":
                    self.assertSameResult(v, qemu("info", img), name)
                self.assertEqual(digest(img), before)

    # -- 3. create ----------------------------------------------------------
    def test_create_opens_in_qemu_and_cryptsetup(self):
        for extra in ("", "cipher-alg=aes-128,cipher-mode=cbc,ivgen-alg=essiv,hash-alg=sha1",
                      "cipher-alg=aes-256,cipher-mode=cbc,ivgen-alg=plain64,ivgen-hash-alg=sha512"):
            with self.subTest(extra=extra):
                img = self.p("v.luks")
                o = "key-secret=s0,iter-time=10" + ("," + extra if extra else "")
                r = vblk("create", "-f", "luks", "--object", SECRET, "-o", o, img, "3M")
                self.assertEqual(r.rc, 0, r)
                # The "Formatting" line lists the options in qemu-img's order
                # (it prints it before its own, sometimes flaky, timing).
                os.unlink(img)
                q = qemu("create", "-f", "luks", "--object", SECRET, "-o", o, img, "3M")
                self.assertEqual(r.stdout, q.stdout)
                if os.path.exists(img):
                    os.unlink(img)
                r = vblk("create", "-q", "-f", "luks", "--object", SECRET, "-o", o, img, "3M")
                self.assertEqual((r.rc, r.stdout), (0, ""), r)
                info = json.loads(qemu("info", "--output=json", img).stdout)
                self.assertEqual(info["format"], "luks")
                self.assertEqual(info["virtual-size"], 3 * MiB)
                ref = self.p("ref.luks")
                qemu_create(ref, 3 * MiB, extra)
                spec_v = info["format-specific"]["data"]
                spec_q = json.loads(qemu("info", "--output=json", ref).stdout)["format-specific"]["data"]
                for k in ("uuid", "master-key-iters"):
                    spec_v.pop(k), spec_q.pop(k)
                for s in spec_v["slots"] + spec_q["slots"]:
                    s.pop("iters", None)
                self.assertEqual(spec_v, spec_q)
                self.assertEqual(os.path.getsize(img), os.path.getsize(ref))
                self.check_roundtrip_small(img)
                if CRYPTSETUP:
                    d = subprocess.run([CRYPTSETUP, "luksDump", img], capture_output=True, text=True)
                    self.assertEqual(d.returncode, 0, d)
                    self.assertIn("Version:       \t1", d.stdout)
                    # cryptsetup without device-mapper checks some cipher
                    # strings (cbc-plain64:sha512) only through dm: it must
                    # treat vblk's image as it treats qemu-img's.
                    for pw, ok in ((b"pw", True), (b"wrong", False)):
                        t = [subprocess.run([CRYPTSETUP, "open", "--test-passphrase", i, "-d", "-"],
                                            input=pw, capture_output=True) for i in (img, ref)]
                        self.assertEqual(t[0].returncode, t[1].returncode, t)
                        if extra == "":
                            self.assertEqual(t[0].returncode == 0, ok, t)

    def check_roundtrip_small(self, img):
        r = vblk("io", "--object", SECRET, "--image-opts", opts(img), "-c", "write -P 0x3c 512 100000")
        self.assertEqual(r.rc, 0, r)
        qemu_io(img, "read -P 0x3c 512 100000", "write -P 0x4d 2M 4096")
        r = vblk("io", "--object", SECRET, "--image-opts", opts(img), "-c", "read -P 0x4d 2M 4096")
        self.assertEqual(r.rc, 0, r)
        self.assertNotIn("fail", r.stdout.lower(), r)

    def test_create_errors(self):
        for o in ("", "key-secret=nope", "key-secret=s0,cipher-alg=aes-999", "key-secret=s0,cipher-mode=foo",
                  "key-secret=s0,ivgen-alg=x", "key-secret=s0,hash-alg=sha3", "key-secret=s0,cipher-alg=des",
                  "key-secret=s0,ivgen-alg=essiv,ivgen-hash-alg=sha1", "key-secret=s0,iter-time=-1",
                  "key-secret=s0,preallocation=bogus"):
            with self.subTest(o=o):
                img = self.p("e.luks")
                argv = ["create", "-f", "luks", "--object", SECRET] + (["-o", o] if o else []) + [img, "1M"]
                v = vblk(*argv)
                exists_v = os.path.exists(img)
                for _ in range(5):  # QEMU's flaky PBKDF timing, as in qemu_create
                    q = qemu(*argv)
                    if "Unable to get accurate CPU usage" not in q.stderr:
                        break
                exists_q = os.path.exists(img)
                if os.path.exists(img):
                    os.unlink(img)
                self.assertEqual(v.rc, 1, v)
                # The measured PBKDF rate is the machine's.
                digits = lambda t: re.sub(r"iterations \d+", "iterations N", t)  # noqa: E731
                v.stderr, q.stderr = digits(v.stderr), digits(q.stderr)
                self.assertSameResult(v, q, o)
                self.assertEqual(exists_v, exists_q, o)

    def test_convert_to_luks(self):
        """convert -O luks: the new target opens with -o key-secret (as
        qemu-img's img_add_key_secrets does) and its zero areas are written,
        since a new LUKS payload reads as noise, not zeroes."""
        src = self.p("src.raw")
        with open(src, "wb") as f:
            f.write(rand_bytes(MiB, 1) + bytes(MiB) + rand_bytes(MiB - 512, 2))
        dst = self.p("dst.luks")
        r = vblk("convert", "-O", "luks", "--object", SECRET, "-o", "key-secret=s0,iter-time=50", src, dst)
        self.assertEqual(r.rc, 0, r)
        q = qemu("compare", "--object", SECRET, "--image-opts", opts(dst), "driver=raw,file.filename=" + src)
        self.assertEqual(q.rc, 0, q)
        self.assertEqual(q.stdout, "Images are identical.\n")
        # Without the key: qemu-img's words, and no file left behind.
        os.unlink(dst)
        v, q = both("convert", "-O", "luks", src, dst)
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 1)
        self.assertFalse(os.path.exists(dst))

    def test_create_help(self):
        v, q = both("create", "-f", "luks", "-o", "help", self.p("x"))
        self.assertSameResult(v, q)


class LuksQmpTest(GraphTestCase):
    """blockdev-create driver luks in vblk serve beside qemu-storage-daemon."""

    def test_blockdev_create(self):
        P = self.path

        def run_(q, c, out):
            c("object-add", **{"qom-type": "secret", "id": "s0", "data": "pw"})
            create_luks_job(c, "f", {"driver": "file", "filename": P("l.luks"), "size": 0})
            c("blockdev-add", driver="file", filename=P("l.luks"), **{"node-name": "lf"})
            # Refused by the command (schema) and by the job (QEMU's words).
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "luks", "file": "lf", "size": MiB,
                                                               "cipher-alg": "aes-999"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "luks", "file": "lf", "size": MiB,
                                                               "iter-time": "x"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "luks", "size": MiB}})
            for bad in ({}, {"key-secret": "nope"}, {"key-secret": "s0", "cipher-alg": "des"},
                        {"key-secret": "s0", "ivgen-alg": "essiv", "ivgen-hash-alg": "sha1"}):
                create_luks_job(c, "e", dict({"driver": "luks", "file": "lf", "size": MiB}, **bad))
            create_luks_job(c, "l1", {"driver": "luks", "file": "lf", "size": 3 * MiB, "key-secret": "s0",
                                  "iter-time": 50, "cipher-alg": "aes-128", "cipher-mode": "cbc",
                                  "ivgen-alg": "essiv", "hash-alg": "sha1"})
            c("blockdev-del", **{"node-name": "lf"})
            c("blockdev-add", driver="luks", file={"driver": "file", "filename": P("l.luks")},
              **{"key-secret": "s0", "node-name": "l"})
            c("blockdev-add", driver="luks", file={"driver": "file", "filename": P("l.luks")},
              **{"node-name": "nokey"})
            # The node as query-named-block-nodes shows it (encrypted: true);
            # the random and timed fields left out.
            nodes = [n for n in q.cmd("query-named-block-nodes", {"flat": True})["return"] if n["drv"] == "luks"]
            comparable_luks_nodes(nodes, lambda n: n["image"]["format-specific"]["data"])
            self.assertEqual(len(nodes), 1)
            self.assertTrue(nodes[0]["encrypted"])
            out.append(("nodes", nodes))

        run_retrying_flakes(lambda: self.both(run_))
        for i in range(len(DAEMONS)):
            img = self.kept(i, "l.luks")
            info = json.loads(qemu("info", "--output=json", img).stdout)
            self.assertEqual((info["format"], info["virtual-size"]), ("luks", 3 * MiB))
            data = info["format-specific"]["data"]
            self.assertEqual((data["cipher-alg"], data["cipher-mode"], data["ivgen-alg"], data["hash-alg"]),
                             ("aes-128", "cbc", "essiv", "sha1"))
            qemu_io(img, "write -P 0x21 0 3M", "read -P 0x21 0 3M")


if __name__ == "__main__":
    unittest.main()
