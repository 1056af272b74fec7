#!/usr/bin/env python3
"""Interop: blockdev-backup and the job verbs, vblk serve beside qemu-storage-daemon.

Every scenario runs against qemu-storage-daemon (QEMU 7.2) and `vblk serve`
with the same QMP commands on images made the same way, and asserts the same
outcomes for both: reply errors (class and text), the BLOCK_JOB_* events and
their data, query-block-jobs fields, and the backup's content checked with
`qemu-img compare`. The internal pause/resume cycles QEMU goes through while
it inserts its filter (extra JOB_STATUS_CHANGE paused/running pairs) are not
part of the comparison.

Environment: VBLK (binary under test), VBLK_BACKUP_PIT_REPS (point-in-time
repetitions, default 20), VBLK_BACKUP_ONE_DAEMON=1 (run with one daemon).

Only the Python standard library is used.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import BothDaemons, MiB, InteropTestCase, VBLK, rand_bytes, storage_daemons  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
QEMU_IMG = shutil.which("qemu-img")
PIT_REPS = int(os.environ.get("VBLK_BACKUP_PIT_REPS", "20"))


DAEMONS = storage_daemons()


def compare(a, b, fmt_a="raw", fmt_b="raw"):
    r = subprocess.run([QEMU_IMG, "compare", "-f", fmt_a, "-F", fmt_b, a, b], capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def file_node(name, path, fmt="raw"):
    return {"driver": fmt, "node-name": name, "file": {"driver": "file", "filename": path}}


def job_statuses(events, job="j"):
    """JOB_STATUS_CHANGE statuses, without QEMU's internal pause/resume pairs."""
    out = []
    for e in events:
        if e["event"] == "JOB_STATUS_CHANGE" and e["data"]["id"] == job:
            s = e["data"]["status"]
            if s == "running" and out and out[-1] == "paused":
                out.pop()
                continue
            out.append(s)
    return out


def block_events(events):
    return [(e["event"], e["data"]) for e in events if e["event"].startswith("BLOCK_JOB_")]


