#!/usr/bin/env python3
"""Interop: external snapshots (blockdev-snapshot, blockdev-snapshot-sync) and
internal ones (blockdev-snapshot-internal-sync, -delete-internal-sync) in
vblk serve beside qemu-storage-daemon 7.2: same replies (errors included),
same node graph in query-named-block-nodes, the NBD export moved to the
overlay (its writes land there, the old image stays as it was), and images
qemu-img describes alike. Snapshot dates and clocks are normalised.
"""

import os
import subprocess
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_common import DAEMONS, QEMU_IO, GraphTestCase, compare, img, img_info  # noqa: E402

MiB = 1 << 20


def nodes(q):
    """The graph as (node-name, drv, ro, backing_file, depth, image backing)."""
    out = []
    for n in q.ok("query-named-block-nodes"):
        i = n["image"]
        out.append((n["node-name"], n["drv"], n["ro"], n.get("backing_file"), n["backing_file_depth"],
                    i.get("backing-filename"), i.get("backing-filename-format"), "backing-image" in i))
    return out


def undate(r):
    """A delete-internal-sync reply without its dates and clocks."""
    if "return" in r:
        for k in ("date-sec", "date-nsec", "vm-clock-sec", "vm-clock-nsec"):
            assert isinstance(r["return"].pop(k), int)
    return r


