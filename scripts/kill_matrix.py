#!/usr/bin/env python3
"""SIGKILL matrix: kill vblk with SIGKILL at random instants of its
operations and check what it leaves behind.

Each point builds its images afresh (qcow2 images of 8-64 MiB holding random
data written at random offsets: a raw file of random extents converted by
qemu-img, then qemu-io writes of random data, patterns and zeroes), runs the
operation once to the end to measure how long it takes (and checks that
un-killed run), runs it again on a fresh copy of the same images and sends
SIGKILL after a random delay in [0, measured duration] (a quarter of the
points aim around the completion instead: the rename of a backup, the
block-job-complete of a mirror, ...), then checks the images:

  convert         vblk convert qcow2 -> qcow2 (64k, 4k, 512-byte clusters,
                  a backing chain as source) and -> raw. The source files are
                  unchanged (sha256) and check clean; the target, where it is
                  an image, checks without corruption (leaks allowed) and
                  every 512-byte sector of it holds the source's sector or
                  zeroes (an incomplete copy, never a wrong byte); a run that
                  exits by itself leaves a target identical to the source.
  backup          vblk backup, full (-O qcow2 / raw; no bitmap, a new
                  --bitmap, an existing --bitmap) and --incremental: TARGET
                  does not exist (only TARGET.vblk-partial, or nothing), or
                  it exists and `qemu-img compare` says it is identical to the
                  source as it was. The source checks without corruption and
                  reads as before. With a bitmap, data is then written to the
                  source and an incremental backup made on top of the last
                  finished backup of the chain: it must succeed and restore
                  to the source's content, or be refused because the bitmap
                  was left in use (inconsistent: counted), after which
                  `bitmap --remove`, a new full and an incremental must
                  restore exactly. A bitmap gone from an image that had it
                  (say, the header's bitmaps autoclear bit left down) is a
                  violation; a new chain's bitmap absent because its first
                  full backup did not finish is not.
  commit, rebase  the `vblk commit` / `vblk rebase` commands (qemu-img's
                  interface), when the binary has them; otherwise listed as
                  skipped. commit: base and overlay check without corruption
                  and the overlay reads as before.
  snapshot        vblk snapshot -c / -d / -a on an image with data and two
                  snapshots (512 B - 2 KiB clusters: many refcount updates).
                  Checks without corruption (leaks allowed; OFLAG_COPIED
                  missing on refcount-1 clusters only is repaired with
                  `check -r all` and counted, as in tests/interop/test_crash.py);
                  the active layer reads as before (-c, -d) or as before or as
                  the snapshot (-a); every snapshot left reads as it was taken;
                  the snapshots not involved are all there.
  stream, commit-active, commit-mid, mirror, blockdev-backup
                  jobs in `vblk serve` (QMP): block-stream, block-commit of
                  the active layer (then block-job-complete) and of an
                  intermediate one, blockdev-mirror (then
                  block-job-complete), blockdev-backup; the daemon is killed
                  at a random time after the job command (sometimes around
                  the completion, sometimes after it). Every image of the
                  chain checks without corruption and the top reads as
                  before (these jobs never change what the guest sees); a
                  mirror / backup target checks without corruption or is not
                  an image (its content is only reported).

A violation of any of these makes the run exit 1 after printing, per
violation, the reproducer: one command that runs that point again (same
images, same delay) and keeps its directory. A point's images and variant
depend only on its seed (and --max-size / --exclude-variants); the kill's
effect also depends on timing, so a reproducer may need a few runs (or
nearby delays).

Half of the points of convert, backup and the jobs run rate-limited (-r /
"speed", chosen so the copy lasts 0.1-1.2 s: kills between paced chunks),
half at full speed (kills with requests in flight).

Usage:
  python3 scripts/kill_matrix.py --vblk build/vblk --points 600 [--ops convert,backup,...|jobs]
      [--seed S] [--table FILE.md] [--tmpdir /dev/shm] [--max-size MiB] [-v]
      [--rate-limited] [--delay-cap FRACTION] [--daemon qemu-storage-daemon]
  python3 scripts/kill_matrix.py --vblk build/vblk --ops OP --point-seed P --delay D --keep

--daemon runs the jobs in another daemon with the same command line (such
as qemu-storage-daemon, to see whether QEMU behaves the same).

Python standard library only; needs qemu-img and qemu-io ($QEMU_IMG, $QEMU_IO).
"""

import argparse
import collections
import hashlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True  # keep the source tree clean
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
from qmp_driver import QMP, QMPError  # noqa: E402  (the benches' QMP client)

KiB = 1024
MiB = 1024 * KiB

# Every process this script started and has not reaped yet: killed in the
# finally block of main() (by pid, never by name).
LIVE = set()


# ---------------------------------------------------------------------------
# processes and tools
# ---------------------------------------------------------------------------

