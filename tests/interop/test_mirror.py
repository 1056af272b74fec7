#!/usr/bin/env python3
"""Interop: blockdev-mirror, vblk serve beside qemu-storage-daemon.

Every scenario runs against qemu-storage-daemon (QEMU 7.2) and `vblk serve`
with the same QMP commands on images made the same way and asserts the same
outcomes: reply errors (class and text), job statuses and BLOCK_JOB_* events
with their data, query-block-jobs / query-jobs / query-block-exports, and
the copies' content with `qemu-img compare`. Normalised, because they cannot
agree: timestamps, generated node names (#blockNNN), and the internal
drained sections QEMU goes through (JOB_STATUS_CHANGE paused/running and
standby/ready pairs).

The writer scenarios drive fio's nbd engine at full speed through an NBD
export of the source: a write-blocking mirror becomes ready under it and,
after block-job-complete, the export's writes land on the target; a
background mirror converges once the writer pauses; a cancel after ready
leaves target == source.

Environment: VBLK (binary under test), VBLK_MIRROR_ONE_DAEMON=1 (run with
whichever daemon exists). Python standard library only.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import BothDaemons, MiB, InteropTestCase, rand_bytes, storage_daemons  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
QEMU_IMG = shutil.which("qemu-img")
FIO = shutil.which("fio")

DAEMONS = storage_daemons()
SAME = (0, "Images are identical.")


def compare(a, b, fmt_a="raw", fmt_b="raw", share=False):
    """qemu-img compare; `share` (-U) reads images a running job holds."""
    r = subprocess.run([QEMU_IMG, "compare"] + (["-U"] if share else []) + ["-f", fmt_a, "-F", fmt_b, a, b],
                       capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def file_node(name, path, fmt="raw"):
    return {"driver": fmt, "node-name": name, "file": {"driver": "file", "filename": path}}


def norm(v):
    """Generated node names differ between the daemons."""
    return json.loads(re.sub(r"#block\d+", "#block", json.dumps(v)))


def job_statuses(events, job="j"):
    """JOB_STATUS_CHANGE statuses without QEMU's internal pause/resume pairs
    (paused→running, standby→ready while it drains)."""
    out = []
    for e in events:
        if e["event"] == "JOB_STATUS_CHANGE" and e["data"]["id"] == job:
            s = e["data"]["status"]
            if out and (s, out[-1]) in (("running", "paused"), ("ready", "standby")):
                out.pop()
                continue
            out.append(s)
    return out


def block_events(events, job="j"):
    return [(e["event"], e["data"]) for e in events
            if e["event"].startswith("BLOCK_JOB_") and e["data"].get("device", e["data"].get("id")) == job]


def write_file(path, size, seed, sparse=False):
    with open(path, "wb") as f:
        f.truncate(size)
        if sparse:
            for i in range(0, size, 4 * MiB):
                f.seek(i)
                f.write(rand_bytes(MiB, "%s-%d" % (seed, i)))
        else:
            f.write(rand_bytes(size, seed))


def empty_file(path, size):
    with open(path, "wb") as f:
        f.truncate(size)


def fio(sock, seconds, extra=()):
    """fio's nbd engine writing 4 KiB at random, queue depth 16, for `seconds`."""
    return subprocess.Popen([FIO, "--name=w", "--ioengine=nbd", "--uri=nbd+unix:///src?socket=" + sock,
                             "--rw=randwrite", "--bs=4k", "--iodepth=16", "--time_based",
                             "--runtime=%d" % seconds, "--output-format=json"] + list(extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fio_done(p):
    out, err = p.communicate(timeout=120)
    if p.returncode != 0:
        raise AssertionError("fio failed: " + err)
    return json.loads(out[out.index("{"):])["jobs"][0]["write"]["total_ios"]


@unittest.skipUnless(QSD and QEMU_IMG, "needs qemu-storage-daemon and qemu-img")
class MirrorInteropTest(BothDaemons, InteropTestCase):

    def setUp(self):
        super().setUp()
        if len(DAEMONS) < 2 and not os.environ.get("VBLK_MIRROR_ONE_DAEMON"):
            self.skipTest("needs both qemu-storage-daemon and vblk serve")


    def export(self, q, d, node="src"):
        sock = os.path.join(d, "nbd.sock")
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": node, "name": "src", "writable": True})
        return sock

    def ready(self, q, timeout=60):
        return q.event("BLOCK_JOB_READY", timeout)["data"]

    def finished(self, q, name="BLOCK_JOB_COMPLETED", timeout=60):
        e = q.event(name, timeout)
        deadline = time.time() + 10
        while q.ok("query-jobs") and time.time() < deadline:
            time.sleep(0.02)
        return e["data"]

    def job_view(self, q):
        j = q.ok("query-block-jobs")[0]
        return {k: j[k] for k in ("type", "device", "len", "offset", "paused", "speed", "io-status", "ready",
                                  "status", "auto-finalize", "auto-dismiss")}

    # -- scenarios --------------------------------------------------------
    def test_full_complete_switches_export(self):
        """sync=full over a sparse source with an NBD export: ready with the
        whole disk copied, the export goes through the filter, complete
        moves it to the target, later writes land there."""
        def run(q, d):
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 32 * MiB, 1, sparse=True)
            empty_file(tgt, 32 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            sock = self.export(q, d)
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "auto-dismiss": False})
            ready = self.ready(q)
            at_ready = (self.job_view(q), q.ok("query-jobs"), norm(q.ok("query-block-exports")))
            names = sorted(n["node-name"] for n in norm(q.ok("query-named-block-nodes")))
            in_use = (q.cmd("blockdev-del", **{"node-name": "tgt"}), q.cmd("blockdev-del", **{"node-name": "src"}))
            again = q.cmd("blockdev-mirror", **{"job-id": "j2", "device": "src", "target": "tgt", "sync": "full"})
            # The job shares no consistent read of its target, not even with -U.
            locked = compare(src, tgt, share=True)[0]
            q.ok("block-job-complete", device="j")
            done = q.event("BLOCK_JOB_COMPLETED", 30)["data"]  # auto-dismiss off: it stays concluded
            time.sleep(0.1)
            concluded = q.ok("query-jobs")
            q.ok("job-dismiss", id="j")
            exports = q.ok("query-block-exports")
            synced = compare(src, tgt, share=True)
            # Writes through the export now reach the target only.
            w = subprocess.run([QEMU_IO, "-f", "raw", "-c", "write -P 0x5a 1M 64k",
                                "nbd+unix:///src?socket=" + sock], capture_output=True, text=True, timeout=30)
            self.assertEqual(w.returncode, 0, w.stderr)
            with open(tgt, "rb") as f:
                f.seek(MiB)
                on_target = f.read(64 * 1024) == b"\x5a" * 65536
            with open(src, "rb") as f:
                f.seek(MiB)
                on_source = f.read(64 * 1024) == b"\x5a" * 65536
            del_src = q.cmd("blockdev-del", **{"node-name": "src"})
            del_tgt = q.cmd("blockdev-del", **{"node-name": "tgt"})
            return (ready, at_ready, names, in_use, again, locked, done, concluded, exports, synced, on_target, on_source,
                    del_src, del_tgt, job_statuses(q.events), block_events(q.events))
        seen = self.each_daemon(run)
        self.assertSame(seen)
        (ready, at_ready, names, in_use, again, locked, done, concluded, exports, synced, on_target, on_source,
         del_src, del_tgt, statuses, _) = list(seen.values())[0]
        self.assertEqual(locked, 2)
        self.assertEqual(synced, SAME)
        self.assertEqual(ready, {"device": "j", "len": 32 * MiB, "offset": 32 * MiB, "speed": 0, "type": "mirror"})
        self.assertEqual(at_ready[0]["status"], "ready")
        self.assertEqual(at_ready[2][0]["node-name"], "#block")  # the export goes through the filter
        self.assertIn("#block", names)
        self.assertEqual(in_use[0]["error"]["desc"], "Node tgt is in use")
        self.assertEqual(again["error"]["desc"], "Need a root block node")
        self.assertEqual(exports[0]["node-name"], "tgt")
        self.assertTrue(on_target)
        self.assertFalse(on_source)
        self.assertEqual(del_src, {"return": {}})
        self.assertIn("error", del_tgt)
        self.assertEqual(statuses, ["created", "running", "ready", "waiting", "pending", "concluded", "null"])

    def test_source_free_when_job_ends_under_io(self):
        """A guest writes and reads back through an NBD export the whole
        time; each mirror is completed and, as soon as BLOCK_JOB_COMPLETED
        has come, blockdev-del of the old image succeeds (QEMU's job ends
        drained). vblk's mirror filter kept the source as its child until
        the requests inside it ended: "Block device x is in use", 2 in 750
        mirrors of a 10-minute scripts/soak_serve.py run.

        Every block the clients read back must hold what they wrote, in
        vblk. qemu-storage-daemon 7.2 is held to the deletion only: in 1
        of 6 runs on a loaded machine its clients read back other data than
        they wrote in 16 blocks (not investigated here)."""
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
        import threading
        import soak_serve

        def run(q, d):
            src = os.path.join(d, "m0.qcow2")
            subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", src, str(16 * MiB)], check=True)
            q.ok("blockdev-add", **file_node("m0", src, "qcow2"))
            sock = os.path.join(d, "nbd.sock")
            q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "name": "e", "node-name": "m0", "writable": True})
            stop = threading.Event()
            clients = [soak_serve.Client(k, sock, b"e", k * 8 * MiB, 8 * MiB, stop, k) for k in range(2)]
            for c in clients:
                c.start()
            refused = []
            for i in range(1, 13):
                tgt = os.path.join(d, "m%d.qcow2" % i)
                subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", tgt, str(16 * MiB)], check=True)
                q.ok("blockdev-add", **file_node("m%d" % i, tgt, "qcow2"))
                q.ok("blockdev-mirror", **{"job-id": "j%d" % i, "device": "m%d" % (i - 1), "target": "m%d" % i,
                                           "sync": "full"})
                q.event("BLOCK_JOB_READY", 120)
                q.ok("block-job-complete", device="j%d" % i)
                q.event("BLOCK_JOB_COMPLETED", 120)  # and at once:
                r = q.cmd("blockdev-del", **{"node-name": "m%d" % (i - 1)})
                if "error" in r:
                    refused.append(r["error"]["desc"])
                    time.sleep(1)
                    q.cmd("blockdev-del", **{"node-name": "m%d" % (i - 1)})
            stop.set()
            for c in clients:
                c.join(30)
            return refused, [e for c in clients for e in c.errors], all(c.requests for c in clients)
        seen = self.each_daemon(run)
        for name, (refused, errors, worked) in seen.items():
            self.assertEqual(refused, [], name)
            if name != "qemu-storage-daemon":
                self.assertEqual(errors, [], name)
            self.assertTrue(worked, name)

    def test_cancel_after_ready(self):
        """A soft cancel once ready finishes the copy without switching
        (BLOCK_JOB_COMPLETED, target == source, export still on the source);
        a forced one ends with BLOCK_JOB_CANCELLED; before ready any cancel
        is forced."""
        def run(q, d):
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 16 * MiB, 2)
            empty_file(tgt, 16 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            self.export(q, d)
            out = []
            for force in (False, True):
                empty_file(tgt, 16 * MiB)
                q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full"})
                self.ready(q)
                q.ok("block-job-cancel", device="j", force=force)
                name = "BLOCK_JOB_CANCELLED" if force else "BLOCK_JOB_COMPLETED"
                out.append((name, self.finished(q, name), compare(src, tgt)[0],
                            q.ok("query-block-exports")[0]["node-name"]))
            empty_file(tgt, 16 * MiB)
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 2 * MiB, "buf-size": 256 * 1024})
            time.sleep(0.3)
            q.ok("block-job-cancel", device="j")
            e = self.finished(q, "BLOCK_JOB_CANCELLED")
            out.append((e["len"], e["offset"] < e["len"], compare(src, tgt)[0]))
            return out, job_statuses(q.events)
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out, statuses = list(seen.values())[0]
        self.assertEqual(out[0], ("BLOCK_JOB_COMPLETED", {"device": "j", "len": 16 * MiB, "offset": 16 * MiB,
                                                          "speed": 0, "type": "mirror"}, 0, "src"))
        self.assertEqual(out[1][2:], (0, "src"))
        self.assertEqual(out[2], (16 * MiB, True, 1))

    def test_argument_errors(self):
        bad = [
            {"job-id": "j", "device": "nope", "target": "tgt", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "nope", "sync": "full"},
            {"job-id": "j", "device": "#block", "target": "tgt", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "src", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "incremental"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "bitmap"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "bogus"},
            {"job-id": "j", "device": "src", "target": "tgt"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "granularity": 1000},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "granularity": 256},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "granularity": 1 << 27},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "granularity": 1 << 33},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "granularity": -1},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "buf-size": -1},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": -1},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "replaces": "nope"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "replaces": "small"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "filter-node-name": "tgt"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "filter-node-name": "1bad"},
            {"device": "src", "target": "tgt", "sync": "full"},
            {"job-id": "1j", "device": "src", "target": "tgt", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "copy-mode": "x"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "on-source-error": "x"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "bogus": 1},
        ]

        def run(q, d):
            src, tgt, small = (os.path.join(d, n) for n in ("src.raw", "tgt.raw", "small.raw"))
            write_file(src, 4 * MiB, 3)
            empty_file(tgt, 4 * MiB)
            empty_file(small, MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            q.ok("blockdev-add", **file_node("small", small))
            # "#block": the raw node's implicit file child (not a root node).
            child = [n["node-name"] for n in q.ok("query-named-block-nodes") if n["drv"] == "file"][0]
            out = []
            for a in bad:
                a = dict(a, device=child) if a.get("device") == "#block" else a
                out.append(q.cmd("blockdev-mirror", **a))
                time.sleep(0.02)
                out.append(job_statuses(q.events))
                q.events.clear()
            # A target of another size fails the started job.
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "small", "sync": "full"})
            out.append(self.finished(q))
            out.append(job_statuses(q.events))
            q.events.clear()
            # Verbs before ready; a second job on busy nodes.
            # (a job copies up to buf-size before its first rate-limit sleep)
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 64 * 1024, "buf-size": 64 * 1024})
            out.append(q.cmd("block-job-complete", device="j"))
            out.append(q.cmd("job-complete", id="j"))
            out.append(q.cmd("blockdev-mirror", **{"job-id": "j2", "device": "small", "target": "tgt",
                                                   "sync": "full"}))
            out.append(q.cmd("blockdev-backup", **{"job-id": "j2", "device": "src", "target": "small",
                                                   "sync": "full"}))
            out.append(q.cmd("blockdev-del", **{"node-name": "src"}))
            q.ok("block-job-cancel", device="j")
            self.finished(q, "BLOCK_JOB_CANCELLED")
            return norm(out)
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out[16]["error"]["desc"], "Parameter 'granularity' expects a power of 2")
        self.assertEqual(out[28], {"error": {"class": "GenericError",
                                             "desc": "Parameter 'speed' expects a non-negative value"}})
        self.assertEqual(out[29], ["created", "null"])
        self.assertEqual(out[48]["error"], "Source and target image have different sizes")

    def test_pause_resume_set_speed(self):
        def run(q, d):
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 16 * MiB, 4)
            empty_file(tgt, 16 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 4 * MiB, "buf-size": MiB, "granularity": 65536})
            time.sleep(0.5)
            q.ok("block-job-pause", device="j")
            time.sleep(0.5)
            a = q.ok("query-block-jobs")[0]
            time.sleep(0.5)
            b = q.ok("query-block-jobs")[0]
            self.assertEqual(a["offset"], b["offset"], "progress while paused")
            self.assertLess(a["offset"], a["len"])
            q.ok("block-job-set-speed", device="j", speed=0)
            bad = q.cmd("block-job-set-speed", device="j", speed=-5)
            q.ok("block-job-resume", device="j")
            ready = self.ready(q, 30)
            q.ok("block-job-pause", device="j")
            time.sleep(0.3)
            standby = q.ok("query-block-jobs")[0]["status"]
            q.ok("block-job-resume", device="j")
            q.ok("job-complete", id="j")
            done = self.finished(q)
            self.assertEqual(compare(src, tgt), SAME)
            return ({k: a[k] for k in ("status", "paused", "speed", "len")}, bad, ready, standby, done,
                    job_statuses(q.events))
        seen = self.each_daemon(run)
        self.assertSame(seen)
        a, bad, ready, standby, done, statuses = list(seen.values())[0]
        self.assertEqual(a, {"status": "paused", "paused": True, "speed": 4 * MiB, "len": 16 * MiB})
        self.assertEqual(standby, "standby")
        # (the user's pauses are among the pairs job_statuses leaves out)
        self.assertEqual(statuses, ["created", "running", "ready", "waiting", "pending", "concluded", "null"])

    def test_sync_top_and_none(self):
        """sync=top copies the source's own layer onto a target that has the
        same backing file; sync=none only what is written after the start."""
        def run(q, d):
            base = os.path.join(d, "base.raw")
            write_file(base, 8 * MiB, 5)
            top, ttop = os.path.join(d, "top.qcow2"), os.path.join(d, "ttop.qcow2")
            for p in (top, ttop):
                subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", p],
                               check=True)
            subprocess.run([QEMU_IO, "-c", "write -P 0x11 1M 1M", "-c", "write -P 0x22 5M 512k", top],
                           check=True, capture_output=True)
            q.ok("blockdev-add", driver="qcow2", **{"node-name": "top"},
                 file={"driver": "file", "filename": top})
            q.ok("blockdev-add", driver="qcow2", **{"node-name": "ttop"},
                 file={"driver": "file", "filename": ttop})
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "top", "target": "ttop", "sync": "top"})
            r1 = self.ready(q)
            q.ok("block-job-complete", device="j")
            d1 = self.finished(q)
            q.ok("blockdev-del", **{"node-name": "ttop"})
            q.ok("blockdev-del", **{"node-name": "top"})
            top_same = compare(top, ttop, "qcow2", "qcow2")
            mp = json.loads(subprocess.run([QEMU_IMG, "map", "--output=json", ttop], capture_output=True,
                                           text=True).stdout)
            top_alloc = sum(e["length"] for e in mp if e["depth"] == 0 and e["data"])
            # sync=none: only writes made through the export after the start.
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 8 * MiB, 6)
            empty_file(tgt, 8 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            sock = self.export(q, d)
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "none"})
            r2 = self.ready(q)
            w = subprocess.run([QEMU_IO, "-f", "raw", "-c", "write -P 0x33 2M 128k",
                                "nbd+unix:///src?socket=" + sock], capture_output=True, text=True, timeout=30)
            self.assertEqual(w.returncode, 0, w.stderr)
            q.ok("block-job-complete", device="j")
            d2 = self.finished(q)
            with open(tgt, "rb") as f:
                t = f.read()
            with open(src, "rb") as f:
                s = f.read()
            copied = t[2 * MiB:2 * MiB + 128 * 1024] == s[2 * MiB:2 * MiB + 128 * 1024] == b"\x33" * 131072
            untouched = t[:MiB] == b"\0" * MiB
            return r1, d1, top_same, top_alloc, r2["len"], d2["offset"] >= 131072, copied, untouched
        seen = self.each_daemon(run)
        self.assertSame(seen)
        r1, d1, top_same, top_alloc, _, _, copied, untouched = list(seen.values())[0]
        self.assertEqual(top_same, SAME)
        self.assertEqual(r1["len"], MiB + 512 * 1024)
        self.assertEqual(top_alloc, MiB + 512 * 1024)
        self.assertTrue(copied)
        self.assertTrue(untouched)

    def test_target_write_error_policies(self):
        def run(q, d):
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 8 * MiB, 7)
            q.ok("blockdev-add", **file_node("src", src))
            out = {}
            for policy in ("stop", "report", "ignore"):
                empty_file(tgt, 8 * MiB)
                rule = {"event": "write_aio", "errno": 5, "sector": 4096, "once": True}
                q.ok("blockdev-add", driver="raw", **{"node-name": "tgt"},
                     file={"driver": "blkdebug", "inject-error": [rule],
                           "image": {"driver": "file", "filename": tgt}})
                q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                           "on-target-error": policy})
                err = q.event("BLOCK_JOB_ERROR")["data"]
                paused = None
                if policy == "stop":
                    end = time.time() + 30
                    while True:
                        j = q.ok("query-block-jobs")[0]
                        if j["status"] == "paused" or time.time() > end:
                            break
                        time.sleep(0.05)
                    paused = {k: j[k] for k in ("status", "paused", "io-status")}
                    q.ok("block-job-resume", device="j")
                if policy == "report":
                    done = self.finished(q)
                else:
                    self.ready(q)
                    q.ok("block-job-complete", device="j")
                    done = self.finished(q)
                q.ok("blockdev-del", **{"node-name": "tgt"})
                out[policy] = (err, paused, done.get("error"), compare(src, tgt)[0])
            return out
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out["stop"], ({"device": "j", "operation": "write", "action": "stop"},
                                       {"status": "paused", "paused": True, "io-status": "failed"}, None, 0))
        self.assertEqual(out["report"][2:], ("Input/output error", 1))
        self.assertEqual(out["ignore"][2:], (None, 0))

    @unittest.skipUnless(FIO and QEMU_IO, "needs fio and qemu-io")
    def test_write_blocking_under_fio(self):
        """fio writes through the export at full speed; a write-blocking mirror
        becomes ready meanwhile. After the writer, complete leaves target ==
        source; then a second fio run (write and verify) goes to the target
        through the switched export, and the first one's data is there."""
        def run(q, d):
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 64 * MiB, 8, sparse=True)
            empty_file(tgt, 64 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            sock = self.export(q, d)
            p = fio(sock, 4)
            time.sleep(0.5)
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "copy-mode": "write-blocking"})
            self.ready(q, 30)
            ready_while_writing = p.poll() is None
            ios = fio_done(p)
            self.assertGreater(ios, 0)
            q.ok("block-job-complete", device="j")
            self.finished(q)
            same = compare(src, tgt)
            with open(src, "rb") as f:
                before = f.read()
            v = subprocess.run([FIO, "--name=v", "--ioengine=nbd", "--uri=nbd+unix:///src?socket=" + sock,
                                "--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=8M", "--offset=16M",
                                "--verify=crc32c", "--verify_state_save=0", "--output-format=json"],
                               capture_output=True, text=True, timeout=120, cwd=d)
            self.assertEqual(v.returncode, 0, v.stderr)
            with open(src, "rb") as f:
                src_untouched = f.read() == before
            with open(tgt, "rb") as f:
                t = f.read()
            landed = t[16 * MiB:24 * MiB] != before[16 * MiB:24 * MiB]
            rest_same = t[:16 * MiB] == before[:16 * MiB] and t[24 * MiB:] == before[24 * MiB:]
            return ready_while_writing, same, src_untouched, landed, rest_same
        seen = self.each_daemon(run)
        self.assertSame(seen)
        self.assertEqual(list(seen.values())[0], (True, SAME, True, True, True))

    @unittest.skipUnless(FIO, "needs fio")
    def test_complete_while_fio_writes_and_verifies(self):
        """fio writes 16 MiB through the export (each block once, with a
        checksum) and then reads it all back through the export; the
        write-blocking mirror completes while fio is still writing, so the
        writes before the switch went to the source and the target, those
        after to the target only, and the read-back (from the target) finds
        every block: no write is lost at the switch."""
        def run(q, d):
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 32 * MiB, 10, sparse=True)
            empty_file(tgt, 32 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            sock = self.export(q, d)
            p = subprocess.Popen([FIO, "--name=v", "--ioengine=nbd", "--uri=nbd+unix:///src?socket=" + sock,
                                  "--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=16M", "--offset=8M",
                                  "--rate_iops=2000", "--verify=crc32c", "--verify_state_save=0",
                                  "--output-format=json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=d)
            time.sleep(0.3)
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "copy-mode": "write-blocking"})
            self.ready(q, 30)
            q.ok("block-job-complete", device="j")
            completed_while_writing = p.poll() is None
            done = self.finished(q)
            out, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, err)
            verified = json.loads(out[out.index("{"):])["jobs"][0]["read"]["io_bytes"]
            return completed_while_writing, "error" in done, verified, q.ok("query-block-exports")[0]["node-name"]
        seen = self.each_daemon(run)
        self.assertSame(seen)
        self.assertEqual(list(seen.values())[0], (True, False, 16 * MiB, "tgt"))

    @unittest.skipUnless(FIO, "needs fio")
    def test_background_converges_when_writer_pauses(self):
        """A background mirror under fio: once the writer stops, the job is
        (or becomes) ready; a soft cancel then leaves target == source."""
        def run(q, d):
            src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
            write_file(src, 64 * MiB, 9, sparse=True)
            empty_file(tgt, 64 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            sock = self.export(q, d)
            p = fio(sock, 3)
            time.sleep(0.3)
            q.ok("blockdev-mirror", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full"})
            fio_done(p)
            self.ready(q, 30)
            time.sleep(0.3)  # in sync again after the last writes
            q.ok("block-job-cancel", device="j")
            done = self.finished(q)
            return done["offset"] == done["len"], compare(src, tgt), q.ok("query-block-exports")[0]["node-name"]
        seen = self.each_daemon(run)
        self.assertSame(seen)
        self.assertEqual(list(seen.values())[0], (True, SAME, "src"))


if __name__ == "__main__":
    unittest.main()
