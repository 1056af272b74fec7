#!/usr/bin/env python3
"""Backup benchmark: `vblk serve` blockdev-backup against qemu-storage-daemon's
blockdev-backup and blockdev-mirror, driven through QMP by the same client.

It rebuilds the table of QEMU's "backup performance: block_status + async"
series (v3, 2020): full copies of a fully written image by a block job,
in seconds, mean ± stdev, and every column in % against every other column.

Cases (source -> target; images of --size, default 1 GiB, every byte 0xff as
in QEMU's bench, so block-status reports one data extent and every cluster
is copied):
  raw-raw       raw file -> raw file
  qcow2-qcow2   qcow2 (qemu-img convert of the raw) -> qcow2
  raw-nbd       raw file -> NBD: qemu-nbd -f raw --cache=none --aio=native
                -t -k SOCK serving a fresh raw file
  nbd-raw       NBD: qemu-nbd (same options) serving the raw source -> raw
The nodes are what QEMU's bench adds: `file` nodes with cache.direct=true
and aio=native for raw images (no raw format node), a qcow2 node over such a
file node, and an `nbd` node (server type unix) for NBD. Targets are created
before every run: `qemu-img create -f raw|qcow2` of the same virtual size
(QEMU's bench reused targets pre-filled with 0xff; a fresh sparse target
keeps the `qemu-img compare` check meaningful).

Environments (letters are the table's columns):
  A qemu-mirror             qemu-storage-daemon, blockdev-mirror sync=full;
                            block-job-complete on BLOCK_JOB_READY
  B qemu-backup             qemu-storage-daemon, blockdev-backup sync=full
  C qemu-backup-copy-range  ... x-perf {use-copy-range: true}
  D qemu-backup-mw1         ... x-perf {max-workers: 1}
  E vblk-backup             vblk serve, blockdev-backup sync=full
  F vblk-backup-copy-range  ... x-perf {use-copy-range: true}
  G vblk-backup-mw1         ... x-perf {max-workers: 1}
Both daemons get the same command line (`--chardev socket,path=S,server=on,
wait=off,id=m0 --monitor chardev=m0`) and the same QMP commands
(qmp_capabilities, blockdev-add source and target, the job command with
job-id job0, device source, target target, quit).

Timing: one daemon (and qemu-nbd, for the NBD cases) is started per
measurement. The time runs from sending the job command to the arrival of
BLOCK_JOB_COMPLETED (without an error), plus an fsync of the target file
right after it (data a daemon left in the page cache is paid for). Daemon
start, blockdev-add and quit are not timed (quit's time is kept in the JSON).
The source's page cache is dropped (posix_fadvise DONTNEED) before every run.
Environments run interleaved, the order rotating per run. Every target is
checked once (first run) with `qemu-img compare` against the source, qcow2
targets also with `qemu-img check`. An environment that fails (a QMP error, a
job error) is reported with the daemon's message and not run again for that
case.

Output: per case, a table of mean ± stdev, MiB/s, the speed-up of every
environment over qemu-backup (B) and qemu-mirror (A), and the matrix
"% against each other column" (row's mean time over column's, -1, in %:
"-30" means the row needs 30 % less time than the column), then a
QEMU-shaped summary (cases x environments) and the issue's goal line:
vblk-backup >= 1.3x faster than qemu-backup and faster than qemu-mirror on
raw-raw and qcow2-qcow2.

Python 3 standard library only.
"""
import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon, QMPError  # noqa: E402

MIB = 1 << 20
GOAL_CASES = ("raw-raw", "qcow2-qcow2")
GOAL_RATIO = 1.3

# name, daemon, job command, extra job arguments
ENVS = [
    ("qemu-mirror", "qemu", "blockdev-mirror", {}),
    ("qemu-backup", "qemu", "blockdev-backup", {}),
    ("qemu-backup-copy-range", "qemu", "blockdev-backup", {"x-perf": {"use-copy-range": True}}),
    ("qemu-backup-mw1", "qemu", "blockdev-backup", {"x-perf": {"max-workers": 1}}),
    ("vblk-backup", "vblk", "blockdev-backup", {}),
    ("vblk-backup-copy-range", "vblk", "blockdev-backup", {"x-perf": {"use-copy-range": True}}),
    ("vblk-backup-mw1", "vblk", "blockdev-backup", {"x-perf": {"max-workers": 1}}),
]
LETTER = {e[0]: chr(ord("A") + i) for i, e in enumerate(ENVS)}
CASES = ["raw-raw", "qcow2-qcow2", "raw-nbd", "nbd-raw"]





