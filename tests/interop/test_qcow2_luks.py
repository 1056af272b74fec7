#!/usr/bin/env python3
"""qcow2 with encrypt.format=luks beside QEMU 7.2 (block/qcow2.c's crypto
header extension, crypt_physical_offset, crypto/block-luks.c).

Images qemu-img made and qemu-io wrote read bit-exact through vblk (512 B
and 64 KiB clusters, extended L2); images vblk made and wrote pass
qemu-img check and compare equal to their plaintext with the key; missing
and wrong keys fail with QEMU's words; info prints QEMU's encrypt block; the
file holds ciphertext, not the guest's bytes.
"""

import json
import os
import shutil
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import InteropTestCase, KiB, MiB, both, qemu, rand_bytes, run, vblk  # noqa: E402
from graph_common import DAEMONS, GraphTestCase, comparable_luks_nodes, create_luks_job, run_retrying_flakes  # noqa: E402

QEMU_IO = shutil.which("qemu-io")
SECRET = "secret,id=s0,data=pw"
WRONG = "secret,id=s0,data=not-pw"
# A sector's worth of text that can be searched for in the file.
PLAIN = (b"vblk plaintext marker; must not appear in an encrypted image. " * 9)[:512]


def opts(path, key="s0"):
    return "driver=qcow2,file.filename=%s,encrypt.key-secret=%s" % (path, key)


def target_json(path, key="s0"):
    return "json:" + json.dumps({"driver": "qcow2", "file": {"driver": "file", "filename": path},
                                 "encrypt": {"key-secret": key}})


def qemu_create(path, size, extra=""):
    """qemu-img create -f qcow2 -o encrypt.format=luks; QEMU's iteration
    timing fails now and then on a busy machine: retried."""
    o = "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10" + ("," + extra if extra else "")
    for _ in range(5):
        r = qemu("create", "-q", "-f", "qcow2", "--object", SECRET, "-o", o, path, str(size))
        if r.rc == 0:
            return
    raise AssertionError(r)


def vblk_create(path, size, extra=""):
    o = "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10" + ("," + extra if extra else "")
    r = vblk("create", "-q", "-f", "qcow2", "--object", SECRET, "-o", o, path, str(size))
    assert r.rc == 0, r


def qemu_io(path, *cmds):
    argv = [QEMU_IO, "--object", SECRET, "--image-opts", opts(path)]
    for c in cmds:
        argv += ["-c", c]
    r = run(argv)
    assert r.rc == 0 and "fail" not in r.stdout.lower() and not r.stderr, r
    return r


def vblk_io(path, *cmds):
    argv = ["io", "--object", SECRET, "--image-opts", opts(path)]
    for c in cmds:
        argv += ["-c", c]
    r = vblk(*argv)
    assert r.rc == 0 and "fail" not in r.stdout.lower() and not r.stderr, r
    return r


def read(path):
    with open(path, "rb") as f:
        return f.read()


# Writes that cover the interesting cases for any cluster size up to 64 KiB
# in a 4 MiB image: sector-sized, unaligned-to-cluster, cluster-crossing,
# overwrites of allocated data (in place), partial clusters (copy-on-write
# around them), zero writes (zero clusters and partial zeroes) and discards.
WRITES = [
    "write -P 0x11 0 512",
    "write -P 0x12 1536 3k",
    "write -P 0x13 60k 10k",
    "write -P 0x14 512k 192k",
    "write -P 0x15 520k 1k",
    "write -z 600k 64k",
    "write -z 1m 3k",
    "write -P 0x16 2m 300k",
    "discard 2m 64k",
    "write -P 0x17 4193792 512",
]


