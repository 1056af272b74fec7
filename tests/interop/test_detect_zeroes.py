#!/usr/bin/env python3
"""Interop: detect-zeroes on a backup target, vblk serve beside
qemu-storage-daemon, and `vblk backup`'s own zero detection beside
qemu-img convert.

A source where every other MiB is allocated zeroes (the rest random data) is
backed up with blockdev-backup sync=full to a fresh raw target whose node has
detect-zeroes off, on, or unmap (with discard=unmap, which unmap needs). Both
daemons must leave the same allocation (`qemu-img map --output=json` of the
target) and the same content (`qemu-img compare`), and refuse the same wrong
settings with the same error. `vblk backup` (its CLI default: zero runs
become write-zeroes) must allocate no more than `qemu-img convert` of the
same source.

Only the Python standard library is used.
"""

import json
import os
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import BothDaemons, MiB, InteropTestCase, rand_bytes, storage_daemons, vblk  # noqa: E402

QEMU_IMG = shutil.which("qemu-img")
SIZE = 16 * MiB


def make_source(path):
    """Every other MiB allocated zeroes, the rest random data."""
    with open(path, "wb") as f:
        for i in range(SIZE // MiB):
            f.write(bytes(MiB) if i % 2 else rand_bytes(MiB, "dz-%d" % i))
        f.flush()
        os.fsync(f.fileno())


def qemu_map(path):
    r = subprocess.run([QEMU_IMG, "map", "--output=json", "-f", "raw", path], capture_output=True, text=True,
                       check=True)
    return [(e["start"], e["length"], e["data"], e["zero"]) for e in json.loads(r.stdout)]


def compare(a, b):
    r = subprocess.run([QEMU_IMG, "compare", "-f", "raw", "-F", "raw", a, b], capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def allocated(path):
    """Allocated bytes once on disk (delayed allocation would hide the
    file system's extent-tree blocks until then)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return os.stat(path).st_blocks * 512


@unittest.skipUnless(QEMU_IMG, "needs qemu-img")
class DetectZeroesTest(BothDaemons, InteropTestCase):

    def test_backup_target_detect_zeroes(self):
        if len(storage_daemons()) < 2:
            self.skipTest("needs both qemu-storage-daemon and vblk serve")

        def run(q, d):
            src = os.path.join(d, "src.raw")
            make_source(src)
            q.ok("blockdev-add", **{"driver": "raw", "node-name": "src",
                                    "file": {"driver": "file", "filename": src}})
            seen = {}
            for mode in ("off", "on", "unmap"):
                tgt = os.path.join(d, "tgt-%s.raw" % mode)
                with open(tgt, "wb") as f:
                    f.truncate(SIZE)
                node = {"driver": "raw", "node-name": "tgt", "detect-zeroes": mode,
                        "file": {"driver": "file", "filename": tgt}}
                if mode == "unmap":
                    node["discard"] = "unmap"
                q.ok("blockdev-add", **node)
                q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full"})
                e = q.event("BLOCK_JOB_COMPLETED", 60)
                self.assertNotIn("error", e["data"])
                q.drain_events()
                q.ok("blockdev-del", **{"node-name": "tgt"})
                self.assertEqual(compare(src, tgt), (0, "Images are identical."), mode)
                seen[mode] = qemu_map(tgt)
            # Wrong settings, refused alike.
            errs = []
            for extra in ({"detect-zeroes": "unmap"}, {"detect-zeroes": "unmap", "discard": "ignore"}):
                tgt = os.path.join(d, "tgt-off.raw")
                r = q.cmd("blockdev-add", **dict({"driver": "raw", "node-name": "bad",
                                                  "file": {"driver": "file", "filename": tgt}}, **extra))
                errs.append(r.get("error"))
            seen["errors"] = errs
            return seen

        seen = self.each_daemon(run)
        self.assertSame(seen)
        s = list(seen.values())[0]
        # unmap leaves the zero MiBs as holes; off writes them as data.
        self.assertTrue(all(data for _, _, data, _ in s["off"]), s["off"])
        holes = sum(length for _, length, data, zero in s["unmap"] if not data and zero)
        self.assertEqual(holes, SIZE // 2, s["unmap"])
        self.assertEqual(s["errors"][0]["class"], "GenericError")

    def test_cli_backup_as_sparse_as_qemu_img_convert(self):
        d = self.subdir("cli")
        src = os.path.join(d, "src.raw")
        make_source(src)
        conv, bak = os.path.join(d, "conv.raw"), os.path.join(d, "bak.raw")
        subprocess.run([QEMU_IMG, "convert", "-f", "raw", "-O", "raw", src, conv], check=True)
        r = vblk("backup", "-f", "raw", "-O", "raw", src, bak)
        self.assertEqual(r.rc, 0, r.stderr)
        self.assertEqual(compare(src, bak), (0, "Images are identical."))
        self.assertLessEqual(allocated(bak), allocated(conv))
        self.assertLess(allocated(bak), SIZE // 2 + MiB)
        self.assertEqual(qemu_map(bak), qemu_map(conv))


if __name__ == "__main__":
    unittest.main()