def fill_ff(path, size):
    """A fully written raw image, every byte 0xff (as QEMU's bench made it)."""
    buf = b"\xff" * MIB
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        for off in range(0, size, MIB):
            os.pwrite(fd, buf[:min(MIB, size - off)], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def file_node(path):
    return {"driver": "file", "filename": path, "cache": {"direct": True}, "aio": "native"}


def nbd_node(sock):
    return {"driver": "nbd", "server": {"type": "unix", "path": sock}}


class NbdServer:
    """qemu-nbd serving one raw file on a unix socket for one measurement."""

    def __init__(self, path, sock, log):
        bi.rm(sock)
        self.argv = ["qemu-nbd", "-f", "raw", "--cache=none", "--aio=native", "-t", "-k", sock, path]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        end = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"qemu-nbd exited with status {self.proc.returncode}: {shlex.join(self.argv)}")
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(sock)
                break  # -t: a probe connection does not end the server
            except OSError:
                if time.monotonic() > end:
                    self.stop()
                    raise SystemExit(f"qemu-nbd did not listen on {sock}")
                time.sleep(0.02)
            finally:
                s.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure(env, case, files, daemon_argv0, qemu_img, size, workdir, timeout):
    """One timed job. Returns (seconds, quit seconds, target file)."""
    name, kind, command, extra = env
    W = lambda n: os.path.join(workdir, n)  # noqa: E731
    src_file = files["qcow2"] if case == "qcow2-qcow2" else files["raw"]
    fmt = "qcow2" if case == "qcow2-qcow2" else "raw"
    dst_file = W("dst." + fmt)
    bi.rm(dst_file)
    subprocess.run([qemu_img, "create", "-q", "-f", fmt, dst_file, str(size)], check=True)
    bi.fsync_path(dst_file)
    bi.drop_cache(src_file)
    nbd = None
    if case == "raw-nbd":
        nbd = NbdServer(dst_file, W("nbd.sock"), W("qemu-nbd.log"))
    elif case == "nbd-raw":
        nbd = NbdServer(src_file, W("nbd.sock"), W("qemu-nbd.log"))
    if case == "qcow2-qcow2":
        source = {"driver": "qcow2", "file": file_node(src_file)}
        target = {"driver": "qcow2", "file": file_node(dst_file)}
    else:
        source = nbd_node(W("nbd.sock")) if case == "nbd-raw" else file_node(src_file)
        target = nbd_node(W("nbd.sock")) if case == "raw-nbd" else file_node(dst_file)
    source["node-name"], target["node-name"] = "source", "target"
    args = {"job-id": "job0", "device": "source", "target": "target", "sync": "full"}
    args.update(extra)
    d = None
    try:
        d = Daemon(daemon_argv0, W("qmp.sock"), W(kind + "-daemon.log"))
        try:
            d.qmp.ok("blockdev-add", source)
            d.qmp.ok("blockdev-add", target)
            t0 = time.monotonic()
            d.qmp.ok(command, args)
            while True:
                ev, t_ev = d.qmp.next_event({"BLOCK_JOB_READY", "BLOCK_JOB_COMPLETED"}, timeout)
                if ev["event"] == "BLOCK_JOB_READY":
                    d.qmp.ok("block-job-complete", {"device": "job0"})
                    continue
                break
            data = ev.get("data", {})
            if "error" in data:
                raise QMPError(f"job ended with error: {data['error']}")
            if data.get("offset") != data.get("len"):
                raise QMPError(f"job ended at offset {data.get('offset')} of {data.get('len')}")
            t1 = time.monotonic()
            bi.fsync_path(dst_file)
            t = (t_ev - t0) + (time.monotonic() - t1)
        except (QMPError, OSError) as e:
            tail = d.log_tail()
            raise QMPError(f"{e}" + (f"\n    daemon stderr: {tail}" if tail else ""))
        tq = d.quit(timeout)
        d = None
        if nbd:
            nbd.stop()
        return t, tq, dst_file, fmt, src_file
    finally:
        if d is not None:
            d.kill()
        if nbd:
            nbd.stop()


