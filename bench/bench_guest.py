#!/usr/bin/env python3
"""Guest impact of a live backup to a slow target: `vblk serve` against
qemu-storage-daemon, the same QMP commands and the same fio guest for both,
stock backup, fleecing and vblk's copy-before-write (COW) buffer side by side.

What a VM feels while it is backed up: the guest is fio writing 32 KiB
blocks at random offsets (--iodepth, default 8) through the daemon's NBD
export of the source disk (fio's nbd engine); the backup copies the source
(--size, default 2 GiB of random data) to a target that can take only
--target-rate bytes per second (default 50 MB/s, a `throttle` node over a raw
file: both daemons model the slow target the same way). Each guest write to
a cluster the backup has not copied yet must first save the old data
(copy-before-write); with stock backup that copy goes to the slow target,
which is where a backup slows the guest.

Environments (--envs, comma-separated; default all):
  qemu               qemu-storage-daemon 7.2, stock blockdev-backup
  qemu-fleece        qemu-storage-daemon, push backup with fleecing (below)
  vblk               vblk serve, stock blockdev-backup (no buffer)
  vblk-buf64M        vblk, blockdev-backup x-perf.cow-buffer-size = 64 MiB
  vblk-buf256M       ... 256 MiB
  vblk-buf1G         ... 1 GiB
  vblk-spill         vblk, 256 MiB buffer + cow-spill-dir (the work dir) and
                     cow-spill-size = the disk size
  vblk-spill-cached  vblk-spill with cow-spill-direct = false: the spill file
                     goes through the page cache
  qemu-fleece-cached qemu-fleece with the fleecing image's cache.direct =
                     false (its writes go through the page cache too)
  vblk-fleece        vblk, the same fleecing graph as qemu-fleece
  vblk-fleece-buf1G  vblk fleecing, copy-before-write x-cow-buffer-size 1 GiB
A vblk row whose option or driver the binary does not know yet ("... is
unexpected", "does not accept value") is skipped with that reason.

Fleecing (QEMU 7.2's push backup with fleecing, Proxmox's graph, as in
qemu-iotests tests/image-fleecing): after the idle phase the guest export is
deleted, a raw fleecing image of the disk's size (in the work dir, beside
the source, cache.direct like it) is added as node "fleece", then
copy-before-write "fl-cbw" (file=disk, target=fleece,
on-cbw-error=break-snapshot, cbw-timeout=45), snapshot-access "fl-access"
over it, the guest export again on fl-cbw, and blockdev-backup
device=fl-access target=target sync=full.  Guest writes then save the old
data to the local fleecing image instead of the slow target.

Per environment and run, the daemon is started fresh and:
  idle    the guest alone for --runtime seconds (the row's baseline; VmHWM
          of the daemon read after it is the no-backup peak RSS)
  backup  blockdev-backup starts, the guest runs --runtime seconds while it
          copies; query-block-jobs is polled meanwhile (vblk's x-cow-buffer
          peaks; for a buffered fleecing filter, fl-cbw's entry in
          query-named-block-nodes); then the backup runs to completion (or is cancelled with
          --no-wait-completion) and the daemon's VmHWM is read before quit
Measured: the guest's write IOPS, mean and p99 completion latency in each
phase; "IOPS kept" = backup / idle IOPS, "p99 x" = backup / idle p99;
whether the backup outlasted the phase; the backup's completion time
(blockdev-backup to BLOCK_JOB_COMPLETED; about size / target-rate); the
daemon's peak RSS; vblk's COW buffer and spill peaks and sync copies.

The bar (SPEC): with a 1 GiB buffer or spill (vblk-buf1G, vblk-spill,
vblk-fleece-buf1G) vblk keeps >= 90 % of the no-backup IOPS with p99 <= 2x,
is ahead of qemu-fleece (higher IOPS kept), and the backup completes in
about disk-size / target-rate (<= 1.25x).  The verdict line judges the best
of those rows.

Runs alternate the order of the environments (a shared, noisy machine).
Output: a table of mean ± stdev per environment, JSON with --json.

Python 3 standard library only.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon, QMPError  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30

# name -> (daemon, graph, options): "backup" options go into blockdev-backup's
# x-perf, "fleece" options into the copy-before-write node; "@dir" / "@size"
# stand for the work dir and the disk size.
ENVS = {
    "qemu": ("qemu", "backup", {}),
    "qemu-fleece": ("qemu", "fleece", {}),
    "vblk": ("vblk", "backup", {}),
    "vblk-buf64M": ("vblk", "backup", {"cow-buffer-size": 64 * MiB}),
    "vblk-buf256M": ("vblk", "backup", {"cow-buffer-size": 256 * MiB}),
    "vblk-buf1G": ("vblk", "backup", {"cow-buffer-size": GiB}),
    "vblk-spill": ("vblk", "backup", {"cow-buffer-size": 256 * MiB, "cow-spill-dir": "@dir",
                                      "cow-spill-size": "@size"}),
    "vblk-spill-cached": ("vblk", "backup", {"cow-buffer-size": 256 * MiB, "cow-spill-dir": "@dir",
                                             "cow-spill-size": "@size", "cow-spill-direct": False}),
    "qemu-fleece-cached": ("qemu", "fleece", {"@fleece-direct": False}),
    "vblk-fleece": ("vblk", "fleece", {}),
    "vblk-fleece-buf1G": ("vblk", "fleece", {"x-cow-buffer-size": GiB}),
}
BAR_ENVS = ("vblk-buf1G", "vblk-spill", "vblk-spill-cached", "vblk-fleece-buf1G")
BAR_KEPT_PCT, BAR_P99_X, BAR_COMPLETION_X = 90.0, 2.0, 1.25
# What a daemon says about an option or driver it does not know (QEMU's
# wording, which vblk follows).
UNKNOWN_RE = re.compile(r"is unexpected|does not accept value|Invalid parameter|unknown (option|parameter|driver)",
                        re.I)
COW_KEYS = ("size", "used", "used-peak", "spill-size", "spilled", "spilled-peak", "sync-copies")
POLL_SECONDS = 0.5


class Unsupported(Exception):
    """The daemon does not know an option or driver this environment needs."""


class Failed(Exception):
    """This environment's run failed (a QMP error other than Unsupported, fio)."""


