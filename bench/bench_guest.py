#!/usr/bin/env python3
"""Guest impact of a live backup to a slow target: `vblk serve` against
qemu-storage-daemon, the same QMP commands and the same fio guest for both.

What a VM feels while it is backed up: the guest is fio writing 32 KiB
blocks at random offsets (--iodepth, default 8) through the daemon's NBD
export of the source disk (fio's nbd engine); the backup copies the source
to a target that can take only --target-rate bytes per second (default 50 MB/s,
a `throttle` node over a raw file: both daemons model the slow target the
same way). Each guest write to a cluster the backup has not copied yet must
first save the old data (copy-before-write), which is where a backup slows
the guest.

Per environment and run, two phases of --runtime seconds each:
  idle    the guest alone
  backup  blockdev-backup sync=full starts, then the guest runs while it
          copies (--size and --target-rate make the backup outlast the
          phase; it is cancelled afterwards)
and the result is the guest's write IOPS and 99th-percentile completion
latency in each, and their ratios: "iops kept" = backup / idle IOPS (the
SPEC's bar: >= 90 %), "p99 x" = backup / idle p99 latency (bar: <= 2x).

Environments: qemu (qemu-storage-daemon 7.2, stock backup) and vblk (vblk
serve). Both get: --object throttle-group,id=slow,x-bps-total=RATE;
--blockdev file (cache.direct=on, aio=native) for the source and a raw
target file under a throttle node; --nbd-server on a unix socket; --export
of the source, writable. Runs alternate the order of the environments.

Output: a table of mean ± stdev per environment, JSON with --json.

Python 3 standard library only.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon  # noqa: E402


def fio_guest(sock, runtime, iodepth):
    """Write IOPS and p99 completion latency (ms) of the fio guest."""
    argv = ["fio", "--output-format=json", "--name=guest", "--rw=randwrite", "--bs=32k",
            f"--iodepth={iodepth}", "--time_based", f"--runtime={runtime}", "--norandommap",
            "--randrepeat=0", "--ioengine=nbd", f"--uri=nbd+unix:///disk?socket={sock}"]
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=runtime * 10 + 60)
    if p.returncode != 0:
        raise SystemExit(f"fio failed ({p.returncode}): {p.stderr[-1500:]}")
    w = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["write"]
    pct = w["clat_ns"].get("percentile", {})
    p99 = pct.get("99.000000", 0) / 1e6
    return w["iops"], p99


def daemon_args(workdir, src, dst, rate):
    return ["--object", f"throttle-group,id=slow,x-bps-total={rate}",
            "--blockdev", json.dumps({"driver": "file", "node-name": "disk", "filename": src,
                                      "cache": {"direct": True}, "aio": "native"}),
            "--blockdev", json.dumps({"driver": "throttle", "node-name": "target", "throttle-group": "slow",
                                      "file": {"driver": "file", "filename": dst}}),
            "--nbd-server", f"addr.type=unix,addr.path={os.path.join(workdir, 'nbd.sock')}",
            "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]


def measure(argv0, workdir, src, size, args):
    """One run: (idle iops, idle p99, backup iops, backup p99)."""
    dst = os.path.join(workdir, "dst.raw")
    bi.rm(dst)
    with open(dst, "wb") as f:
        f.truncate(size)
    sock = os.path.join(workdir, "nbd.sock")
    d = Daemon(list(argv0) + daemon_args(workdir, src, dst, args.target_rate), os.path.join(workdir, "qmp.sock"),
               os.path.join(workdir, "daemon.log"))
    try:
        idle = fio_guest(sock, args.runtime, args.iodepth)
        d.qmp.ok("blockdev-backup", {"job-id": "b0", "device": "disk", "target": "target", "sync": "full"})
        busy = fio_guest(sock, args.runtime, args.iodepth)
        jobs = d.qmp.ok("query-block-jobs")
        still_running = bool(jobs) and jobs[0].get("offset", 0) < jobs[0].get("len", 0)
        if jobs:
            d.qmp.ok("block-job-cancel", {"device": "b0", "force": True})
            d.qmp.next_event({"BLOCK_JOB_CANCELLED", "BLOCK_JOB_COMPLETED"}, 600)
        d.quit(600)
        d = None
        return idle + busy + (still_running,)
    finally:
        if d is not None:
            d.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("2G"))
    ap.add_argument("--runtime", type=int, default=10, help="seconds per phase")
    ap.add_argument("--iodepth", type=int, default=8)
    ap.add_argument("--target-rate", type=int, default=50 * 1000 * 1000, help="target bytes/s")
    ap.add_argument("--envs", default="qemu,vblk")
    ap.add_argument("--dir")
    ap.add_argument("--json")
    args = ap.parse_args()
    vblk = bi.resolve_tool(args.vblk, "vblk")
    qsd = shutil.which("qemu-storage-daemon")
    envs = [e for e in args.envs.split(",") if e]
    argv0 = {"qemu": [qsd], "vblk": [vblk, "serve"]}
    own_dir = not args.dir
    workdir = tempfile.mkdtemp(prefix="vblk-bench-guest-", dir="/var/tmp") if own_dir else os.path.abspath(args.dir)
    meta = bi.run_meta(vblk, {"qsd_version": [qsd, "--version"], "fio_version": ["fio", "--version"]},
                       image_fs=bi.fs_of(workdir), image_size=args.size, runs=args.runs, runtime=args.runtime,
                       iodepth=args.iodepth, target_rate=args.target_rate)
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']}; {meta['qsd_version']}; {meta['fio_version']}")
    print(f"# guest:    fio randwrite 32k iodepth {args.iodepth} over NBD, {args.runtime} s per phase; "
          f"source {bi.human_size(args.size)} random data on {meta['image_fs']}; target {args.target_rate / 1e6:.0f} MB/s")
    print(f"# load:     {meta['loadavg_start']} at start", flush=True)
    results = {e: [] for e in envs}
    t_start = time.monotonic()
    try:
        src = os.path.join(workdir, "src.raw")
        bi.make_image(src, args.size)
        for run in range(args.runs):
            order = envs if run % 2 == 0 else envs[::-1]
            for e in order:
                r = measure(argv0[e], workdir, src, args.size, args)
                results[e].append(dict(zip(("idle_iops", "idle_p99_ms", "backup_iops", "backup_p99_ms",
                                            "backup_outlasted_phase"), r)))
                print(f"  run {run + 1} {e:5s}: idle {r[0]:8.0f} IOPS p99 {r[1]:7.2f} ms | backup {r[2]:8.0f} IOPS "
                      f"p99 {r[3]:8.2f} ms{'' if r[4] else '  (backup finished early)'}", file=sys.stderr, flush=True)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)

    def ms(xs):
        return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)

    rows = [["environment", "idle IOPS", "backup IOPS", "IOPS kept", "idle p99 ms", "backup p99 ms", "p99 x"]]
    summary = {}
    for e in envs:
        rs = results[e]
        kept = [r["backup_iops"] / r["idle_iops"] * 100 for r in rs]
        px = [r["backup_p99_ms"] / r["idle_p99_ms"] for r in rs if r["idle_p99_ms"]]
        summary[e] = {"iops_kept_pct": ms(kept), "p99_ratio": ms(px)}
        rows.append([e, bi.fmt_pm(*ms([r["idle_iops"] for r in rs]), 0),
                     bi.fmt_pm(*ms([r["backup_iops"] for r in rs]), 0), bi.fmt_pm(*ms(kept), 1) + " %",
                     bi.fmt_pm(*ms([r["idle_p99_ms"] for r in rs]), 2),
                     bi.fmt_pm(*ms([r["backup_p99_ms"] for r in rs]), 2), bi.fmt_pm(*ms(px), 1)])
    print()
    print(bi.render_table(rows))
    meta["elapsed_seconds"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = bi.loadavg()
    if "vblk" in summary:
        kept, px = summary["vblk"]["iops_kept_pct"][0], summary["vblk"]["p99_ratio"][0]
        met = kept >= 90 and px <= 2
        print(f"\nvblk keeps {kept:.1f} % of the guest's IOPS with p99 {px:.1f}x: "
              f"{'meets' if met else 'misses'} the bar (>= 90 %, <= 2x)")
    print(f"# total wall time {meta['elapsed_seconds']:.0f} s; load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, {"runs": results, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
