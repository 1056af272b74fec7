#!/usr/bin/env python3
"""Interop: block-commit (active commit), vblk serve beside qemu-storage-daemon.

A qcow2 chain base <- mid <- top, each layer a node of its own (as libvirt
adds them), top exported over NBD. Every scenario runs against both daemons
with the same commands and asserts the same replies, job statuses, events
and image contents (qemu-img compare of the chain against the base);
normalised as in test_mirror.py. The base must be a writable node (vblk
cannot reopen a read-only backing file). The intermediate commit is tested
in test_stream.py, with block-stream.

Environment: VBLK (binary under test), VBLK_MIRROR_ONE_DAEMON=1 (run with
whichever daemon exists). Python standard library only.
"""

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


def make_chain(d):
    base, mid, top = (os.path.join(d, n) for n in ("base.qcow2", "mid.qcow2", "top.qcow2"))
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run(QEMU_IMG, "create", "-f", "qcow2", base, "8M")
    run(QEMU_IO, "-c", "write -P 1 0 2M", base)
    run(QEMU_IMG, "create", "-f", "qcow2", "-b", base, "-F", "qcow2", mid)
    run(QEMU_IO, "-c", "write -P 2 1M 2M", mid)
    run(QEMU_IMG, "create", "-f", "qcow2", "-b", mid, "-F", "qcow2", top)
    run(QEMU_IO, "-c", "write -P 3 2M 2M", "-c", "write -z 6M 64k", top)
    return base, mid, top


def qcow2_node(name, path, backing):
    return {"driver": "qcow2", "node-name": name, "file": {"driver": "file", "filename": path}, "backing": backing}