def fio_start(sock, runtime, iodepth, outdir):
    argv = ["fio", "--output-format=json", "--name=guest", "--rw=randwrite", "--bs=32k",
            f"--iodepth={iodepth}", "--time_based", f"--runtime={runtime}", "--norandommap",
            "--randrepeat=0", "--ioengine=nbd", f"--uri=nbd+unix:///disk?socket={sock}"]
    out = open(os.path.join(outdir, "fio.json"), "w+")
    err = open(os.path.join(outdir, "fio.err"), "w+")
    return subprocess.Popen(argv, stdout=out, stderr=err, text=True), out, err


def fio_result(proc, out, err, runtime):
    """(write IOPS, mean ms, p99 ms) of a finished fio guest."""
    try:
        rc = proc.wait(runtime * 10 + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    out.seek(0)
    err.seek(0)
    text, etext = out.read(), err.read()
    out.close()
    err.close()
    if rc != 0:
        raise Failed(f"fio failed ({rc}): {etext[-1500:]}")
    w = json.loads(text[text.index("{"):])["jobs"][0]["write"]
    clat = w["clat_ns"]
    return w["iops"], clat.get("mean", 0) / 1e6, clat.get("percentile", {}).get("99.000000", 0) / 1e6


def fio_guest(sock, runtime, iodepth, outdir):
    """The guest alone: (write IOPS, mean ms, p99 ms)."""
    return fio_result(*fio_start(sock, runtime, iodepth, outdir), runtime)


def daemon_args(workdir, src, dst, rate):
    return ["--object", f"throttle-group,id=slow,x-bps-total={rate}",
            "--blockdev", json.dumps({"driver": "file", "node-name": "disk", "filename": src,
                                      "cache": {"direct": True}, "aio": "native"}),
            "--blockdev", json.dumps({"driver": "throttle", "node-name": "target", "throttle-group": "slow",
                                      "file": {"driver": "file", "filename": dst}}),
            "--nbd-server", f"addr.type=unix,addr.path={os.path.join(workdir, 'nbd.sock')}",
            "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]


def vm_hwm_mib(pid):
    """The process's peak RSS (VmHWM) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def qmp_setup(q, name, args):
    """A setup command: Unsupported if the daemon does not know an option or
    driver in it, Failed on any other error."""
    r = q.cmd(name, args)
    if "return" in r:
        return r["return"]
    desc = r.get("error", {}).get("desc", str(r))
    if UNKNOWN_RE.search(desc):
        raise Unsupported(f"{name}: {desc}")
    raise Failed(f"{name}: {desc}")


def resolve_opts(opts, workdir, size):
    return {k: (workdir if v == "@dir" else size if v == "@size" else v) for k, v in opts.items()}


def start_fleece(q, workdir, size, cbw_opts):
    cbw_opts = dict(cbw_opts)
    direct = cbw_opts.pop("@fleece-direct", True)
    """Proxmox's fleecing graph over "disk"; the guest export moves onto fl-cbw."""
    fl = os.path.join(workdir, "fleece.raw")
    bi.rm(fl)
    with open(fl, "wb") as f:
        f.truncate(size)
    qmp_setup(q, "block-export-del", {"id": "e0"})
    q.event("BLOCK_EXPORT_DELETED", 60)
    qmp_setup(q, "blockdev-add", {"driver": "file", "node-name": "fleece", "filename": fl,
                                  "cache": {"direct": direct}, "aio": "native" if direct else "threads"})
    qmp_setup(q, "blockdev-add", dict({"driver": "copy-before-write", "node-name": "fl-cbw", "file": "disk",
                                       "target": "fleece", "on-cbw-error": "break-snapshot", "cbw-timeout": 45},
                                      **cbw_opts))
    qmp_setup(q, "blockdev-add", {"driver": "snapshot-access", "node-name": "fl-access", "file": "fl-cbw"})
    qmp_setup(q, "block-export-add", {"type": "nbd", "id": "e0", "node-name": "fl-cbw", "name": "disk",
                                      "writable": True})
    return "fl-access"


class JobWatch:
    """Polls query-block-jobs (and, for a buffered fleecing node, the node's
    x-cow-buffer in query-named-block-nodes) and waits for the job's end."""

    def __init__(self, q, job, cow_node=None):
        self.q, self.job, self.cow_node = q, job, cow_node
        self.t0 = time.monotonic()
        self.end = None  # (event name, seconds since start)
        self.cow = None  # the last x-cow-buffer seen, with peaks kept
        self.offset = 0
        self.length = 0
        self.error = None

    def _cow(self, stats):
        if not isinstance(stats, dict):
            return
        if self.cow is None:
            self.cow = {}
        for k in COW_KEYS:
            if k in stats:
                self.cow[k] = max(self.cow.get(k, 0), stats[k]) if ("peak" in k or k == "sync-copies") else stats[k]

    def poll(self):
        if self.end:
            return
        for j in self.q.ok("query-block-jobs"):
            if j.get("device") == self.job:
                self.offset, self.length = j.get("offset", 0), j.get("len", 0)
                self._cow(j.get("x-cow-buffer"))
        if self.cow_node:
            for n in self.q.ok("query-named-block-nodes", {"flat": True}):
                if n.get("node-name") == self.cow_node:
                    self._cow(n.get("x-cow-buffer"))
        self._events(0)

    def _events(self, wait):
        """Takes the queued events, then those arriving within `wait` s."""
        deadline = time.monotonic() + wait
        while True:
            while self.q.events:
                e = self.q.events.pop(0)
                if e["event"] in ("BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED") and \
                        e.get("data", {}).get("device") == self.job and not self.end:
                    self.end = (e["event"], time.monotonic() - self.t0)
                    self.error = e["data"].get("error")
            if self.end:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            e = self.q._read_event(time.monotonic() + left, "block job events")
            if e is None:
                return
            self.q.events.append(e)

    def wait_while(self, proc):
        """Polls until `proc` exits."""
        while proc.poll() is None:
            self.poll()
            if self.end:
                time.sleep(POLL_SECONDS)
            else:
                self._events(POLL_SECONDS)

    def wait_end(self, timeout):
        deadline = time.monotonic() + timeout
        while not self.end:
            if time.monotonic() > deadline:
                raise Failed(f"backup did not end within {timeout:.0f} s")
            self.poll()
            self._events(POLL_SECONDS)


def measure(env, argv0, workdir, src, args):
    """One run of one environment: a dict of what was measured."""
    daemon, graph, opts = ENVS[env]
    opts = resolve_opts(opts, workdir, args.size)
    dst = os.path.join(args.target_dir or workdir, "vblk-bench-guest-dst.raw")
    bi.rm(dst)
    with open(dst, "wb") as f:
        f.truncate(args.size)
    sock = os.path.join(workdir, "nbd.sock")
    d = None
    try:
        d = Daemon(list(argv0) + daemon_args(workdir, src, dst, args.target_rate),
                   os.path.join(workdir, "qmp.sock"), os.path.join(workdir, "daemon.log"))
        q = d.qmp
        idle = fio_guest(sock, args.runtime, args.iodepth, workdir)
        idle_rss = vm_hwm_mib(d.proc.pid)
        t_setup = time.monotonic()
        backup = {"job-id": "b0", "device": "disk", "target": "target", "sync": "full"}
        cow_node = None
        if graph == "fleece":
            backup["device"] = start_fleece(q, workdir, args.size, opts)
            cow_node = "fl-cbw" if opts else None
        elif opts:
            backup["x-perf"] = opts
        setup_s = time.monotonic() - t_setup
        watch = JobWatch(q, "b0", cow_node)
        qmp_setup(q, "blockdev-backup", backup)
        watch.t0 = time.monotonic()
        proc_files = fio_start(sock, args.runtime, args.iodepth, workdir)
        watch.wait_while(proc_files[0])
        busy = fio_result(*proc_files, args.runtime)
        watch.poll()
        outlasted = not watch.end
        if watch.end:
            pass
        elif args.no_wait_completion:
            q.ok("block-job-cancel", {"device": "b0", "force": True})
            watch.wait_end(600)
        else:
            watch.wait_end(max(600.0, 5 * args.size / args.target_rate))
        peak_rss = vm_hwm_mib(d.proc.pid)
        if watch.end[0] == "BLOCK_JOB_COMPLETED" and watch.error:
            raise Failed(f"backup failed: {watch.error}")
        completed = watch.end[0] == "BLOCK_JOB_COMPLETED"
        d.quit(600)
        d = None
        return {"idle_iops": idle[0], "idle_mean_ms": idle[1], "idle_p99_ms": idle[2],
                "backup_iops": busy[0], "backup_mean_ms": busy[1], "backup_p99_ms": busy[2],
                "backup_outlasted_phase": outlasted,
                "backup_seconds": watch.end[1] if completed else None,
                "backup_cancelled": not completed,
                "setup_seconds": setup_s, "idle_rss_mib": idle_rss, "peak_rss_mib": peak_rss,
                "cow_buffer": watch.cow}
    except QMPError as e:
        raise Failed(f"QMP: {e}; daemon log: {d.log_tail(500) if d else ''}") from None
    finally:
        if d is not None:
            d.kill()
        bi.rm(dst)  # 2 GiB of memory when it is in /dev/shm


def ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def pm(v, digits, unit=""):
    return "-" if v is None else bi.fmt_pm(*v, digits) + unit


def summarize(envs, results, args):
    summary = {}
    for e in envs:
        rs = results[e]
        if not rs:
            continue
        cows = [r["cow_buffer"] for r in rs if r.get("cow_buffer")]
        summary[e] = {
            "runs": len(rs),
            "idle_iops": ms([r["idle_iops"] for r in rs]),
            "idle_mean_ms": ms([r["idle_mean_ms"] for r in rs]),
            "idle_p99_ms": ms([r["idle_p99_ms"] for r in rs]),
            "backup_iops": ms([r["backup_iops"] for r in rs]),
            "backup_mean_ms": ms([r["backup_mean_ms"] for r in rs]),
            "backup_p99_ms": ms([r["backup_p99_ms"] for r in rs]),
            "iops_kept_pct": ms([r["backup_iops"] / r["idle_iops"] * 100 for r in rs if r["idle_iops"]]),
            "p99_ratio": ms([r["backup_p99_ms"] / r["idle_p99_ms"] for r in rs if r["idle_p99_ms"]]),
            "backup_seconds": ms([r["backup_seconds"] for r in rs]),
            "outlasted_runs": sum(1 for r in rs if r["backup_outlasted_phase"]),
            "idle_rss_mib": ms([r["idle_rss_mib"] for r in rs]),
            "peak_rss_mib": ms([r["peak_rss_mib"] for r in rs]),
            "cow_used_peak_mib": ms([c.get("used-peak", 0) / MiB for c in cows]) if cows else None,
            "cow_spilled_peak_mib": ms([c.get("spilled-peak", 0) / MiB for c in cows]) if cows else None,
            "cow_sync_copies": ms([c.get("sync-copies", 0) for c in cows]) if cows else None,
        }
    return summary


def row_bar(s):
    """Whether a row's means meet the guest bar (kept and p99 only)."""
    if not s["iops_kept_pct"] or not s["p99_ratio"]:
        return "?"
    return "meets" if s["iops_kept_pct"][0] >= BAR_KEPT_PCT and s["p99_ratio"][0] <= BAR_P99_X else "misses"


def render(envs, results, summary, skipped, failed, args):
    rows = [["environment", "IOPS", "IOPS kept", "mean ms", "p99 ms", "p99 x", "backup s", "peak RSS MiB",
             "COW peak MiB (spill)", "sync copies", "bar"]]
    for daemon in ("qemu", "vblk"):
        idle = [r for e in envs if ENVS[e][0] == daemon for r in results[e]]
        if idle:
            rows.append([f"{daemon}, no backup", pm(ms([r["idle_iops"] for r in idle]), 0), "100 %",
                         pm(ms([r["idle_mean_ms"] for r in idle]), 2), pm(ms([r["idle_p99_ms"] for r in idle]), 2),
                         "1", "-", pm(ms([r["idle_rss_mib"] for r in idle]), 0), "-", "-", ""])
    for e in envs:
        if e in skipped or e in failed:
            rows.append([e, "skipped" if e in skipped else "FAILED"] + ["-"] * 8 + [""])
            continue
        s = summary[e]
        cow = "-"
        if s["cow_used_peak_mib"]:
            cow = pm(s["cow_used_peak_mib"], 0) + f" ({pm(s['cow_spilled_peak_mib'], 0)})"
        secs = pm(s["backup_seconds"], 1)
        if s["outlasted_runs"] < s["runs"]:
            secs += f" (early {s['runs'] - s['outlasted_runs']}/{s['runs']})"
        rows.append([e, pm(s["backup_iops"], 0), pm(s["iops_kept_pct"], 1, " %"), pm(s["backup_mean_ms"], 2),
                     pm(s["backup_p99_ms"], 2), pm(s["p99_ratio"], 1), secs, pm(s["peak_rss_mib"], 0), cow,
                     pm(s["cow_sync_copies"], 0), row_bar(s)])
    notes = [f"{e}: skipped, {why}" for e, why in skipped.items()] + [f"{e}: FAILED, {why}" for e, why in failed.items()]
    return bi.render_table(rows) + "".join("\n  " + n for n in notes)


def verdict(summary, skipped, failed, args, waited):
    """The verdict line for the bar, and a dict of it for the JSON."""
    cands = [e for e in BAR_ENVS if e in summary and summary[e]["iops_kept_pct"]]
    if not cands:
        missing = "; ".join(f"{e}: {skipped.get(e) or failed.get(e) or 'not selected'}" for e in BAR_ENVS)
        return f"bar not judged: no 1 GiB-buffer or spill vblk row measured ({missing})", {"judged": False}
    best = max(cands, key=lambda e: summary[e]["iops_kept_pct"][0])
    s = summary[best]
    kept, px = s["iops_kept_pct"][0], s["p99_ratio"][0] if s["p99_ratio"] else float("inf")
    ideal = args.size / args.target_rate
    checks = {"kept": kept >= BAR_KEPT_PCT, "p99": px <= BAR_P99_X}
    parts = [f"keeps {kept:.1f} % (>= {BAR_KEPT_PCT:.0f} %; {s['backup_iops'][0]:.0f} IOPS)",
             f"p99 {px:.1f}x (<= {BAR_P99_X:.0f}x; {s['backup_p99_ms'][0]:.2f} ms)"]
    # QEMU at its best: the fleecing row (direct or cached) that kept more.
    qfs = [e for e in ("qemu-fleece", "qemu-fleece-cached") if e in summary and summary[e]["iops_kept_pct"]]
    qbest = max(qfs, key=lambda e: summary[e]["iops_kept_pct"][0]) if qfs else None
    qf = summary.get(qbest) if qbest else None
    if qf and qf["iops_kept_pct"]:
        # Ahead = more of its own no-backup IOPS kept (the daemons' idle
        # rates differ); the absolute numbers are printed beside it.
        checks["ahead_of_qemu_fleece"] = kept > qf["iops_kept_pct"][0]
        parts.append(f"{qbest} keeps {qf['iops_kept_pct'][0]:.1f} % ({qf['backup_iops'][0]:.0f} IOPS)"
                     + (f" with p99 {qf['p99_ratio'][0]:.1f}x ({qf['backup_p99_ms'][0]:.2f} ms)"
                        if qf["p99_ratio"] else ""))
    else:
        parts.append("qemu-fleece not measured")
    if waited and s["backup_seconds"]:
        secs = s["backup_seconds"][0]
        checks["completion"] = secs <= BAR_COMPLETION_X * ideal
        parts.append(f"backup {secs:.1f} s for ideal {ideal:.1f} s (<= {BAR_COMPLETION_X}x)")
    else:
        parts.append("completion not measured")
    met = all(checks.values())
    line = (f"bar ({best}, best of {', '.join(cands)}): {'MEETS' if met else 'MISSES'} -- " + "; ".join(parts)
            + ("" if met else f"; failed: {', '.join(k for k, v in checks.items() if not v)}"))
    return line, {"judged": True, "env": best, "met": met, "checks": checks}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("2G"))
    ap.add_argument("--runtime", type=int, default=10, help="seconds per phase")
    ap.add_argument("--iodepth", type=int, default=8)
    ap.add_argument("--target-rate", type=int, default=50 * 1000 * 1000, help="target bytes/s")
    ap.add_argument("--envs", default=",".join(ENVS), help="comma-separated, of: " + ", ".join(ENVS))
    ap.add_argument("--no-wait-completion", action="store_true",
                    help="cancel the backup after the phase instead of timing it to completion")
    ap.add_argument("--dir")
    ap.add_argument("--target-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the target file lives (default /dev/shm: a backup server is another machine, so "
                         "the target's writes do not take the guest disk's bandwidth; the throttle makes it slow)")
    ap.add_argument("--json")
    args = ap.parse_args()
    envs = [e for e in args.envs.split(",") if e]
    bad = [e for e in envs if e not in ENVS]
    if bad:
        ap.error(f"unknown environment(s) {', '.join(bad)}; known: {', '.join(ENVS)}")
    vblk = bi.resolve_tool(args.vblk, "vblk")
    qsd = shutil.which("qemu-storage-daemon")
    if not qsd and any(ENVS[e][0] == "qemu" for e in envs):
        raise SystemExit("qemu-storage-daemon not found in PATH")
    argv0 = {"qemu": [qsd], "vblk": [vblk, "serve"]}
    own_dir = not args.dir
    workdir = tempfile.mkdtemp(prefix="vblk-bench-guest-", dir="/var/tmp") if own_dir else os.path.abspath(args.dir)
    meta = bi.run_meta(vblk, {"qsd_version": [qsd or "true", "--version"], "fio_version": ["fio", "--version"]},
                       image_fs=bi.fs_of(workdir), image_size=args.size, runs=args.runs, runtime=args.runtime,
                       iodepth=args.iodepth, target_rate=args.target_rate, envs=envs,
                       wait_completion=not args.no_wait_completion)
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']}; {meta['qsd_version']}; {meta['fio_version']}")
    print(f"# guest:    fio randwrite 32k iodepth {args.iodepth} over NBD, {args.runtime} s per phase; "
          f"source {bi.human_size(args.size)} random data on {meta['image_fs']}; target {args.target_rate / 1e6:.0f} MB/s"
          f" in {args.target_dir or 'the work dir'}"
          f" (ideal backup {args.size / args.target_rate:.1f} s"
          f"{', cancelled after the phase' if args.no_wait_completion else ', run to completion'})")
    print(f"# load:     {meta['loadavg_start']} at start", flush=True)
    results = {e: [] for e in envs}
    skipped, failed = {}, {}
    t_start = time.monotonic()
    try:
        src = os.path.join(workdir, "src.raw")
        bi.make_image(src, args.size)
        for run in range(args.runs):
            order = envs if run % 2 == 0 else envs[::-1]
            for e in order:
                if e in skipped:
                    continue
                try:
                    r = measure(e, argv0[ENVS[e][0]], workdir, src, args)
                except Unsupported as x:
                    skipped[e] = str(x)
                    print(f"  run {run + 1} {e:17s}: skipped, {x}", file=sys.stderr, flush=True)
                    continue
                except Failed as x:
                    failed.setdefault(e, str(x))
                    print(f"  run {run + 1} {e:17s}: FAILED, {x}", file=sys.stderr, flush=True)
                    continue
                results[e].append(r)
                cow = r["cow_buffer"]
                print(f"  run {run + 1} {e:17s}: idle {r['idle_iops']:7.0f} IOPS p99 {r['idle_p99_ms']:7.2f} ms | "
                      f"backup {r['backup_iops']:7.0f} IOPS p99 {r['backup_p99_ms']:8.2f} ms | "
                      + (f"done in {r['backup_seconds']:.1f} s" if r["backup_seconds"] is not None else "cancelled")
                      + f"{'' if r['backup_outlasted_phase'] else ' (finished within the phase)'} | "
                      f"RSS {r['idle_rss_mib']:.0f}/{r['peak_rss_mib']:.0f} MiB"
                      + (f" | cow {json.dumps(cow)}" if cow else ""), file=sys.stderr, flush=True)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)

    summary = summarize(envs, results, args)
    print()
    print(render(envs, results, summary, skipped, failed, args))
    print("\nIOPS / mean / p99: the guest during the backup phase (no-backup rows: the idle phases); IOPS kept and "
          "p99 x against the same daemon's idle phase of the same run; backup s: blockdev-backup to "
          "BLOCK_JOB_COMPLETED; peak RSS: the daemon's VmHWM; COW peak: vblk's x-cow-buffer used-peak (spilled-peak); "
          f"bar: >= {BAR_KEPT_PCT:.0f} % kept and p99 <= {BAR_P99_X:.0f}x.")
    meta["elapsed_seconds"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = bi.loadavg()
    line, v = verdict(summary, skipped, failed, args, not args.no_wait_completion)
    print(f"\n{line}")
    print(f"# total wall time {meta['elapsed_seconds']:.0f} s; load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, {"runs": results, "summary": summary, "skipped": skipped, "failed": failed,
                                    "verdict": v})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
