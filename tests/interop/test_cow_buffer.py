#!/usr/bin/env python3
"""Interop: blockdev-backup's COW buffer (`x-perf.cow-buffer-size`, spill).

With a COW buffer, copy-before-write claims the clusters a guest write hits
before the backup copied them, reads their old data into memory (beyond the
memory size into an unlinked spill file in `x-perf.cow-spill-dir`, up to
`x-perf.cow-spill-size`), lets the guest write go on at once and a drain task
writes the old data to the target ahead of the background copy. When memory
and spill are full, copy-before-write falls back to the synchronous copy.

What this file checks, against `vblk serve` (the buffer is vblk-only), and
beside qemu-storage-daemon (same QMP without the x-perf cow options) where
the outcome must be QEMU's:
- the point-in-time guarantee under a qemu-io writer on the source's NBD
  export (unaligned, sub-cluster, multi-cluster, repeated writes, write
  zeroes, discards), VBLK_COW_REPS backups each, for buffer off / large /
  spilling / spill full (synchronous copies), raw and qcow2 source and
  target, a 1 MiB-cluster target, a throttled target, four concurrent
  writers; the `x-cow-buffer` statistics prove the buffer was used and keep
  their limits; at BLOCK_JOB_COMPLETED the buffer is empty and the target
  already complete, and the concluded job keeps its peaks;
- target write errors (on-target-error stop / report / ignore) while the
  buffer is in use, events and outcome as qemu-storage-daemon's; a failed
  drain write keeps its data (stop, ignore) or fails the job (report); a
  failed source read while buffering fails the guest write as without a
  buffer; failing spill writes (root: a full tmpfs) fall back to
  synchronous copies; sync=incremental buffers only the bitmap's clusters;
- cancel with a full buffer (events as QEMU's, len included; the memory is
  given back, twice over; the drain keeps to the job's speed), pause with
  data buffered (kept, not drained while paused, new writes buffered),
  kill -9 with a spill file (every acknowledged write is in the source, the
  spill file is unlinked and the dir stays empty, qcow2 checks clean), the
  default spill dir /var/tmp;
- argument errors (negative, not whole clusters, spill without a buffer,
  a spill dir that is missing or a file, sync=none, wrong types): refused,
  nothing started;
- no sanitizer report in any daemon's log (for the ASan build).

Environment: VBLK (binary under test), VBLK_COW_REPS (point-in-time
repetitions per configuration, default 20).

Only the Python standard library is used.
"""

import hashlib
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import IS_ROOT, KiB, MiB, InteropTestCase, VBLK, rand_bytes, vblk_has_serve, wait_unlocked  # noqa: E402
from qmp_driver import Daemon  # noqa: E402  (common.py puts bench/ on the path)
import nbd_wire  # noqa: E402
from nbd_wire import CMD_DISC, CMD_FLUSH, CMD_READ, CMD_WRITE, FLAG_FUA, REQ_MAGIC, SIMPLE_REPLY_MAGIC  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
QEMU_IMG = shutil.which("qemu-img")
REPS = int(os.environ.get("VBLK_COW_REPS", "20"))

CLUSTER = 64 * KiB
SIZE = 16 * MiB
VBLK_NAME = "vblk serve"
QSD_NAME = "qemu-storage-daemon"


HAVE_SERVE = vblk_has_serve()


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def file_node(name, path, fmt="raw"):
    return {"driver": fmt, "node-name": name, "file": {"driver": "file", "filename": path}}


def target_node(name, path, fmt="raw", group=None, rule=None):
    """fmt over file, blkdebug (with `rule`) in between, a throttle node
    (in throttle group `group`) on top."""
    proto = {"driver": "file", "filename": path}
    if rule is not None:
        proto = {"driver": "blkdebug", "inject-error": [rule], "image": proto}
    node = {"driver": fmt, "file": proto}
    if group is not None:
        node = {"driver": "throttle", "throttle-group": group, "file": node}
    node["node-name"] = name
    return node


def cow(size, spill=None, spill_dir=None, direct=None):
    x = {"cow-buffer-size": size}
    if direct is not None:
        x["cow-spill-direct"] = direct
    if spill is not None:
        x["cow-spill-size"] = spill
    if spill_dir is not None:
        x["cow-spill-dir"] = spill_dir
    return x


def compare(a, b, fmt_a="raw", fmt_b="raw"):
    r = subprocess.run([QEMU_IMG, "compare", "-f", fmt_a, "-F", fmt_b, a, b], capture_output=True, text=True)
    return r.returncode, r.stdout.strip() + r.stderr.strip()


