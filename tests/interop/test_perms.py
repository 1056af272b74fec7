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

from graph_common import GraphTestCase, graph, img  # noqa: E402

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
            out.append(graph(q))
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
            out.append(graph(q))
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


    def prepare_chain(self):
        """base <- mid <- top, each with data of its own."""
        prev = None
        for name, pat in (("base", 1), ("mid", 2), ("top", 3)):
            p = self.path(name + ".qcow2")
            args = ["create", "-q", "-f", "qcow2"] + (["-b", prev, "-F", "qcow2"] if prev else []) + [p, "16M"]
            img(*args)
            r = __import__("subprocess").run(["qemu-io", "-f", "qcow2", "-c", "write -P %d %dM 2M" % (pat, 2 * pat), p],
                                              capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            prev = p

    def open_chain(self, c):
        c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": self.path("base.qcow2")},
          **{"node-name": "b0"})
        c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": self.path("mid.qcow2"),
                                                "node-name": "mf"}, backing="b0", **{"node-name": "m0"})
        c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": self.path("top.qcow2")},
          backing="m0", **{"node-name": "t0"})

    def chain_job(self, start, exports=(("m0", True), ("m0", False), ("b0", True), ("t0", False)),
                  refused=()):
        """A job on the chain held at speed 1 while exports try the layers:
        `exports` must be answered alike; `refused` must be refused by both
        (in words that may differ)."""

        def run(q, c, out):
            self.open_chain(c)
            c("nbd-server-start", addr={"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}})
            q.ok(start[0], **start[1])
            for i, (node, writable) in enumerate(exports):
                c("block-export-add", type="nbd", id="e%d" % i, **{"node-name": node, "writable": writable})
            for i, (node, writable) in enumerate(refused):
                r = q.cmd("block-export-add", {"type": "nbd", "id": "r%d" % i, "node-name": node,
                                               "writable": writable})
                out.append(("refused", node, writable, "error" in r))
            c("query-block-exports")
            q.ok("block-job-cancel", device="j", force=True)
            q.event("BLOCK_JOB_CANCELLED", 30)
            q.ok("nbd-server-stop")

        self.both(run, self.prepare_chain)

    def test_stream_claims_the_layers_it_reads(self):
        """block-stream: nobody writes the layer streamed from."""
        self.chain_job(("block-stream", {"job-id": "j", "device": "t0", "base-node": "b0", "speed": 1}))

    def test_active_commit_claims_the_moving_layers(self):
        """Active block-commit: the layers above the base are not read by
        anyone else (they change under the reader), as in QEMU."""
        self.chain_job(("block-commit", {"job-id": "j", "device": "t0", "base-node": "b0", "speed": 1}))

    def test_intermediate_commit_claims_the_base(self):
        """block-commit of mid into base: nobody else writes the base, nor
        reads the top while it is being dropped; the overlay goes on."""
        self.chain_job(("block-commit", {"job-id": "j", "device": "t0", "top-node": "m0", "base-node": "b0",
                                         "speed": 1}))


if __name__ == "__main__":
    unittest.main()
