#!/usr/bin/env python3
"""Side-by-side benchmark of `vblk bench` and `qemu-img bench` on qcow2.

Cases (all -f qcow2 -t none -i io_uring, i.e. O_DIRECT):
  empty-*     a fresh qcow2 (created by qemu-img) before every single run, so
              writes measure allocation, copy-on-write and metadata updates;
  prealloc-*  a qcow2 created with -o preallocation=falloc and fully written
              once with random data, so reads and writes hit allocated
              clusters (the in-place path).
4 KiB "random" requests use the co-prime scatter step of bench_img.py.
Tools alternate within each run; mean ± stdev over --runs runs.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402


def bench_argv(tool, case, image):
    argv = [tool, "bench", "-f", "qcow2", "-t", "none", "-i", "io_uring", "-c", str(case["count"]),
            "-d", str(case["depth"]), "-s", str(case["size"])]
    if case["step"]:
        argv += ["-S", str(case["step"])]
    if case["write"]:
        argv += ["-w", "--pattern=165"]
    return argv + [image]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--qemu-img", default="qemu-img")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("1G"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None, metavar="VBLK",
                    help="an earlier vblk binary, run beside the others as vblk-base (regressions)")
    args = ap.parse_args()
    vblk = bi.resolve_tool(args.vblk, "vblk")
    qemu = bi.resolve_tool(args.qemu_img, "qemu-img")
    tools = [("vblk", vblk), ("qemu-img", qemu)]
    if args.baseline:
        tools.append(("vblk-base", bi.resolve_tool(args.baseline, "vblk")))
    div = 10 if args.quick else 1
    step = bi.scatter_step(args.size)
    nblocks = args.size // bi.BLOCK
    cases = [
        {"name": "empty-rand-4k-write-qd32", "layout": "empty", "write": True, "depth": 32, "size": 4096,
         "step": step, "count": min(100000 // div, nblocks), "kind": "rand"},
        {"name": "empty-rand-4k-read-qd32", "layout": "empty", "write": False, "depth": 32, "size": 4096,
         "step": step, "count": min(200000 // div, nblocks), "kind": "rand"},
        {"name": "empty-seq-1m-write-qd32", "layout": "empty", "write": True, "depth": 32, "size": 1 << 20,
         "step": 0, "count": (args.size >> 20) // div, "kind": "seq"},
        {"name": "prealloc-rand-4k-read-qd32", "layout": "prealloc", "write": False, "depth": 32, "size": 4096,
         "step": step, "count": min(200000 // div, nblocks), "kind": "rand"},
        {"name": "prealloc-rand-4k-write-qd32", "layout": "prealloc", "write": True, "depth": 32, "size": 4096,
         "step": step, "count": min(200000 // div, nblocks), "kind": "rand"},
        {"name": "prealloc-seq-1m-write-qd32", "layout": "prealloc", "write": True, "depth": 32, "size": 1 << 20,
         "step": 0, "count": (args.size >> 20) // div, "kind": "seq"},
    ]
    workdir = tempfile.mkdtemp(prefix="vblk-bench-qcow2-", dir="/var/tmp")
    pre = os.path.join(workdir, "prealloc.qcow2")
    empty = os.path.join(workdir, "empty.qcow2")
    print(f"# command:  {' '.join(['python3'] + sys.argv)}")
    print(f"# vblk:     {bi.first_line([vblk, '--version'])}; qemu-img: {bi.first_line([qemu, '--version'])}")
    print(f"# image:    {bi.human_size(args.size)} qcow2 (64 KiB clusters) on {bi.fs_of(workdir)}; "
          f"load at start {bi.loadavg()}")
    print(f"# runs:     {args.runs} per case per tool, alternating order; -t none -i io_uring", flush=True)
    try:
        subprocess.run([qemu, "create", "-q", "-f", "qcow2", "-o", "preallocation=falloc", pre,
                        str(args.size)], check=True)
        subprocess.run([qemu, "bench", "-q", "-f", "qcow2", "-t", "none", "-w", "-s", "1M", "-d", "16",
                        "-c", str(args.size >> 20), "--pattern=90", pre], check=True, stdout=subprocess.DEVNULL)
        times = {c["name"]: {n: [] for n, _ in tools} for c in cases}
        for r in range(args.runs):
            order = tools if r % 2 == 0 else tools[::-1]
            for case in cases:
                for name, path in order:
                    image = pre
                    if case["layout"] == "empty":
                        image = empty
                        subprocess.run([qemu, "create", "-q", "-f", "qcow2", empty, str(args.size)], check=True)
                    t = bi.run_tool(bench_argv(path, case, image), 600)
                    times[case["name"]][name].append(t)
                    print(f"run {r + 1}/{args.runs} {case['name']:<30} {name:<8} {t:7.3f} s",
                          file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [["case", "count", "vblk (s)", "qemu-img (s)", "vblk speed", "qemu-img speed", "unit", "vblk/qemu"] +
            (["vblk-base speed", "vblk/base"] if args.baseline else [])]
    out = []
    slower = []
    for case in cases:
        tv, tq = times[case["name"]]["vblk"], times[case["name"]]["qemu-img"]
        sv = [bi.speed_of(case, t) for t in tv]
        sq = [bi.speed_of(case, t) for t in tq]
        paired = [a / b for a, b in zip(sv, sq)]
        ratio = statistics.mean(sv) / statistics.mean(sq)
        unit = "MiB/s" if case["kind"] == "seq" else "IOPS"
        rows.append([case["name"], str(case["count"]), bi.fmt_pm(*bi.mean_sd(tv), 3), bi.fmt_pm(*bi.mean_sd(tq), 3),
                     bi.fmt_pm(*bi.mean_sd(sv), 0), bi.fmt_pm(*bi.mean_sd(sq), 0), unit,
                     f"{ratio:.2f} ± {statistics.stdev(paired) if len(paired) > 1 else 0:.2f}"])
        if args.baseline:
            tb = times[case["name"]]["vblk-base"]
            sb = [bi.speed_of(case, t) for t in tb]
            pb = [a / b for a, b in zip(sv, sb)]
            rows[-1] += [bi.fmt_pm(*bi.mean_sd(sb), 0),
                         f"{statistics.mean(sv) / statistics.mean(sb):.2f} ± {statistics.stdev(pb) if len(pb) > 1 else 0:.2f}"]
        out.append({"case": case["name"], "vblk_seconds": tv, "qemu_seconds": tq, "ratio": ratio})
        if ratio < 1:
            slower.append(case["name"])
    print()
    print(bi.render_table(rows))
    print()
    print("vblk at least as fast as qemu-img in every case" if not slower else f"vblk slower in: {', '.join(slower)}")
    print(f"# load at end {bi.loadavg()}")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
