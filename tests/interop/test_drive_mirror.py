#!/usr/bin/env python3
"""Interop: drive-mirror (the legacy mirror command), vblk serve beside
qemu-storage-daemon.

The command creates its target (mode absolute-paths: the source's format,
or `format`; for sync=top the source's backing file in the new image's
header) or opens it (mode existing), then runs the mirror job. Each scenario
runs against both daemons in a directory of its own with relative file
names and asserts the same replies (errors in QEMU's order: a file created
before a later check refuses the job stays), the same images (format,
cluster size, backing file by qemu-img info; content by qemu-img compare),
the export moved to the target on complete, and the target node gone from
query-named-block-nodes once its job has ended.

Environment: VBLK (binary under test), VBLK_MIRROR_ONE_DAEMON=1 (run with
whichever daemon exists). Python standard library only.
"""

import json
import os
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import BothDaemons, MiB, InteropTestCase, storage_daemons  # noqa: E402
from test_mirror import SAME, compare, job_statuses, norm  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
QEMU_IMG = shutil.which("qemu-img")
DAEMONS = storage_daemons()


def sh(*a):
    subprocess.run(a, check=True, capture_output=True)


def info(path):
    r = subprocess.run([QEMU_IMG, "info", "-U", "--output=json", path], capture_output=True, text=True)
    i = json.loads(r.stdout) if r.returncode == 0 else {}
    return i.get("format"), i.get("cluster-size"), i.get("backing-filename"), i.get("backing-filename-format")