@unittest.skipUnless(QSD and QEMU_IMG, "needs qemu-storage-daemon and qemu-img")
class BackupInteropTest(BothDaemons, InteropTestCase):

    def setUp(self):
        super().setUp()
        # VBLK_BACKUP_ONE_DAEMON=1 runs against whichever daemon exists
        # (to check the test itself against qemu-storage-daemon alone).
        if len(DAEMONS) < 2 and not os.environ.get("VBLK_BACKUP_ONE_DAEMON"):
            self.skipTest("needs both qemu-storage-daemon and vblk serve")

    # -- helpers ----------------------------------------------------------
    def images(self, d, size=32 * MiB, seed=1, sparse=False):
        src = os.path.join(d, "src.raw")
        tgt = os.path.join(d, "tgt.raw")
        with open(src, "wb") as f:
            f.truncate(size)
            if sparse:
                for i in range(0, size, 4 * MiB):
                    f.seek(i)
                    f.write(rand_bytes(MiB, "%s-%d" % (seed, i)))
            else:
                f.write(rand_bytes(size, seed))
        with open(tgt, "wb") as f:
            f.truncate(size)
        return src, tgt


    def wait_done(self, q, timeout=120):
        e = q.event("BLOCK_JOB_COMPLETED", timeout)
        q.drain_events()
        return e

    # -- scenarios --------------------------------------------------------
    def test_target_free_when_job_ends_under_writes(self):
        """A guest writes through an NBD export the whole time: as soon as
        BLOCK_JOB_COMPLETED has come, blockdev-del of the target succeeds
        (QEMU's job ends drained). vblk's copy-before-write filter held the
        target until the writes inside it ended: "Block device tgtN is in
        use" (found by scripts/soak_serve.py)."""
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
        import threading
        import soak_serve

        def run(q, d):
            src = os.path.join(d, "src.qcow2")  # zeroes: what the writers expect where they have not written
            subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", src, str(16 * MiB)], check=True)
            q.ok("blockdev-add", **file_node("src", src, "qcow2"))
            sock = os.path.join(d, "nbd.sock")
            q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            q.ok("block-export-add", {"type": "nbd", "id": "e", "name": "e", "node-name": "src", "writable": True})
            stop = threading.Event()
            writers = [soak_serve.Client(k, sock, b"e", k * 8 * MiB, 8 * MiB, stop, k) for k in range(2)]
            for w in writers:
                w.start()
            refused = []
            for i in range(20):
                tgt = os.path.join(d, "t%d.qcow2" % i)
                subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", tgt, str(16 * MiB)], check=True)
                q.ok("blockdev-add", **file_node("t%d" % i, tgt, "qcow2"))
                q.ok("blockdev-backup", **{"job-id": "j%d" % i, "device": "src", "target": "t%d" % i,
                                           "sync": "full"})
                q.event("BLOCK_JOB_COMPLETED", 120)  # and at once:
                r = q.cmd("blockdev-del", **{"node-name": "t%d" % i})
                if "error" in r:
                    refused.append(r["error"]["desc"])
                    time.sleep(1)
                    q.cmd("blockdev-del", **{"node-name": "t%d" % i})
            stop.set()
            for w in writers:
                w.join(30)
            return refused, [e for w in writers for e in w.errors], all(w.requests for w in writers)
        seen = self.each_daemon(run)
        for name, (refused, errors, wrote) in seen.items():
            self.assertEqual(refused, [], name)
            self.assertEqual(errors, [], name)
            self.assertTrue(wrote, name)

    def test_full_backup_raw_and_qcow2(self):
        def run(q, d):
            src, tgt = self.images(d, sparse=True)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            self.assertEqual(q.cmd("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt",
                                                         "sync": "full"}), {"return": {}})
            done = self.wait_done(q)
            self.assertEqual(compare(src, tgt), (0, "Images are identical."))
            self.assertEqual(q.ok("query-block-jobs"), [])
            # qcow2 -> qcow2, same checks.
            sq, tq = os.path.join(d, "src.qcow2"), os.path.join(d, "tgt.qcow2")
            subprocess.run([QEMU_IMG, "convert", "-O", "qcow2", src, sq], check=True)
            subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", tq, str(32 * MiB)], check=True)
            q.ok("blockdev-add", **file_node("sq", sq, "qcow2"))
            q.ok("blockdev-add", **file_node("tq", tq, "qcow2"))
            q.ok("blockdev-backup", **{"job-id": "j2", "device": "sq", "target": "tq", "sync": "full"})
            done2 = self.wait_done(q)
            q.ok("blockdev-del", **{"node-name": "tq"})
            q.ok("blockdev-del", **{"node-name": "sq"})  # qcow2 nodes hold write locks
            self.assertEqual(compare(sq, tq, "qcow2", "qcow2"), (0, "Images are identical."))
            check = subprocess.run([QEMU_IMG, "check", tq], capture_output=True, text=True)
            self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
            return (done["data"], done2["data"], job_statuses(q.events), job_statuses(q.events, "j2"))
        seen = self.each_daemon(run)
        self.assertSame(seen)
        data, _, st, _ = list(seen.values())[0]
        self.assertEqual(data, {"device": "j", "len": 32 * MiB, "offset": 32 * MiB, "speed": 0, "type": "backup"})
        self.assertEqual(st, ["created", "running", "waiting", "pending", "concluded", "null"])

    def test_compress(self):
        """compress=true stores compressed clusters in a qcow2 target (as many
        as QEMU's), refuses a raw target with QEMU's error, and verifies."""
        def run(q, d):
            src = os.path.join(d, "src.raw")
            with open(src, "wb") as f:
                f.truncate(16 * MiB)
                for i in range(0, 16 * MiB, 2 * MiB):  # compressible data, holes between
                    f.seek(i)
                    f.write((b"vblk %08d " % i) * (MiB // 14))
            raw_tgt = os.path.join(d, "tgt.raw")
            with open(raw_tgt, "wb") as f:
                f.truncate(16 * MiB)
            tq = os.path.join(d, "tgt.qcow2")
            subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", tq, str(16 * MiB)], check=True)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("traw", raw_tgt))
            q.ok("blockdev-add", **file_node("tq", tq, "qcow2"))
            refused = q.cmd("blockdev-backup", **{"job-id": "j", "device": "src", "target": "traw",
                                                  "sync": "full", "compress": True})
            q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tq", "sync": "full",
                                       "compress": True})
            done = self.wait_done(q)
            q.ok("blockdev-del", **{"node-name": "tq"})
            self.assertEqual(compare(src, tq, "raw", "qcow2"), (0, "Images are identical."))
            check = subprocess.run([QEMU_IMG, "check", "--output=json", tq], capture_output=True, text=True)
            self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
            c = json.loads(check.stdout)
            self.assertGreater(c["compressed-clusters"], 0)
            return (refused, done["data"], c["compressed-clusters"], c["allocated-clusters"])
        seen = self.each_daemon(run)
        self.assertSame(seen)
        refused = list(seen.values())[0][0]
        self.assertEqual(refused["error"], {"class": "GenericError",
                                            "desc": "Compression is not supported for this drive "})

    def test_pause_resume(self):
        def run(q, d):
            src, tgt = self.images(d)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 8 * MiB})
            time.sleep(0.5)
            q.ok("block-job-pause", device="j")
            again = q.cmd("block-job-pause", device="j")
            time.sleep(0.5)  # the copy settles
            a = q.ok("query-block-jobs")[0]
            time.sleep(0.5)
            b = q.ok("query-block-jobs")[0]
            self.assertEqual(a["offset"], b["offset"], "progress while paused")
            self.assertLess(a["offset"], a["len"])
            cancel_paused = q.cmd("block-job-cancel", device="j")
            q.ok("block-job-set-speed", device="j", speed=0)
            q.ok("block-job-resume", device="j")
            again_resume = q.cmd("block-job-resume", device="j")
            done = self.wait_done(q)
            self.assertEqual(compare(src, tgt), (0, "Images are identical."))
            return ({k: a[k] for k in ("status", "paused", "busy", "io-status", "ready", "speed", "len")},
                    again, cancel_paused, again_resume, done["data"])
        seen = self.each_daemon(run)
        self.assertSame(seen)
        a, again, cancel_paused, again_resume, done = list(seen.values())[0]
        self.assertEqual(a["status"], "paused")
        self.assertTrue(a["paused"])
        self.assertEqual(again["error"]["desc"], "Job is already paused")
        self.assertEqual(cancel_paused["error"]["desc"], "The block job for device 'j' is currently paused")
        self.assertEqual(again_resume["error"]["desc"], "Can't resume a job that was not paused")

    def test_set_speed(self):
        def run(q, d):
            src, tgt = self.images(d)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 1 * MiB})
            time.sleep(1.0)
            j = q.ok("query-block-jobs")[0]
            # 1 MiB/s for a second: far from done (one chunk of overshoot at most).
            self.assertLess(j["offset"], 4 * MiB)
            bad = q.cmd("block-job-set-speed", device="j", speed=-1)
            t0 = time.time()
            q.ok("block-job-set-speed", device="j", speed=0)
            done = self.wait_done(q, timeout=30)
            self.assertLess(time.time() - t0, 20)
            self.assertEqual(compare(src, tgt), (0, "Images are identical."))
            return j["speed"], bad, done["data"]["speed"]
        seen = self.each_daemon(run)
        self.assertSame(seen)
        speed, bad, final = list(seen.values())[0]
        self.assertEqual(speed, MiB)
        self.assertEqual(bad["error"], {"class": "GenericError",
                                        "desc": "Parameter 'speed' expects a non-negative value"})
        self.assertEqual(final, 0)

    def test_cancel(self):
        def run(q, d):
            src, tgt = self.images(d)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 4 * MiB, "filter-node-name": "flt"})
            time.sleep(0.3)
            in_use = q.cmd("blockdev-del", **{"node-name": "tgt"})
            q.ok("block-job-cancel", device="j")
            e = q.event("BLOCK_JOB_CANCELLED")
            q.drain_events()
            self.assertLess(e["data"]["offset"], e["data"]["len"])
            self.assertEqual(q.ok("query-block-jobs"), [])
            # The filter is gone and the nodes are free again.
            names = [n["node-name"] for n in q.ok("query-named-block-nodes")]
            self.assertNotIn("flt", names)
            q.ok("blockdev-del", **{"node-name": "tgt"})
            q.ok("blockdev-del", **{"node-name": "src"})
            return e["data"]["len"], e["data"]["speed"], in_use["error"]["class"], job_statuses(q.events)
        seen = self.each_daemon(run)
        self.assertSame(seen)
        self.assertEqual(list(seen.values())[0][3], ["created", "running", "aborting", "concluded", "null"])

    def test_point_in_time_under_nbd_writer(self):
        if not QEMU_IO:
            self.skipTest("needs qemu-io")

        def run(q, d):
            size = 16 * MiB
            src, tgt = self.images(d, size=size, seed=7)
            with open(src, "rb") as f:
                before = f.read()
            sock = os.path.join(d, "nbd.sock")
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            q.ok("block-export-add", type="nbd", id="e0", **{"node-name": "src"}, writable=True)
            rng = random.Random(1234)
            for rep in range(PIT_REPS):
                with open(tgt, "wb") as f:
                    f.truncate(size)
                q.ok("blockdev-add", **file_node("tgt", tgt))
                cmds = []
                for _ in range(20):
                    n = rng.randint(1, 256 * 1024)
                    off = rng.randrange(0, size - n)
                    cmds += ["-c", "write -P 0x%02x %d %d" % (rng.randint(1, 255), off, n)]
                q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                           "speed": 16 * MiB})
                w = subprocess.run([QEMU_IO, "-f", "raw"] + cmds + ["nbd+unix:///src?socket=" + sock],
                                   capture_output=True, text=True, timeout=60)
                self.assertEqual(w.returncode, 0, w.stderr)
                done = self.wait_done(q)
                self.assertNotIn("error", done["data"])
                q.ok("blockdev-del", **{"node-name": "tgt"})
                with open(tgt, "rb") as f:
                    self.assertTrue(f.read() == before, "rep %d: backup is not the point-in-time image" % rep)
                with open(src, "rb") as f:
                    before = f.read()  # the next round's point in time
            q.ok("block-export-del", id="e0")
            return PIT_REPS
        self.assertSame(self.each_daemon(run))

    def test_target_write_errors(self):
        def blkdebug_target(path, rule):
            return {"driver": "raw", "node-name": "tgt",
                    "file": {"driver": "blkdebug", "inject-error": [rule],
                             "image": {"driver": "file", "filename": path}}}

        def run(q, d):
            src, tgt = self.images(d, size=16 * MiB)
            q.ok("blockdev-add", **file_node("src", src))
            out = {}
            for policy in ("stop", "report", "ignore"):
                with open(tgt, "wb") as f:
                    f.truncate(16 * MiB)
                rule = {"event": "write_aio", "errno": 5, "sector": 8192, "once": True}
                q.ok("blockdev-add", **blkdebug_target(tgt, rule))
                q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                           "on-target-error": policy})
                err = q.event("BLOCK_JOB_ERROR")
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
                done = self.wait_done(q)
                q.ok("blockdev-del", **{"node-name": "tgt"})
                rc, _ = compare(src, tgt)
                out[policy] = (err["data"], paused, "error" in done["data"], done["data"].get("error"), rc)
            return out
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out["stop"], ({"device": "j", "operation": "write", "action": "stop"},
                                       {"status": "paused", "paused": True, "io-status": "failed"}, False, None, 0))
        self.assertEqual(out["report"], ({"device": "j", "operation": "write", "action": "report"}, None, True,
                                         "Input/output error", 1))
        self.assertEqual(out["ignore"][0]["action"], "ignore")
        self.assertEqual(out["ignore"][2:], (False, None, 0))

    def test_argument_errors(self):
        bad = [
            {},
            {"job-id": "j", "device": "src", "target": "tgt"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "foo"},
            {"device": "src", "target": "tgt", "sync": "full"},
            {"job-id": "1j", "device": "src", "target": "tgt", "sync": "full"},
            {"job-id": "j", "device": "nope", "target": "tgt", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "nope", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "src", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "small", "sync": "full"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": -1},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "x-perf": {"max-workers": 0}},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "x-perf": {"max-chunk": -1}},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "x-perf": {"max-chunk": 4096}},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "x-perf": {"bogus": 1}},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "incremental"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "bitmap": "b0"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "bitmap-mode": "always"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "on-target-error": "explode"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": "fast"},
            {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "bogus": 1},
        ]

        def run(q, d):
            src, tgt = self.images(d, size=4 * MiB)
            small = os.path.join(d, "small.raw")
            with open(small, "wb") as f:
                f.truncate(MiB)
            q.ok("blockdev-add", **file_node("src", src))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            q.ok("blockdev-add", **file_node("small", small))
            out = [q.cmd("blockdev-backup", **a) for a in bad]
            for c in ("block-job-pause", "block-job-resume", "block-job-cancel", "block-job-complete"):
                out.append(q.cmd(c, device="nope"))
            out.append(q.cmd("block-job-set-speed", device="nope", speed=1))
            for c in ("block-job-finalize", "block-job-dismiss", "job-pause", "job-resume", "job-cancel",
                      "job-complete", "job-finalize", "job-dismiss"):
                out.append(q.cmd(c, id="nope"))
            out.append(q.cmd("block-job-pause"))
            # Verbs a running backup refuses, then a second job on busy nodes.
            q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": MiB, "auto-dismiss": False})
            out.append(q.cmd("blockdev-backup", **{"job-id": "j", "device": "src", "target": "small",
                                                   "sync": "full"}))
            out.append(q.cmd("blockdev-backup", **{"job-id": "j2", "device": "small", "target": "tgt",
                                                   "sync": "full"}))
            out.append(q.cmd("block-job-complete", device="j"))
            out.append(q.cmd("job-complete", id="j"))
            out.append(q.cmd("job-finalize", id="j"))
            out.append(q.cmd("job-dismiss", id="j"))
            q.ok("job-cancel", id="j")
            q.event("BLOCK_JOB_CANCELLED")
            q.drain_events()
            jobs = q.ok("query-jobs")
            out.append([(j["id"], j["status"], j.get("error")) for j in jobs])
            out.append(q.cmd("job-cancel", id="j"))
            out.append(q.cmd("job-dismiss", id="j"))
            out.append(q.ok("query-jobs"))
            return out
        seen = self.each_daemon(run)
        self.assertSame(seen)


if __name__ == "__main__":
    unittest.main()
