#!/usr/bin/env python3
"""Mirror benchmark: `vblk serve` blockdev-mirror against qemu-storage-daemon's,
driven through QMP by the same client, side by side in one run.

Cases (a raw source of --size, default 1 GiB, every byte written, so every
cluster is copied; a fresh sparse raw target of the same size):
  idle     blockdev-mirror sync=full (copy-mode background) with no writer:
           seconds to BLOCK_JOB_READY, then block-job-complete to
           BLOCK_JOB_COMPLETED (the "total" column includes the fsync of
           the target file right after it)
  writer   the same under fio writing through an NBD export of the source
           (nbd engine, randwrite 4 KiB, queue depth 16, started 1 s before
           the job), copy-mode write-blocking so the job converges: seconds
           to READY, and fio's write IOPS before the job (baseline) and
           between the job's start and READY (from fio's 100 ms IOPS log);
           fio is stopped at READY, then complete.
Environments (nodes are `file` nodes, no format node; every daemon gets the
same command line and QMP commands):
  qemu-threads         qemu-storage-daemon, aio=threads, page cache
  qemu-io_uring        ... aio=io_uring, page cache
  qemu-native-direct   ... aio=native, cache.direct=true
  qemu-io_uring-direct ... aio=io_uring, cache.direct=true
  vblk-direct          vblk serve, cache.direct=true (io_uring)
  vblk                 vblk serve, page cache
Every target is checked with `qemu-img compare` against the source after
the job (for `writer`, fio stopped before complete, so they must be equal).
The source's page cache is dropped before every run; environments run
interleaved, the order rotating per run. Prints per case a table of mean ±
stdev and names the fastest QEMU configuration; --json writes everything
with the command line (bench_img.run_meta).

Python 3 standard library only (fio and QEMU's tools on PATH).
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon  # noqa: E402

MIB = 1 << 20

ENVS = {
    "qemu-threads": ("qemu", {"aio": "threads"}),
    "qemu-io_uring": ("qemu", {"aio": "io_uring"}),
    "qemu-native-direct": ("qemu", {"aio": "native", "cache": {"direct": True}}),
    "qemu-io_uring-direct": ("qemu", {"aio": "io_uring", "cache": {"direct": True}}),
    "vblk-direct": ("vblk", {"cache": {"direct": True}}),
    "vblk": ("vblk", {}),
}


def make_source(path, size):
    block = os.urandom(MIB)
    with open(path, "wb") as f:
        for i in range(size // MIB):
            f.write(block[i % 997:] + block[:i % 997])  # no two MiB alike
    bi.fsync_path(path)


def fresh_target(path, size):
    bi.rm(path)
    with open(path, "wb") as f:
        f.truncate(size)


def fio_iops_log(prefix):
    """[(ms, iops)] from fio's write IOPS log."""
    out = []
    for name in os.listdir(os.path.dirname(prefix)):
        if name.startswith(os.path.basename(prefix)) and name.endswith(".log") and "iops" in name:
            with open(os.path.join(os.path.dirname(prefix), name)) as f:
                for line in f:
                    p = [x.strip() for x in line.split(",")]
                    if len(p) >= 3 and p[2] == "1":  # direction 1: write
                        out.append((int(p[0]), int(p[1])))
    return sorted(out)


def mean_over(log, t0_ms, t1_ms):
    vals = [v for t, v in log if t0_ms < t <= t1_ms]
    return sum(vals) / len(vals) if vals else 0.0


