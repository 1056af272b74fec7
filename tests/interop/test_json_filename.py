"""QEMU's json: pseudo-protocol in the qemu-img style commands, beside
qemu-img: an object naming its driver opens as --image-opts would (the names
`info` prints for nodes known only by options, such as rbd's, can be given
back); parse errors and non-objects fail with QEMU's texts."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MiB, InteropTestCase, both  # noqa: E402


class JsonFilenameTest(InteropTestCase):
    def test_json_names_as_qemu_img(self):
        raw = os.path.join(self.tmp, "a.raw")
        qcow2 = os.path.join(self.tmp, "a.qcow2")
        with open(raw, "wb") as f:
            f.truncate(MiB)
            f.seek(4096)
            f.write(b"\x5a" * 65536)
        self.assertEqual(both("convert", "-O", "qcow2", raw, qcow2)[0].rc, 0)
        names = [
            'json:{',
            'json:[1]',
            'json:{"driver": "file", "filename": "%s"}' % raw,
            'json:{"driver": "raw", "file": {"driver": "file", "filename": "%s"}}' % raw,
            'json:{"driver": "qcow2", "file": {"driver": "file", "filename": "%s"}}' % qcow2,
            'json:{"driver": "qcow2", "file": {"driver": "file", "filename": "%s"}}' % raw,
            'json:{"driver": "file", "filename": "/nonexistent/x"}',
            'json:{"driver": "null-co", "size": 1048576, "read-zeroes": true}',
            'json:{"driver": "null-co", "filename": "null-co://x"}',
            # Protocol prefixes: the name alone picks the driver.
            'null-co://',
            'null-co://x',
        ]
        for name in names:
            for cmd in (["info"], ["info", "--output=json"], ["map", "--output=json"], ["check"]):
                v, q = both(*cmd, name)
                self.assertSameResult(v, q, (cmd, name))
        v, q = both("compare", names[3], names[4])
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 0, v)
        out = os.path.join(self.tmp, "v.raw")
        v, q = both("convert", "-O", "raw", names[4], out)
        self.assertEqual((v.rc, q.rc), (0, 0), (v, q))
        with open(out, "rb") as a, open(raw, "rb") as b:
            self.assertTrue(a.read() == b.read())

    def test_blkdebug_legacy_names(self):
        # blkdebug:[CONFIG]:IMAGE, with QEMU's config file format and its
        # errors (qemu-iotests name images this way).
        raw = os.path.join(self.tmp, "r.raw")
        qcow2 = os.path.join(self.tmp, "q.qcow2")
        with open(raw, "wb") as f:
            f.truncate(4 * MiB)
            f.seek(2 * MiB)
            f.write(b"\x22" * 65536)
        self.assertEqual(both("convert", "-f", "raw", "-O", "qcow2", raw, qcow2)[0].rc, 0)
        confs = {
            "s.conf": '# comment\n[inject-error]\nevent = "read_aio"\nerrno = "5"\nsector = "4096"\nonce ="off"\n',
            "group.conf": "[bogus]\n",
            "colon.conf": "[inject-error]\nevent: x\n",
            "nospace.conf": '[inject-error]\nevent="x"\n',
            "nogroup.conf": 'event = "x"\n',
        }
        for name, text in confs.items():
            with open(os.path.join(self.tmp, name), "w") as f:
                f.write(text)
        c = lambda name: os.path.join(self.tmp, name)  # noqa: E731
        out = os.path.join(self.tmp, "o.raw")
        cases = [
            ["info", "blkdebug::" + qcow2],
            ["map", "--output=json", "-f", "raw", "blkdebug::" + raw],
            ["compare", "blkdebug::" + qcow2, raw],
            ["convert", "-f", "raw", "-O", "raw", "blkdebug:%s:%s" % (c("s.conf"), raw), out],
            ["info", "blkdebug:%s:%s" % (c("missing.conf"), raw)],
            ["info", "blkdebug:" + raw],
        ] + [["info", "blkdebug:%s:%s" % (c(n), raw)] for n in ("group.conf", "colon.conf", "nospace.conf",
                                                                 "nogroup.conf")]
        for cmd in cases:
            v, q = both(*cmd)
            self.assertSameResult(v, q, cmd)
        # The injected error reached the copy at the configured sector.
        v, _ = both(*cases[3])
        self.assertEqual(v.rc, 1, v)
        self.assertIn("error while reading at byte 2097152: Input/output error", v.stderr)


if __name__ == "__main__":
    unittest.main()