def verify(qemu_img, fmt, src, dst):
    """qemu-img compare (and check for qcow2); returns (ok, message)."""
    p = subprocess.run([qemu_img, "compare", "-q", "-f", fmt, "-F", fmt, src, dst],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        return False, f"qemu-img compare: exit {p.returncode} {p.stdout.strip()}"
    if fmt == "qcow2":
        p = subprocess.run([qemu_img, "check", "-q", dst], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        if p.returncode != 0:
            return False, f"qemu-img check: exit {p.returncode} {p.stdout.strip()}"
    return True, ""


def pct(a, b):
    v = (a / b - 1) * 100
    return f"{v:+.0f}"


def report(res):
    t = res["seconds"]
    mean = {e: statistics.fmean(v) for e, v in t.items() if v}
    res["mean"] = mean
    envs = list(t)
    head = ["environment", "time (s)", "MiB/s", "x B", "x A", "ok"] + [LETTER[e] for e in envs]
    rows = [head]
    for e in envs:
        label = f"{LETTER[e]} {e}"
        if e not in mean:
            rows.append([label, "FAILED", "", "", "", "NO"] + [""] * len(envs))
            continue
        m, sd = bi.mean_sd(t[e])
        xb = f"{mean['qemu-backup'] / m:.2f}" if "qemu-backup" in mean else ""
        xa = f"{mean['qemu-mirror'] / m:.2f}" if "qemu-mirror" in mean else ""
        ok = res["verified"].get(e)
        ok = "" if ok is None else ("yes" if ok else "NO")
        cells = ["" if o == e or o not in mean else pct(m, mean[o]) for o in envs]
        rows.append([label, bi.fmt_pm(m, sd, 3), f"{res['bytes'] / MIB / m:.0f}", xb, xa, ok] + cells)
    print(f"\n## {res['case']} ({bi.human_size(res['bytes'])}; x B, x A: speed-up over qemu-backup, "
          f"qemu-mirror; letter columns: % of time against that column)")
    print(bi.render_table(rows))
    for e, msg in res["errors"].items():
        print(f"{LETTER[e]} {e} FAILED: {msg}")
    print(f"# load {bi.loadavg()} after this case", flush=True)


def summary(results, envs):
    """QEMU's table: cases x environments, mean ± relative stdev."""
    rows = [["case"] + [f"{LETTER[e]} {e}" for e in envs]]
    for res in results:
        row = [res["case"]]
        for e in envs:
            v = res["seconds"].get(e)
            if not v:
                row.append("FAILED" if e in res["errors"] else "")
                continue
            m, sd = bi.mean_sd(v)
            row.append(f"{m:.2f} ± {100 * sd / m:.0f}%")
        rows.append(row)
    print("\n## summary (seconds, mean ± relative stdev)")
    print(bi.render_table(rows))


def goal(results):
    """The issue's goal line; returns (text, met or None when not measured)."""
    parts, met = [], True
    by = {r["case"]: r.get("mean", {}) for r in results}
    for c in GOAL_CASES:
        m = by.get(c, {})
        if not all(e in m for e in ("vblk-backup", "qemu-backup", "qemu-mirror")):
            return f"goal not measured (needs cases {', '.join(GOAL_CASES)} with vblk-backup, qemu-backup, " \
                   f"qemu-mirror)", None
        xb, xa = m["qemu-backup"] / m["vblk-backup"], m["qemu-mirror"] / m["vblk-backup"]
        ok = xb >= GOAL_RATIO and xa > 1.0
        met = met and ok
        parts.append(f"{c}: {xb:.2f}x qemu-backup, {xa:.2f}x qemu-mirror {'(ok)' if ok else '(MISSED)'}")
    verdict = "MET" if met else "NOT MET"
    return (f"goal (vblk-backup >= {GOAL_RATIO}x faster than qemu-backup and faster than qemu-mirror on "
            f"{' and '.join(GOAL_CASES)}): {verdict}; " + "; ".join(parts)), met


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--qsd", default="qemu-storage-daemon", help="qemu-storage-daemon binary")
    ap.add_argument("--qemu-img", default="qemu-img")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("1G"), help="image size (default 1G)")
    ap.add_argument("--only", default=None, metavar="REGEX", help="cases matching REGEX")
    ap.add_argument("--envs", default=None, metavar="REGEX", help="environments matching REGEX")
    ap.add_argument("--dir", default=None, help="image directory (default: temp dir under /var/tmp)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--no-verify", action="store_true", help="skip qemu-img compare/check of the targets")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a job may take")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if args.size <= 0 or args.size % MIB:
        ap.error("--size must be a positive multiple of 1 MiB")
    vblk = bi.resolve_tool(args.vblk, "vblk")
    qsd = bi.resolve_tool(args.qsd, "qemu-storage-daemon")
    qemu_img = bi.resolve_tool(args.qemu_img, "qemu-img")
    bi.resolve_tool("qemu-nbd", "qemu-nbd")
    envs = [e for e in ENVS if not args.envs or re.search(args.envs, e[0])]
    cases = [c for c in CASES if not args.only or re.search(args.only, c)]
    if not envs:
        ap.error(f"--envs {args.envs!r} matches no environment")
    if not cases:
        ap.error(f"--only {args.only!r} matches no case")
    argv0 = {"qemu": [qsd], "vblk": [vblk, "serve"]}

    own_dir = not args.dir
    workdir = tempfile.mkdtemp(prefix="vblk-bench-backup-", dir="/var/tmp") if own_dir else os.path.abspath(args.dir)
    os.makedirs(workdir, exist_ok=True)
    files = {"raw": os.path.join(workdir, "src.raw"), "qcow2": os.path.join(workdir, "src.qcow2")}
    meta = bi.run_meta(vblk, {"qsd_version": [qsd, "--version"], "qemu_nbd_version": ["qemu-nbd", "--version"],
                              "qemu_img_version": [qemu_img, "--version"]},
                       image_fs=bi.fs_of(workdir), image_size=args.size, runs=args.runs,
                       environments={e[0]: {"letter": LETTER[e[0]], "daemon": e[1], "command": e[2],
                                            "arguments": e[3]} for e in envs})
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']} ({meta['vblk']} serve); {meta['qsd_version']}; "
          f"{meta['qemu_nbd_version']}; {meta['qemu_img_version']}")
    print(f"# images:   {bi.human_size(args.size)}, every byte 0xff, on {meta['image_fs']}; nodes: file "
          f"cache.direct=true aio=native (qcow2 over it), nbd over a unix socket to qemu-nbd -f raw "
          f"--cache=none --aio=native")
    print(f"# load:     {meta['loadavg_start']} (1/5/15 min) at start")
    print(f"# runs:     {args.runs} per case and environment, interleaved, order rotating; time = job command "
          f"to BLOCK_JOB_COMPLETED + fsync(target), source page cache dropped before each run", flush=True)

    t_start = time.monotonic()
    results = []
    try:
        print("creating images ...", file=sys.stderr, flush=True)
        fill_ff(files["raw"], args.size)
        if "qcow2-qcow2" in cases:
            subprocess.run([qemu_img, "convert", "-f", "raw", "-O", "qcow2", files["raw"], files["qcow2"]],
                           check=True)
            bi.fsync_path(files["qcow2"])
        for case in cases:
            names = [e[0] for e in envs]
            res = {"case": case, "bytes": args.size, "seconds": {n: [] for n in names},
                   "quit_seconds": {n: [] for n in names}, "verified": {}, "errors": {}}
            for r in range(args.runs):
                k = r % len(envs)
                for env in envs[k:] + envs[:k]:
                    name = env[0]
                    if name in res["errors"]:
                        continue
                    try:
                        t, tq, dst, fmt, src = measure(env, case, files, argv0[env[1]], qemu_img, args.size,
                                                       workdir, args.timeout)
                    except QMPError as e:
                        res["errors"][name] = str(e)
                        print(f"run {r + 1}/{args.runs} {case:<12} {name:<23} FAILED: {e}", file=sys.stderr,
                              flush=True)
                        continue
                    res["seconds"][name].append(t)
                    res["quit_seconds"][name].append(tq)
                    if r == 0 and not args.no_verify:
                        ok, msg = verify(qemu_img, fmt, src, dst)
                        res["verified"][name] = ok
                        if not ok:
                            print(f"WARNING: {name} {case}: {msg}", file=sys.stderr)
                    print(f"run {r + 1}/{args.runs} {case:<12} {name:<23} {t:7.3f} s  (quit {tq:.3f} s)",
                          file=sys.stderr, flush=True)
            for n in ("dst.raw", "dst.qcow2"):
                bi.rm(os.path.join(workdir, n))
            results.append(res)
            report(res)
            bi.write_json(args.json, meta, results)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["elapsed_seconds"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = bi.loadavg()
    if bi.sha256_of(vblk) != meta["vblk_sha256"]:
        print(f"WARNING: {vblk} changed during the benchmark; results mix two builds", file=sys.stderr)
        meta["vblk_changed_during_run"] = True

    summary(results, [e[0] for e in envs])
    text, met = goal(results)
    meta["goal"] = {"text": text, "met": met}
    print()
    print(text)
    failed = [f"{r['case']}/{e}" for r in results for e in r["errors"]]
    bad = [f"{r['case']}/{e}" for r in results for e, ok in r["verified"].items() if not ok]
    if failed:
        print("FAILED: " + ", ".join(failed))
    if bad:
        print("target differs from source: " + ", ".join(bad))
    print(f"# total wall time {meta['elapsed_seconds']:.0f} s; load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, results)
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