@unittest.skipUnless(QSD and QEMU_IMG and QEMU_IO, "needs qemu-storage-daemon, qemu-img and qemu-io")
class CommitInteropTest(BothDaemons, InteropTestCase):

    def setUp(self):
        super().setUp()
        if len(DAEMONS) < 2 and not os.environ.get("VBLK_MIRROR_ONE_DAEMON"):
            self.skipTest("needs both qemu-storage-daemon and vblk serve")


    def setup_chain(self, q, d):
        base, mid, top = make_chain(d)
        q.ok("blockdev-add", **qcow2_node("base", base, None))
        q.ok("blockdev-add", **qcow2_node("mid", mid, "base"))
        q.ok("blockdev-add", **qcow2_node("top", top, "mid"))
        sock = os.path.join(d, "nbd.sock")
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "top", "name": "top", "writable": True})
        return base, mid, top, sock

    def nbd_io(self, sock, *cmds):
        args = [QEMU_IO, "-f", "raw"]
        for c in cmds:
            args += ["-c", c]
        r = subprocess.run(args + ["nbd+unix:///top?socket=" + sock], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)

    def finished(self, q, name="BLOCK_JOB_COMPLETED"):
        e = q.event(name, 60)
        end = time.time() + 10
        while q.ok("query-jobs") and time.time() < end:
            time.sleep(0.02)
        return e["data"]

    def test_active_commit_complete(self):
        """Commit top and mid into base under NBD writes: ready with what the
        upper layers allocate, complete moves the export to base, and base
        then reads as the whole chain did."""
        def run(q, d):
            base, mid, top, sock = self.setup_chain(q, d)
            q.ok("block-commit", **{"job-id": "j", "device": "top", "base-node": "base"})
            self.nbd_io(sock, "write -P 4 5M 256k")
            ready = q.event("BLOCK_JOB_READY", 60)["data"]
            view = {k: v for k, v in q.ok("query-block-jobs")[0].items() if k not in ("len", "offset", "busy")}
            exports = norm(q.ok("query-block-exports"))
            self.nbd_io(sock, "write -P 5 7M 64k")
            q.ok("block-job-complete", device="j")
            done = self.finished(q)
            after = q.ok("query-block-exports")
            for n in ("top", "mid"):
                q.ok("blockdev-del", **{"node-name": n})
            q.ok("block-export-del", id="e0")
            q.ok("blockdev-del", **{"node-name": "base"})
            chain_vs_base = compare(top, base, "qcow2", "qcow2")
            check = subprocess.run([QEMU_IMG, "check", base], capture_output=True, text=True)
            return (ready["type"], ready["len"] >= 3 * MiB, view, exports, done["type"], "error" in done, after,
                    chain_vs_base, check.returncode, job_statuses(q.events))
        seen = self.each_daemon(run)
        self.assertSame(seen)
        (rtype, _, view, exports, dtype, err, after, chain_vs_base, check, statuses) = list(seen.values())[0]
        self.assertEqual((rtype, dtype, err), ("commit", "commit", False))
        self.assertEqual(view["status"], "ready")
        self.assertEqual(exports[0]["node-name"], "#block")
        self.assertEqual(after[0]["node-name"], "base")
        self.assertEqual(chain_vs_base, SAME)
        self.assertEqual(check, 0)
        self.assertEqual(statuses, ["created", "running", "ready", "waiting", "pending", "concluded", "null"])

    def test_default_base_filename_and_cancel(self):
        """The default base is the chain's bottom, `base` finds it by file
        name; a soft cancel after ready leaves the export on top with base
        holding the merged data; a forced one is CANCELLED."""
        def run(q, d):
            base, mid, top, sock = self.setup_chain(q, d)
            out = []
            for args, force in (({}, False), ({"base": base}, True)):
                q.ok("block-commit", **dict({"job-id": "j", "device": "top"}, **args))
                out.append(q.event("BLOCK_JOB_READY", 60)["data"]["type"])
                q.ok("block-job-cancel", device="j", force=force)
                out.append(self.finished(q, "BLOCK_JOB_CANCELLED" if force else "BLOCK_JOB_COMPLETED")["type"])
                out.append(q.ok("query-block-exports")[0]["node-name"])
            q.ok("block-export-del", id="e0")
            for n in ("top", "mid", "base"):
                q.ok("blockdev-del", **{"node-name": n})
            out.append(compare(top, base, "qcow2", "qcow2"))
            return out
        seen = self.each_daemon(run)
        self.assertSame(seen)
        self.assertEqual(list(seen.values())[0], ["commit", "commit", "top", "commit", "commit", "top", SAME])

    def test_argument_errors(self):
        bad = [
            {"device": "nope"},
            {"device": "mid"},
            {"device": "top", "top-node": "x"},
            {"device": "top", "top-node": "base", "base-node": "mid"},
            {"device": "top", "base-node": "top"},
            {"device": "top", "base-node": "nope"},
            {"device": "top", "top": "a", "top-node": "b"},
            {"device": "top", "base": "a", "base-node": "b"},
            {"device": "top", "top": "nope.qcow2"},
            {"device": "top", "base": "nope.qcow2"},
            {"device": "top", "backing-file": "x"},
            {"device": "top", "top-node": "top", "base-node": "top"},
            {"device": "top", "speed": -1},
            {"device": "top", "job-id": "1x"},
            {"device": "top", "job-id": "j", "speed": -1},
            {"device": "top", "job-id": "j", "filter-node-name": "mid"},
            {"device": "top", "job-id": "j", "on-error": "x"},
            {"device": "top", "job-id": "j", "bogus": 1},
            {"job-id": "j"},
        ]

        def run(q, d):
            self.setup_chain(q, d)
            out = []
            for a in bad:
                out.append(q.cmd("block-commit", **a))
                time.sleep(0.02)
                out.append(job_statuses(q.events))
                q.events.clear()
            # A second job on the chain while one runs.
            q.ok("block-commit", **{"job-id": "j", "device": "top", "speed": 64 * 1024})
            out.append(q.cmd("block-commit", **{"job-id": "k", "device": "top"}))
            out.append(q.cmd("blockdev-del", **{"node-name": "base"}))
            q.ok("block-job-cancel", device="j", force=True)
            self.finished(q, "BLOCK_JOB_CANCELLED")
            return norm(out)
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out[0], {"error": {"class": "DeviceNotFound", "desc": "Device 'nope' not found"}})
        self.assertEqual(out[29], ["created", "null"])


if __name__ == "__main__":
    unittest.main()