def one_run(args, env, case, d, src, tgt):
    kind, file_opts = ENVS[env]
    argv0 = [args.qsd] if kind == "qemu" else [args.vblk, "serve"]
    fresh_target(tgt, args.size)
    bi.drop_cache(src)
    dm = Daemon(argv0, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
    q = dm.qmp
    res = {"env": env, "case": case}
    fio = None
    try:
        for name, path in (("src", src), ("tgt", tgt)):
            q.ok("blockdev-add", dict({"driver": "file", "node-name": name, "filename": path}, **file_opts))
        job = {"job-id": "j", "device": "src", "target": "tgt", "sync": "full"}
        if case == "writer":
            sock = os.path.join(d, "nbd.sock")
            q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "src", "name": "src",
                                      "writable": True})
            prefix = os.path.join(d, "fio-%s" % env)
            for n in os.listdir(d):
                if n.startswith("fio-"):
                    os.unlink(os.path.join(d, n))
            fio = subprocess.Popen([args.fio, "--name=w", "--ioengine=nbd", "--uri=nbd+unix:///src?socket=" + sock,
                                    "--rw=randwrite", "--bs=4k", "--iodepth=16", "--time_based", "--runtime=600",
                                    "--write_iops_log=" + prefix, "--log_avg_msec=100", "--output-format=json"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d)
            t_fio = time.monotonic()
            time.sleep(1.0)
            job["copy-mode"] = "write-blocking"
        t0 = time.monotonic()
        q.ok("blockdev-mirror", job)
        q.event("BLOCK_JOB_READY", args.timeout)
        t_ready = time.monotonic()
        if fio:
            fio.send_signal(signal.SIGINT)
            out, err = fio.communicate(timeout=60)
            fio = None
            log = fio_iops_log(prefix)
            res["iops_before"] = mean_over(log, 0, (t0 - t_fio) * 1000)
            res["iops_during"] = mean_over(log, (t0 - t_fio) * 1000 + 100, (t_ready - t_fio) * 1000)
        t1 = time.monotonic()
        q.ok("block-job-complete", device="j")
        e = q.event("BLOCK_JOB_COMPLETED", args.timeout)
        if "error" in e["data"]:
            raise RuntimeError("job failed: " + e["data"]["error"])
        bi.fsync_path(tgt)
        t_done = time.monotonic()
        res["ready_s"] = t_ready - t0
        res["complete_s"] = t_done - t1
        res["total_s"] = (t_ready - t0) + (t_done - t1)
    finally:
        if fio:
            fio.kill()
            fio.wait()
        dm.quit()
    r = subprocess.run([args.qemu_img, "compare", "-f", "raw", "-F", "raw", src, tgt], capture_output=True, text=True)
    res["identical"] = r.returncode == 0
    if r.returncode != 0:
        raise RuntimeError("%s %s: target differs: %s" % (env, case, r.stdout + r.stderr))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--qsd", default="qemu-storage-daemon")
    ap.add_argument("--qemu-img", default="qemu-img")
    ap.add_argument("--fio", default="fio")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("1G"))
    ap.add_argument("--cases", default="idle,writer")
    ap.add_argument("--envs", default=",".join(ENVS))
    ap.add_argument("--dir", default=None, help="image directory (default: temp dir under /var/tmp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    args.vblk = bi.resolve_tool(args.vblk, "vblk")
    args.qsd = bi.resolve_tool(args.qsd, "qemu-storage-daemon")
    args.fio = bi.resolve_tool(args.fio, "fio")
    envs = args.envs.split(",")
    cases = args.cases.split(",")
    d = args.dir or tempfile.mkdtemp(prefix="bench_mirror.", dir="/var/tmp")
    os.makedirs(d, exist_ok=True)
    src, tgt = os.path.join(d, "src.raw"), os.path.join(d, "tgt.raw")
    meta = bi.run_meta(args.vblk, {"qemu": [args.qsd, "--version"], "fio": [args.fio, "--version"]},
                       size=args.size, runs=args.runs, dir=d)
    print("# bench_mirror: %s, %d run(s), %s" % (bi.human_size(args.size), args.runs, meta["command"]))
    make_source(src, args.size)
    results = []
    try:
        for case in cases:
            rows = {e: [] for e in envs}
            for run in range(args.runs):
                order = envs[run % len(envs):] + envs[:run % len(envs)]
                for env in order:
                    r = one_run(args, env, case, d, src, tgt)
                    rows[env].append(r)
                    results.append(r)
            table = [["env", "ready s", "complete s", "total s", "MiB/s"]
                     + (["IOPS before", "IOPS during"] if case == "writer" else [])]
            for env in envs:
                rs = rows[env]
                cell = lambda k, dg=2: bi.fmt_pm(*bi.mean_sd([r[k] for r in rs]), dg)  # noqa: E731
                mibs = args.size / MIB / (sum(r["ready_s"] for r in rs) / len(rs))
                line = [env, cell("ready_s"), cell("complete_s", 3), cell("total_s"), "%.0f" % mibs]
                if case == "writer":
                    line += [cell("iops_before", 0), cell("iops_during", 0)]
                table.append(line)
            print("\n## %s (seconds, mean ± stdev)" % case)
            print(bi.render_table(table))
            mean = {e: sum(r["total_s"] for r in rows[e]) / len(rows[e]) for e in envs}
            qemu = [e for e in envs if e.startswith("qemu")]
            if qemu:
                best = min(qemu, key=lambda e: mean[e])
                print("fastest QEMU configuration: %s (%.2f s)" % (best, mean[best]))
                for e in envs:
                    if e.startswith("vblk"):
                        print("%s: %.2fx the fastest QEMU" % (e, mean[best] / mean[e]))
    finally:
        bi.rm(src)
        bi.rm(tgt)
        if not args.dir:
            shutil.rmtree(d, ignore_errors=True)
    meta["loadavg_end"] = bi.loadavg()
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