def img_check(path):
    r = subprocess.run([QEMU_IMG, "check", path], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


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


def rss(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    raise AssertionError("no VmRSS for %d" % pid)


def deleted_fds_in(pid, d):
    """The open files of `pid` that were unlinked from directory `d`."""
    out = []
    fd_dir = "/proc/%d/fd" % pid
    for fd in os.listdir(fd_dir):
        try:
            t = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if t.startswith(d.rstrip("/") + "/") and t.endswith(" (deleted)"):
            out.append(t)
    return out


def random_writes(rng, size, n, big_first=False, discards=False):
    """(offset, length, pattern) of n writes: unaligned sub-sector, sub-cluster
    and multi-cluster, some repeating an earlier place exactly or shifted a
    little. big_first: the first write is 1 MiB in the upper half of the disk
    (clusters the backup has not reached yet)."""
    out = []
    if big_first:
        out.append((rng.randrange(size // 2, size - MiB), MiB, rng.randint(1, 255)))
    while len(out) < n:
        r = rng.random()
        if out and r < 0.1:
            off, ln, _ = rng.choice(out)
        elif out and r < 0.2:
            off, ln, _ = rng.choice(out)
            off = max(0, min(size - ln, off + rng.randint(-4096, 4096)))
        else:
            if r < 0.4:
                ln = rng.randint(1, 4096)
            elif r < 0.7:
                ln = rng.randint(4097, CLUSTER)
            else:
                ln = rng.randint(CLUSTER + 1, 512 * KiB)
            off = rng.randrange(0, size - ln)
        # Pattern 0: write zeroes (NBD_CMD_WRITE_ZEROES), half of them
        # allowed to unmap; -1: discard (NBD_CMD_TRIM) of whole clusters on a
        # discard=unmap source, which then reads zeroes. Copy-before-write
        # must catch those too.
        r = rng.random()
        if discards and r < 0.07:
            off, ln = off // CLUSTER * CLUSTER, max(1, ln // CLUSTER) * CLUSTER
            out.append((off, min(ln, size - off), -1))
        else:
            out.append((off, ln, 0 if r < 0.15 else rng.randint(1, 255)))
    return out


def runs(flags, value):
    """(start, end) of the runs of `value` in the bytearray `flags`."""
    out, i, n = [], 0, len(flags)
    while i < n:
        j = flags.find(bytes([1 - value]), i) if flags[i] == value else flags.find(bytes([value]), i)
        j = n if j < 0 else j
        if flags[i] == value:
            out.append((i, j))
        i = j
    return out


def apply_writes(image, writes):
    b = bytearray(image)
    for off, ln, pat in writes:
        b[off:off + ln] = bytes([max(pat, 0)]) * ln
    return bytes(b)


# -- a small NBD client -------------------------------------------------------

class Nbd:
    """Fixed-newstyle NBD client, one request in flight at a time."""

    def __init__(self, path, name, timeout=60):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(timeout)
        self.s.connect(path)
        self.size, self.flags = nbd_wire.go(self.s, name.encode())
        self.cookie = 0

    def _recv(self, n):
        return nbd_wire.recv_exact(self.s, n)

    def _request(self, cmd, offset, length, flags=0, payload=b"", data_len=0):
        self.cookie += 1
        self.s.sendall(struct.pack(">IHHQQI", REQ_MAGIC, flags, cmd, self.cookie, offset, length) + payload)
        magic, err, cookie = struct.unpack(">IIQ", self._recv(16))
        assert magic == SIMPLE_REPLY_MAGIC and cookie == self.cookie, (hex(magic), cookie)
        return err, (self._recv(data_len) if err == 0 and data_len else b"")

    def write(self, offset, data, fua=False):
        """The NBD error code (0: acknowledged)."""
        return self._request(CMD_WRITE, offset, len(data), FLAG_FUA if fua else 0, data)[0]

    def read(self, offset, length):
        err, data = self._request(CMD_READ, offset, length, data_len=length)
        assert err == 0, "NBD read error %d" % err
        return data

    def read_all(self):
        return b"".join(self.read(o, min(MiB, self.size - o)) for o in range(0, self.size, MiB))

    def flush(self):
        return self._request(CMD_FLUSH, 0, 0)[0]

    def close(self):
        try:
            self.s.sendall(struct.pack(">IHHQQI", REQ_MAGIC, 0, CMD_DISC, 0, 0, 0))
        except OSError:
            pass
        self.s.close()


class Writer(threading.Thread):
    """Writes `writes` ((offset, length, pattern)) one after the other through
    an NBD connection, at most one every `gap` seconds, until they run out or
    stop() is called; `acked` lists the acknowledged ones, `failed` those
    answered with an error, `inflight` the one sent and not answered when the
    connection broke."""

    def __init__(self, sock, writes, gap=0.0, fua=False, loop=False):
        super().__init__(daemon=True)
        self.nbd = Nbd(sock, "src")
        self.writes, self.gap, self.fua, self.loop = writes, gap, fua, loop
        self.acked, self.failed = [], []
        self.inflight = None
        self.broken = None
        self._halt = threading.Event()

    def run(self):
        i = 0
        try:
            while not self._halt.is_set() and (self.loop or i < len(self.writes)):
                w = self.writes[i % len(self.writes)]
                i += 1
                self.inflight = w
                err = self.nbd.write(w[0], bytes([w[2]]) * w[1], self.fua)
                self.inflight = None
                (self.failed if err else self.acked).append(w)
                if self.gap:
                    self._halt.wait(self.gap)
        except (OSError, EOFError, AssertionError) as e:
            self.broken = e

    def stop(self):
        self._halt.set()
        self.join(60)
        assert not self.is_alive(), "NBD writer hangs"
        self.nbd.close()


# ---------------------------------------------------------------------------

@unittest.skipUnless(QSD and QEMU_IMG, "needs qemu-storage-daemon and qemu-img")
@unittest.skipUnless(HAVE_SERVE, "needs vblk serve")
class CowBufferTest(InteropTestCase):

    # -- helpers ----------------------------------------------------------
    def source(self, d, fmt="raw", seed=1, size=SIZE):
        raw = os.path.join(d, "src.raw")
        with open(raw, "wb") as f:
            f.write(rand_bytes(size, seed))
        if fmt == "raw":
            return raw
        path = os.path.join(d, "src.qcow2")
        subprocess.run([QEMU_IMG, "convert", "-O", "qcow2", raw, path], check=True)
        os.unlink(raw)
        return path

    def fresh_target(self, d, fmt="raw", size=SIZE, cluster=None):
        path = os.path.join(d, "tgt." + fmt)
        if fmt == "raw":
            with open(path, "wb") as f:
                f.truncate(size)
        else:
            if os.path.exists(path):
                os.unlink(path)
            opts = ["-o", "cluster_size=%d" % cluster] if cluster else []
            subprocess.run([QEMU_IMG, "create", "-q", "-f", fmt] + opts + [path, str(size)], check=True)
        return path

    def start(self, name, d, env=None):
        """A daemon; `env`: variables for it alone. At the end of the test
        it is killed if still running, and its log must hold no sanitizer
        report."""
        cmd = [VBLK, "serve"] if name == VBLK_NAME else [QSD]
        saved = dict(os.environ)
        os.environ.update(env or {})
        try:
            dm = Daemon(cmd, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.addCleanup(self.check_log, dm)
        self.addCleanup(dm.kill)
        return dm

    def check_log(self, dm):
        with open(dm.log_path, errors="replace") as f:
            log = f.read()
        for mark in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"):
            self.assertNotIn(mark, log, "%s: sanitizer report:\n%s" % (dm.argv[0], log[-4000:]))

    def each_daemon(self, scenario):
        """Runs scenario(name, daemon, workdir) for qemu-storage-daemon and
        vblk serve; returns {name: observation}."""
        seen = {}
        for name in (QSD_NAME, VBLK_NAME):
            with self.subTest(daemon=name):
                d = self.subdir(name.replace(" ", "_"))
                # Under ASan: no quarantine, freed memory back to the OS at once, so the
                # RSS checks of test_cancel_with_full_buffer mean vblk's memory. Added
                # to the caller's ASAN_OPTIONS (scripts/test.sh sets some): later
                # options win.
                env = {"ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "detect_leaks=1") +
                       ":quarantine_size_mb=0:thread_local_quarantine_size_kb=0:allocator_release_to_os_interval_ms=0"}
                dm = self.start(name, d, env)
                try:
                    seen[name] = scenario(name, dm, d)
                finally:
                    dm.quit()
        return seen

    def assertSame(self, seen):
        self.assertEqual(len(seen), 2, "a daemon's scenario failed")
        vals = list(seen.values())
        for name, v in seen.items():
            self.assertEqual(v, vals[0], "%s differs from %s" % (name, list(seen)[0]))

    def export(self, q, d, node="src"):
        sock = os.path.join(d, "nbd.sock")
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        q.ok("block-export-add", type="nbd", id="e0", **{"node-name": node}, writable=True)
        return sock

    def job(self, q, verb="query-block-jobs", job="j"):
        for j in q.ok(verb):
            if j.get("device", j.get("id")) == job:
                return j
        return None

    def wait_for(self, q, pred, what, timeout=30):
        end = time.monotonic() + timeout
        while True:
            j = self.job(q)
            if j is not None and pred(j):
                return j
            if time.monotonic() > end:
                raise AssertionError("%s: not within %ss; job %r" % (what, timeout, j))
            time.sleep(0.02)

    def wait_for_no_jobs(self, q, timeout=30):
        end = time.monotonic() + timeout
        while q.ok("query-jobs"):
            self.assertLess(time.monotonic(), end, "jobs left: %r" % q.ok("query-jobs"))
            time.sleep(0.02)
        q.drain_events()
        q.events.clear()

    def event_polling(self, q, name, timeout=60):
        """Waits for event `name` while polling query-block-jobs; returns the
        event and the job as each poll saw it."""
        end = time.monotonic() + timeout
        polled = []
        while True:
            for e in q.events:
                if e["event"] == name:
                    q.events.remove(e)
                    return e, polled
            if time.monotonic() > end:
                raise AssertionError("no %s within %ss" % (name, timeout))
            j = self.job(q)
            if j is not None:
                polled.append(j)
            q.drain_events(0.01)

    # -- point in time ----------------------------------------------------
    def point_in_time(self, xperf, reps, seed, src_fmt="raw", tgt_fmt="raw", speed=32 * MiB,
                      throttle=None, big_first=False, tgt_cluster=None, size=SIZE):
        """`reps` backups of a source under a qemu-io writer on its NBD
        export, the job limited to `speed` or (with throttle=bps) the target
        behind a throttle node. The point-in-time checks fail at once;
        returns (the x-cow-buffer statistics of each job, peaks as seen
        while it ran, None without a buffer; the issues, (kind, rep,
        detail), that the caller checks last with assertNoIssues)."""
        if not QEMU_IO:
            self.skipTest("needs qemu-io")
        d = self.subdir("pit")
        spill_dir = xperf.get("cow-spill-dir") if xperf else None
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, src_fmt, seed, size)
        pit = os.path.join(d, "pit.raw")
        if throttle:
            q.ok("object-add", **{"qom-type": "throttle-group", "id": "tg", "limits": {"bps-total": throttle}})
            speed = 0
        q.ok("blockdev-add", **dict(file_node("src", src, src_fmt), discard="unmap"))
        sock = self.export(q, d)
        reader = Nbd(sock, "src")
        before = reader.read_all()
        rng = random.Random(seed)
        stats = []
        issues = []  # checked after all repetitions (the point-in-time checks come first)
        # Repetitions where the writer (a qemu-io process) took longer to
        # start and finish than the whole backup: the data checks still
        # hold, only the race was not run. A loaded machine loses a few;
        # most must race.
        missed_race = []
        for rep in range(reps):
            tgt = self.fresh_target(d, tgt_fmt, size, cluster=tgt_cluster)
            q.ok("blockdev-add", **target_node("tgt", tgt, tgt_fmt, group="tg" if throttle else None))
            writes = random_writes(rng, size, 20, big_first, discards=src_fmt == "raw" and size % CLUSTER == 0)
            if size % CLUSTER:  # the partial last cluster, every time
                writes[1:1] = [(size - rng.randint(1, 3 * CLUSTER), rng.randint(1, CLUSTER), rng.randint(1, 255))]
                writes[1] = (writes[1][0], size - writes[1][0] - rng.randint(0, 100) if rng.random() < 0.5
                             else min(writes[1][1], size - writes[1][0]), writes[1][2])
            cmds = []
            for i, (off, ln, pat) in enumerate(writes):
                if pat > 0:
                    cmds += ["-c", "write -P 0x%02x %d %d" % (pat, off, ln)]
                elif pat < 0:
                    cmds += ["-c", "discard %d %d" % (off, ln)]
                else:
                    cmds += ["-c", "write -z %s%d %d" % ("-u " if i % 2 else "", off, ln)]
            args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "auto-dismiss": False,
                    "speed": speed}
            if xperf:
                args["x-perf"] = xperf
            q.ok("blockdev-backup", **args)
            w = subprocess.Popen([QEMU_IO, "-f", "raw"] + cmds + ["nbd+unix:///src?socket=" + sock],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running = None  # the last query of the job while it ran
            while w.poll() is None:
                j = self.job(q)
                if j["status"] == "running":
                    running = j
                time.sleep(0.01)
            out, err = w.communicate()
            self.assertEqual(w.returncode, 0, out + err)
            self.assertNotIn("failed", out + err)
            # The writes raced the backup: it is still copying.
            j = self.job(q)
            if j["status"] == "running":
                running = j
            else:
                missed_race.append((rep, j["status"]))
            while running is not None and xperf and running["x-cow-buffer"]["used"] + running["x-cow-buffer"]["spilled"]:
                j = self.job(q)
                if j["status"] != "running":
                    break
                running = j
                time.sleep(0.01)
            done = q.event("BLOCK_JOB_COMPLETED", 120)
            self.assertNotIn("error", done["data"], "rep %d" % rep)
            if tgt_fmt == "raw":
                # At BLOCK_JOB_COMPLETED the buffer was empty: every byte of
                # the point-in-time image is on the target already.
                with open(tgt, "rb") as f:
                    self.assertTrue(f.read() == before,
                                    "rep %d: target incomplete at BLOCK_JOB_COMPLETED" % rep)
            jq = self.job(q, "query-jobs")
            jb = self.job(q)
            self.assertEqual(jq["status"], "concluded")
            if xperf:
                xb = jq.get("x-cow-buffer")
                self.assertIsNotNone(xb, "rep %d: no x-cow-buffer in query-jobs: %r" % (rep, jq))
                self.assertEqual(jb.get("x-cow-buffer"), xb, "query-block-jobs and query-jobs differ")
                self.assertEqual((xb["used"], xb["spilled"]), (0, 0),
                                 "rep %d: concluded with data in the buffer: %r" % (rep, xb))
                peaks = dict(xb)
                if running is not None:
                    xr = running["x-cow-buffer"]
                    self.assertEqual((xr["size"], xr["spill-size"]),
                                     (xperf["cow-buffer-size"], xperf.get("cow-spill-size", 0)), xr)
                    for k in ("used-peak", "spilled-peak", "sync-copies"):
                        if xb[k] < xr[k]:
                            issues.append(("the concluded job's x-cow-buffer lost what it had while running",
                                           rep, "%s %d -> %d" % (k, xr[k], xb[k])))
                        peaks[k] = max(xb[k], xr[k])
                    peaks["size"], peaks["spill-size"] = xr["size"], xr["spill-size"]
                self.assertLessEqual(peaks["used-peak"], xperf["cow-buffer-size"], "memory over its limit: %r" % peaks)
                self.assertLessEqual(peaks["spilled-peak"], xperf.get("cow-spill-size", 0),
                                     "spill over its limit: %r" % peaks)
                # (With a buffer too small for the writes, all of them may go
                # synchronously: that still went through the buffer's path.)
                if peaks["used-peak"] == 0 and peaks["sync-copies"] == 0:
                    issues.append(("the buffer was never used", rep, peaks))
                stats.append(peaks)
            else:
                self.assertNotIn("x-cow-buffer", jq)
                self.assertNotIn("x-cow-buffer", jb)
                stats.append(None)
            q.ok("job-dismiss", id="j")
            q.drain_events()
            q.ok("blockdev-del", **{"node-name": "tgt"})
            with open(pit, "wb") as f:
                f.write(before)
            self.assertEqual(compare(pit, tgt, "raw", tgt_fmt), (0, "Images are identical."),
                             "rep %d: backup is not the point-in-time image" % rep)
            if spill_dir:
                self.assertEqual(os.listdir(spill_dir), [], "spill dir not empty")
            after = reader.read_all()
            self.assertTrue(after == apply_writes(before, writes), "rep %d: source lost a write" % rep)
            before = after
        reader.close()
        q.ok("block-export-del", id="e0")
        dm.quit()
        if tgt_fmt == "qcow2":
            self.assertEqual(img_check(tgt)[0], 0, img_check(tgt)[1])
        if src_fmt == "qcow2":
            self.assertEqual(img_check(src)[0], 0, img_check(src)[1])
        if len(missed_race) > reps // 4:
            issues += [("the backup ended before the writer did", r, st) for r, st in missed_race]
        return stats, issues

    def assertNoIssues(self, issues):
        """One line per kind of issue: the repetitions and the first detail."""
        kinds = {}
        for kind, rep, detail in issues:
            kinds.setdefault(kind, []).append((rep, detail))
        lines = []
        for k, v in kinds.items():
            reps = sorted(set(r for r, _ in v))
            lines.append("%s: in %d repetition(s) (%s%s); rep %d: %s"
                         % (k, len(reps), ", ".join(map(str, reps[:8])), ", ..." if len(reps) > 8 else "",
                            v[0][0], v[0][1]))
        self.assertEqual(lines, [])

    def test_pit_buffer_off(self):
        # Half the speed of the others: without a buffer each write that
        # meets an uncopied cluster waits for its copy.
        stats, issues = self.point_in_time(None, REPS, 11, speed=16 * MiB)
        self.assertNoIssues(issues)

    def test_pit_buffer_large(self):
        stats, issues = self.point_in_time(cow(64 * MiB), REPS, 12)
        for xb in stats:
            self.assertEqual((xb["spilled-peak"], xb["sync-copies"]), (0, 0), xb)
        self.assertNoIssues(issues)

    def test_pit_buffer_spills(self):
        spill = self.subdir("spill")
        stats, issues = self.point_in_time(cow(256 * KiB, 64 * MiB, spill), REPS, 13, big_first=True)
        for xb in stats:
            self.assertGreater(xb["spilled-peak"], 0, "a 1 MiB write into 256 KiB did not spill: %r" % xb)
            self.assertEqual(xb["sync-copies"], 0, xb)
        self.assertNoIssues(issues)

    def test_pit_buffer_spills_through_page_cache(self):
        spill = self.subdir("spill")
        stats, issues = self.point_in_time(cow(256 * KiB, 64 * MiB, spill, direct=False), REPS, 15, big_first=True)
        for xb in stats:
            self.assertGreater(xb["spilled-peak"], 0, "a 1 MiB write into 256 KiB did not spill: %r" % xb)
            self.assertEqual(xb["sync-copies"], 0, xb)
        self.assertNoIssues(issues)

    def test_pit_spill_full_falls_back_to_sync(self):
        spill = self.subdir("spill")
        stats, issues = self.point_in_time(cow(128 * KiB, 128 * KiB, spill), REPS, 14, big_first=True)
        for xb in stats:
            self.assertGreater(xb["sync-copies"], 0, "a 1 MiB write into 128+128 KiB was not synchronous: %r" % xb)
        self.assertTrue(any(xb["used-peak"] > 0 for xb in stats), "the small buffer was never used: %r" % stats)
        self.assertNoIssues(issues)

    def test_pit_qcow2_source_and_target(self):
        spill = self.subdir("spill")
        reps = max(3, REPS // 4)
        stats, issues = self.point_in_time(cow(256 * KiB, 64 * MiB, spill), reps, 15, "qcow2", "qcow2",
                                           big_first=True)
        self.assertTrue(any(xb["spilled-peak"] > 0 for xb in stats), stats)
        self.assertNoIssues(issues)

    def test_pit_qcow2_target_large_buffer(self):
        stats, issues = self.point_in_time(cow(64 * MiB), max(3, REPS // 4), 16, "raw", "qcow2")
        self.assertNoIssues(issues)

    def test_pit_qcow2_target_1m_clusters(self):
        """A 1 MiB-cluster target makes the backup's cluster 1 MiB: every
        small write claims and buffers a whole MiB; 2 MiB memory spills."""
        spill = self.subdir("spill")
        stats, issues = self.point_in_time(cow(2 * MiB, 64 * MiB, spill), max(3, REPS // 4), 19, "raw", "qcow2",
                                           tgt_cluster=MiB)
        for xb in stats:
            self.assertEqual(xb["used-peak"] % MiB, 0, "buffered less than a cluster: %r" % xb)
        self.assertNoIssues(issues)

    def test_pit_size_not_whole_clusters(self):
        """A disk of 16 MiB - 3.5 KiB: the last cluster is partial; writes
        hit it every time, through memory and spill."""
        spill = self.subdir("spill")
        stats, issues = self.point_in_time(cow(256 * KiB, 64 * MiB, spill), max(3, REPS // 4), 20,
                                           big_first=True, size=SIZE - 7 * 512)
        self.assertNoIssues(issues)

    def test_pit_throttled_target_large_buffer(self):
        """The target behind a throttle node (no job speed): the guest's
        writes go on at once, the backup still runs when they are done."""
        # 16 MiB/s: a second per backup, so a slow qemu-io start on a busy
        # machine does not look like waiting writes.
        stats, issues = self.point_in_time(cow(64 * MiB), max(3, REPS // 4), 17, throttle=16 * MiB)
        self.assertNoIssues(issues)

    def test_pit_concurrent_writers(self):
        """Four NBD connections writing at once, most writes into the same
        2 MiB (so they meet each other's claims, buffer entries and drains),
        memory small enough to spill out in the background: the target is
        the point-in-time image every time, and bytes nobody wrote are kept."""
        d = self.subdir("conc")
        spill = self.subdir("conc-spill")
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, seed=18)
        q.ok("blockdev-add", **file_node("src", src))
        sock = self.export(q, d)
        reader = Nbd(sock, "src")
        before = reader.read_all()
        rng = random.Random(18)
        peaks = []
        for rep in range(max(5, REPS // 2)):
            tgt = self.fresh_target(d)
            q.ok("blockdev-add", **target_node("tgt", tgt))
            sets = []
            for w in range(4):
                ws = []
                for _ in range(25):
                    ln = rng.choice([rng.randint(1, 4096), rng.randint(4097, CLUSTER), rng.randint(CLUSTER, 300 * KiB)])
                    lo = 6 * MiB if rng.random() < 0.8 else 0
                    hi = 8 * MiB if lo else SIZE
                    ws.append((rng.randrange(lo, hi - ln), ln, 16 * w + rng.randint(1, 15)))
                sets.append(ws)
            q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 32 * MiB, "auto-dismiss": False,
                                       "x-perf": cow(512 * KiB, 64 * MiB, spill)})
            writers = [Writer(sock, ws) for ws in sets]
            for w in writers:
                w.start()
            last = None
            while any(w.is_alive() for w in writers):
                j = self.job(q)
                if j["status"] == "running":
                    last = j
                time.sleep(0.01)
            for w in writers:
                w.stop()
                self.assertEqual((w.failed, w.broken), ([], None), "rep %d: guest writes failed" % rep)
            done = q.event("BLOCK_JOB_COMPLETED", 120)
            self.assertNotIn("error", done["data"])
            with open(tgt, "rb") as f:
                self.assertTrue(f.read() == before, "rep %d: backup is not the point-in-time image" % rep)
            if last is not None:
                peaks.append(last["x-cow-buffer"])
            q.ok("job-dismiss", id="j")
            q.drain_events()
            q.ok("blockdev-del", **{"node-name": "tgt"})
            after = reader.read_all()
            touched = bytearray(SIZE)
            for ws in sets:
                for off, ln, _ in ws:
                    touched[off:off + ln] = b"\1" * ln
            untouched_same = all(after[a:b] == before[a:b] for a, b in runs(touched, 0))
            self.assertTrue(untouched_same, "rep %d: bytes no writer touched changed" % rep)
            self.assertEqual(os.listdir(spill), [])
            before = after
        reader.close()
        dm.quit()
        self.assertTrue(any(p["used-peak"] > 0 for p in peaks), peaks)
        self.assertTrue(any(p["spilled-peak"] > 0 for p in peaks), peaks)

    def test_two_jobs_at_once(self):
        """Two backups with buffers sharing one spill dir, a writer on each
        source at the same time: each target is its own source's point in
        time, and each job's statistics are its own."""
        if not QEMU_IO:
            self.skipTest("needs qemu-io")
        d = self.subdir("two")
        spill = self.subdir("two-spill")
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        sock = os.path.join(d, "nbd.sock")
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        srcs = []
        for k in range(2):
            sd = self.subdir("two-%d" % k)
            src = self.source(sd, seed=120 + k)
            q.ok("blockdev-add", **file_node("src%d" % k, src))
            q.ok("block-export-add", type="nbd", id="e%d" % k, **{"node-name": "src%d" % k}, writable=True)
            srcs.append((sd, src))
        readers = [Nbd(sock, "src%d" % k) for k in range(2)]
        rng = random.Random(12)
        for rep in range(max(3, REPS // 4)):
            befores = [r.read_all() for r in readers]
            procs, tgts = [], []
            for k, (sd, _) in enumerate(srcs):
                tgt = self.fresh_target(sd)
                tgts.append(tgt)
                q.ok("blockdev-add", **file_node("tgt%d" % k, tgt))
                q.ok("blockdev-backup", **{"job-id": "j%d" % k, "device": "src%d" % k, "target": "tgt%d" % k,
                                           "sync": "full", "speed": 16 * MiB, "auto-dismiss": False,
                                           "x-perf": cow((k + 1) * 256 * KiB, 8 * MiB, spill)})
            for k in range(2):
                cmds = []
                for off, ln, pat in random_writes(rng, SIZE, 20, big_first=True):
                    cmds += ["-c", "write -P 0x%02x %d %d" % (max(pat, 1), off, ln)]
                procs.append(subprocess.Popen([QEMU_IO, "-f", "raw"] + cmds + ["nbd+unix:///src%d?socket=%s" % (k, sock)],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for p in procs:
                out, err = p.communicate(timeout=60)
                self.assertEqual(p.returncode, 0, out + err)
            peaks = {}
            for k in range(2):
                j = self.job(q, job="j%d" % k)
                self.assertEqual(j["x-cow-buffer"]["size"], (k + 1) * 256 * KiB, j)
            for _ in range(2):
                q.event("BLOCK_JOB_COMPLETED", 120)
            for k in range(2):
                j = self.job(q, "query-jobs", "j%d" % k)
                xb = j["x-cow-buffer"]
                self.assertEqual((xb["used"], xb["spilled"]), (0, 0), xb)
                self.assertGreater(xb["used-peak"], 0, xb)
                self.assertLessEqual(xb["used-peak"], (k + 1) * 256 * KiB, "job %d over its own limit: %r" % (k, xb))
                peaks[k] = xb
                q.ok("job-dismiss", id="j%d" % k)
                q.ok("blockdev-del", **{"node-name": "tgt%d" % k})
                with open(tgts[k], "rb") as f:
                    self.assertTrue(f.read() == befores[k], "rep %d job %d: not the point-in-time image" % (rep, k))
            q.drain_events()
            self.assertEqual(os.listdir(spill), [])
        for r in readers:
            r.close()
        dm.quit()

    # -- target write errors ------------------------------------------------
    def test_target_error_background_copy_with_buffer(self):
        """The background copy's write at 4 MiB fails (once) while a writer
        keeps putting old data of the upper half into the buffer. Events and
        outcome equal qemu-storage-daemon's without a buffer; under stop the
        job keeps the buffer while paused and does not drain it."""
        def run(name, dm, d):
            q = dm.qmp
            src = self.source(d, seed=21)
            q.ok("blockdev-add", **file_node("src", src))
            sock = self.export(q, d)
            out = {}
            for k, policy in enumerate(("stop", "report", "ignore")):
                reader = Nbd(sock, "src")
                before = reader.read_all()
                reader.close()
                tgt = self.fresh_target(d)
                rule = {"event": "write_aio", "errno": 5, "sector": 4 * MiB // 512, "once": True}
                q.ok("blockdev-add", **target_node("tgt", tgt, rule=rule))
                args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                        "on-target-error": policy, "speed": 8 * MiB}
                if name == VBLK_NAME:
                    args["x-perf"] = cow(64 * MiB)
                q.ok("blockdev-backup", **args)
                # 64 KiB every 20 ms to distinct clusters of the upper half.
                cl = list(range(SIZE // 2, SIZE, CLUSTER))
                random.Random(k).shuffle(cl)
                writes = [(o + 100, CLUSTER - 200, 0x40 + k) for o in cl]
                wr = Writer(sock, writes, gap=0.02)
                wr.start()
                err, polled = self.event_polling(q, "BLOCK_JOB_ERROR")
                if name == VBLK_NAME:
                    self.assertTrue(any(j["x-cow-buffer"]["used-peak"] > 0 for j in polled),
                                    "%s: the writes were not buffered before the error" % policy)
                paused = None
                if policy == "stop":
                    j = self.wait_for(q, lambda j: j["status"] == "paused", "pause on error")
                    time.sleep(0.3)  # the writer goes on meanwhile
                    a = self.job(q)
                    time.sleep(0.3)
                    b = self.job(q)
                    paused = {k2: a[k2] for k2 in ("status", "paused", "io-status")}
                    if name == VBLK_NAME:
                        ua, ub = a["x-cow-buffer"]["used"], b["x-cow-buffer"]["used"]
                        self.assertGreater(ua, 0, "nothing buffered while paused on error: %r" % a)
                        self.assertGreaterEqual(ub, ua, "drained while paused: %r %r" % (a, b))
                    q.ok("block-job-resume", device="j")
                done = q.event("BLOCK_JOB_COMPLETED", 120)
                wr.stop()
                self.assertEqual((wr.failed, wr.broken), ([], None), "guest writes failed")
                q.drain_events()
                q.ok("blockdev-del", **{"node-name": "tgt"})
                with open(tgt, "rb") as f:
                    pit_ok = f.read() == before
                reader = Nbd(sock, "src")
                self.assertTrue(reader.read_all() == apply_writes(before, wr.acked), "source lost a write")
                reader.close()
                out[policy] = (err["data"], paused, done["data"].get("error"), pit_ok,
                               job_statuses(q.events), len(wr.acked) > 0)
                q.events.clear()
            return out
        seen = self.each_daemon(run)
        self.assertSame(seen)
        out = list(seen.values())[0]
        self.assertEqual(out["stop"][:4], ({"device": "j", "operation": "write", "action": "stop"},
                                           {"status": "paused", "paused": True, "io-status": "failed"}, None, True))
        self.assertEqual(out["report"][:4], ({"device": "j", "operation": "write", "action": "report"}, None,
                                             "Input/output error", False))
        self.assertEqual(out["ignore"][:4], ({"device": "j", "operation": "write", "action": "ignore"}, None,
                                             None, True))

    def test_failed_drain_write_keeps_data(self):
        """vblk only: the writes hit the last MiB, far ahead of the background
        copy; the drain's write of their old data fails once. The guest
        writes succeed, the policy acts as for a job write (the events QEMU
        sends for a background-copy error) and the data is not lost: stop
        and ignore end with the point-in-time image."""
        d = self.subdir("drain")
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, seed=31)
        q.ok("blockdev-add", **file_node("src", src))
        sock = self.export(q, d)
        region = SIZE - MiB
        for k, policy in enumerate(("stop", "report", "ignore")):
            with self.subTest(policy=policy):
                reader = Nbd(sock, "src")
                before = reader.read_all()
                reader.close()
                tgt = self.fresh_target(d)
                rule = {"event": "write_aio", "errno": 5, "sector": (region + MiB // 2) // 512, "once": True}
                q.ok("blockdev-add", **target_node("tgt", tgt, rule=rule))
                t0 = time.monotonic()
                q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                           "on-target-error": policy, "auto-dismiss": False, "speed": 4 * MiB,
                                           "x-perf": cow(64 * MiB)})
                writes = [(region + i * CLUSTER + 7, CLUSTER - 9, 0x60 + k) for i in range(16)]
                wr = Writer(sock, writes)
                wr.start()
                wr.join(30)
                self.assertFalse(wr.is_alive(), "guest writes did not go on at once")
                wr.stop()
                self.assertEqual((wr.failed, wr.broken, len(wr.acked)), ([], None, 16), "guest writes failed")
                err = q.event("BLOCK_JOB_ERROR", 30)
                # The background copy at 4 MiB/s would need ~4 s to reach
                # the failing sector; the drain gets there at once.
                self.assertLess(time.monotonic() - t0, 2.5, "the error came from the background copy")
                self.assertEqual(err["data"], {"device": "j", "operation": "write", "action": policy})
                if policy == "stop":
                    j = self.wait_for(q, lambda j: j["status"] == "paused", "pause on error")
                    time.sleep(0.3)
                    j = self.job(q)
                    self.assertEqual((j["paused"], j["io-status"]), (True, "failed"))
                    self.assertGreater(j["x-cow-buffer"]["used"] + j["x-cow-buffer"]["spilled"], 0,
                                       "the failed drain write dropped its data: %r" % j)
                    q.ok("block-job-resume", device="j")
                done = q.event("BLOCK_JOB_COMPLETED", 60)
                jq = self.job(q, "query-jobs")
                self.assertEqual((jq["x-cow-buffer"]["used"], jq["x-cow-buffer"]["spilled"]), (0, 0), jq)
                q.ok("job-dismiss", id="j")
                q.drain_events()
                q.ok("blockdev-del", **{"node-name": "tgt"})
                with open(tgt, "rb") as f:
                    pit_ok = f.read() == before
                if policy == "report":
                    self.assertEqual(done["data"].get("error"), "Input/output error")
                else:
                    self.assertNotIn("error", done["data"])
                    self.assertTrue(pit_ok, "%s: backup is not the point-in-time image" % policy)
                q.events.clear()
        dm.quit()

    def test_spill_write_failure_falls_back_to_sync(self):
        """The spill dir is a 256 KiB tmpfs under an 8 MiB cow-spill-size:
        spill writes fail (ENOSPC). The guest writes must still succeed
        (synchronous copies), with no job error and the point-in-time image."""
        if not IS_ROOT:
            self.skipTest("needs root to mount a small tmpfs")
        d = self.subdir("enospc")
        spill = self.subdir("enospc-spill")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", spill], capture_output=True, text=True)
        if r.returncode:
            self.skipTest("cannot mount a tmpfs: " + r.stderr.strip())
        self.addCleanup(subprocess.run, ["umount", "-l", spill], capture_output=True)
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, seed=81)
        tgt = self.fresh_target(d)
        q.ok("blockdev-add", **file_node("src", src))
        q.ok("blockdev-add", **file_node("tgt", tgt))
        sock = self.export(q, d)
        reader = Nbd(sock, "src")
        before = reader.read_all()
        q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                   "speed": MiB, "auto-dismiss": False, "x-perf": cow(128 * KiB, 8 * MiB, spill)})
        writes = [(4 * MiB + i * CLUSTER + 11, CLUSTER - 22, 0xa1) for i in range(64)]
        wr = Writer(sock, writes)
        wr.start()
        wr.join(60)
        wr.stop()
        self.assertEqual((wr.failed, wr.broken, len(wr.acked)), ([], None, 64), "guest writes failed")
        j = self.job(q)
        xb = j["x-cow-buffer"]
        self.assertLessEqual(xb["spilled"], 256 * KiB, xb)
        self.assertGreater(xb["sync-copies"], 0, "spill writes cannot succeed, yet no synchronous copy: %r" % xb)
        q.ok("block-job-set-speed", device="j", speed=0)
        done = q.event("BLOCK_JOB_COMPLETED", 60)
        self.assertNotIn("error", done["data"])
        self.assertEqual([e["event"] for e in q.drain_events() if e["event"] == "BLOCK_JOB_ERROR"], [])
        with open(tgt, "rb") as f:
            self.assertTrue(f.read() == before, "backup is not the point-in-time image")
        self.assertTrue(reader.read_all() == apply_writes(before, writes))
        reader.close()
        q.ok("job-dismiss", id="j")
        dm.quit()
        self.assertEqual(os.listdir(spill), [])

    def test_source_read_error_while_buffering(self):
        """Reading the old data into the buffer fails (blkdebug on the
        source, once): the guest write must fail as it does without a buffer
        (qemu-storage-daemon: EIO, the source unchanged there), not go on
        without its old data; the backup then completes with the point in
        time."""
        def run(name, dm, d):
            q = dm.qmp
            src = self.source(d, seed=101)
            with open(src, "rb") as f:
                old = f.read()
            tgt = self.fresh_target(d)
            rule = {"event": "read_aio", "errno": 5, "sector": 12 * MiB // 512 + 7, "once": True}
            q.ok("blockdev-add", **{"driver": "raw", "node-name": "src",
                                    "file": {"driver": "blkdebug", "inject-error": [rule],
                                             "image": {"driver": "file", "filename": src}}})
            q.ok("blockdev-add", **file_node("tgt", tgt))
            sock = self.export(q, d)
            args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": 4 * MiB}
            if name == VBLK_NAME:
                args["x-perf"] = cow(64 * MiB)
            q.ok("blockdev-backup", **args)
            writes = [(12 * MiB + i * CLUSTER, CLUSTER, 0xc1) for i in range(4)]
            n = Nbd(sock, "src")
            errs = [n.write(off, bytes([pat]) * ln) for off, ln, pat in writes]
            n.close()
            if name == VBLK_NAME:
                self.assertGreater(self.job(q)["x-cow-buffer"]["used-peak"], 0, "nothing buffered")
            q.ok("block-job-set-speed", device="j", speed=0)
            done = q.event("BLOCK_JOB_COMPLETED")
            q.drain_events()
            q.ok("blockdev-del", **{"node-name": "tgt"})
            with open(tgt, "rb") as f:
                pit = f.read() == old
            with open(src, "rb") as f:
                now = f.read()
            acked = [w for w, e in zip(writes, errs) if e == 0]
            return errs, pit, now == apply_writes(old, acked), done["data"], block_events(q.events)
        seen = self.each_daemon(run)
        self.assertSame(seen)
        errs, pit, src_ok = list(seen.values())[0][:3]
        self.assertEqual((errs, pit, src_ok), ([5, 0, 0, 0], True, True))

    def test_sparse_qcow2_source_onto_dirty_target(self):
        """A qcow2 source with holes, a raw target full of 0xee: guest
        writes into holes, zero clusters and data buffer their old data
        (zeroes for holes); the target ends as the point-in-time image, and
        byte for byte as qemu-storage-daemon's."""
        def run(name, dm, d):
            q = dm.qmp
            raw = os.path.join(d, "layout.raw")
            with open(raw, "wb") as f:
                f.truncate(SIZE)
                for i in range(0, SIZE, 2 * MiB):  # 512 KiB of data every 2 MiB
                    f.seek(i)
                    f.write(rand_bytes(512 * KiB, "sparse-%d" % i))
            src = os.path.join(d, "src.qcow2")
            subprocess.run([QEMU_IMG, "convert", "-O", "qcow2", raw, src], check=True)
            subprocess.run([QEMU_IO, "-f", "qcow2", "-c", "write -z 1536k 256k", src], check=True,
                           capture_output=True)  # a zero cluster run as well
            tgt = os.path.join(d, "tgt.raw")
            with open(tgt, "wb") as f:
                f.write(b"\xee" * SIZE)
            q.ok("blockdev-add", **file_node("src", src, "qcow2"))
            q.ok("blockdev-add", **file_node("tgt", tgt))
            sock = self.export(q, d)
            reader = Nbd(sock, "src")
            point = reader.read_all()
            args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": 4 * MiB}
            if name == VBLK_NAME:
                args["x-perf"] = cow(512 * KiB, 16 * MiB, self.subdir("sparse-spill"))
            q.ok("blockdev-backup", **args)
            n = Nbd(sock, "src")
            for i in range(4 * MiB, SIZE, 384 * KiB):  # through data, holes and zero clusters
                self.assertEqual(n.write(i + 1000, bytes([0xe1]) * (100 * KiB)), 0)
            n.close()
            if name == VBLK_NAME:
                xb = self.job(q)["x-cow-buffer"]
                self.assertGreater(xb["used-peak"] + xb["spilled-peak"], 0, xb)
            q.ok("block-job-set-speed", device="j", speed=0)
            done = q.event("BLOCK_JOB_COMPLETED")
            q.drain_events()
            reader.close()
            q.ok("blockdev-del", **{"node-name": "tgt"})
            with open(tgt, "rb") as f:
                got = f.read()
            self.assertTrue(got == point, "target is not the point-in-time image")
            return hashlib.sha256(got).hexdigest(), done["data"], block_events(q.events)
        self.assertSame(self.each_daemon(run))

    def test_incremental_with_buffer(self):
        """sync=incremental: only the bitmap's clusters are copied, so only
        guest writes to those are buffered; the target equals
        qemu-storage-daemon's byte for byte (old data in the dirty clusters,
        nothing elsewhere)."""
        def run(name, dm, d):
            q = dm.qmp
            src = self.source(d, seed=111)
            q.ok("blockdev-add", **file_node("src", src))
            sock = self.export(q, d)
            q.ok("block-dirty-bitmap-add", {"node": "src", "name": "b0"})
            n = Nbd(sock, "src")
            for i in range(0, 64, 2):  # dirty every other cluster of [8, 12) MiB
                self.assertEqual(n.write(8 * MiB + i * CLUSTER, bytes([0xd0]) * CLUSTER), 0)
            point = n.read_all()
            tgt = self.fresh_target(d)
            q.ok("blockdev-add", **file_node("tgt", tgt))
            args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "incremental", "bitmap": "b0",
                    "speed": MiB}
            if name == VBLK_NAME:
                args["x-perf"] = cow(64 * MiB)
            q.ok("blockdev-backup", **args)
            # Every cluster of [8, 12) MiB, dirty or not, and some elsewhere.
            for i in range(64):
                self.assertEqual(n.write(8 * MiB + i * CLUSTER + 5, bytes([0xd1]) * (CLUSTER - 10)), 0)
            for i in range(8):
                self.assertEqual(n.write(i * 2 * MiB + 77, bytes([0xd2]) * 1000), 0)
            j = self.job(q)
            if name == VBLK_NAME:
                xb = j["x-cow-buffer"]
                self.assertGreater(xb["used"], 0, xb)
                self.assertLessEqual(xb["used-peak"], 32 * CLUSTER, "buffered clusters outside the bitmap: %r" % xb)
            q.ok("block-job-set-speed", device="j", speed=0)
            done = q.event("BLOCK_JOB_COMPLETED")
            q.drain_events()
            q.ok("blockdev-del", **{"node-name": "tgt"})
            n.close()
            with open(tgt, "rb") as f:
                got = f.read()
            want = bytearray(SIZE)
            for i in range(0, 64, 2):
                o = 8 * MiB + i * CLUSTER
                want[o:o + CLUSTER] = point[o:o + CLUSTER]
            self.assertTrue(got == bytes(want), "target is not the dirty clusters' point in time")
            return hashlib.sha256(got).hexdigest(), done["data"], block_events(q.events)
        self.assertSame(self.each_daemon(run))

    # -- cancel, pause, kill ---------------------------------------------------
    def test_cancel_with_full_buffer(self):
        """8 MiB of old data buffered (the job crawls at 1 MiB/s); cancel:
        the same events as qemu-storage-daemon, the memory is given back
        (and the RSS after the second cancel is not above the first's; raw
        targets both times), a qcow2 target the third time checks clean
        after it, and the source holds every write."""
        def run(name, dm, d):
            q = dm.qmp
            src = self.source(d, seed=41)
            q.ok("blockdev-add", **file_node("src", src))
            sock = self.export(q, d)
            out = []
            rss_log = []
            for cycle in range(3):
                reader = Nbd(sock, "src")
                before = reader.read_all()
                fmt = ("raw", "raw", "qcow2")[cycle]  # the third time a qcow2 target
                tgt = self.fresh_target(d, fmt)
                q.ok("blockdev-add", **file_node("tgt", tgt, fmt))
                base = rss(dm.proc.pid)
                args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": MiB}
                if name == VBLK_NAME:
                    args["x-perf"] = cow(64 * MiB)
                q.ok("blockdev-backup", **args)
                writes = [(4 * MiB + i * 256 * KiB, 256 * KiB, 0x70 + cycle) for i in range(32)]
                wr = Writer(sock, writes)
                wr.start()
                wr.join(60)
                wr.stop()
                self.assertEqual((wr.failed, wr.broken, len(wr.acked)), ([], None, 32))
                j = self.job(q)
                if name == VBLK_NAME:
                    xb = j["x-cow-buffer"]
                    self.assertGreaterEqual(xb["used"], 6 * MiB, "buffer not full: %r" % xb)
                    if cycle == 0:
                        # The drain goes through the job's rate limit: 1 MiB/s,
                        # the first second taken by the background's first MiB.
                        time.sleep(1.5)
                        xb2 = self.job(q)["x-cow-buffer"]
                        self.assertGreater(xb["used"], xb2["used"], "the drain does not run: %r %r" % (xb, xb2))
                        self.assertLessEqual(xb["used"] - xb2["used"], 1536 * KiB + CLUSTER,
                                             "the drain ignores the speed: %r %r" % (xb, xb2))
                    full = rss(dm.proc.pid)
                    self.assertGreater(full - base, 4 * MiB, "the buffer is not in RSS? %d -> %d" % (base, full))
                q.ok("block-job-cancel", device="j")
                e = q.event("BLOCK_JOB_CANCELLED")
                q.drain_events()
                self.assertEqual(q.ok("query-block-jobs"), [])
                self.assertEqual(q.ok("query-jobs"), [])
                if name == VBLK_NAME:
                    time.sleep(0.2)
                    after = rss(dm.proc.pid)
                    rss_log.append((base, full, after))
                    self.assertLess(after - base, (full - base) / 2,
                                    "cycle %d: RSS did not fall back after cancel: %d -> %d -> %d"
                                    % (cycle, base, full, after))
                q.ok("blockdev-del", **{"node-name": "tgt"})
                check = img_check(tgt) if fmt == "qcow2" else (0, "")
                self.assertEqual(check[0], 0, "target after cancel: " + check[1])
                self.assertTrue(reader.read_all() == apply_writes(before, wr.acked), "source lost a write")
                reader.close()
                out.append((e["data"]["len"], e["data"]["speed"], e["data"]["offset"] < e["data"]["len"],
                            job_statuses(q.events), block_events(q.events)))
                q.events.clear()
            if rss_log:
                self.assertLess(rss_log[1][2] - rss_log[0][2], 2 * MiB, "RSS grows cycle over cycle: %r" % rss_log)
            return out
        seen = self.each_daemon(run)
        self.assertSame(seen)
        self.assertEqual(list(seen.values())[0][0][3], ["created", "running", "aborting", "concluded", "null"])

    def test_verbs_under_writers(self):
        """Pause, resume, set-speed and complete or cancel while two NBD
        writers keep writing (disjoint halves, memory spilling): no guest
        write fails, the source holds every acknowledged write, a completed
        backup is the point in time, the spill dir stays empty."""
        d = self.subdir("verbs")
        spill = self.subdir("verbs-spill")
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, seed=131)
        q.ok("blockdev-add", **file_node("src", src))
        sock = self.export(q, d)
        reader = Nbd(sock, "src")
        rng = random.Random(131)
        half = SIZE // 2
        spilled = []
        for rnd in range(6):
            before = reader.read_all()
            tgt = self.fresh_target(d)
            q.ok("blockdev-add", **file_node("tgt", tgt))
            q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                       "speed": 8 * MiB, "x-perf": cow(256 * KiB, 16 * MiB, spill)})
            writers = []
            for k in range(2):
                ws = [(off + k * half, ln, pat) for off, ln, pat in random_writes(rng, half, 50)]
                writers.append(Writer(sock, ws, gap=0.003, loop=True))
            for w in writers:
                w.start()
            time.sleep(0.15)
            q.ok("block-job-pause", device="j")
            time.sleep(0.15)
            q.ok("block-job-set-speed", device="j", speed=2 * MiB)
            q.ok("block-job-resume", device="j")
            time.sleep(0.15)
            xb = self.job(q)["x-cow-buffer"]
            self.assertGreater(xb["used-peak"], 0, "round %d: nothing buffered: %r" % (rnd, xb))
            spilled.append(xb["spilled-peak"])
            cancel = rnd % 2 == 1
            if cancel:
                q.ok("block-job-cancel", device="j")
                e = q.event("BLOCK_JOB_CANCELLED", 30)
            else:
                q.ok("block-job-set-speed", device="j", speed=0)
            time.sleep(0.1)
            for w in writers:
                w.stop()
                self.assertEqual((w.failed, w.broken), ([], None), "round %d: guest writes failed" % rnd)
                self.assertGreater(len(w.acked), 5)
            if not cancel:
                e = q.event("BLOCK_JOB_COMPLETED", 60)
                self.assertNotIn("error", e["data"])
            q.drain_events()
            q.events.clear()
            self.assertEqual(q.ok("query-block-jobs"), [])
            q.ok("blockdev-del", **{"node-name": "tgt"})
            if not cancel:
                with open(tgt, "rb") as f:
                    self.assertTrue(f.read() == before, "round %d: backup is not the point-in-time image" % rnd)
            want = apply_writes(before, writers[0].acked + writers[1].acked)
            self.assertTrue(reader.read_all() == want, "round %d: the source lacks acknowledged writes" % rnd)
            self.assertEqual(os.listdir(spill), [])
        reader.close()
        dm.quit()
        self.assertTrue(any(spilled), "never spilled: %r" % spilled)

    def test_pause_keeps_buffer(self):
        """Data buffered, pause: query shows it kept and not drained while
        paused; more writes while paused are buffered; resume completes with
        the point-in-time image. Job fields and events as qemu-storage-daemon's."""
        def run(name, dm, d):
            q = dm.qmp
            src = self.source(d, seed=51)
            q.ok("blockdev-add", **file_node("src", src))
            sock = self.export(q, d)
            reader = Nbd(sock, "src")
            before = reader.read_all()
            tgt = self.fresh_target(d)
            q.ok("blockdev-add", **file_node("tgt", tgt))
            args = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full", "speed": MiB}
            if name == VBLK_NAME:
                args["x-perf"] = cow(64 * MiB)
            q.ok("blockdev-backup", **args)
            wr = Writer(sock, [(8 * MiB + i * CLUSTER + 3, CLUSTER, 0x81) for i in range(32)])
            wr.start()
            wr.join(60)
            wr.stop()
            q.ok("block-job-pause", device="j")
            self.wait_for(q, lambda j: j["status"] == "paused", "pause")
            time.sleep(0.3)
            a = self.job(q)
            time.sleep(0.5)
            b = self.job(q)
            self.assertEqual(a["offset"], b["offset"], "progress while paused")
            wr2 = Writer(sock, [(12 * MiB + i * CLUSTER, CLUSTER // 2, 0x82) for i in range(16)])
            wr2.start()
            wr2.join(60)
            wr2.stop()
            c = self.job(q)
            if name == VBLK_NAME:
                self.assertEqual(self.job(q, "query-jobs").get("x-cow-buffer"), c["x-cow-buffer"],
                                 "query-jobs and query-block-jobs differ")
                ua, ub, uc = (x["x-cow-buffer"]["used"] for x in (a, b, c))
                self.assertGreater(ua, 0, "nothing buffered at pause: %r" % a)
                self.assertEqual(ua, ub, "the buffer changed while paused: %r %r" % (a, b))
                self.assertGreater(uc, ub, "writes while paused were not buffered: %r %r" % (b, c))
            for w in (wr, wr2):
                self.assertEqual((w.failed, w.broken), ([], None))
            q.ok("block-job-set-speed", device="j", speed=0)
            q.ok("block-job-resume", device="j")
            done = q.event("BLOCK_JOB_COMPLETED", 60)
            q.drain_events()
            q.ok("blockdev-del", **{"node-name": "tgt"})
            with open(tgt, "rb") as f:
                self.assertTrue(f.read() == before, "backup is not the point-in-time image")
            self.assertTrue(reader.read_all() == apply_writes(apply_writes(before, wr.acked), wr2.acked))
            reader.close()
            return ({k: a[k] for k in ("status", "paused", "busy", "io-status", "ready", "speed", "len")},
                    done["data"], job_statuses(q.events))
        seen = self.each_daemon(run)
        self.assertSame(seen)

    def kill_mid_backup(self, src_fmt, tgt_fmt, seed):
        d = self.subdir("kill-" + src_fmt)
        spill = self.subdir("kill-spill-" + src_fmt)
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, src_fmt, seed)
        tgt = self.fresh_target(d, tgt_fmt)
        q.ok("blockdev-add", **file_node("src", src, src_fmt))
        q.ok("blockdev-add", **file_node("tgt", tgt, tgt_fmt))
        sock = self.export(q, d)
        reader = Nbd(sock, "src")
        base = reader.read_all()
        reader.close()
        q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                   "speed": MiB, "x-perf": cow(256 * KiB, 64 * MiB, spill)})
        rng = random.Random(seed)
        writes = random_writes(rng, SIZE, 400)
        wr = Writer(sock, writes, gap=0.002, fua=True, loop=True)
        wr.start()
        j = self.wait_for(q, lambda j: j["x-cow-buffer"]["spilled"] > 0, "spill")
        held = deleted_fds_in(dm.proc.pid, spill)
        listing = os.listdir(spill)
        # Some acknowledged writes to check after the kill (a loaded machine,
        # say under ASan, may have acknowledged few by the time of the spill).
        end = time.time() + 30
        time.sleep(0.1)
        while len(wr.acked) <= 10 and time.time() < end:
            time.sleep(0.05)
        dm.proc.send_signal(signal.SIGKILL)
        dm.proc.wait()
        wr.join(30)
        self.assertFalse(wr.is_alive())
        wr.nbd.s.close()
        self.assertEqual(listing, [], "spill file visible in the spill dir")
        self.assertTrue(held, "no unlinked spill file open in %s while %d bytes spilled" % (spill, j["x-cow-buffer"]["spilled"]))
        self.assertEqual(os.listdir(spill), [], "spill dir not empty after kill -9")
        self.assertEqual(wr.failed, [])
        self.assertGreater(len(wr.acked), 10)
        wait_unlocked(src)
        wait_unlocked(tgt)
        if src_fmt == "qcow2":
            rc, text = img_check(src)
            self.assertEqual(rc, 0, text)
            flat = os.path.join(d, "flat.raw")
            subprocess.run([QEMU_IMG, "convert", "-O", "raw", src, flat], check=True)
        else:
            flat = src
        with open(flat, "rb") as f:
            got = f.read()
        want = bytearray(apply_writes(base, wr.acked))
        if wr.inflight is not None:  # sent, never answered: old or new bytes
            off, ln, pat = wr.inflight
            for i in range(off, off + ln):
                if got[i] == pat:
                    want[i] = pat
        self.assertTrue(got == bytes(want), "the source lacks acknowledged writes")
        if tgt_fmt == "qcow2":
            rc, text = img_check(tgt)
            self.assertIn(rc, (0, 3), text)  # leaked clusters after a crash are allowed

    def test_kill9_raw(self):
        self.kill_mid_backup("raw", "raw", 61)

    def test_kill9_qcow2(self):
        self.kill_mid_backup("qcow2", "qcow2", 62)

    # -- arguments --------------------------------------------------------------
    def test_argument_errors(self):
        d = self.subdir("args")
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, size=4 * MiB)
        tgt = self.fresh_target(d, size=4 * MiB)
        q.ok("blockdev-add", **file_node("src", src))
        q.ok("blockdev-add", **file_node("tgt", tgt))
        spill = self.subdir("args-spill")
        afile = os.path.join(d, "afile")
        open(afile, "w").close()
        bad = [
            ({"cow-buffer-size": -1}, "cow-buffer-size"),
            ({"cow-buffer-size": -MiB, "cow-spill-size": MiB}, "cow-buffer-size"),
            ({"cow-buffer-size": 65537}, "cow-buffer-size"),
            ({"cow-buffer-size": 1000}, "cow-buffer-size"),
            ({"cow-buffer-size": MiB, "cow-spill-size": -1}, "cow-spill-size"),
            ({"cow-buffer-size": MiB, "cow-spill-size": 1000, "cow-spill-dir": spill}, "cow-spill-size"),
            ({"cow-buffer-size": MiB, "cow-spill-size": MiB + 1, "cow-spill-dir": spill}, "cow-spill-size"),
            ({"cow-spill-size": MiB}, "cow-buffer-size"),
            ({"cow-spill-size": MiB, "cow-spill-dir": spill}, "cow-buffer-size"),
            ({"cow-buffer-size": 0, "cow-spill-size": MiB}, "cow-buffer-size"),
            ({"cow-spill-dir": spill}, "cow-buffer-size"),
            ({"cow-spill-direct": False}, "cow-buffer-size"),
            ({"cow-buffer-size": MiB, "cow-spill-size": MiB, "cow-spill-dir": os.path.join(d, "nope")},
             "cow-spill-dir"),
            ({"cow-buffer-size": MiB, "cow-spill-size": MiB, "cow-spill-dir": afile}, "cow-spill-dir"),
            # sync=none: the target is read directly (fleecing), so it must
            # hold the old data as soon as the guest write is done.
            ({"sync": "none", "cow-buffer-size": MiB}, "cow-buffer-size"),
        ]
        nodes = sorted(n["node-name"] for n in q.ok("query-named-block-nodes"))
        for xperf, member in bad:
            xperf = dict(xperf)
            sync = xperf.pop("sync", "full")
            with self.subTest(xperf=xperf):
                r = q.cmd("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": sync,
                                                "x-perf": xperf})
                if "error" not in r:  # accepted: end the job for the next case, then fail
                    q.cmd("job-cancel", id="j")
                    self.wait_for_no_jobs(q)
                    self.fail("accepted: %r" % xperf)
                self.assertEqual(r["error"]["class"], "GenericError", r)
                names = [member] + ([xperf["cow-spill-dir"]] if member == "cow-spill-dir" else [])
                self.assertTrue(any(n in r["error"]["desc"] for n in names),
                                "the error names none of %s: %r" % (names, r))
                self.assertNotIn("is unexpected", r["error"]["desc"], "x-perf cow options unknown")
                self.assertEqual(q.ok("query-jobs"), [], "a job started")
                self.assertEqual(sorted(n["node-name"] for n in q.ok("query-named-block-nodes")), nodes)
                self.assertEqual(os.listdir(spill), [])
                self.assertEqual(q.drain_events(), [], "events for a refused backup")
        # Less than one backup cluster (1 MiB: the target's cluster size).
        big = os.path.join(d, "big.qcow2")
        subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", "-o", "cluster_size=1M", big, str(4 * MiB)], check=True)
        q.ok("blockdev-add", **file_node("big", big, "qcow2"))
        for xperf, member in (({"cow-buffer-size": 512 * KiB}, "cow-buffer-size"),
                              ({"cow-buffer-size": MiB, "cow-spill-size": 512 * KiB}, "cow-spill-size")):
            with self.subTest(xperf=xperf, target="1M clusters"):
                r = q.cmd("blockdev-backup", **{"job-id": "j", "device": "src", "target": "big", "sync": "full",
                                                "x-perf": xperf})
                if "error" not in r:
                    q.cmd("job-cancel", id="j")
                    self.wait_for_no_jobs(q)
                    self.fail("accepted: %r" % xperf)
                self.assertIn(member, r["error"]["desc"], r)
                self.assertEqual(q.ok("query-jobs"), [])
        q.ok("blockdev-del", **{"node-name": "big"})
        # Type errors read like QEMU's for the other x-perf members.
        for member, value, want in (("cow-buffer-size", "big", "integer"), ("cow-spill-size", True, "integer"),
                                    ("cow-spill-dir", 7, "string"), ("cow-spill-direct", 1, "boolean")):
            with self.subTest(member=member):
                x = {"cow-buffer-size": MiB, "cow-spill-size": MiB}
                x[member] = value
                r = q.cmd("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                                "x-perf": x})
                self.assertEqual(r.get("error"), {"class": "GenericError", "desc":
                                 "Invalid parameter type for 'x-perf.%s', expected: %s" % (member, want)})
        # And the nodes are free for a good one.
        q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                   "x-perf": cow(MiB, MiB, spill)})
        done = q.event("BLOCK_JOB_COMPLETED", 60)
        self.assertNotIn("error", done["data"])
        self.assertEqual(compare(src, tgt), (0, "Images are identical."))
        # cow-buffer-size 0 is the default: no buffer, no x-cow-buffer.
        q.ok("blockdev-backup", **{"job-id": "j0", "device": "src", "target": "tgt", "sync": "full",
                                   "speed": MiB, "x-perf": {"cow-buffer-size": 0}})
        for verb in ("query-jobs", "query-block-jobs"):
            j = self.job(q, verb, "j0")
            self.assertIsNotNone(j)
            self.assertNotIn("x-cow-buffer", j)
        q.ok("job-cancel", id="j0")
        q.event("BLOCK_JOB_CANCELLED")
        dm.quit()

    def test_default_spill_dir(self):
        """Without cow-spill-dir the spill file is an unlinked file in
        /var/tmp, gone after kill -9."""
        d = self.subdir("defspill")
        before = set(os.listdir("/var/tmp"))
        dm = self.start(VBLK_NAME, d)
        q = dm.qmp
        src = self.source(d, seed=71)
        tgt = self.fresh_target(d)
        q.ok("blockdev-add", **file_node("src", src))
        q.ok("blockdev-add", **file_node("tgt", tgt))
        sock = self.export(q, d)
        q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full",
                                   "speed": MiB, "x-perf": cow(128 * KiB, 8 * MiB)})
        wr = Writer(sock, [(8 * MiB + i * CLUSTER, CLUSTER, 0x91) for i in range(32)])
        wr.start()
        wr.join(30)
        wr.stop()
        self.assertEqual((wr.failed, wr.broken, len(wr.acked)), ([], None, 32))
        j = self.job(q)
        self.assertGreater(j["x-cow-buffer"]["spilled"], 0, j)
        self.assertTrue(deleted_fds_in(dm.proc.pid, "/var/tmp"), "no unlinked spill file open in /var/tmp")
        # (Other programs may use /var/tmp meanwhile: only names that could be
        # vblk's count.)
        def new_names():
            return sorted(n for n in set(os.listdir("/var/tmp")) - before if "vblk" in n or "spill" in n)
        self.assertEqual(new_names(), [])
        dm.kill()
        self.assertEqual(new_names(), [])


if __name__ == "__main__":
    unittest.main()
