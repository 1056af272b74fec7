#!/usr/bin/env python3
"""Interop: users of one node inside one daemon exclude each other as QEMU's
block layer makes them (bdrv_parent_perms_conflict), beside
qemu-storage-daemon 7.2: the same graph and commands must give the same
replies, word for word, and leave the images untouched.

The operator's mistakes tried here: blockdev-create of a new image over the
file node a running qcow2 node sits on (it would reformat the disk under
it), a writable export of that file node, a second format node over it.
"""

import hashlib
import os
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_common import GraphTestCase, img  # noqa: E402

MiB = 1 << 20


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class PermsTest(GraphTestCase):

    def prepare_disk(self):
        """A 64 MiB qcow2 with data, for d0 over f0."""
        p = self.path("disk.qcow2")
        img("create", "-q", "-f", "qcow2", p, "64M")
        r = __import__("subprocess").run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 4M", p],
                                          capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)

    def open_disk(self, c):
        c("blockdev-add", driver="file", filename=self.path("disk.qcow2"), **{"node-name": "f0"})
        c("blockdev-add", driver="qcow2", file="f0", **{"node-name": "d0"})

    def test_create_over_a_file_in_use(self):
        """blockdev-create (qcow2, raw over a file node) under a running d0
        fails as a job with QEMU's permission conflict; the disk keeps every
        byte."""
        before = {}

        def prepare():
            self.prepare_disk()
            before["sha"] = digest(self.path("disk.qcow2"))

        def run(q, c, out):
            self.open_disk(c)
            for job, opts in (("j1", {"driver": "qcow2", "file": "f0", "size": MiB}),
                              ("j2", {"driver": "qcow2", "file": "f0", "size": 64 * MiB,
                                      "cluster-size": 4096})):
                c("blockdev-create", **{"job-id": job, "options": opts})
                c.wait_job(job)
                c("query-jobs")
                c("job-dismiss", id=job)
                c.ev()
            # d0 still reads its data.
            c("query-named-block-nodes", flat=True)
            c("blockdev-del", **{"node-name": "d0"})
            c("blockdev-del", **{"node-name": "f0"})
            return digest(self.path("disk.qcow2")) == before["sha"]

        seen = self.both(run, prepare)
        for name, obs in seen.items():
            self.assertEqual(obs[-1], ["result", True], name)
            jobs = [r for (cmd, _, r) in [x for x in obs if len(x) == 3] if cmd == "query-jobs"]
            self.assertIn("Permission conflict on node 'f0'", jobs[0]["return"][0]["error"], name)
        r = img("check", self.kept(1, "disk.qcow2"), check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_exports_and_second_format_node(self):
        """A writable export of f0, a read-only one (it unshares resize that
        d0 needs), a second qcow2 or raw node over f0: each refused with the
        same text; a writable export of d0 works, and a raw node over f0 is
        refused while that export runs."""

        def run(q, c, out):
            self.open_disk(c)
            c("nbd-server-start", addr={"type": "unix", "data": {"path": self.path("nbd.sock")}})
            c("block-export-add", type="nbd", id="e0", **{"node-name": "f0", "writable": True})
            c("block-export-add", type="nbd", id="e1", **{"node-name": "f0"})
            c("blockdev-add", driver="qcow2", file="f0", **{"node-name": "d1"})
            c("blockdev-add", driver="raw", file="f0", **{"node-name": "r1"})
            c("blockdev-add", driver="raw", file="f0", **{"node-name": "r2", "read-only": True})
            c("block-export-add", type="nbd", id="e2", **{"node-name": "d0", "writable": True})
            # A read-only second user of d0 shares what the export needs.
            c("block-export-add", type="nbd", id="e3", **{"node-name": "d0"})
            c("query-block-exports")
            c("query-named-block-nodes", flat=True)
            c("block-export-del", id="e2")
            c("block-export-del", id="e3")
            c.ev(wait=0.5)
            c("nbd-server-stop")

        self.both(run, self.prepare_disk)

    def test_second_qcow2_over_file_of_export(self):
        """blockdev-create over the file of an exported node while a client
        may write: the export stays, the disk is unchanged."""

        def run(q, c, out):
            self.open_disk(c)
            c("nbd-server-start", addr={"type": "unix", "data": {"path": self.path("nbd.sock")}})
            c("block-export-add", type="nbd", id="e0", **{"node-name": "d0", "writable": True})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": "f0",
                                                              "size": MiB}})
            c.wait_job("j")
            c("query-jobs")
            c("job-dismiss", id="j")
            c("query-block-exports")
            c("block-export-del", id="e0")
            c.ev(wait=0.5)
            c("nbd-server-stop")
            return img("info", "-U", "--output=json", self.path("disk.qcow2")).stdout.count('"virtual-size": 67108864')

        seen = self.both(run, self.prepare_disk)
        for name, obs in seen.items():
            self.assertEqual(obs[-1], ["result", 1], name)


if __name__ == "__main__":
    unittest.main()