class Qcow2LuksTest(InteropTestCase):

    def p(self, name):
        return os.path.join(self.tmp, name)

    def to_raw(self, img, key="s0", secret=SECRET):
        """vblk's and qemu-img's plaintext of img: (vblk raw, qemu raw)."""
        v = vblk("convert", "--object", secret, "--image-opts", opts(img, key), "-O", "raw", self.p("v.raw"))
        q = qemu("convert", "--object", secret, "--image-opts", opts(img, key), "-O", "raw", self.p("q.raw"))
        self.assertEqual((v.rc, q.rc), (0, 0), (v, q))
        return read(self.p("v.raw")), read(self.p("q.raw"))

    # -- 1. images qemu-img made, qemu-io wrote, read bit-exact -------------
    @unittest.skipUnless(QEMU_IO, "qemu-io not installed")
    def test_qemu_written_reads_bit_exact(self):
        for extra in ("cluster_size=512", "cluster_size=64k", "cluster_size=16k,extended_l2=on",
                      "cluster_size=4k,encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,"
                      "encrypt.ivgen-alg=essiv,encrypt.hash-alg=sha1"):
            with self.subTest(extra=extra):
                img = self.p("q.qcow2")
                qemu_create(img, 4 * MiB, extra)
                qemu_io(img, *WRITES)
                v, q = self.to_raw(img)
                self.assertEqual(len(v), 4 * MiB)
                self.assertTrue(v == q, extra)
                # Patterns where qemu-io put them (not both wrong alike).
                self.assertEqual(v[1536:1536 + 3 * KiB], b"\x12" * 3 * KiB)
                self.assertEqual(v[520 * KiB:521 * KiB], b"\x15" * KiB)
                self.assertEqual(v[600 * KiB:664 * KiB], bytes(64 * KiB))
                # vblk's reads of ranges, and qemu-img compare of both raws.
                vblk_io(img, "read -P 0x13 60k 10k", "read -P 0x14 521k 79k", "read -P 0 2m 64k",
                        "read -P 0x16 2162688 241664")
                r = qemu("compare", "-f", "raw", "-F", "raw", self.p("v.raw"), self.p("q.raw"))
                self.assertEqual(r.rc, 0, r)
                v, q = both("check", "--object", SECRET, "--image-opts", opts(img))
                self.assertSameResult(v, q, extra)
                os.unlink(img)

    # -- 2. images vblk made and wrote pass qemu-img check and compare ------
    def check_vblk_image(self, img, ref):
        r = qemu("check", "--object", SECRET, "--image-opts", opts(img))
        self.assertEqual(r.rc, 0, r)
        self.assertIn("No errors were found on the image.", r.stdout)
        r = qemu("compare", "--object", SECRET, "--image-opts", opts(img), "driver=raw,file.filename=" + ref)
        self.assertEqual(r.rc, 0, r)
        if QEMU_IO:
            qemu_io(img, "read -P 0x13 60k 10k")

    def test_vblk_written_passes_qemu_check_and_compare(self):
        for extra in ("cluster_size=512", "cluster_size=64k", "cluster_size=16k,extended_l2=on"):
            with self.subTest(extra=extra):
                img = self.p("v.qcow2")
                vblk_create(img, 4 * MiB, extra)
                vblk_io(img, *WRITES)
                # The same writes on a plain raw image are the reference.
                ref = self.p("ref.raw")
                with open(ref, "wb") as f:
                    f.truncate(4 * MiB)
                r = vblk("io", "-f", "raw", *sum((["-c", w] for w in WRITES), []), ref)
                self.assertEqual(r.rc, 0, r)
                self.check_vblk_image(img, ref)
                os.unlink(img)

    def test_convert_into_encrypted_qcow2(self):
        src = self.p("src.raw")
        data = bytearray(rand_bytes(3 * MiB, "luks-src"))
        data[MiB:2 * MiB] = bytes(MiB)  # a zero area to skip
        with open(src, "wb") as f:
            f.write(data)
        # -O qcow2 -o encrypt...: created, opened with the key, written.
        out = self.p("out.qcow2")
        r = vblk("convert", "--object", SECRET, "-O", "qcow2", "-o",
                 "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10,cluster_size=4k", src, out)
        self.assertEqual(r.rc, 0, r)
        self.check_vblk_image_against(out, src)
        # -n into an existing encrypted image (qemu-img made).
        tgt = self.p("tgt.qcow2")
        qemu_create(tgt, 3 * MiB)
        r = vblk("convert", "-n", "--object", SECRET, "-f", "raw", "-O", "qcow2", src, target_json(tgt))
        self.assertEqual(r.rc, 0, r)
        self.check_vblk_image_against(tgt, src)

    def check_vblk_image_against(self, img, ref):
        r = qemu("check", "--object", SECRET, "--image-opts", opts(img))
        self.assertEqual(r.rc, 0, r)
        r = qemu("compare", "--object", SECRET, "--image-opts", opts(img), "driver=raw,file.filename=" + ref)
        self.assertEqual(r.rc, 0, r)
        r = vblk("compare", "--object", SECRET, "--image-opts", opts(img), "driver=raw,file.filename=" + ref)
        self.assertEqual(r.rc, 0, r)

    # -- 3. missing and wrong keys: QEMU's words ----------------------------
    def test_key_errors(self):
        img = self.p("k.qcow2")
        qemu_create(img, MiB)
        before = read(img)
        cases = [
            ("--object", WRONG, "--image-opts", opts(img)),       # wrong password
            ("--image-opts", opts(img)),                           # no such secret
            ("--object", SECRET, "--image-opts", opts(img, "s1")),  # another id
            ("--object", SECRET, img),                             # no key-secret
            ("--object", SECRET, "--image-opts", opts(img) + ",encrypt.format=aes"),
            ("--object", SECRET, "--image-opts", opts(img) + ",encrypt.format=luks"),
        ]
        for args in cases:
            for cmd in (["convert", "-O", "raw"], ["check"], ["map", "--output=json"]):
                with self.subTest(args=args, cmd=cmd):
                    tail = [self.p("o.raw")] if cmd[0] == "convert" else []
                    v, q = both(*cmd, *args, *tail)
                    self.assertSameResult(v, q)
        v, q = both("check", "--object", WRONG, "--image-opts", opts(img))
        self.assertIn("Invalid password, cannot unlock any keyslot", v.stderr)
        # Encryption options on a plain image.
        plain = self.p("plain.qcow2")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", plain, "1M").rc, 0)
        v, q = both("check", "--object", SECRET, "--image-opts", opts(plain) + ",encrypt.format=luks")
        self.assertSameResult(v, q)
        self.assertIn("No encryption in image header", v.stderr)
        self.assertEqual(read(img), before)

    def test_create_with_a_wrong_secret_keeps_an_existing_file(self):
        """The volume (secret, algorithms) is made before the file is
        touched: a typo in the secret id changes nothing on disk (QEMU
        truncates the file first and then removes it)."""
        for fmt, o in (("qcow2", "encrypt.format=luks,encrypt.key-secret=typo"), ("luks", "key-secret=typo")):
            with self.subTest(fmt=fmt):
                img = self.p("precious.img")
                data = rand_bytes(64 * KiB, 5)
                with open(img, "wb") as f:
                    f.write(data)
                r = vblk("create", "-f", fmt, "--object", SECRET, "-o", o, img, "1M")
                self.assertEqual(r.rc, 1, r)
                self.assertIn("No secret with id 'typo'", r.stderr)
                with open(img, "rb") as f:
                    self.assertEqual(f.read(), data)

    def test_create_errors(self):
        for o in ("encrypt.format=luks", "encrypt.format=luks,encrypt.key-secret=nope",
                  "encrypt.format=luks,encrypt.key-secret=s0,encrypt.cipher-alg=foo",
                  "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=x",
                  "encrypt.key-secret=s0", "encrypt.format=foo,encrypt.key-secret=s0", "encrypt=on"):
            with self.subTest(o=o):
                v, q = both("create", "-f", "qcow2", "--object", SECRET, "-o", o, "e.qcow2", "1M", cwd=self.tmp)
                self.assertSameResult(v, q)
                self.assertFalse(os.path.exists(self.p("e.qcow2")))
        # Compressed and encrypted at once.
        src = self.p("s.raw")
        with open(src, "wb") as f:
            f.write(rand_bytes(MiB, 1))
        v, q = both("convert", "-c", "--object", SECRET, "-O", "qcow2", "-o",
                    "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10", src, self.p("c.qcow2"))
        self.assertSameResult(v, q)
        self.assertIn("Compression and encryption not supported at the same time", v.stderr)
        # vblk refuses a compressed write into an encrypted image (QEMU
        # would store the cluster in the clear).
        img = self.p("w.qcow2")
        vblk_create(img, MiB)
        r = vblk("io", "--object", SECRET, "--image-opts", opts(img), "-c", "write -c -P 0x55 0 64k")
        self.assertIn("write failed: Operation not supported", r.stdout + r.stderr)
        self.assertNotIn(b"\x55" * 4096, read(img))

    # -- 4. info: encrypted: yes and QEMU's encrypt block --------------------
    def test_info(self):
        img = self.p("i.qcow2")
        qemu_create(img, 2 * MiB, "cluster_size=4k,encrypt.cipher-alg=aes-128,encrypt.ivgen-alg=essiv")
        for extra in ([], ["--output=json"]):
            v, q = both("info", *extra, img)
            self.assertSameResult(v, q)
            v, q = both("info", *extra, "--object", SECRET, "--image-opts", opts(img))
            self.assertSameResult(v, q)
        self.assertIn("encrypted: yes", v.stdout if not extra else vblk("info", img).stdout)
        # An image vblk made: the same encrypt fields as qemu-img sees them.
        mine = self.p("m.qcow2")
        vblk_create(mine, 2 * MiB, "encrypt.hash-alg=sha512")
        v, q = both("info", "--output=json", mine)
        self.assertEqual(v.rc, 0, v)
        vi, qi = json.loads(v.stdout), json.loads(q.stdout)
        self.assertTrue(vi["encrypted"] and qi["encrypted"])
        self.assertEqual(vi["format-specific"], qi["format-specific"])
        enc = vi["format-specific"]["data"]["encrypt"]
        self.assertEqual((enc["format"], enc["cipher-alg"], enc["hash-alg"]), ("luks", "aes-256", "sha512"))
        v, q = both("info", mine)
        self.assertEqual(v.stdout.split("Format specific information:")[1],
                         q.stdout.split("Format specific information:")[1])

    # -- 5. the file holds ciphertext ----------------------------------------
    def test_data_is_encrypted_by_host_offset(self):
        img = self.p("c.qcow2")
        vblk_create(img, MiB, "cluster_size=4k")
        pattern = self.p("plain.bin")
        with open(pattern, "wb") as f:
            f.write(PLAIN * 16)
        # The same 8 KiB at two guest places: two host clusters.
        src = self.p("src.raw")
        with open(src, "wb") as f:
            f.truncate(MiB)
            f.seek(0)
            f.write(PLAIN * 16)
            f.seek(512 * KiB)
            f.write(PLAIN * 16)
        r = vblk("convert", "-n", "--object", SECRET, "-f", "raw", "-O", "qcow2", src, target_json(img))
        self.assertEqual(r.rc, 0, r)
        data = read(img)
        self.assertNotIn(PLAIN[:64], data)
        v, q = self.to_raw(img)
        self.assertTrue(v == q == read(src))
        # The sectors' ciphertext differs by host offset (the IV): the two
        # copies are not the same bytes in the file. Their host clusters
        # from the L1 and L2 tables (4 KiB clusters: 512 KiB is L2 index 128).
        l1 = int.from_bytes(data[40:48], "big")
        l2 = int.from_bytes(data[l1:l1 + 8], "big") & 0x00fffffffffffe00
        hosts = [int.from_bytes(data[l2 + 8 * i:l2 + 8 * i + 8], "big") & 0x00fffffffffffe00 for i in (0, 128)]
        self.assertTrue(all(hosts) and hosts[0] != hosts[1], hosts)
        ct = [data[h:h + 8 * KiB] for h in hosts]
        self.assertNotEqual(ct[0], ct[1])
        self.assertNotEqual(ct[0], PLAIN * 16)
        self.assertNotEqual(ct[0][:512], ct[0][512:1024])
        # Sanity of the check: an unencrypted image shows the text.
        plain = self.p("p.qcow2")
        self.assertEqual(vblk("create", "-q", "-f", "qcow2", plain, "1M").rc, 0)
        self.assertEqual(vblk("convert", "-n", "-f", "raw", "-O", "qcow2", src, plain).rc, 0)
        self.assertIn(PLAIN[:64], read(plain))

    # -- 6. check counts the crypto header clusters --------------------------
    def test_check_counts_header(self):
        for maker in (qemu_create, vblk_create):
            img = self.p("h.qcow2")
            maker(img, MiB, "cluster_size=512")
            for fix in ([], ["-r", "all"]):
                v, q = both("check", *fix, "--object", SECRET, "--image-opts", opts(img))
                self.assertSameResult(v, q)
                self.assertIn("No errors were found", v.stdout)
            os.unlink(img)