class SnapshotTest(GraphTestCase):

    def io(self, sock, *cmds):
        argv = [QEMU_IO, "-f", "raw"]
        for c in cmds:
            argv += ["-c", c]
        argv.append("nbd+unix:///exp?socket=%s" % sock)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r)
        self.assertNotIn("error", r.stdout + r.stderr, r)

    def test_external(self):
        P = self.path
        sock = os.path.join(self.tmp, "nbd.sock")

        def prepare():
            img("create", "-q", "-f", "raw", P("base.raw"), "4M")
            subprocess.run([QEMU_IO, "-f", "raw", "-c", "write -P 7 0 4M", P("base.raw")], check=True,
                           capture_output=True)
            # As libvirt makes overlays: the backing file named in the
            # header, the node opened without it.
            img("create", "-q", "-f", "qcow2", "-b", P("base.raw"), "-F", "raw", P("ov.qcow2"))
            img("create", "-q", "-f", "qcow2", "-b", P("base.raw"), "-F", "raw", P("ov2.qcow2"))
            img("create", "-q", "-f", "qcow2", P("busy.qcow2"), "4M")

        def run(q, c, out):
            c("blockdev-add", driver="raw", file={"driver": "file", "filename": P("base.raw")},
              **{"node-name": "base"})
            c("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            c("block-export-add", type="nbd", id="e", name="exp", writable=True, **{"node-name": "base"})
            c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": P("ov.qcow2")},
              backing=None, **{"node-name": "ov"})
            c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": P("ov2.qcow2")},
              **{"node-name": "ov2"})
            c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": P("busy.qcow2")},
              **{"node-name": "busy"})
            c("block-export-add", type="nbd", id="e2", **{"node-name": "busy"})
            c("blockdev-snapshot", node="nope", overlay="ov")
            c("blockdev-snapshot", node="base", overlay="nope")
            c("blockdev-snapshot", node="base", overlay="ov2")
            c("blockdev-snapshot", node="base", overlay="base")
            c("blockdev-snapshot", node="base", overlay="busy")
            c("blockdev-snapshot", node="base")
            c("blockdev-snapshot", node="base", overlay="ov", x=1)
            c("blockdev-snapshot", node="base", overlay="ov")
            out.append(nodes(q))
            c("query-block-exports")
            # The export writes to the overlay now.
            self.io(sock, "write -P 9 1M 64k", "read -P 7 0 1M", "read -P 9 1M 64k")
            c("blockdev-del", **{"node-name": "base"})
            c("blockdev-snapshot", node="base", overlay="busy")
            # blockdev-snapshot-sync: device names never match in a daemon.
            c("blockdev-snapshot-sync", device="ov", **{"snapshot-file": P("s1.qcow2")})
            c("blockdev-snapshot-sync", **{"snapshot-file": P("s1.qcow2")})
            c("blockdev-snapshot-sync", **{"node-name": "ov", "snapshot-file": P("s1.qcow2")})
            c("blockdev-snapshot-sync", **{"node-name": "ov", "snapshot-file": P("s1.qcow2"),
                                           "snapshot-node-name": "ov2"})
            c("blockdev-snapshot-sync", **{"node-name": "ov", "snapshot-file": P("s1.qcow2"),
                                           "snapshot-node-name": "s1", "format": "raw"})
            c("blockdev-snapshot-sync", **{"node-name": "ov", "snapshot-file": P("nodir/s1.qcow2"),
                                           "snapshot-node-name": "s1"})
            c("blockdev-snapshot-sync", **{"node-name": "ov", "snapshot-file": P("missing.qcow2"),
                                           "snapshot-node-name": "s1", "mode": "existing"})
            c("blockdev-snapshot-sync", **{"node-name": "ov", "snapshot-file": P("s1.qcow2"),
                                           "snapshot-node-name": "s1", "mode": "relative"})
            # The export's node: the export moves up again.
            c("blockdev-snapshot-sync", **{"node-name": "ov", "device": "x", "snapshot-file": P("s1.qcow2"),
                                           "snapshot-node-name": "s1", "format": "qcow2"})
            out.append(nodes(q))
            c("query-block-exports")
            self.io(sock, "write -P 10 2M 64k", "read -P 9 1M 64k", "read -P 10 2M 64k", "read -P 7 3M 1M")
            # A node nobody uses: QEMU's overlay goes with its last reference.
            c("blockdev-snapshot-sync", **{"node-name": "ov2", "snapshot-file": P("s2.qcow2"),
                                           "snapshot-node-name": "s2"})
            out.append(nodes(q))
            c("blockdev-snapshot-sync", **{"node-name": "s2", "snapshot-file": P("s3.qcow2"),
                                           "snapshot-node-name": "s3"})
            c("blockdev-del", **{"node-name": "s1"})
            c("blockdev-del", **{"node-name": "ov"})
            return {f: img_info(P(f)) for f in ("s1.qcow2", "s2.qcow2")}

        self.both(run, prepare)
        for i in range(len(DAEMONS)):
            # The old top kept its data; the overlay holds the export's write.
            self.assertEqual(compare(self.kept(i, "base.raw"), self.kept(0, "base.raw"), "raw", "raw")[0], 0)
            r = img("map", "--output=json", "-U", self.kept(i, "ov.qcow2"))
            self.assertIn('"start": 1048576, "length": 65536, "depth": 0, "present": true, "zero": false, '
                          '"data": true', r.stdout, DAEMONS[i][0])
            r = img("map", "--output=json", "-U", self.kept(i, "s1.qcow2"))
            self.assertIn('"start": 2097152, "length": 65536, "depth": 0, "present": true, "zero": false, '
                          '"data": true', r.stdout, DAEMONS[i][0])
            for f in ("s1.qcow2", "s2.qcow2", "ov.qcow2"):
                r = img("check", "-U", self.kept(i, f), check=False)
                self.assertEqual(r.returncode, 0, (DAEMONS[i][0], f, r.stdout))

    def test_internal(self):
        P = self.path

        def prepare():
            img("create", "-q", "-f", "qcow2", P("iq.qcow2"), "4M")
            img("create", "-q", "-f", "raw", P("r.raw"), "4M")
            img("create", "-q", "-f", "qcow2", P("ro.qcow2"), "4M")

        def run(q, c, out):
            c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": P("iq.qcow2")},
              **{"node-name": "iq"})
            c("blockdev-add", driver="raw", file={"driver": "file", "filename": P("r.raw")}, **{"node-name": "r"})
            c("blockdev-add", driver="qcow2", file={"driver": "file", "filename": P("ro.qcow2")},
              **{"node-name": "ro", "read-only": True})
            c("blockdev-snapshot-internal-sync", device="iq", name="sn1")
            c("blockdev-snapshot-internal-sync", device="iq", name="sn1")
            c("blockdev-snapshot-internal-sync", device="iq", name="")
            c("blockdev-snapshot-internal-sync", device="nope", name="x")
            c("blockdev-snapshot-internal-sync", device="r", name="x")
            c("blockdev-snapshot-internal-sync", device="ro", name="x")
            c("blockdev-snapshot-internal-sync", device="iq")
            c("blockdev-snapshot-delete-internal-sync", device="iq")
            c("blockdev-snapshot-delete-internal-sync", device="nope", name="sn1")
            c("blockdev-snapshot-delete-internal-sync", device="iq", name="nope")
            c("blockdev-snapshot-delete-internal-sync", device="iq", id="7", name="sn1")
            out.append(undate(q.cmd("blockdev-snapshot-delete-internal-sync", {"device": "iq", "id": "1"})))
            c("blockdev-snapshot-internal-sync", device="iq", name="sn2")
            c("blockdev-snapshot-internal-sync", device="iq", name="sn3")
            c("blockdev-snapshot-internal-sync", device="iq", name="sn4")
            out.append(undate(q.cmd("blockdev-snapshot-delete-internal-sync", {"device": "iq", "name": "sn2"})))
            c("blockdev-snapshot-delete-internal-sync", device="iq", id="3", name="sn3")
            out.append(undate(q.cmd("blockdev-snapshot-delete-internal-sync", {"device": "iq", "id": "2", "name": "sn3"})))

        self.both(run, prepare)
        for i in range(len(DAEMONS)):
            r = img("snapshot", "-l", "-U", self.kept(i, "iq.qcow2"))
            lines = [l.split()[:2] for l in r.stdout.splitlines()[2:]]
            self.assertEqual(lines, [["3", "sn4"]], DAEMONS[i][0])
            self.assertEqual(img("check", "-U", self.kept(i, "iq.qcow2"), check=False).returncode, 0)


if __name__ == "__main__":
    unittest.main()
