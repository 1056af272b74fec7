#!/usr/bin/env python3
"""Compressed qcow2 -> raw, side by side: `vblk convert` against `qemu-img
convert` (default, and -m 16 -W) and QEMU's backup (qemu-storage-daemon
blockdev-backup sync=full), on the same images in one run.

Images (--size, default 1 GiB, under /var/tmp): a raw source of
semi-compressible data (text-like 4 KiB blocks, random ones and zero ones,
as QEMU's compression tests use), compressed by `qemu-img convert -c` into
a qcow2 with compression_type=zlib and one with compression_type=zstd
(64 KiB clusters; random clusters that do not shrink stay plain).

Environments, each writing a fresh raw target on the same file system:
  vblk          vblk convert -f qcow2 -O raw SRC DST
  qemu-img      qemu-img convert -f qcow2 -O raw SRC DST
  qemu-img-m16W qemu-img convert -m 16 -W -f qcow2 -O raw SRC DST
  qemu-backup   qemu-storage-daemon: blockdev-add qcow2 over a file node and
                a raw file target (cache.direct, aio=native, as in
                bench_backup.py), blockdev-backup sync=full, timed from the
                job command to BLOCK_JOB_COMPLETED
  vblk-backup   the same QMP commands to `vblk serve` (the like-for-like of
                qemu-backup: the target node's detect-zeroes is off in both,
                so both write every zero block as data, where the converts
                leave 4 KiB holes)
Every time includes an fsync of the target (data left in the page cache is
paid for); the source's page cache is dropped before every run, the target
deleted. Environments run interleaved, the order rotating per run; the first
run's targets are checked against the raw source with `qemu-img compare`.

Reported: seconds mean ± stdev, the speed-up of vblk convert over each QEMU
tool and over the fastest, and of vblk's faster tool over QEMU's fastest.
Python 3 standard library only.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon  # noqa: E402

MIB = 1 << 20
ENVS = ["vblk", "vblk-backup", "qemu-img", "qemu-img-m16W", "qemu-backup"]
QEMU = ["qemu-img", "qemu-img-m16W", "qemu-backup"]
OURS = ["vblk", "vblk-backup"]
GOAL = 2.0


def semi_compressible_file(path, size):
    """1 MiB of mixed 4 KiB blocks, re-drawn per MiB from a fixed seed."""
    rng = random.Random(1)
    words = [b"alpha", b"beta", b"gamma", b"qcow2", b"cluster", b"\n", b"refcount", b"  "]
    text = bytearray()
    while len(text) < 64 * 4096:
        text += rng.choice(words)
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            out = bytearray()
            while len(out) < MIB:
                kind = rng.randrange(6)
                if kind == 0:
                    out += rng.randbytes(4096)
                elif kind == 1:
                    out += bytes(4096)
                else:
                    k = rng.randrange(63) * 4096
                    out += text[k:k + 4096]
            f.write(out[:MIB])
        f.flush()
        os.fsync(f.fileno())


def measure(env, vblk, src, dst, workdir):
    bi.rm(dst)
    bi.drop_cache(src)
    if env in ("qemu-backup", "vblk-backup"):
        subprocess.run(["qemu-img", "create", "-q", "-f", "raw", dst, str(virtual_size(src))], check=True)
        argv0 = ["qemu-storage-daemon"] if env == "qemu-backup" else [vblk, "serve"]
        d = Daemon(argv0, os.path.join(workdir, "qmp.sock"), os.path.join(workdir, "daemon.log"))
        try:
            d.qmp.ok("blockdev-add", {"node-name": "source", "driver": "qcow2",
                                      "file": {"driver": "file", "filename": src, "cache": {"direct": True},
                                               "aio": "native"}})
            d.qmp.ok("blockdev-add", {"node-name": "target", "driver": "file", "filename": dst,
                                      "cache": {"direct": True}, "aio": "native"})
            t0 = time.monotonic()
            d.qmp.ok("blockdev-backup", {"job-id": "job0", "device": "source", "target": "target", "sync": "full"})
            ev, t_ev = d.qmp.next_event({"BLOCK_JOB_COMPLETED"}, 600)
            if "error" in ev.get("data", {}):
                raise SystemExit(f"{env} failed: {ev['data']['error']}")
            t1 = time.monotonic()
            bi.fsync_path(dst)
            t = (t_ev - t0) + (time.monotonic() - t1)
            d.quit()
        finally:
            if d.proc.poll() is None:
                d.kill()
        return t
    argv = {"vblk": [vblk, "convert"], "qemu-img": ["qemu-img", "convert"],
            "qemu-img-m16W": ["qemu-img", "convert", "-m", "16", "-W"]}[env]
    argv = argv + ["-f", "qcow2", "-O", "raw", src, dst]
    t0 = time.monotonic()
    subprocess.run(argv, check=True)
    bi.fsync_path(dst)
    return time.monotonic() - t0


def virtual_size(img):
    out = subprocess.run(["qemu-img", "info", "--output=json", img], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout)["virtual-size"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("1G"))
    ap.add_argument("--types", default="zlib,zstd")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    vblk = bi.resolve_tool(args.vblk, "vblk")
    own_dir = not args.dir
    workdir = tempfile.mkdtemp(prefix="vblk-bench-inflate-", dir="/var/tmp") if own_dir else os.path.abspath(args.dir)
    meta = bi.run_meta(vblk, {"qemu_img_version": ["qemu-img", "--version"]}, image_fs=bi.fs_of(workdir),
                       runs=args.runs)
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']} ({meta['vblk']}); {meta['qemu_img_version']}")
    print(f"# images:   {bi.human_size(args.size)} semi-compressible, qemu-img convert -c, on {meta['image_fs']}")
    print(f"# load:     {meta['loadavg_start']} (1/5/15 min) at start", flush=True)
    W = lambda n: os.path.join(workdir, n)  # noqa: E731
    times = {}
    results = []
    try:
        print("creating images ...", file=sys.stderr, flush=True)
        semi_compressible_file(W("src.raw"), args.size)
        types = args.types.split(",")
        for t in types:
            subprocess.run(["qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", "-o", f"compression_type={t}",
                            W("src.raw"), W(f"{t}.qcow2")], check=True)
            meta[f"{t}_qcow2_bytes"] = os.path.getsize(W(f"{t}.qcow2"))
        for r in range(args.runs):
            for t in types:
                k = r % len(ENVS)
                for env in ENVS[k:] + ENVS[:k]:
                    secs = measure(env, vblk, W(f"{t}.qcow2"), W("dst.raw"), workdir)
                    if r == 0:
                        c = subprocess.run(["qemu-img", "compare", "-f", "raw", "-F", "raw", W("src.raw"),
                                            W("dst.raw")], stdout=subprocess.PIPE, text=True)
                        if c.returncode != 0:
                            raise SystemExit(f"{env} {t}: target differs from the source: {c.stdout}")
                    times.setdefault(t, {}).setdefault(env, []).append(secs)
                    print(f"run {r + 1}/{args.runs} {t:<5} {env:<14} {secs:7.2f} s", file=sys.stderr, flush=True)
            bi.rm(W("dst.raw"))
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["loadavg_end"] = bi.loadavg()
    rows = [["case"] + [f"{e} s" for e in ENVS] + [f"vblk vs {e}" for e in QEMU] + ["vblk vs fastest QEMU"] +
            ["fastest vblk vs fastest QEMU"]]
    short = []
    for t, per in times.items():
        m = {e: statistics.fmean(v) for e, v in per.items()}
        best = min(QEMU, key=lambda e: m[e])
        ours = min(OURS, key=lambda e: m[e])
        row = [f"{t} -> raw"] + [bi.fmt_pm(*bi.mean_sd(per[e]), 2) for e in ENVS]
        row += [f"{m[e] / m['vblk']:.2f}x" for e in QEMU] + [f"{m[best] / m['vblk']:.2f}x ({best})"]
        row += [f"{m[best] / m[ours]:.2f}x ({ours} / {best})"]
        rows.append(row)
        if m[best] / m[ours] < GOAL:
            short.append(t)
        results.append({"case": t, "seconds": per, "fastest_qemu": best, "speedup_over_fastest": m[best] / m["vblk"],
                        "fastest_vblk": ours, "fastest_vblk_over_fastest_qemu": m[best] / m[ours]})
    print()
    print(bi.render_table(rows))
    print()
    print(f"vblk's fastest tool >= {GOAL}x the fastest QEMU tool in every case" if not short
          else f"vblk's fastest tool below {GOAL}x the fastest QEMU tool in: {', '.join(short)}")
    print(f"# load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
