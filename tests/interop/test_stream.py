#!/usr/bin/env python3
"""Interop: block-stream and block-commit of an intermediate layer, vblk serve
beside qemu-storage-daemon.

A qcow2 chain base <- mid <- top, each layer a node of its own, top exported
over NBD and written during the jobs. Before a job the chain's content is
converted to a raw reference and the same writes are applied to it; after
the job the image must read exactly as the reference (qemu-img compare),
pass qemu-img check, and name the new backing file (qemu-img info) as
QEMU's does. Replies, job statuses and events are compared between the
daemons as in test_mirror.py.

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

from common import BothDaemons, InteropTestCase, storage_daemons  # noqa: E402
from test_commit import make_chain, qcow2_node  # noqa: E402
from test_mirror import SAME, compare, job_statuses, norm  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
QEMU_IMG = shutil.which("qemu-img")
DAEMONS = storage_daemons()
WRITES = ["write -P 7 1536k 128k", "write -P 8 3M 1M", "write -z 5M 64k", "write -P 9 7M 4k"]


def info(path):
    return json.loads(subprocess.run([QEMU_IMG, "info", "--output=json", path], capture_output=True,
                                     text=True).stdout)


@unittest.skipUnless(QSD and QEMU_IMG and QEMU_IO, "needs qemu-storage-daemon, qemu-img and qemu-io")
class StreamInteropTest(BothDaemons, InteropTestCase):
    chdir_to_workdir = True  # relative file names, as the images record them


    def setUp(self):
        super().setUp()
        if len(DAEMONS) < 2 and not os.environ.get("VBLK_MIRROR_ONE_DAEMON"):
            self.skipTest("needs both qemu-storage-daemon and vblk serve")


    def setup_chain(self, q, d):
        make_chain(".")
        ref = "ref.raw"
        subprocess.run([QEMU_IMG, "convert", "-O", "raw", "top.qcow2", ref], check=True)
        for p in (ref,):
            args = [QEMU_IO, "-f", "raw"]
            for c in WRITES:
                args += ["-c", c]
            subprocess.run(args + [p], check=True, capture_output=True)
        q.ok("blockdev-add", **qcow2_node("base", "base.qcow2", None))
        q.ok("blockdev-add", **qcow2_node("mid", "mid.qcow2", "base"))
        q.ok("blockdev-add", **qcow2_node("top", "top.qcow2", "mid"))
        sock = os.path.join(d, "nbd.sock")
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "top", "name": "top", "writable": True})
        return ref, sock

    def write_through_export(self, sock):
        args = [QEMU_IO, "-f", "raw"]
        for c in WRITES:
            args += ["-c", c]
        r = subprocess.run(args + ["nbd+unix:///top?socket=" + sock], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)

    def teardown_chain(self, q):
        q.ok("block-export-del", id="e0")
        for n in ("top", "mid", "base"):
            q.ok("blockdev-del", **{"node-name": n})
        q.ok("nbd-server-stop")

    def finished(self, q, name="BLOCK_JOB_COMPLETED"):
        e = q.event(name, 60)
        end = time.time() + 10
        while q.ok("query-jobs") and time.time() < end:
            time.sleep(0.02)
        return e["data"]

    def run_job(self, q, d, cmd, args):
        """Starts the job slowly, writes through the export meanwhile, waits
        for the end; returns what must agree between the daemons."""
        ref, sock = self.setup_chain(q, d)
        q.ok(cmd, **dict({"job-id": "j", "speed": 4 << 20}, **args))
        self.write_through_export(sock)
        # Unthrottle for the rest; on a loaded machine the job may already
        # have ended (and been dismissed) while the export was written.
        r = q.cmd("block-job-set-speed", device="j", speed=0)
        if "error" in r:
            self.assertEqual(r["error"]["class"], "DeviceNotActive", r)
        done = self.finished(q)
        nodes = {n["node-name"]: n.get("backing_file") for n in q.ok("query-named-block-nodes")
                 if n["node-name"] in ("top", "mid")}
        self.teardown_chain(q)
        i = info("top.qcow2")
        check = subprocess.run([QEMU_IMG, "check", "top.qcow2"], capture_output=True, text=True).returncode
        return (done, nodes, i.get("backing-filename"), i.get("backing-filename-format"),
                compare("top.qcow2", ref, "qcow2", "raw"), check, job_statuses(q.events))

    def test_stream_to_base_node(self):
        seen = self.each_daemon(lambda q, d: self.run_job(q, d, "block-stream", {"device": "top", "base-node": "base"}))
        self.assertSame(seen)
        done, nodes, bf, bfmt, same, check, statuses = list(seen.values())[0]
        self.assertEqual(done["type"], "stream")
        self.assertEqual((bf, bfmt, same, check), ("base.qcow2", "qcow2", SAME, 0))
        self.assertEqual(statuses, ["created", "running", "waiting", "pending", "concluded", "null"])

    def test_stream_whole_chain(self):
        seen = self.each_daemon(lambda q, d: self.run_job(q, d, "block-stream", {"device": "top"}))
        self.assertSame(seen)
        _, nodes, bf, _, same, check, _ = list(seen.values())[0]
        self.assertEqual((nodes["top"], bf, same, check), (None, None, SAME, 0))

    def test_stream_bottom_and_backing_file(self):
        def run(q, d):
            a = self.run_job(q, d, "block-stream", {"device": "top", "bottom": "mid"})
            b = self.run_job(q, d, "block-stream", {"device": "top", "base": "base.qcow2",
                                                    "backing-file": "other.qcow2"})
            return a[2:6], b[2:4]
        seen = self.each_daemon(run)
        self.assertSame(seen)
        a, b = list(seen.values())[0]
        self.assertEqual(a, ("base.qcow2", "qcow2", SAME, 0))
        self.assertEqual(b, ("other.qcow2", "qcow2"))

    def test_commit_intermediate(self):
        seen = self.each_daemon(lambda q, d: self.run_job(q, d, "block-commit", {"device": "top", "top-node": "mid",
                                                                                 "base-node": "base"}))
        self.assertSame(seen)
        done, nodes, bf, bfmt, same, check, statuses = list(seen.values())[0]
        self.assertEqual(done["type"], "commit")
        self.assertEqual((nodes["top"], bf, bfmt, same, check), ("base.qcow2", "base.qcow2", "qcow2", SAME, 0))
        self.assertEqual(statuses, ["created", "running", "waiting", "pending", "concluded", "null"])

    def test_stream_errors(self):
        bad = [
            {"device": "nope"},
            {"device": "top", "base": "a", "base-node": "b"},
            {"device": "top", "base": "a", "bottom": "b"},
            {"device": "top", "bottom": "a", "base-node": "b"},
            {"device": "top", "base": "nope"},
            {"device": "top", "base-node": "top"},
            {"device": "top", "base-node": "x"},
            {"device": "top", "bottom": "x"},
            {"device": "mid", "bottom": "top"},
            {"device": "top", "backing-file": "x"},
            {"device": "top"},
            {"device": "top", "job-id": "j", "speed": -1},
            {"device": "top", "job-id": "j", "filter-node-name": "mid"},
            {"device": "top", "job-id": "j", "on-error": "x"},
            {"device": "top", "job-id": "j", "bogus": 1},
        ]

        def run(q, d):
            self.setup_chain(q, d)
            out = []
            for a in bad:
                out.append(q.cmd("block-stream", **a))
                time.sleep(0.02)
                out.append(job_statuses(q.events))
                q.events.clear()
            # Nothing to stream below the chain's bottom: done at once, len 0.
            q.ok("block-stream", **{"device": "base", "job-id": "j"})
            out.append(self.finished(q))
            q.events.clear()
            # A second job on the chain while one runs.
            q.ok("block-stream", **{"device": "top", "job-id": "j", "speed": 64 * 1024})
            out.append(q.cmd("block-stream", **{"device": "top", "job-id": "k"}))
            out.append(q.cmd("block-commit", **{"device": "top", "job-id": "k"}))
            q.ok("block-job-cancel", device="j")
            out.append(self.finished(q, "BLOCK_JOB_CANCELLED")["type"])
            return norm(out)
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out[23], ["created", "null"])
        self.assertEqual(out[30], {"device": "j", "len": 0, "offset": 0, "speed": 0, "type": "stream"})


if __name__ == "__main__":
    unittest.main()