class Ctx:
    def __init__(self, vblk, qemu_img, qemu_io, max_size, verbose):
        self.vblk = vblk
        self.qemu_img = qemu_img
        self.qemu_io = qemu_io
        self.max_size = max_size
        self.verbose = verbose
        self.env = dict(os.environ, LC_ALL="C", LANG="C")

    def run(self, argv, cwd, timeout=180):
        """Runs argv to its end; returns CompletedProcess (text)."""
        try:
            return subprocess.run([str(a) for a in argv], cwd=cwd, env=self.env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, errors="replace", timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Violation("timed out after %d s: %s" % (timeout, " ".join(map(str, argv))))

    def img(self, cwd, *args, check=True):
        r = self.run([self.qemu_img] + list(args), cwd)
        if check and r.returncode != 0:
            raise SetupError("qemu-img %s: %s" % (" ".join(map(str, args)), r.stderr.strip()))
        return r

    def io(self, cwd, path, cmds, fmt="qcow2"):
        argv = [self.qemu_io, "-f", fmt]
        for c in cmds:
            argv += ["-c", c]
        r = self.run(argv + [path], cwd)
        if r.returncode != 0 or "error" in r.stdout.lower() or "failed" in r.stdout.lower():
            raise SetupError("qemu-io %s: %s%s" % (path, r.stdout[-500:], r.stderr[-500:]))

    def vblk_cmd(self, cwd, *args):
        return self.run([self.vblk] + list(args), cwd)


class Violation(Exception):
    """A broken promise (reported with the point's reproducer)."""


class SetupError(Exception):
    """The harness could not build a point's images (not vblk's fault)."""


def popen(argv, cwd, env, log_path):
    with open(log_path, "ab") as log:
        p = subprocess.Popen([str(a) for a in argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log)
    LIVE.add(p)
    return p


def reap(p, timeout=60):
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        LIVE.discard(p)
        raise Violation("pid %d did not exit within %d s" % (p.pid, timeout))
    LIVE.discard(p)
    return p.returncode


def kill_all_live():
    for p in list(LIVE):
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGKILL)
            except OSError:
                pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        LIVE.discard(p)


def lock_bytes(path):
    """Byte offsets of the OFD locks anybody holds on path's inode (image locks)."""
    try:
        ino = os.stat(path).st_ino
    except OSError:
        return []
    held = []
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[1] == "OFDLCK" and int(parts[5].split(":")[2]) == ino:
                held.append(parts[6])
    return held


def wait_unlocked(paths, timeout=30):
    """A process killed with SIGKILL keeps its locks until the kernel has
    cancelled its io_uring requests, a little after wait() returned."""
    end = time.monotonic() + timeout
    for path in paths:
        while lock_bytes(path):
            if time.monotonic() > end:
                raise Violation("%s still locked %d s after the kill" % (path, timeout))
            time.sleep(0.005)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# image construction
# ---------------------------------------------------------------------------

def random_raw(path, size, rng, density):
    """A sparse raw file with random data extents (64 KiB - 2 MiB, 4 KiB
    aligned) covering about `density` of it: unique content everywhere."""
    with open(path, "wb") as f:
        f.truncate(size)
        covered = 0
        while covered < density * size:
            length = rng.choice((64, 128, 256, 512, 1024, 2048)) * KiB
            off = rng.randrange(0, (size - length) // 4096 + 1) * 4096
            f.seek(off)
            f.write(rng.randbytes(length))
            covered += length


def io_writes(rng, size, n, chunks, zero_share=0.15, max_len=MiB):
    """qemu-io commands: n writes at random offsets of random data (from the
    chunk files), patterns, and zeroes."""
    cmds = []
    for _ in range(n):
        length = rng.choice((4, 16, 64, 128, 512, 1024)) * KiB
        length = min(length, max_len)
        off = rng.randrange(0, (size - length) // 512 + 1) * 512
        r = rng.random()
        if r < zero_share:
            cmds.append("write -z %d %d" % (off, length))
        elif r < 0.45:
            cmds.append("write -P %d %d %d" % (rng.randrange(1, 256), off, length))
        else:
            cmds.append("write -s %s %d %d" % (rng.choice(chunks), off, length))
    return cmds


def make_chunks(d, rng, n=4):
    names = []
    for i in range(n):
        name = "chunk%d.bin" % i
        with open(os.path.join(d, name), "wb") as f:
            f.write(rng.randbytes(MiB))
        names.append(name)
    return names


def make_image(ctx, d, name, size, rng, density, cluster=65536, extra_writes=40, chunks=None):
    """A qcow2 image with random data: extents converted from a raw file,
    then qemu-io writes on top (so allocation is out of order)."""
    raw = os.path.join(d, name + ".tmp.raw")
    random_raw(raw, size, rng, density)
    ctx.img(d, "convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=%d" % cluster, raw, name)
    os.unlink(raw)
    if extra_writes:
        chunks = chunks or make_chunks(d, rng)
        ctx.io(d, name, io_writes(rng, size, extra_writes, chunks))


def make_overlay(ctx, d, name, backing, size, rng, density, cluster=65536, chunks=None):
    """A qcow2 overlay of `backing` (relative name) with qemu-io writes
    covering about `density` of it."""
    ctx.img(d, "create", "-q", "-f", "qcow2", "-o", "cluster_size=%d" % cluster, "-b", backing, "-F", "qcow2",
            name, str(size))
    chunks = chunks or make_chunks(d, rng)
    n = max(4, int(density * size / (400 * KiB)))
    ctx.io(d, name, io_writes(rng, size, n, chunks))


def to_raw(ctx, d, img, out, fmt="qcow2", snapshot=None):
    args = ["convert", "-f", fmt]
    if snapshot:
        args += ["-l", "snapshot.name=" + snapshot]
    ctx.img(d, *(args + ["-O", "raw", img, out]))


def check_image(ctx, d, path, fmt="qcow2"):
    """qemu-img check: ("clean"|"leaks"|"corrupt"|"unopenable", text)."""
    r = ctx.img(d, "check", "-f", fmt, path, check=False)
    kind = {0: "clean", 3: "leaks", 2: "corrupt"}.get(r.returncode, "unopenable")
    return kind, (r.stdout + r.stderr).strip()


# qemu-img check's OFLAG_COPIED reports; harmless when the entry lacks the
# flag and the cluster's refcount is one (an unneeded copy on the next
# write): a snapshot operation killed between its refcount updates and the
# COPIED flags they allow. As in tests/interop/test_crash.py.
COPIED_RE = re.compile(r"^ERROR OFLAG_COPIED (?:L2 cluster: l1_index=\d+ l1_entry|data cluster: l2_entry)="
                       r"([0-9a-f]+) refcount=(\d+)$")


def only_conservative_copied(text):
    errors = [l for l in text.splitlines() if l.startswith("ERROR")]
    for line in errors:
        m = COPIED_RE.match(line)
        if not m or int(m.group(2)) != 1 or int(m.group(1), 16) & (1 << 63):
            return False
    return bool(errors)


def compare(ctx, d, a, b, fa="qcow2", fb="raw"):
    """qemu-img compare: (rc, message); rc 0 identical."""
    r = ctx.img(d, "compare", "-f", fa, "-F", fb, a, b, check=False)
    return r.returncode, (r.stdout + r.stderr).strip()


def img_info(ctx, d, path):
    r = ctx.img(d, "info", "-U", "--output=json", path, check=False)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout)


def bitmaps_of(ctx, d, path):
    """{name: flags} of an image's persistent bitmaps."""
    info = img_info(ctx, d, path) or {}
    data = info.get("format-specific", {}).get("data", {})
    return {b["name"]: b.get("flags", []) for b in data.get("bitmaps", [])}


def bitmaps_header(path):
    """(autoclear bitmaps bit set, bitmaps extension present) from a qcow2
    header: an extension without the bit is ignored by QEMU and vblk (a
    program that does not know bitmaps touched the image), i.e. every
    persistent bitmap of the image is gone."""
    with open(path, "rb") as f:
        h = f.read(65536)
    autoclear = int.from_bytes(h[88:96], "big")
    hdr_len = int.from_bytes(h[100:104], "big") if int.from_bytes(h[4:8], "big") >= 3 else 72
    off, ext = hdr_len, False
    while off + 8 <= len(h):
        t, n = int.from_bytes(h[off:off + 4], "big"), int.from_bytes(h[off + 4:off + 8], "big")
        if t == 0:
            break
        if t == 0x23852875:
            ext = True
        off += 8 + (n + 7) // 8 * 8
    return bool(autoclear & 1), ext


def sectors_from(got_path, ref_path, sector=512):
    """Checks that every sector of got is the ref's sector or zeroes.
    Returns (identical, first bad offset or None)."""
    zero_chunk = bytes(64 * KiB)
    identical = True
    with open(got_path, "rb") as g, open(ref_path, "rb") as r:
        off = 0
        while True:
            a = g.read(64 * KiB)
            b = r.read(64 * KiB)
            if not a and not b:
                return identical, None
            if len(a) != len(b):
                return False, off + min(len(a), len(b))
            if a != b:
                identical = False
                if a != zero_chunk[:len(a)]:
                    z = bytes(sector)
                    for i in range(0, len(a), sector):
                        s = a[i:i + sector]
                        if s != b[i:i + sector] and s != z[:len(s)]:
                            return False, off + i
            off += len(a)


# ---------------------------------------------------------------------------
# one point's result
# ---------------------------------------------------------------------------

class Point:
    def __init__(self, op, seed, variant):
        self.op = op
        self.seed = seed
        self.variant = variant
        self.outcomes = []
        self.violations = []
        self.phase = None        # "exited" | "killed-before" | "killed-after"
        self.duration = None     # the un-killed run's duration (s)
        self.delay = None
        self.mode = None         # "uniform" | "completion"

    def out(self, tag):
        self.outcomes.append(tag)

    def bad(self, msg):
        self.violations.append(msg)


def choose_delay(rng, duration, window=None, cap=None):
    """A delay in [0, duration]; a quarter of the points around the
    completion (window = (start, end) of the completion phase). With `cap`,
    a delay in [0, cap * duration] (never around the completion)."""
    if cap is not None:
        return rng.uniform(0, cap * duration), "capped"
    if rng.random() < 0.25:
        lo, hi = window if window else (0.75 * duration, 1.05 * duration)
        return rng.uniform(lo, hi), "completion"
    return rng.uniform(0, duration), "uniform"


# ---------------------------------------------------------------------------
# operations
# ---------------------------------------------------------------------------

def rate_mib(rng, size):
    """A rate limit (MiB/s) that makes a copy of up to `size` bytes last
    about 0.1-1.2 s."""
    return max(8, int(size / MiB / rng.uniform(0.1, 1.2)))


class Op:
    name = "?"
    variants = ()
    rate_capable = False  # half of the points then run rate-limited ("+rate")

    def available(self, ctx):
        return True, ""

    def sizes(self, ctx, rng, lo, hi):
        hi = min(hi, ctx.max_size) if ctx.max_size else hi
        lo = min(lo, hi)
        return rng.randrange(lo, hi + 1, 8) * MiB if hi >= lo + 8 else hi * MiB

    # setup(ctx, d, rng, variant) -> state (dict); measure(ctx, d, st, pt)
    # -> (duration, completion window or None), the un-killed run checked;
    # kill(ctx, d, st, delay, pt): the killed run and its checks, setting
    # pt.phase and recording outcomes and violations in pt.


class CliOp(Op):
    """An operation that is one vblk command line."""

    def argv(self, ctx, st):
        raise NotImplementedError

    def measure(self, ctx, d, st, pt):
        log = os.path.join(d, "vblk.log")
        t0 = time.monotonic()
        p = popen(self.argv(ctx, st), d, ctx.env, log)
        rc = reap(p, 300)
        dur = time.monotonic() - t0
        if rc != 0:
            raise Violation("un-killed run failed (rc %d): %s" % (rc, open(log, errors="replace").read()[-800:]))
        self.check(ctx, d, st, pt, exited_rc=0, measuring=True)
        return dur, None

    def kill(self, ctx, d, st, delay, pt):
        log = os.path.join(d, "vblk.log")
        t0 = time.monotonic()
        p = popen(self.argv(ctx, st), d, ctx.env, log)
        left = t0 + delay - time.monotonic()
        if left > 0:
            time.sleep(left)
        rc = p.poll()
        if rc is None:
            p.send_signal(signal.SIGKILL)
            rc = reap(p)
            # rc 0: it exited between the poll and the signal (a zombie
            # ignores SIGKILL): not killed.
            killed = rc != 0
        else:
            LIVE.discard(p)
            killed = False
        wait_unlocked([os.path.join(d, f) for f in os.listdir(d)])
        if not killed:
            pt.phase = "exited"
            if rc != 0:
                pt.bad("exited with rc %d before the kill: %s" % (rc, open(log, errors="replace").read()[-800:]))
            self.check(ctx, d, st, pt, exited_rc=rc)
        else:
            if rc != -signal.SIGKILL:
                pt.bad("rc %s after SIGKILL" % rc)
            pt.phase = "killed-before"
            done = self.check(ctx, d, st, pt, exited_rc=None)
            pt.phase = "killed-after" if done else "killed-before"


class ConvertOp(CliOp):
    name = "convert"
    variants = ("qcow2", "qcow2-4k", "qcow2-512", "qcow2-chain", "raw", "raw-chain")
    rate_capable = True

    def setup(self, ctx, d, rng, variant):
        chain = "-chain" in variant
        small = variant.startswith("qcow2-512")
        size = self.sizes(ctx, rng, 8 if small else 24, 24 if small else 64)
        src_cluster = rng.choice((65536, 65536, 4096))
        st = {"variant": variant, "size": size}
        if chain:
            make_image(ctx, d, "base.qcow2", size, rng, rng.uniform(0.4, 0.9), src_cluster)
            make_overlay(ctx, d, "src.qcow2", "base.qcow2", size, rng, rng.uniform(0.2, 0.5), src_cluster)
            st["sources"] = ["base.qcow2", "src.qcow2"]
        else:
            make_image(ctx, d, "src.qcow2", size, rng, rng.uniform(0.6, 1.0), src_cluster)
            st["sources"] = ["src.qcow2"]
        to_raw(ctx, d, "src.qcow2", "ref.raw")
        st["sha"] = {s: sha256(os.path.join(d, s)) for s in st["sources"]}
        if variant.startswith("raw"):
            st["out"], st["fmt"], st["opts"] = "tgt.raw", "raw", []
        else:
            cs = {"qcow2-4k": 4096, "qcow2-512": 512}.get(variant.split("+")[0], 65536)
            st["out"], st["fmt"], st["opts"] = "tgt.qcow2", "qcow2", ["-o", "cluster_size=%d" % cs]
        if variant.endswith("+rate"):
            st["opts"] += ["-r", "%dM" % rate_mib(rng, size)]
        return st

    def argv(self, ctx, st):
        return [ctx.vblk, "convert", "-f", "qcow2", "-O", st["fmt"]] + st["opts"] + ["src.qcow2", st["out"]]

    def check(self, ctx, d, st, pt, exited_rc, measuring=False):
        for s in st["sources"]:
            if sha256(os.path.join(d, s)) != st["sha"][s]:
                pt.bad("source %s changed (sha256)" % s)
            kind, text = check_image(ctx, d, s)
            if kind != "clean":
                pt.bad("source %s: qemu-img check %s: %s" % (s, kind, text[-600:]))
        if not pt.violations:
            pt.out("source unchanged, clean")
        out = os.path.join(d, st["out"])
        if not os.path.exists(out):
            if exited_rc is not None:
                pt.bad("no target after a run that exited")
            pt.out("target absent")
            return False
        if st["fmt"] == "qcow2":
            kind, text = check_image(ctx, d, st["out"])
            if kind == "unopenable":
                if exited_rc is not None:
                    pt.bad("target does not open after a run that exited: " + text[-400:])
                pt.out("target not an image")
                return False
            if kind == "corrupt":
                pt.bad("target: qemu-img check finds corruption: " + text[-800:])
                return False
            pt.out("target " + ("clean" if kind == "clean" else "leaks only"))
        got = os.path.join(d, "got.raw")
        r = ctx.img(d, "convert", "-f", st["fmt"], "-O", "raw", st["out"], got, check=False)
        if r.returncode != 0:
            pt.bad("target does not read: " + r.stderr[-400:])
            return False
        same, bad_at = sectors_from(got, os.path.join(d, "ref.raw"))
        os.unlink(got)
        if bad_at is not None:
            pt.bad("target sector at offset %d holds neither the source's data nor zeroes" % bad_at)
            return False
        if exited_rc is not None and not same:
            pt.bad("target differs from the source after a run that exited")
        pt.out("target identical" if same else "target partial (source or zero)")
        return same


class BackupOp(CliOp):
    name = "backup"
    variants = ("full", "full-raw", "full-new-bitmap", "full-bitmap", "incremental")
    rate_capable = True

    def setup(self, ctx, d, rng, variant):
        size = self.sizes(ctx, rng, 24, 64)
        cluster = rng.choice((65536, 65536, 4096))
        base_variant = variant.split("+")[0]
        st = {"variant": base_variant, "size": size, "bitmap": base_variant not in ("full", "full-raw")}
        make_image(ctx, d, "src.qcow2", size, rng, rng.uniform(0.6, 1.0), cluster)
        chunks = [f for f in os.listdir(d) if f.startswith("chunk")]
        st["prev"] = None
        if base_variant in ("full-bitmap", "incremental"):
            r = ctx.vblk_cmd(d, "backup", "-q", "--bitmap", "b0", "src.qcow2", "full0.qcow2")
            if r.returncode != 0:
                raise Violation("setup: full backup with --bitmap failed: " + r.stderr)
            # New data since the chain's start: what the incremental copies.
            ctx.io(d, "src.qcow2", io_writes(rng, size, max(8, size // (150 * KiB)), chunks))
            st["prev"] = "full0.qcow2"
        to_raw(ctx, d, "src.qcow2", "ref.raw")
        st["sha"] = sha256(os.path.join(d, "src.qcow2"))
        st["target"] = "tgt.raw" if base_variant == "full-raw" else "tgt.qcow2"
        st["tfmt"] = "raw" if base_variant == "full-raw" else "qcow2"
        st["rng_follow"] = rng.randrange(1 << 30)
        st["rate"] = ["-r", "%dM" % rate_mib(rng, size)] if variant.endswith("+rate") else []
        return st

    def argv(self, ctx, st):
        a = [ctx.vblk, "backup", "-q", "-f", "qcow2", "-O", st["tfmt"]] + st["rate"]
        if st["bitmap"]:
            a += ["--bitmap", "b0"]
        if st["variant"] == "incremental":
            a += ["--incremental", "-B", st["prev"], "-F", "qcow2"]
        return a + ["src.qcow2", st["target"]]

    def check(self, ctx, d, st, pt, exited_rc, measuring=False):
        tgt = os.path.join(d, st["target"])
        partial = tgt + ".vblk-partial"
        # The source: no corruption, the same guest content; untouched when
        # no bitmap is involved (opened read-only).
        kind, text = check_image(ctx, d, "src.qcow2")
        if kind not in ("clean", "leaks"):
            pt.bad("source: qemu-img check %s: %s" % (kind, text[-800:]))
        else:
            pt.out("source " + ("clean" if kind == "clean" else "leaks only"))
        rc, msg = compare(ctx, d, "src.qcow2", "ref.raw")
        if rc != 0:
            pt.bad("source content changed: " + msg)
        if not st["bitmap"] and sha256(os.path.join(d, "src.qcow2")) != st["sha"]:
            pt.bad("source file changed (sha256) by a backup without bitmap")
        done = os.path.exists(tgt)
        if done:
            rc, msg = compare(ctx, d, st["target"], "ref.raw", fa=st["tfmt"])
            if rc != 0:
                pt.bad("TARGET exists but differs from the source: " + msg)
            if st["tfmt"] == "qcow2":
                kind, text = check_image(ctx, d, st["target"])
                if kind == "corrupt" or kind == "unopenable":
                    pt.bad("TARGET: qemu-img check %s: %s" % (kind, text[-600:]))
                elif kind == "leaks":
                    pt.out("TARGET leaks only")
            if os.path.exists(partial):
                pt.bad("both TARGET and TARGET.vblk-partial exist")
            pt.out("TARGET complete, identical")
        elif os.path.exists(partial):
            if exited_rc is not None:
                pt.bad("only the partial target after a run that exited")
            pt.out("partial target left (no TARGET)")
        else:
            if exited_rc is not None:
                pt.bad("no target after a run that exited")
            pt.out("no target at all")
        if st["bitmap"] and not pt.violations:
            self.check_bitmap(ctx, d, st, pt, done)
        return done

    def check_bitmap(self, ctx, d, st, pt, done):
        """The chain goes on: write to the source, make an incremental backup
        on top of the last finished backup, and restore it."""
        rng = random.Random(st["rng_follow"])
        bms = bitmaps_of(ctx, d, "src.qcow2")
        bit, ext = bitmaps_header(os.path.join(d, "src.qcow2"))  # before a read-write open changes it
        prev = st["target"] if done else st["prev"]
        chunks = sorted(f for f in os.listdir(d) if f.startswith("chunk"))
        ctx.io(d, "src.qcow2", io_writes(rng, st["size"], 6, chunks))
        if prev is None:
            # A new chain whose full backup did not finish: the bitmap must
            # not claim a start point (it would call everything before it
            # backed up).
            if "b0" not in bms:
                pt.out("bitmap: new bitmap absent (chain not started)")
            elif "in-use" in bms["b0"]:
                pt.out("bitmap: in use (inconsistent), no backup")
            else:
                pt.bad("bitmap b0 stored consistent, but its full backup did not finish")
            return
        inc = "inc-after.qcow2"
        r = ctx.vblk_cmd(d, "backup", "-q", "--incremental", "--bitmap", "b0", "-B", prev, "-F", "qcow2",
                         "src.qcow2", inc)
        if r.returncode == 0:
            rc, msg = compare(ctx, d, inc, "src.qcow2", fa="qcow2", fb="qcow2")
            if rc != 0:
                pt.bad("incremental backup after the kill (on %s) restores different content: %s" % (prev, msg))
            else:
                pt.out("bitmap usable: next incremental identical")
            return
        err = r.stderr
        if "is inconsistent" in err:
            pt.out("bitmap: left in use, next incremental refused")
        elif "does not exist" in err and "b0" not in bms and st["variant"] != "full-new-bitmap":
            if ext and not bit:
                pt.bad("bitmap b0 lost: the source's header has the bitmaps extension but its autoclear bit is "
                       "clear, so every persistent bitmap of the image is ignored (killed between the two header "
                       "writes that mark the bitmaps in use at the read-write open?); the next incremental (on %s) "
                       "says: %s" % (prev, err.strip()[-300:]))
            else:
                pt.bad("bitmap b0 lost (extension %s, autoclear bit %s); the next incremental (on %s) says: %s"
                       % (ext, bit, prev, err.strip()[-300:]))
        elif "does not exist" in err and st["variant"] == "full-new-bitmap":
            # The full backup finished, the new bitmap was never stored: the
            # next incremental is refused, nothing lies.
            pt.out("bitmap: never stored, next incremental refused")
        else:
            pt.bad("incremental backup after the kill failed (on %s): %s" % (prev, err.strip()[-600:]))
            return
        # Recovery as the message says: remove, a new full, an incremental.
        steps = [["bitmap", "--remove", "src.qcow2", "b0"]] if "b0" in bms else []
        steps += [["backup", "-q", "--bitmap", "b0", "src.qcow2", "full2.qcow2"]]
        for s in steps:
            r = ctx.vblk_cmd(d, *s)
            if r.returncode != 0:
                pt.bad("recovery step %s failed: %s" % (" ".join(s), r.stderr.strip()[-400:]))
                return
        ctx.io(d, "src.qcow2", io_writes(rng, st["size"], 6, chunks))
        r = ctx.vblk_cmd(d, "backup", "-q", "--incremental", "--bitmap", "b0", "-B", "full2.qcow2", "-F", "qcow2",
                         "src.qcow2", "inc2.qcow2")
        if r.returncode != 0:
            pt.bad("incremental after the recovery failed: " + r.stderr.strip()[-400:])
            return
        rc, msg = compare(ctx, d, "inc2.qcow2", "src.qcow2", fa="qcow2", fb="qcow2")
        if rc != 0:
            pt.bad("incremental after the recovery restores different content: " + msg)


class MissingCliOp(Op):
    """A qemu-img command vblk may not have yet: run when it exists."""

    def available(self, ctx):
        r = ctx.run([ctx.vblk, self.name, "--help"], None)
        if r.returncode != 0:
            msg = (r.stderr.strip().splitlines() or ["?"])[0]
            return False, "vblk has no `%s` command (%s)" % (self.name, msg)
        return True, ""


class CommitCliOp(MissingCliOp, CliOp):
    name = "commit"
    variants = ("commit", "commit-4k")

    def setup(self, ctx, d, rng, variant):
        size = self.sizes(ctx, rng, 16, 64)
        cluster = 4096 if variant == "commit-4k" else 65536
        make_image(ctx, d, "base.qcow2", size, rng, rng.uniform(0.4, 0.9), cluster)
        make_overlay(ctx, d, "top.qcow2", "base.qcow2", size, rng, rng.uniform(0.3, 0.8), cluster)
        to_raw(ctx, d, "top.qcow2", "ref.raw")
        return {"variant": variant}

    def argv(self, ctx, st):
        # -d: the overlay is kept (and not emptied), so it still reads as before.
        return [ctx.vblk, "commit", "-q", "-d", "-f", "qcow2", "top.qcow2"]

    def check(self, ctx, d, st, pt, exited_rc, measuring=False):
        for name in ("base.qcow2", "top.qcow2"):
            kind, text = check_image(ctx, d, name)
            if kind not in ("clean", "leaks"):
                pt.bad("%s: qemu-img check %s: %s" % (name, kind, text[-800:]))
            else:
                pt.out("%s %s" % (name[:-6], "clean" if kind == "clean" else "leaks only"))
        rc, msg = compare(ctx, d, "top.qcow2", "ref.raw")
        if rc != 0:
            pt.bad("the overlay reads differently: " + msg)
        rc, _ = compare(ctx, d, "base.qcow2", "ref.raw")
        if exited_rc is not None and rc != 0:
            pt.bad("base differs from the overlay after a commit that exited")
        pt.out("base holds the commit" if rc == 0 else "base partly committed")
        return rc == 0


class RebaseCliOp(MissingCliOp, CliOp):
    name = "rebase"
    variants = ("rebase",)

    def setup(self, ctx, d, rng, variant):
        size = self.sizes(ctx, rng, 16, 64)
        make_image(ctx, d, "base.qcow2", size, rng, rng.uniform(0.4, 0.9))
        make_overlay(ctx, d, "mid.qcow2", "base.qcow2", size, rng, rng.uniform(0.3, 0.6))
        make_overlay(ctx, d, "top.qcow2", "mid.qcow2", size, rng, rng.uniform(0.2, 0.5))
        to_raw(ctx, d, "top.qcow2", "ref.raw")
        return {"variant": variant}

    def argv(self, ctx, st):
        return [ctx.vblk, "rebase", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2"]

    def check(self, ctx, d, st, pt, exited_rc, measuring=False):
        for name in ("base.qcow2", "mid.qcow2", "top.qcow2"):
            kind, text = check_image(ctx, d, name)
            if kind not in ("clean", "leaks"):
                pt.bad("%s: qemu-img check %s: %s" % (name, kind, text[-800:]))
        rc, msg = compare(ctx, d, "top.qcow2", "ref.raw")
        if rc != 0:
            pt.bad("the overlay reads differently: " + msg)
        info = img_info(ctx, d, "top.qcow2") or {}
        on_base = info.get("backing-filename") == "base.qcow2"
        pt.out("top on base" if on_base else "top still on mid")
        return on_base


class SnapshotOp(CliOp):
    name = "snapshot"
    variants = ("create", "delete", "apply")

    def setup(self, ctx, d, rng, variant):
        size = self.sizes(ctx, rng, 16, 48)
        cluster = rng.choice((512, 512, 1024, 2048))
        make_image(ctx, d, "img.qcow2", size, rng, rng.uniform(0.6, 1.0), cluster)
        chunks = sorted(f for f in os.listdir(d) if f.startswith("chunk"))
        refs = {}
        for snap in ("s0", "s1"):
            r = ctx.img(d, "snapshot", "-c", snap, "img.qcow2")
            to_raw(ctx, d, "img.qcow2", snap + ".raw")
            refs[snap] = snap + ".raw"
            ctx.io(d, "img.qcow2", io_writes(rng, size, 30, chunks, max_len=256 * KiB))
        to_raw(ctx, d, "img.qcow2", "active.raw")
        # s0 and the active layer must differ, or a revert would not show.
        if compare(ctx, d, "s0.raw", "active.raw", "raw", "raw")[0] == 0:
            raise SetupError("active layer equals s0")
        return {"variant": variant, "refs": refs}

    def argv(self, ctx, st):
        flag, snap = {"create": ("-c", "s2"), "delete": ("-d", "s1"), "apply": ("-a", "s0")}[st["variant"]]
        return [ctx.vblk, "snapshot", flag, snap, "img.qcow2"]

    def check(self, ctx, d, st, pt, exited_rc, measuring=False):
        v = st["variant"]
        kind, text = check_image(ctx, d, "img.qcow2")
        if kind == "corrupt" and only_conservative_copied(text):
            ctx.img(d, "check", "-q", "-r", "all", "img.qcow2", check=False)
            kind2, text2 = check_image(ctx, d, "img.qcow2")
            if kind2 != "clean":
                pt.bad("after check -r all of OFLAG_COPIED reports: %s: %s" % (kind2, text2[-600:]))
            pt.out("COPIED behind (repaired)")
        elif kind not in ("clean", "leaks"):
            pt.bad("qemu-img check %s: %s" % (kind, text[-800:]))
            return False
        else:
            pt.out("clean" if kind == "clean" else "leaks only")
        info = img_info(ctx, d, "img.qcow2")
        present = [s["name"] for s in (info or {}).get("snapshots", [])]
        refs = dict(st["refs"], s2="active.raw")
        for s in present:
            if s not in refs:
                pt.bad("unknown snapshot %r" % s)
                continue
            raw = os.path.join(d, "snap.raw")
            to_raw(ctx, d, "img.qcow2", raw, snapshot=s)
            if compare(ctx, d, raw, refs[s], "raw", "raw")[0] != 0:
                pt.bad("snapshot %s no longer reads as it was taken" % s)
            os.unlink(raw)
        keep = {"create": ("s0", "s1"), "delete": ("s0",), "apply": ("s0", "s1")}[v]
        for s in keep:
            if s not in present:
                pt.bad("snapshot %s lost" % s)
        rc_active, msg = compare(ctx, d, "img.qcow2", "active.raw")
        rc_s0, _ = compare(ctx, d, "img.qcow2", "s0.raw")
        if v == "apply":
            if rc_active != 0 and rc_s0 != 0:
                pt.bad("active layer reads as neither before nor as s0: " + msg)
            done = rc_s0 == 0
            pt.out("reverted to s0" if done else "not reverted")
        else:
            if rc_active != 0:
                pt.bad("active layer changed: " + msg)
            done = ("s2" in present) if v == "create" else ("s1" not in present)
            pt.out(("snapshot created" if done else "not created") if v == "create"
                   else ("snapshot deleted" if done else "not deleted"))
        if exited_rc is not None and not done:
            pt.bad("the command exited but its effect is missing")
        return done


# -- jobs in vblk serve -------------------------------------------------------

def qnode(name, path, backing="absent", fmt="qcow2"):
    n = {"driver": fmt, "node-name": name, "file": {"driver": "file", "filename": path}}
    if backing != "absent":
        n["backing"] = backing
    return n


class Serve:
    def __init__(self, ctx, d):
        self.sock = os.path.join(d, "qmp.sock")
        self.log = os.path.join(d, "serve.log")
        argv = list(ctx.daemon) + ["--chardev", "socket,path=%s,server=on,wait=off,id=m0" % self.sock,
                "--monitor", "chardev=m0"]
        self.proc = popen(argv, d, ctx.env, self.log)
        end = time.monotonic() + 30
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise SetupError("%s did not start: %s" % (ctx.daemon[0], self.log_tail()))
            time.sleep(0.005)
        self.qmp = QMP(self.sock)

    def log_tail(self, n=1200):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:].strip()
        except OSError:
            return ""

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        reap(self.proc)

    def quit(self):
        try:
            self.qmp.cmd("quit", timeout=60)
        except (OSError, QMPError, ValueError):
            pass
        self.qmp.close()
        return reap(self.proc, 120)


class JobOp(Op):
    """A block job in `vblk serve`. Subclasses: build() makes the images
    and returns the state: "nodes" (blockdev-add arguments in order), "cmd",
    "args", "complete" (block-job-complete after READY), "chain" (files that
    must check without corruption), "top", "target" (or None), "tfmt"."""

    rate_capable = True

    def setup(self, ctx, d, rng, variant):
        st = self.build(ctx, d, rng, variant.split("+")[0])
        if variant.endswith("+rate"):
            st["args"]["speed"] = rate_mib(rng, os.path.getsize(os.path.join(d, "ref.raw"))) * MiB
        return st

    def flow(self, q, st, marks, t0):
        """Starts the job and drives it to its end, noting when things
        happened (seconds after t0)."""
        q.send(st["cmd"], dict(st["args"], **{"job-id": "j"}))
        r = q.reply(st["cmd"], 60)
        if "return" not in r:
            raise Violation("%s refused: %s" % (st["cmd"], r))
        marks["started"] = time.monotonic() - t0
        names = {"BLOCK_JOB_READY", "BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED", "BLOCK_JOB_ERROR"}
        while True:
            e, at = q.next_event(names, 120)
            if e["event"] == "BLOCK_JOB_READY" and st["complete"]:
                marks["ready"] = at - t0
                q.ok("block-job-complete", device="j", timeout=60)
                marks["complete-sent"] = time.monotonic() - t0
                continue
            if e["event"] == "BLOCK_JOB_COMPLETED":
                marks["end"] = at - t0
                if "error" in e["data"]:
                    raise Violation("job failed: %s" % e["data"]["error"])
                return
            if e["event"] in ("BLOCK_JOB_CANCELLED", "BLOCK_JOB_ERROR"):
                raise Violation("job: %s %s" % (e["event"], e["data"]))

    def start(self, ctx, d, st):
        try:
            s = Serve(ctx, d)
        except (QMPError, OSError) as e:
            raise SetupError("the daemon did not start: %s" % e)
        try:
            for n in st["nodes"]:
                s.qmp.ok("blockdev-add", n, timeout=60)
        except (QMPError, OSError) as e:
            s.kill()
            raise SetupError("blockdev-add: %s; log: %s" % (e, s.log_tail()))
        except BaseException:
            s.kill()
            raise
        return s

    def measure(self, ctx, d, st, pt):
        s = self.start(ctx, d, st)
        marks = {}
        try:
            t0 = time.monotonic()
            self.flow(s.qmp, st, marks, t0)
        except (QMPError, OSError, ValueError) as e:
            s.kill()
            raise Violation("un-killed run: %s; log: %s" % (e, s.log_tail()))
        except BaseException:
            s.kill()
            raise
        rc = s.quit()
        if rc != 0:
            raise Violation("un-killed run: vblk serve exited with rc %d: %s" % (rc, s.log_tail()))
        self.check(ctx, d, st, pt, marks, measuring=True)
        window = None
        if "ready" in marks:
            window = (marks["ready"], marks["end"])
        else:
            window = (0.8 * marks["end"], marks["end"])
        # A little beyond the end too: kills after the completion.
        return marks["end"], (window[0], window[1] + 0.15 * marks["end"] + 0.005)

    def kill(self, ctx, d, st, delay, pt):
        s = self.start(ctx, d, st)
        marks = {}
        killed_at = {}

        def do_kill():
            killed_at["t"] = time.monotonic() - t0
            killed_at["rc_before"] = s.proc.poll()
            if killed_at["rc_before"] is None:
                s.proc.send_signal(signal.SIGKILL)

        t0 = time.monotonic()
        timer = threading.Timer(delay, do_kill)
        timer.start()
        err = None
        try:
            self.flow(s.qmp, st, marks, t0)
        except (QMPError, OSError, ValueError) as e:
            err = e
        except Violation as e:
            err = e
            if not killed_at:
                pt.bad(str(e))
        finally:
            timer.join()
            s.qmp.close()
            rc = reap(s.proc)
        if killed_at.get("rc_before") is not None:
            pt.bad("vblk serve exited on its own (rc %s) before the kill: %s" % (killed_at["rc_before"],
                                                                                 s.log_tail()))
        elif rc != -signal.SIGKILL:
            pt.bad("vblk serve rc %s after SIGKILL" % rc)
        if err is not None and "end" not in marks and not killed_at:
            pt.bad("job flow failed before the kill: %s" % err)
        files = [os.path.join(d, f) for f in os.listdir(d)]
        wait_unlocked(files)
        after = "end" in marks and marks["end"] < killed_at.get("t", 1e9)
        pt.phase = "killed-after" if after else "killed-before"
        self.check(ctx, d, st, pt, marks, measuring=False, completed=after)

    def check(self, ctx, d, st, pt, marks, measuring, completed=True):
        worst = "clean"
        for name in st["chain"]:
            kind, text = check_image(ctx, d, name)
            if kind not in ("clean", "leaks"):
                pt.bad("%s: qemu-img check %s: %s" % (name, kind, text[-800:]))
            elif kind == "leaks":
                worst = "leaks"
                if measuring:
                    pt.bad("%s leaks after a clean quit: %s" % (name, text[-400:]))
        pt.out("chain " + ("clean" if worst == "clean" else "leaks only"))
        rc, msg = compare(ctx, d, st["top"], "ref.raw")
        if rc != 0:
            pt.bad("%s no longer reads as before the job: %s" % (st["top"], msg))
        if st.get("target"):
            tgt, tfmt = st["target"], st.get("tfmt", "qcow2")
            if tfmt == "qcow2":
                kind, text = check_image(ctx, d, tgt)
                if kind == "corrupt":
                    pt.bad("target %s: qemu-img check finds corruption: %s" % (tgt, text[-800:]))
                    return
                if kind == "unopenable":
                    pt.out("target not an image")
                    if measuring:
                        pt.bad("target does not open after a clean quit: " + text[-400:])
                    return
                pt.out("target " + ("clean" if kind == "clean" else "leaks only"))
            rc, _ = compare(ctx, d, tgt, "ref.raw", fa=tfmt)
            if measuring and rc != 0:
                pt.bad("target differs from the source after a completed job and a clean quit")
            if not measuring:
                pt.out("target identical" if rc == 0 else "target incomplete")
        self.extra_check(ctx, d, st, pt, measuring, completed)

    def extra_check(self, ctx, d, st, pt, measuring, completed):
        pass

    def chain_images(self, ctx, d, rng, depth, cluster):
        size = self.sizes(ctx, rng, 24, 64)
        make_image(ctx, d, "base.qcow2", size, rng, rng.uniform(0.6, 1.0), cluster)
        names = ["base.qcow2"]
        for i in range(1, depth):
            name = "top.qcow2" if i == depth - 1 else "mid.qcow2"
            make_overlay(ctx, d, name, names[-1], size, rng, rng.uniform(0.3, 0.7), cluster)
            names.append(name)
        to_raw(ctx, d, "top.qcow2", "ref.raw")
        return size, names

    def explicit_nodes(self, names):
        nodes = []
        prev = None
        for n in names:
            node = n[:-6]
            nodes.append(qnode(node, n, backing=prev))
            prev = node
        return nodes


class StreamJob(JobOp):
    name = "stream"
    variants = ("stream-all", "stream-mid", "stream-4k")

    def build(self, ctx, d, rng, variant):
        depth = 3 if variant == "stream-mid" else 2
        cluster = 4096 if variant == "stream-4k" else 65536
        size, names = self.chain_images(ctx, d, rng, depth, cluster)
        args = {"device": "top"}
        if variant == "stream-mid":
            args["base-node"] = "base"
        return {"variant": variant, "nodes": self.explicit_nodes(names), "cmd": "block-stream", "args": args,
                "complete": False, "chain": names, "top": "top.qcow2", "target": None}

    def extra_check(self, ctx, d, st, pt, measuring, completed):
        bf = (img_info(ctx, d, "top.qcow2") or {}).get("backing-filename")
        want = "base.qcow2" if st["variant"] == "stream-mid" else None
        if measuring and bf != want:
            pt.bad("after the stream top's backing file is %r, not %r" % (bf, want))
        if not measuring:
            pt.out("top relinked" if bf == want else "top not yet relinked")


class CommitActiveJob(JobOp):
    name = "commit-active"
    variants = ("commit-active", "commit-active-3", "commit-active-4k")

    def build(self, ctx, d, rng, variant):
        depth = 3 if variant == "commit-active-3" else 2
        cluster = 4096 if variant.endswith("4k") else 65536
        size, names = self.chain_images(ctx, d, rng, depth, cluster)
        return {"variant": variant, "nodes": self.explicit_nodes(names), "cmd": "block-commit",
                "args": {"device": "top", "base-node": "base"}, "complete": True, "chain": names,
                "top": "top.qcow2", "target": None}

    def extra_check(self, ctx, d, st, pt, measuring, completed):
        rc, msg = compare(ctx, d, "base.qcow2", "ref.raw")
        if measuring and rc != 0:
            pt.bad("base does not read as the chain after the commit: " + msg)
        if not measuring:
            pt.out("base holds the chain" if rc == 0 else "base partly committed")


class CommitMidJob(JobOp):
    name = "commit-mid"
    variants = ("commit-mid", "commit-mid-4k")

    def build(self, ctx, d, rng, variant):
        cluster = 4096 if variant.endswith("4k") else 65536
        size, names = self.chain_images(ctx, d, rng, 3, cluster)
        return {"variant": variant, "nodes": self.explicit_nodes(names), "cmd": "block-commit",
                "args": {"device": "top", "top-node": "mid", "base-node": "base"}, "complete": False,
                "chain": names, "top": "top.qcow2", "target": None}

    def extra_check(self, ctx, d, st, pt, measuring, completed):
        bf = (img_info(ctx, d, "top.qcow2") or {}).get("backing-filename")
        if measuring and bf != "base.qcow2":
            pt.bad("after the commit top's backing file is %r" % bf)
        if not measuring:
            pt.out("top relinked to base" if bf == "base.qcow2" else "top still on mid")


class MirrorJob(JobOp):
    name = "mirror"
    variants = ("mirror-full", "mirror-full-4k", "mirror-raw", "mirror-top")

    def build(self, ctx, d, rng, variant):
        cluster = 4096 if variant.endswith("4k") else 65536
        size, names = self.chain_images(ctx, d, rng, 2, cluster)
        sync = "top" if variant == "mirror-top" else "full"
        if variant == "mirror-raw":
            with open(os.path.join(d, "tgt.raw"), "wb") as f:
                f.truncate(size)
            tgt, tfmt, tnode = "tgt.raw", "raw", qnode("tgt", "tgt.raw", fmt="raw")
        elif sync == "top":
            # As libvirt makes one: the target on the same backing file.
            ctx.img(d, "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "tgt.qcow2", str(size))
            tgt, tfmt, tnode = "tgt.qcow2", "qcow2", qnode("tgt", "tgt.qcow2")
        else:
            ctx.img(d, "create", "-q", "-f", "qcow2", "-o", "cluster_size=%d" % cluster, "tgt.qcow2", str(size))
            tgt, tfmt, tnode = "tgt.qcow2", "qcow2", qnode("tgt", "tgt.qcow2", backing=None)
        return {"variant": variant, "nodes": [qnode("top", "top.qcow2"), tnode], "cmd": "blockdev-mirror",
                "args": {"device": "top", "target": "tgt", "sync": sync}, "complete": True, "chain": names,
                "top": "top.qcow2", "target": tgt, "tfmt": tfmt}


class BackupJob(JobOp):
    name = "blockdev-backup"
    variants = ("backup-qcow2", "backup-qcow2-4k", "backup-raw")

    def build(self, ctx, d, rng, variant):
        cluster = 4096 if variant.endswith("4k") else 65536
        size, names = self.chain_images(ctx, d, rng, 2, cluster)
        if variant == "backup-raw":
            with open(os.path.join(d, "tgt.raw"), "wb") as f:
                f.truncate(size)
            tgt, tfmt, tnode = "tgt.raw", "raw", qnode("tgt", "tgt.raw", fmt="raw")
        else:
            ctx.img(d, "create", "-q", "-f", "qcow2", "-o", "cluster_size=%d" % cluster, "tgt.qcow2", str(size))
            tgt, tfmt, tnode = "tgt.qcow2", "qcow2", qnode("tgt", "tgt.qcow2", backing=None)
        return {"variant": variant, "nodes": [qnode("top", "top.qcow2"), tnode], "cmd": "blockdev-backup",
                "args": {"device": "top", "target": "tgt", "sync": "full"}, "complete": False, "chain": names,
                "top": "top.qcow2", "target": tgt, "tfmt": tfmt}


ALL_OPS = [ConvertOp(), BackupOp(), CommitCliOp(), RebaseCliOp(), SnapshotOp(), StreamJob(), CommitActiveJob(),
           CommitMidJob(), MirrorJob(), BackupJob()]
GROUPS = {"jobs": ["stream", "commit-active", "commit-mid", "mirror", "blockdev-backup"]}


# ---------------------------------------------------------------------------
# running points
# ---------------------------------------------------------------------------

def run_point(ctx, op, seed, workdir, delay=None, keep=False):
    """One point: setup, un-killed run (unless the delay is given), killed
    run, checks. Returns the Point."""
    rng = random.Random("%d-setup" % seed)
    variant = rng.choice(op.variants)
    if variant in ctx.exclude_variants:
        # Drawn again from what is left (same draws whatever is excluded
        # before this point: the reproducer needs the same exclusions).
        left = [v for v in op.variants if v not in ctx.exclude_variants]
        if not left:
            raise SystemExit("--exclude-variants leaves nothing of %s" % op.name)
        variant = rng.choice(left)
    if op.rate_capable and (rng.random() < 0.5 or ctx.rate_limited):
        variant += "+rate"
    pt = Point(op.name, seed, variant)
    d = os.path.join(workdir, "p%d-%s" % (seed, op.name))
    setup, meas, kill = (os.path.join(d, x) for x in ("setup", "measure", "kill"))
    os.makedirs(setup)
    try:
        try:
            st = op.setup(ctx, setup, rng, variant)
        except SetupError as e:
            pt.phase = "setup-error"
            pt.out("setup error (not counted)")
            if ctx.verbose:
                print("  setup error: %s" % e, flush=True)
            return pt
        drng = random.Random("%d-delay" % seed)
        if delay is None:
            shutil.copytree(setup, meas)
            mpt = Point(op.name, seed, variant)
            try:
                pt.duration, window = op.measure(ctx, meas, st, mpt)
            except Violation as e:
                mpt.bad(str(e))
                window = None
            except SetupError as e:
                pt.phase = "setup-error"
                pt.out("setup error (not counted)")
                print("  [seed %d] %s: setup error in the un-killed run: %s" % (seed, op.name, e), flush=True)
                return pt
            for v in mpt.violations:
                pt.bad("un-killed run: " + v)
            if not keep:
                shutil.rmtree(meas, ignore_errors=True)
            if pt.violations:
                pt.phase = "measure-failed"
                return pt
            pt.delay, pt.mode = choose_delay(drng, pt.duration, window, ctx.delay_cap)
        else:
            pt.delay, pt.mode = delay, "given"
        shutil.copytree(setup, kill)
        try:
            op.kill(ctx, kill, st, pt.delay, pt)
        except Violation as e:
            pt.bad(str(e))
        except SetupError as e:
            if pt.phase is None:  # before the kill: not a point
                pt.phase = "setup-error"
                pt.out("setup error (not counted)")
                print("  [seed %d] %s: setup error: %s" % (seed, op.name, e), flush=True)
            else:
                pt.bad("harness error after the kill: %s" % e)
        except (QMPError, OSError) as e:
            pt.bad("harness error after the kill: %r" % e)
        return pt
    finally:
        kill_all_live()
        if not keep and not (pt.violations and ctx.keep_failed):
            shutil.rmtree(d, ignore_errors=True)
        else:
            pt.kept = d


def reproducer(args, pt):
    extra = ""
    if args.max_size:
        extra += " --max-size %d" % args.max_size
    if args.rate_limited:
        extra += " --rate-limited"
    if args.daemon:
        extra += " --daemon '%s'" % args.daemon
    if args.exclude_variants:
        extra += " --exclude-variants %s" % args.exclude_variants
    return ("python3 scripts/kill_matrix.py --vblk %s --ops %s --point-seed %d --delay %.4f%s --keep"
            % (args.vblk, pt.op, pt.seed, pt.delay if pt.delay is not None else 0.0, extra))


def summarize(points, ops, skipped):
    """Per-operation tables (text) and a markdown summary table."""
    lines = []
    md = ["| operation | points | killed before completion | killed after completion | exited before the kill "
          "| un-killed run (median, min-max) | outcomes | violations |",
          "|---|---|---|---|---|---|---|---|"]
    tot = collections.Counter()
    for op in ops:
        pts = [p for p in points if p.op == op.name and p.phase != "setup-error"]
        if op.name in skipped:
            lines.append("== %s: skipped: %s" % (op.name, skipped[op.name]))
            md.append("| %s | 0 | | | | | skipped: %s | |" % (op.name, skipped[op.name].replace("|", "/")))
            continue
        if not pts:
            continue
        phases = collections.Counter(p.phase for p in pts)
        viol = sum(1 for p in pts if p.violations)
        durs = [p.duration for p in pts if p.duration is not None]
        dur_txt = ("%.3f s (%.3f-%.3f)" % (statistics.median(durs), min(durs), max(durs))) if durs else "-"
        variants = collections.Counter(p.variant for p in pts)
        lines.append("")
        lines.append("== %s: %d points; killed before completion %d, killed after completion %d, exited before "
                     "the kill %d; violations %d" % (op.name, len(pts), phases["killed-before"],
                                                     phases["killed-after"], phases["exited"], viol))
        lines.append("   un-killed run: %s; variants: %s" % (dur_txt, ", ".join(
            "%s %d" % kv for kv in sorted(variants.items()))))
        outc = collections.Counter(o for p in pts for o in set(p.outcomes))
        width = max([len(o) for o in outc] + [10])
        lines.append("   %-*s  %s" % (width, "outcome", "points"))
        for o, n in sorted(outc.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append("   %-*s  %d" % (width, o, n))
        md.append("| %s | %d | %d | %d | %d | %s | %s | %d |" % (
            op.name, len(pts), phases["killed-before"], phases["killed-after"], phases["exited"], dur_txt,
            "; ".join("%s %d" % (o, n) for o, n in sorted(outc.items(), key=lambda kv: (-kv[1], kv[0]))), viol))
        tot.update({"points": len(pts), "before": phases["killed-before"], "after": phases["killed-after"],
                    "exited": phases["exited"], "viol": viol})
    md.append("| **all** | **%d** | %d | %d | %d | | | **%d** |" % (tot["points"], tot["before"], tot["after"],
                                                                       tot["exited"], tot["viol"]))
    return "\n".join(lines), "\n".join(md)


def parse_ops(spec):
    names = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        names += GROUPS.get(part, [part])
    known = {op.name: op for op in ALL_OPS}
    for n in names:
        if n not in known:
            raise SystemExit("unknown operation %r; known: %s, or 'jobs'" % (n, ", ".join(known)))
    return [known[n] for n in dict.fromkeys(names)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(REPO, "build", "vblk"))
    ap.add_argument("--points", type=int, default=60, help="total points, spread over the operations")
    ap.add_argument("--ops", default=",".join(op.name for op in ALL_OPS),
                    help="comma-separated: " + ", ".join(op.name for op in ALL_OPS) + ", or jobs")
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: random, printed)")
    ap.add_argument("--table", default=None, help="also write the markdown summary table to this file")
    ap.add_argument("--tmpdir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    ap.add_argument("--max-size", type=int, default=0, help="cap image sizes (MiB; default 64)")
    ap.add_argument("--point-seed", type=int, default=None, help="run one point (with --delay): a reproducer")
    ap.add_argument("--delay", type=float, default=None, help="the kill delay of --point-seed (s)")
    ap.add_argument("--keep", action="store_true", help="keep every point's directory")
    ap.add_argument("--keep-failed", action="store_true", help="keep the directories of failing points")
    ap.add_argument("--daemon", default=None,
                    help="run the jobs in this daemon instead of `VBLK serve` (e.g. qemu-storage-daemon, "
                         "to see whether QEMU does the same)")
    ap.add_argument("--delay-cap", type=float, default=None,
                    help="kill no later than this fraction of the un-killed run (no kills around the completion)")
    ap.add_argument("--rate-limited", action="store_true",
                    help="every point of convert, backup and the jobs rate-limited (runs of 0.1-1.2 s)")
    ap.add_argument("--exclude-variants", default="",
                    help="comma-separated variants not to run (names as in the tables, without +rate)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per point")
    args = ap.parse_args()

    qemu_img = os.environ.get("QEMU_IMG") or shutil.which("qemu-img")
    qemu_io = os.environ.get("QEMU_IO") or shutil.which("qemu-io")
    if not qemu_img or not qemu_io:
        raise SystemExit("needs qemu-img and qemu-io")
    vblk = os.path.abspath(args.vblk)
    if not os.access(vblk, os.X_OK):
        raise SystemExit("not executable: %s" % vblk)
    ctx = Ctx(vblk, qemu_img, qemu_io, args.max_size, args.verbose)
    ctx.keep_failed = args.keep_failed or args.keep
    ctx.delay_cap = args.delay_cap
    ctx.exclude_variants = set(v for v in (args.exclude_variants or "").split(",") if v)
    ctx.rate_limited = args.rate_limited
    ctx.daemon = args.daemon.split() if args.daemon else [vblk, "serve"]
    ops = parse_ops(args.ops)
    skipped = {}
    for op in ops:
        ok, why = op.available(ctx)
        if not ok:
            skipped[op.name] = why
    runnable = [op for op in ops if op.name not in skipped]

    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    workdir = tempfile.mkdtemp(prefix="vblk-kill-matrix-", dir=args.tmpdir)
    points = []
    aborted = None
    t_start = time.monotonic()
    try:
        if args.point_seed is not None:
            if len(runnable) != 1 or args.delay is None:
                raise SystemExit("--point-seed needs one runnable operation in --ops and --delay")
            print("reproducing: op %s, point seed %d, delay %.4f s" % (runnable[0].name, args.point_seed,
                                                                        args.delay), flush=True)
            plan = [(runnable[0], args.point_seed)]
        else:
            print("kill matrix: seed %d, %d points over %s; vblk %s; work in %s" % (
                seed, args.points, ", ".join(op.name for op in runnable), vblk, workdir), flush=True)
            for name, why in skipped.items():
                print("  skipped %s: %s" % (name, why), flush=True)
            master = random.Random(seed)
            plan = [(runnable[i % len(runnable)], master.randrange(1 << 31)) for i in range(args.points)] \
                if runnable else []
        for i, (op, pseed) in enumerate(plan):
            try:
                pt = run_point(ctx, op, pseed, workdir, delay=args.delay if args.point_seed is not None else None,
                               keep=args.keep)
            except Exception as e:  # the harness itself (say, the binary vanished): stop, report so far
                import traceback
                traceback.print_exc()
                aborted = "aborted at point %d (%s, seed %d): %r" % (i + 1, op.name, pseed, e)
                break
            points.append(pt)
            if args.verbose or pt.violations or args.point_seed is not None:
                print("  [%d/%d] %-15s %-17s seed %-10d dur %s delay %s (%s) -> %s: %s%s" % (
                    i + 1, len(plan), op.name, pt.variant, pseed,
                    "%.3f" % pt.duration if pt.duration is not None else "-",
                    "%.4f" % pt.delay if pt.delay is not None else "-", pt.mode, pt.phase,
                    ", ".join(sorted(set(pt.outcomes))),
                    "".join("\n      VIOLATION: " + v for v in pt.violations)), flush=True)
            elif (i + 1) % 25 == 0:
                print("  %d/%d points, %.0f s" % (i + 1, len(plan), time.monotonic() - t_start), flush=True)
            if getattr(pt, "kept", None):
                print("      kept: %s" % pt.kept, flush=True)
    finally:
        kill_all_live()
        if not args.keep and not (args.keep_failed and any(p.violations for p in points)):
            shutil.rmtree(workdir, ignore_errors=True)

    text, md = summarize(points, ops, skipped)
    print(text)
    print()
    print(md)
    elapsed = time.monotonic() - t_start
    setup_err = sum(1 for p in points if p.phase == "setup-error")
    bad = [p for p in points if p.violations]
    print()
    print("%d points in %.0f s (seed %d)%s; %d with violations" % (
        len(points) - setup_err, elapsed, seed, (", %d setup errors not counted" % setup_err) if setup_err else "",
        len(bad)))
    if args.table:
        with open(args.table, "w") as f:
            f.write(md + "\n")
    if aborted:
        print("\n" + aborted)
    if bad:
        print("\nVIOLATIONS (reproduce one point with the command below it):")
        for p in bad:
            print("- op %s, variant %s, point seed %d, delay %.4f s (%s), un-killed run %s s, %s:" % (
                p.op, p.variant, p.seed, p.delay or 0.0, p.mode,
                "%.3f" % p.duration if p.duration is not None else "-", p.phase))
            for v in p.violations:
                print("    " + v)
            print("    " + reproducer(args, p))
        return 1
    return 2 if aborted else 0


if __name__ == "__main__":
    sys.exit(main())
