#!/usr/bin/env python3
"""Interop: the fault matrix. Injected I/O errors (blkdebug) under every
job, with every error policy, vblk serve beside qemu-storage-daemon.

Each cell is a job (blockdev-backup, blockdev-mirror, block-commit of the
active layer, block-stream; and `convert`, beside qemu-img) × a fault (EIO on a read of the source, ENOSPC
on a write to the target; once) × a policy (report, ignore, stop, enospc).
The job runs over 8 MiB of data on each daemon with the same QMP commands
and blkdebug rules; what each daemon does is recorded and must be equal:

- the BLOCK_JOB_ERROR events (operation, action) and how many;
- with `stop`: the job's status, paused flag and io-status once paused,
  then block-job-resume;
- for mirror and commit: BLOCK_JOB_READY, then block-job-complete;
- how the job ended (BLOCK_JOB_COMPLETED's error, or none);
- the data after it, by `qemu-img compare` (the backup or mirror target
  against the source; the image the guest reads after a commit or stream
  against the chain's content before the job) and whether the stream
  dropped the backing file.

`convert` has no error policy: it fails at the first error with
qemu-img's exit status and words, whatever the formats (raw and qcow2
sources and targets, the target given as json: with -n).

Errors fall on the data (a raw image's offset 2 MiB, a qcow2 data cluster
found with qemu-img map) except writes into a qcow2 layer (commit's base,
stream's top), where the first write of the job fails.

Environment: VBLK (binary under test). Python standard library only.
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

from common import BothDaemons, MiB, InteropTestCase, both, rand_bytes, storage_daemons  # noqa: E402

QEMU_IMG = shutil.which("qemu-img")
QEMU_IO = shutil.which("qemu-io")
DAEMONS = storage_daemons()

POLICIES = ("report", "ignore", "stop", "enospc")
FAULTS = ("source-read-eio", "target-write-enospc")
SIZE = 8 * MiB


def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True)


def compare(a, b, fa, fb):
    r = subprocess.run([QEMU_IMG, "compare", "-U", "-f", fa, "-F", fb, a, b], capture_output=True, text=True)
    return r.returncode


def host_offset(path, guest):
    """Where qcow2 image `path` keeps its own data for guest offset `guest`."""
    out = subprocess.run([QEMU_IMG, "map", "-U", "--output=json", "-f", "qcow2", path],
                         capture_output=True, text=True, check=True).stdout
    for e in json.loads(out):
        if e["depth"] == 0 and e["data"] and e["start"] <= guest < e["start"] + e["length"]:
            return e["offset"] + guest - e["start"]
    raise AssertionError("no data of %s at %d" % (path, guest))


def rule(fault, sector=None):
    r = {"event": "read_aio", "errno": 5} if fault == "source-read-eio" else {"event": "write_aio", "errno": 28}
    r["once"] = True
    if sector is not None:
        r["sector"] = sector
    return r


def file_child(path, inject=None):
    f = {"driver": "file", "filename": path}
    if inject is None:
        return f
    return {"driver": "blkdebug", "inject-error": [inject], "image": f}


class FaultMatrixTest(BothDaemons, InteropTestCase):

    def setUp(self):
        super().setUp()
        if len(DAEMONS) < 2:
            self.skipTest("needs both qemu-storage-daemon and vblk serve")
        if not QEMU_IO:
            self.skipTest("needs qemu-io")

    # -- one cell ------------------------------------------------------------
    def run_job(self, q, job, start, needs_complete, policy):
        """Starts the job, goes through its errors as the policy has it, and
        returns what happened."""
        q.ok(*start)
        errors = []
        paused = None
        ready = False
        deadline = time.time() + 60
        while True:
            e, _ = q.next_event(("BLOCK_JOB_ERROR", "BLOCK_JOB_READY", "BLOCK_JOB_COMPLETED"), 60)
            name, data = e["event"], e["data"]
            if name == "BLOCK_JOB_ERROR":
                errors.append((data["operation"], data["action"]))
                if data["action"] == "stop":
                    while time.time() < deadline:
                        j = q.ok("query-block-jobs")
                        if j and j[0]["status"] == "paused":
                            break
                        time.sleep(0.02)
                    j = q.ok("query-block-jobs")[0]
                    paused = {k: j[k] for k in ("status", "paused", "io-status")}
                    q.ok("block-job-resume", device=job)
            elif name == "BLOCK_JOB_READY":
                ready = True
                if needs_complete:
                    q.ok("block-job-complete", device=job)
            else:
                while q.ok("query-jobs") and time.time() < deadline:
                    time.sleep(0.02)
                return {"errors": errors, "paused": paused, "ready": ready, "error": data.get("error")}

    def cell(self, q, d, job, fault, policy):
        w = os.path.join(d, "%s-%s-%s" % (job, fault, policy))
        os.makedirs(w)
        p = lambda n: os.path.join(w, n)  # noqa: E731
        tag = "%s_%s_%s" % (job, FAULTS.index(fault), policy)
        src, tgt = "s" + tag, "t" + tag
        if job in ("backup", "mirror"):
            with open(p("src.raw"), "wb") as f:
                f.write(rand_bytes(SIZE, tag))
            with open(p("tgt.raw"), "wb") as f:
                f.truncate(SIZE)
            src_rule = rule(fault, 4096) if fault == "source-read-eio" else None
            tgt_rule = rule(fault, 4096) if fault == "target-write-enospc" else None
            q.ok("blockdev-add", driver="raw", **{"node-name": src}, file=file_child(p("src.raw"), src_rule))
            q.ok("blockdev-add", driver="raw", **{"node-name": tgt}, file=file_child(p("tgt.raw"), tgt_rule))
            args = {"job-id": tag, "device": src, "target": tgt, "sync": "full"}
            if fault == "source-read-eio":
                args["on-source-error"] = policy
            else:
                args["on-target-error"] = policy
            cmd = "blockdev-backup" if job == "backup" else "blockdev-mirror"
            out = self.run_job(q, tag, (cmd, args), job == "mirror", policy)
            out["compare"] = (p("src.raw"), p("tgt.raw"), "raw", "raw")
            return out
        # commit and stream: base <- top, the chain's content kept as ref.raw.
        with open(p("base.raw"), "wb") as f:
            f.write(rand_bytes(SIZE, tag))
        sh(QEMU_IMG, "convert", "-f", "raw", "-O", "qcow2", p("base.raw"), p("base.qcow2"))
        sh(QEMU_IMG, "create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", p("top.qcow2"))
        sh(QEMU_IO, "-f", "qcow2", "-c", "write -P 0x55 1M 2M", "-c", "write -P 0x66 5M 512k", p("top.qcow2"))
        sh(QEMU_IMG, "convert", "-f", "qcow2", "-O", "raw", p("top.qcow2"), p("ref.raw"))
        # Commit reads the top's data and writes the base; stream reads the
        # base's data (where the top has none) and writes the top.
        if job == "commit":
            reads, writes = "top.qcow2", "base.qcow2"
            read_at = host_offset(p("top.qcow2"), 2 * MiB)
        else:
            reads, writes = "base.qcow2", "top.qcow2"
            read_at = host_offset(p("base.qcow2"), 4 * MiB)
        rules = {reads: rule(fault, read_at // 512) if fault == "source-read-eio" else None,
                 writes: rule(fault) if fault == "target-write-enospc" else None}
        q.ok("blockdev-add", driver="qcow2", **{"node-name": "b" + tag}, backing=None,
             file=file_child(p("base.qcow2"), rules["base.qcow2"]))
        q.ok("blockdev-add", driver="qcow2", **{"node-name": src}, backing="b" + tag,
             file=file_child(p("top.qcow2"), rules["top.qcow2"]))
        if job == "commit":
            start = ("block-commit", {"job-id": tag, "device": src, "on-error": policy})
        else:
            start = ("block-stream", {"job-id": tag, "device": src, "on-error": policy})
        out = self.run_job(q, tag, start, job == "commit", policy)
        # What the guest reads now: the base after a completed commit, the
        # top otherwise (a failed commit leaves the chain as it was).
        reader = "base.qcow2" if job == "commit" and out["error"] is None else "top.qcow2"
        out["compare"] = (p("ref.raw"), p(reader), "raw", "qcow2")
        return out

    @staticmethod
    def settle(out):
        """Once the daemon has quit (images closed, caches written): the
        data compared, and whether the top still has a backing file."""
        a, b, fa, fb = out.pop("compare")
        out["same"] = compare(a, b, fa, fb)
        if fb == "qcow2":
            info = json.loads(subprocess.run([QEMU_IMG, "info", "--output=json", b],
                                             capture_output=True, text=True, check=True).stdout)
            out["backing"] = info.get("backing-filename")
        return out

    def matrix(self, job):
        def run(q, d):
            return {"%s/%s" % (fault, policy): self.cell(q, d, job, fault, policy)
                    for fault in FAULTS for policy in POLICIES}
        seen = self.each_daemon(run)
        seen = {d: {c: self.settle(o) for c, o in cells.items()} for d, cells in seen.items()}
        if os.environ.get("VBLK_FAULT_DEBUG"):
            for d, cells in seen.items():
                for c, o in cells.items():
                    print(d[:4], job, c, json.dumps(o), file=sys.stderr)
        names = list(seen)
        a, b = seen[names[0]], seen[names[1]]
        for cell in a:
            self.assertEqual(b[cell], a[cell], "%s %s: %s differs from %s" % (job, cell, names[1], names[0]))
        # Whatever the policy, a job that did not fail left the data whole.
        for cell, o in a.items():
            if o["error"] is None:
                self.assertEqual(o["same"], 0, "%s %s: %s" % (job, cell, o))
            self.assertTrue(o["errors"], "%s %s: no error injected: %s" % (job, cell, o))
        return a

    def test_convert(self):
        w = self.subdir("convert")
        src = os.path.join(w, "src.raw")
        with open(src, "wb") as f:
            f.write(rand_bytes(SIZE, "convert"))
        sh(QEMU_IMG, "convert", "-f", "raw", "-O", "qcow2", src, os.path.join(w, "src.qcow2"))

        def debugged(path, fmt, fault, sector=None):
            return "json:" + json.dumps({"driver": fmt, "file": file_child(path, rule(fault, sector))})

        qsrc_at = host_offset(os.path.join(w, "src.qcow2"), 2 * MiB) // 512
        cases = []
        for out_fmt in ("raw", "qcow2"):
            # A read of the source fails.
            cases.append(["convert", "-O", out_fmt, debugged(src, "raw", "source-read-eio", 4096), "out." + out_fmt])
            cases.append(["convert", "-f", "qcow2", "-O", out_fmt,
                          debugged(os.path.join(w, "src.qcow2"), "qcow2", "source-read-eio", qsrc_at),
                          "out." + out_fmt])
            # A write of the target fails (-n: the target exists).
            sh(QEMU_IMG, "create", "-f", out_fmt, os.path.join(w, "tgt." + out_fmt), str(SIZE))
            cases.append(["convert", "-n", "-O", out_fmt, src,
                          debugged("tgt." + out_fmt, out_fmt, "target-write-enospc",
                                   4096 if out_fmt == "raw" else None)])
        for argv in cases:
            v, q = both(*argv, cwd=w)
            self.assertSameResult(v, q, " ".join(argv))
            self.assertEqual(q.rc, 1, " ".join(argv))

    def test_backup(self):
        self.matrix("backup")

    def test_mirror(self):
        self.matrix("mirror")

    def test_commit(self):
        self.matrix("commit")

    def test_stream(self):
        self.matrix("stream")


if __name__ == "__main__":
    unittest.main()