@unittest.skipUnless(QSD and QEMU_IMG and QEMU_IO, "needs qemu-storage-daemon, qemu-img and qemu-io")
class DriveMirrorInteropTest(BothDaemons, InteropTestCase):
    chdir_to_workdir = True  # relative file names, as the images record them


    def setUp(self):
        super().setUp()
        if len(DAEMONS) < 2 and not os.environ.get("VBLK_MIRROR_ONE_DAEMON"):
            self.skipTest("needs both qemu-storage-daemon and vblk serve")


    def images(self, q):
        sh(QEMU_IMG, "create", "-f", "raw", "src.raw", "8M")
        sh(QEMU_IO, "-f", "raw", "-c", "write -P 1 0 1M", "-c", "write -P 2 5M 512k", "src.raw")
        sh(QEMU_IMG, "create", "-f", "qcow2", "base.qcow2", "8M")
        sh(QEMU_IO, "-c", "write -P 1 0 2M", "base.qcow2")
        sh(QEMU_IMG, "create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2")
        sh(QEMU_IO, "-c", "write -P 3 2M 2M", "top.qcow2")
        q.ok("blockdev-add", driver="raw", **{"node-name": "src"}, file={"driver": "file", "filename": "src.raw"})
        q.ok("blockdev-add", driver="qcow2", **{"node-name": "top"}, file={"driver": "file", "filename": "top.qcow2"})

    def names(self, q):
        return sorted(n["node-name"] for n in norm(q.ok("query-named-block-nodes")))

    def done(self, q, name="BLOCK_JOB_COMPLETED"):
        e = q.event(name, 60)
        end = time.time() + 10
        while q.ok("query-jobs") and time.time() < end:
            time.sleep(0.02)
        return e["data"]

    def test_errors(self):
        bad = [
            {"device": "nope", "target": "t1.raw", "sync": "full"},
            {"device": "#block", "target": "t1.raw", "sync": "full"},
            {"device": "src", "target": "t1.raw", "sync": "full", "format": "bogus"},
            {"device": "src", "target": "t1.raw", "sync": "full", "replaces": "src"},
            {"device": "src", "target": "nodir/t1.raw", "sync": "full"},
            {"device": "src", "target": "t9.raw", "sync": "full", "mode": "existing"},
            {"device": "src", "target": "t1.raw", "sync": "full", "mode": "bogus"},
            {"device": "src", "target": "t1.raw", "sync": "full", "granularity": 1000},
            {"device": "src", "target": "t2.raw", "sync": "full", "node-name": "src"},
            {"device": "src", "target": "t3.raw", "sync": "full", "job-id": "1x"},
            {"device": "src", "target": "t4.raw", "sync": "incremental", "job-id": "j"},
            {"device": "src", "target": "t5.raw", "sync": "full", "job-id": "j", "speed": -1},
            {"device": "src", "sync": "full"},
        ]

        def run(q, d):
            self.images(q)
            child = [n["node-name"] for n in q.ok("query-named-block-nodes") if n["drv"] == "file"][0]
            out = []
            for a in bad:
                a = dict(a, device=child) if a.get("device") == "#block" else a
                out.append(q.cmd("drive-mirror", **a))
                time.sleep(0.02)
                out.append((os.path.exists(a.get("target", "-")), job_statuses(q.events)))
                q.events.clear()
            out.append(self.names(q))
            return norm(out)
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out[4]["error"]["desc"], "Unknown file format 'bogus'")
        self.assertEqual(out[15], [True, []])  # granularity refused after the file was made

    def test_full_raw_cancel_and_qcow2_format(self):
        def run(q, d):
            self.images(q)
            out = []
            q.ok("drive-mirror", **{"job-id": "j", "device": "src", "target": "t.raw", "sync": "full"})
            out.append(q.event("BLOCK_JOB_READY", 60)["data"])
            during = self.names(q)
            q.ok("block-job-cancel", device="j")
            out.append(self.done(q))
            out += [during, self.names(q), compare("src.raw", "t.raw"), info("t.raw")]
            q.ok("drive-mirror", **{"job-id": "j", "device": "src", "target": "t.qcow2", "sync": "full",
                                    "format": "qcow2"})
            q.event("BLOCK_JOB_READY", 60)
            q.ok("block-job-cancel", device="j")
            self.done(q)
            out += [compare("src.raw", "t.qcow2", "raw", "qcow2"), info("t.qcow2")]
            # mode existing: the raw target made above is written again.
            sh(QEMU_IO, "-f", "raw", "-c", "write -P 9 0 64k", "t.raw")
            q.ok("drive-mirror", **{"job-id": "j", "device": "src", "target": "t.raw", "sync": "full",
                                    "mode": "existing", "format": "raw"})
            q.event("BLOCK_JOB_READY", 60)
            q.ok("block-job-cancel", device="j")
            self.done(q)
            out.append(compare("src.raw", "t.raw"))
            return out
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out[0], {"device": "j", "len": 8 * MiB, "offset": 8 * MiB, "speed": 0, "type": "mirror"})
        self.assertIn("#block", out[2])
        self.assertEqual(out[3], ["#block", "#block", "#block", "#block", "src", "top"])
        self.assertEqual(out[4:], [SAME, ("raw", None, None, None), SAME, ("qcow2", 65536, None, None), SAME])

    def test_sync_top_complete_moves_export(self):
        def run(q, d):
            self.images(q)
            sock = os.path.join(d, "nbd.sock")
            q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "top", "name": "top",
                                      "writable": True})
            q.ok("drive-mirror", **{"job-id": "j", "device": "top", "target": "t.qcow2", "sync": "top",
                                    "node-name": "tn"})
            ready = q.event("BLOCK_JOB_READY", 60)["data"]
            created = info("t.qcow2")
            q.ok("block-job-complete", device="j")
            self.done(q)
            exports = q.ok("query-block-exports")
            w = subprocess.run([QEMU_IO, "-f", "raw", "-c", "write -P 7 7M 64k", "nbd+unix:///top?socket=" + sock],
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(w.returncode, 0, w.stderr)
            del_tn = q.cmd("blockdev-del", **{"node-name": "tn"})
            q.ok("block-export-del", id="e0")
            q.ok("blockdev-del", **{"node-name": "top"})
            # The target reads as the source did, plus the write after complete.
            sh(QEMU_IO, "-c", "write -P 7 7M 64k", "top.qcow2")
            return ready["len"], created, exports, del_tn, self.names(q), compare("top.qcow2", "t.qcow2",
                                                                                  "qcow2", "qcow2")
        seen = self.each_daemon(run)
        self.assertSame(seen)
        length, created, exports, del_tn, names, same = list(seen.values())[0]
        self.assertEqual(length, 2 * MiB)
        self.assertEqual(created, ("qcow2", 65536, "base.qcow2", "qcow2"))
        self.assertEqual(exports[0]["node-name"], "tn")
        self.assertEqual(same, SAME)


if __name__ == "__main__":
    unittest.main()
