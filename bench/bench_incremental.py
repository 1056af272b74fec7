#!/usr/bin/env python3
"""Incremental backup and chain restore: `vblk serve` against
qemu-storage-daemon (the same QMP from the same client), `vblk convert`
against `qemu-img convert`, side by side in one run.

incremental (per --dirty percentage, default 1 and 10):
  a fresh qcow2 source of --size (default 4 GiB, 64 KiB clusters) is opened
  by the daemon with a persistent bitmap c1 and exported over NBD; fio writes
  that share of it in random 64 KiB blocks through the export (nbd engine,
  random map: every block once), then flushes. The source file is fsynced
  and evicted from the page cache. Then, as libvirt does, a qcow2 overlay
  (backing file: an empty full backup) is made by blockdev-create and one
  `transaction` adds checkpoint c2, disables c1 and runs blockdev-backup
  sync=bitmap bitmap=c1 into it. Timed: from the transaction to
  BLOCK_JOB_COMPLETED, plus the fsync of the target file.
  Checked: the bitmap counted exactly the dirtied bytes, and `qemu-img
  compare` of the source with the backup chain says identical.
  Environments (the same node options for source and target, file node
  under a qcow2 node):
    qemu-threads, qemu-io_uring, qemu-native-direct, qemu-io_uring-direct,
    qemu-threads-direct  qemu-storage-daemon, aio=... and cache.direct
    vblk, vblk-direct    vblk serve, page cache / cache.direct=true
chain (a base of --chain-size, half of it written, and ten qcow2 overlays,
  each with --chain-dirty percent written in random 64 KiB blocks, some of
  them zeroes): the top converted to one image, raw and qcow2 (-O), with
  caches dropped before each run and the output fsynced; timed end to end.
    qemu-img, qemu-img-W (-W -m 16), vblk, vblk-W (-W -m 16)
  Checked: `qemu-img compare` of the output with the chain's top.

Prints tables of mean ± stdev, names the fastest QEMU configuration and the
vblk / QEMU ratio (QEMU's time / vblk's: above 1 vblk is faster); --json
writes everything with the command line (bench_img.run_meta).

Python 3 standard library only (fio and QEMU's tools on PATH).
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon  # noqa: E402

KIB = 1 << 10
MIB = 1 << 20
BLOCK = 64 * KIB

ENVS = {
    "qemu-threads": ("qemu", {"aio": "threads"}),
    "qemu-io_uring": ("qemu", {"aio": "io_uring"}),
    "qemu-native-direct": ("qemu", {"aio": "native", "cache": {"direct": True}}),
    "qemu-io_uring-direct": ("qemu", {"aio": "io_uring", "cache": {"direct": True}}),
    "qemu-threads-direct": ("qemu", {"aio": "threads", "cache": {"direct": True}}),
    "vblk-direct": ("vblk", {"cache": {"direct": True}}),
    "vblk": ("vblk", {}),
}

CONVERTERS = {
    "qemu-img": ("qemu", []),
    "qemu-img-W": ("qemu", ["-W", "-m", "16"]),
    "vblk": ("vblk", []),
    "vblk-W": ("vblk", ["-W", "-m", "16"]),
}


def run(argv, timeout=3600):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(argv), r.stderr.strip() or r.stdout.strip()))
    return r


def wait_job_event(q, timeout):
    e = q.event("BLOCK_JOB_COMPLETED", timeout)
    if "error" in e["data"]:
        raise RuntimeError("job failed: " + e["data"]["error"])
    return e


def create(q, job, options, timeout):
    q.ok("blockdev-create", {"job-id": job, "options": options})
    while True:
        e = q.event("JOB_STATUS_CHANGE", timeout)
        if e["data"]["id"] == job and e["data"]["status"] == "concluded":
            break
    q.ok("job-dismiss", id=job)


def incremental_run(args, env, pct, d):
    kind, file_opts = ENVS[env]
    argv0 = [args.qsd] if kind == "qemu" else [args.vblk, "serve"]
    src, full, tgt = (os.path.join(d, n) for n in ("src.qcow2", "full.qcow2", "tgt.qcow2"))
    for p in (src, full, tgt):
        bi.rm(p)
    for p in (src, full):
        run([args.qemu_img, "create", "-q", "-f", "qcow2", "-o", "cluster_size=65536", p, str(args.size)])
    dm = Daemon(argv0, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
    q = dm.qmp
    res = {"env": env, "case": "incremental", "dirty_pct": pct}
    dirty = (args.size * pct // 100) // BLOCK * BLOCK
    try:
        q.ok("blockdev-add", {"driver": "qcow2", "node-name": "disk",
                              "file": dict({"driver": "file", "filename": src}, **file_opts)})
        q.ok("block-dirty-bitmap-add", {"node": "disk", "name": "c1", "persistent": True})
        sock = os.path.join(d, "nbd.sock")
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "disk", "name": "disk", "writable": True})
        run([args.fio, "--name=dirty", "--ioengine=nbd", "--uri=nbd+unix:///disk?socket=" + sock,
             "--rw=randwrite", "--bs=64k", "--iodepth=16", "--io_size=%d" % dirty, "--randseed=%d" % (pct + 14),
             "--end_fsync=1", "--output-format=json"])
        count = [b for n in q.ok("query-named-block-nodes", flat=True) if n["node-name"] == "disk"
                 for b in n.get("dirty-bitmaps", []) if b.get("name") == "c1"][0]["count"]
        if count != dirty:
            raise RuntimeError("%s: bitmap c1 counts %d bytes, %d were dirtied" % (env, count, dirty))
        q.ok("block-export-del", id="e0")
        bi.fsync_path(src)
        bi.drop_cache(src)
        create(q, "cf", {"driver": "file", "filename": tgt, "size": 0}, args.timeout)
        q.ok("blockdev-add", dict({"driver": "file", "node-name": "tgt-f", "filename": tgt}, **file_opts))
        create(q, "cq", {"driver": "qcow2", "file": "tgt-f", "size": args.size, "backing-file": full,
                         "backing-fmt": "qcow2"}, args.timeout)
        q.ok("blockdev-add", {"driver": "qcow2", "node-name": "tgt", "file": "tgt-f", "backing": None})
        q.events.clear()
        t0 = time.monotonic()
        q.ok("transaction", actions=[
            {"type": "block-dirty-bitmap-add", "data": {"node": "disk", "name": "c2", "persistent": True}},
            {"type": "block-dirty-bitmap-disable", "data": {"node": "disk", "name": "c1"}},
            {"type": "blockdev-backup", "data": {"job-id": "b", "device": "disk", "target": "tgt",
                                                 "sync": "bitmap", "bitmap": "c1", "bitmap-mode": "never"}}])
        e = wait_job_event(q, args.timeout)
        bi.fsync_path(tgt)
        res["backup_s"] = time.monotonic() - t0
        res["job_len"] = e["data"]["len"]
    finally:
        dm.quit()
    r = subprocess.run([args.qemu_img, "compare", src, tgt], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s %d%%: backup differs: %s" % (env, pct, r.stdout + r.stderr))
    res["identical"] = True
    return res


def make_chain(args, d):
    """base.qcow2 and ov1..ov10.qcow2; returns the top's path."""
    rng = random.Random(14)
    base = os.path.join(d, "base.qcow2")
    run([args.qemu_img, "create", "-q", "-f", "qcow2", base, str(args.chain_size)])
    half = args.chain_size // 2 // MIB * MIB
    run([args.qemu_io, "-f", "qcow2", "-c", "write -P 1 0 %d" % (half // 2),
         "-c", "write -P 2 %d %d" % (args.chain_size // 2, half // 2), base])
    prev = base
    nblocks = args.chain_size // BLOCK
    for i in range(1, 11):
        ov = os.path.join(d, "ov%d.qcow2" % i)
        run([args.qemu_img, "create", "-q", "-f", "qcow2", "-b", prev, "-F", "qcow2", ov])
        cmds = []
        for j, b in enumerate(rng.sample(range(nblocks), int(nblocks * args.chain_dirty / 100))):
            if j % 8 == 7:
                cmds.append("write -z %d %d" % (b * BLOCK, BLOCK))
            else:
                cmds.append("write -P %d %d %d" % ((i * 7 + j) % 255 + 1, b * BLOCK, BLOCK))
        for k in range(0, len(cmds), 2000):
            argv = [args.qemu_io, "-f", "qcow2"]
            for c in cmds[k:k + 2000]:
                argv += ["-c", c]
            run(argv + [ov])
        prev = ov
    return prev, [base] + [os.path.join(d, "ov%d.qcow2" % i) for i in range(1, 11)]


def chain_run(args, conv, fmt, top, files, d):
    kind, extra = CONVERTERS[conv]
    out = os.path.join(d, "out." + fmt)
    bi.rm(out)
    for f in files:
        bi.drop_cache(f)
    tool = args.qemu_img if kind == "qemu" else args.vblk
    argv = [tool, "convert"] + ([] if kind == "qemu" else []) + extra + ["-f", "qcow2", "-O", fmt, top, out]
    t0 = time.monotonic()
    run(argv)
    bi.fsync_path(out)
    secs = time.monotonic() - t0
    r = subprocess.run([args.qemu_img, "compare", "-F", fmt, top, out], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("%s -O %s: output differs: %s" % (conv, fmt, r.stdout + r.stderr))
    m = json.loads(run([args.qemu_img, "map", "--output=json", "-f", fmt, out]).stdout)
    alloc = sum(e["length"] for e in m if e["data"])
    bi.rm(out)
    return {"env": conv, "case": "chain-" + fmt, "convert_s": secs, "allocated": alloc, "identical": True}


def report(title, rows, key, envs, is_qemu):
    table = [["env", "seconds", "n"]]
    mean = {}
    for env in envs:
        xs = [r[key] for r in rows[env]]
        m, sd = bi.mean_sd(xs)
        mean[env] = m
        table.append([env, bi.fmt_pm(m, sd, 3), str(len(xs))])
    print("\n## %s (seconds, mean ± stdev)" % title)
    print(bi.render_table(table))
    qemu = [e for e in envs if is_qemu(e)]
    summary = {}
    if qemu:
        best = min(qemu, key=lambda e: mean[e])
        print("fastest QEMU configuration: %s (%.3f s)" % (best, mean[best]))
        summary["fastest_qemu"] = best
        for e in envs:
            if not is_qemu(e):
                ratio = mean[best] / mean[e]
                summary[e] = ratio
                print("%s: %.2fx the fastest QEMU (%s)%s" % (e, ratio, best, "" if ratio >= 1 else "  <- vblk slower"))
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--qsd", default="qemu-storage-daemon")
    ap.add_argument("--qemu-img", default="qemu-img")
    ap.add_argument("--qemu-io", default="qemu-io")
    ap.add_argument("--fio", default="fio")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("4G"))
    ap.add_argument("--dirty", default="1,10", help="percentages of --size dirtied")
    ap.add_argument("--chain-size", type=bi.parse_size, default=bi.parse_size("1G"))
    ap.add_argument("--chain-dirty", type=float, default=5.0, help="percent written per overlay")
    ap.add_argument("--cases", default="incremental,chain")
    ap.add_argument("--envs", default=",".join(ENVS))
    ap.add_argument("--converters", default=",".join(CONVERTERS))
    ap.add_argument("--dir", default=None, help="image directory (default: temp dir under /var/tmp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    args.vblk = bi.resolve_tool(args.vblk, "vblk")
    args.qsd = bi.resolve_tool(args.qsd, "qemu-storage-daemon")
    args.qemu_img = bi.resolve_tool(args.qemu_img, "qemu-img")
    args.qemu_io = bi.resolve_tool(args.qemu_io, "qemu-io")
    args.fio = bi.resolve_tool(args.fio, "fio")
    cases = args.cases.split(",")
    d = args.dir or tempfile.mkdtemp(prefix="bench_incremental.", dir="/var/tmp")
    os.makedirs(d, exist_ok=True)
    meta = bi.run_meta(args.vblk, {"qemu": [args.qsd, "--version"], "fio": [args.fio, "--version"]},
                       size=args.size, runs=args.runs, dir=d)
    print("# bench_incremental: %d run(s), %s" % (args.runs, meta["command"]))
    results, summary = [], {}
    try:
        if "incremental" in cases:
            envs = args.envs.split(",")
            for pct in [int(x) for x in args.dirty.split(",")]:
                rows = {e: [] for e in envs}
                for n in range(args.runs):
                    for env in envs[n % len(envs):] + envs[:n % len(envs)]:
                        r = incremental_run(args, env, pct, d)
                        rows[env].append(r)
                        results.append(r)
                summary["incremental-%d%%" % pct] = report(
                    "incremental backup, %s qcow2, %d%% dirty (%s)" % (bi.human_size(args.size), pct,
                                                                     bi.human_size(args.size * pct // 100)),
                    rows, "backup_s", envs, lambda e: e.startswith("qemu"))
        if "chain" in cases:
            top, files = make_chain(args, d)
            convs = args.converters.split(",")
            for fmt in ("raw", "qcow2"):
                rows = {c: [] for c in convs}
                for n in range(args.runs):
                    for conv in convs[n % len(convs):] + convs[:n % len(convs)]:
                        r = chain_run(args, conv, fmt, top, files, d)
                        rows[conv].append(r)
                        results.append(r)
                summary["chain-" + fmt] = report(
                    "chain restore: base %s + 10 overlays (%.0f%% each) -> one %s image"
                    % (bi.human_size(args.chain_size), args.chain_dirty, fmt),
                    rows, "convert_s", convs, lambda e: e.startswith("qemu"))
    finally:
        if not args.dir:
            shutil.rmtree(d, ignore_errors=True)
    meta["loadavg_end"] = bi.loadavg()
    meta["summary"] = summary
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
