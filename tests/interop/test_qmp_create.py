#!/usr/bin/env python3
"""Interop: blockdev-create (file and qcow2) in vblk serve beside
qemu-storage-daemon 7.2: the same commands at the same paths must give the
same replies (errors included), the same JOB_STATUS_CHANGE sequence and
query-jobs entries (error texts of failed jobs), and images that qemu-img
info describes alike and qemu-img check finds clean.
"""

import os
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_common import DAEMONS, GraphTestCase, img, img_info  # noqa: E402

MiB = 1 << 20


class CreateTest(GraphTestCase):

    def create(self, c, job, options, dismiss=True):
        """blockdev-create, wait for the job to conclude, query it, dismiss."""
        r = c("blockdev-create", **{"job-id": job, "options": options})
        if "error" in r:
            return r
        c.wait_job(job)
        c("query-jobs")
        if dismiss:
            c("job-dismiss", id=job)
            c.ev()
        return r

    def test_file_and_qcow2(self):
        P = self.path

        def run(q, c, out):
            self.create(c, "f1", {"driver": "file", "filename": P("a.raw"), "size": 3 * MiB})
            self.create(c, "f2", {"driver": "file", "filename": P("odd.raw"), "size": 1000})
            self.create(c, "f3", {"driver": "file", "filename": P("falloc.raw"), "size": MiB,
                                  "preallocation": "falloc"})
            self.create(c, "f4", {"driver": "file", "filename": P("q.qcow2"), "size": 0})
            c("blockdev-add", driver="file", filename=P("q.qcow2"), **{"node-name": "qf"})
            self.create(c, "q1", {"driver": "qcow2", "file": "qf", "size": 64 * MiB})
            # Every option, and inline file options.
            self.create(c, "f5", {"driver": "file", "filename": P("q2.qcow2"), "size": 0})
            self.create(c, "q2", {"driver": "qcow2", "file": {"driver": "file", "filename": P("q2.qcow2")},
                                  "size": 16 * MiB, "cluster-size": 16384, "lazy-refcounts": True,
                                  "refcount-bits": 1, "version": "v3", "extended-l2": True,
                                  "backing-file": P("a.raw"), "backing-fmt": "raw"})
            self.create(c, "f6", {"driver": "file", "filename": P("v2.qcow2"), "size": 0})
            c("blockdev-add", driver="file", filename=P("v2.qcow2"), **{"node-name": "v2f"})
            self.create(c, "q3", {"driver": "qcow2", "file": "v2f", "size": 8 * MiB, "version": "v2",
                                  "cluster-size": 4096})
            self.create(c, "f7", {"driver": "file", "filename": P("pre.qcow2"), "size": 0})
            c("blockdev-add", driver="file", filename=P("pre.qcow2"), **{"node-name": "pf"})
            self.create(c, "q4", {"driver": "qcow2", "file": "pf", "size": 4 * MiB, "preallocation": "metadata"})
            self.create(c, "q5", {"driver": "qcow2", "file": "pf", "size": 4 * MiB, "compression-type": "zstd"},
                        dismiss=False)
            # A concluded job that is not dismissed keeps its id.
            self.create(c, "q5", {"driver": "qcow2", "file": "pf", "size": 4 * MiB})
            c("job-dismiss", id="q5")
            c.ev()
            # The new image opens.
            c("blockdev-add", driver="qcow2", file="qf", **{"node-name": "q"})
            # File nodes' lengths after a format wrote past their end are
            # QEMU's cached guess; the format nodes are compared.
            out.append([n for n in q.ok("query-named-block-nodes", flat=True) if n["drv"] != "file"])
            infos = {}
            for f in ("a.raw", "odd.raw", "falloc.raw", "q.qcow2", "q2.qcow2", "v2.qcow2", "pre.qcow2"):
                infos[f] = img_info(P(f))
                infos[f]["filename"] = os.path.basename(infos[f]["filename"])
                infos[f].pop("backing-filename", None)
                infos[f].pop("full-backing-filename", None)
            return infos

        self.both(run)
        for i in range(len(DAEMONS)):
            for f in ("q.qcow2", "q2.qcow2", "v2.qcow2", "pre.qcow2"):
                r = img("check", "-U", self.kept(i, f), check=False)
                self.assertEqual(r.returncode, 0, (DAEMONS[i][0], f, r.stdout, r.stderr))
        self.assertEqual(os.path.getsize(self.kept(1, "odd.raw")), 1000)

    def test_errors(self):
        P = self.path

        def run(q, c, out):
            c("blockdev-add", driver="file", filename=P("x.qcow2"), **{"node-name": "xf"})
            # Refused by the command (schema, driver, job id).
            c("blockdev-create", options={"driver": "file", "filename": P("c"), "size": 1})
            c("blockdev-create", **{"job-id": "j"})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c"), "size": 1},
                                    "x": 1})
            c("blockdev-create", **{"job-id": "j", "options": {"file": "xf", "size": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": 5}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "foo"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "raw"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "raw", "size": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "null-co"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "size": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c")}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": 1, "size": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c"), "size": "1"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c"), "size": 1.5}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c"), "size": 1,
                                                               "preallocation": "x"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c"), "size": 1,
                                                               "nocow": "on"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c"), "size": 1,
                                                               "bogus": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "size": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": "xf"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": 5, "size": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": {"driver": "file"},
                                                               "size": 1}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": "xf", "size": 1,
                                                               "version": "v4"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": "xf", "size": 1,
                                                               "backing-fmt": "foo"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": "xf", "size": 1,
                                                               "compression-type": "lz4"}})
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "qcow2", "file": "xf", "size": 1,
                                                               "refcount-bits": "16"}})
            c("blockdev-create", **{"job-id": "5j", "options": {"driver": "file", "filename": P("c"), "size": 1}})
            c("blockdev-create", **{"job-id": "", "options": {"driver": "file", "filename": P("c"), "size": 1}})
            # Refused by the job (its error in query-jobs).
            for opts in (
                    {"driver": "file", "filename": P("nodir/x"), "size": 1},
                    {"driver": "file", "filename": P("c"), "size": -1},
                    {"driver": "file", "filename": P("c"), "size": 1, "preallocation": "metadata"},
                    {"driver": "qcow2", "file": "nope", "size": MiB},
                    {"driver": "qcow2", "file": "xf", "size": 1},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "cluster-size": 1000},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "cluster-size": 256},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "cluster-size": 4 * MiB},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "extended-l2": True, "cluster-size": 8192},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "extended-l2": True, "version": "v2"},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "version": "v2", "lazy-refcounts": True},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "version": "v2", "refcount-bits": 8},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "version": "v2", "compression-type": "zstd"},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "refcount-bits": 3},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "refcount-bits": 128},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "refcount-bits": 0},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "backing-fmt": "raw"},
                    {"driver": "qcow2", "file": "xf", "size": MiB, "backing-file": P("b"),
                     "preallocation": "metadata"},
                    {"driver": "qcow2", "file": "xf", "size": 1 << 62}):
                self.create(c, "j", opts)
            # A job id in use.
            self.create(c, "j", {"driver": "file", "filename": P("c"), "size": 1}, dismiss=False)
            c("blockdev-create", **{"job-id": "j", "options": {"driver": "file", "filename": P("c"), "size": 1}})
            c("job-dismiss", id="j")
            c("job-dismiss", id="j")
            c.ev()

        self.both(run)


if __name__ == "__main__":
    unittest.main()