class Qcow2LuksQmpTest(GraphTestCase):
    """blockdev-create qcow2 with encrypt in vblk serve beside
    qemu-storage-daemon."""

    def test_blockdev_create(self):
        P = self.path

        def run_(q, c, out):
            c("object-add", **{"qom-type": "secret", "id": "s0", "data": "pw"})
            create_luks_job(c, "f", {"driver": "file", "filename": P("e.qcow2"), "size": 0})
            c("blockdev-add", driver="file", filename=P("e.qcow2"), **{"node-name": "ef"})
            base = {"driver": "qcow2", "file": "ef", "size": MiB}
            # Refused by the command (schema) and by the job (QEMU's words).
            c("blockdev-create", **{"job-id": "j", "options": dict(base, encrypt={"key-secret": "s0"})})
            c("blockdev-create", **{"job-id": "j", "options": dict(base, encrypt={"format": "x"})})
            c("blockdev-create", **{"job-id": "j", "options": dict(
                base, encrypt={"format": "luks", "cipher-alg": "aes-999"})})
            for bad in ({}, {"key-secret": "nope"}):
                create_luks_job(c, "e", dict(base, encrypt=dict({"format": "luks"}, **bad)))
            create_luks_job(c, "q", dict(base, encrypt={"format": "luks", "key-secret": "s0", "iter-time": 10,
                                                    "cipher-alg": "aes-128"}))
            c("blockdev-add", driver="qcow2", file="ef", encrypt={"format": "luks", "key-secret": "s0"},
              **{"node-name": "q"})
            nodes = [n for n in q.cmd("query-named-block-nodes", {"flat": True})["return"] if n["drv"] == "qcow2"]
            comparable_luks_nodes(nodes, lambda n: n["image"]["format-specific"]["data"]["encrypt"])
            self.assertEqual(len(nodes), 1)
            self.assertTrue(nodes[0]["encrypted"])
            out.append(("nodes", nodes))

        run_retrying_flakes(lambda: self.both(run_))
        for i in range(len(DAEMONS)):
            img = self.kept(i, "e.qcow2")
            r = qemu("check", "--object", SECRET, "--image-opts", opts(img))
            self.assertEqual(r.rc, 0, (DAEMONS[i][0], r))
            if QEMU_IO:
                qemu_io(img, "write -P 0x21 0 1M", "read -P 0x21 0 1M")


if __name__ == "__main__":
    unittest.main()
