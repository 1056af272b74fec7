#!/usr/bin/env python3
"""Start-up cost of a command, side by side: `vblk` against `qemu-img` for
the short commands scripts run by the hundred (--version, info of a small
raw and of a small qcow2), in one run.

Each command is run --runs times per tool, the tools interleaved; wall time
per run (fork + exec + the command) and the peak RSS of one extra run
(`/usr/bin/time -v`, bench_convert.time_v). Reported: mean ± stdev in milliseconds, peak RSS
in MiB, and vblk's time over qemu-img's. Python 3 standard library only.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_convert  # noqa: E402  (time_v: peak RSS from /usr/bin/time -v)
import bench_img as bi  # noqa: E402


def timed(argv):
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return (time.perf_counter() - t0) * 1000


def peak_rss_mib(argv):
    return bench_convert.time_v(argv)[1] / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    vblk = bi.resolve_tool(args.vblk, "vblk")
    qemu_img = bi.resolve_tool("qemu-img", "qemu-img")
    meta = bi.run_meta(vblk, {"qemu_img_version": ["qemu-img", "--version"]}, runs=args.runs)
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']} ({meta['vblk']}); {meta['qemu_img_version']}")
    print(f"# load:     {meta['loadavg_start']} (1/5/15 min) at start", flush=True)
    d = tempfile.mkdtemp(prefix="vblk-bench-startup-")
    try:
        raw, qcow2 = os.path.join(d, "a.raw"), os.path.join(d, "a.qcow2")
        subprocess.run([qemu_img, "create", "-q", "-f", "raw", raw, "64M"], check=True)
        subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", qcow2, "64M"], check=True)
        cases = [("--version", ["--version"]), ("info raw", ["info", raw]), ("info qcow2", ["info", qcow2])]
        rows = [["command", "vblk ms", "qemu-img ms", "vblk / qemu-img", "vblk RSS MiB", "qemu-img RSS MiB"]]
        results = []
        for name, cmd in cases:
            times = {"vblk": [], "qemu-img": []}
            for r in range(args.runs):
                order = [("vblk", vblk), ("qemu-img", qemu_img)]
                for tool, path in (order if r % 2 == 0 else order[::-1]):
                    times[tool].append(timed([path] + cmd))
            rss = {"vblk": peak_rss_mib([vblk] + cmd), "qemu-img": peak_rss_mib([qemu_img] + cmd)}
            mv, sv = bi.mean_sd(times["vblk"])
            mq, sq = bi.mean_sd(times["qemu-img"])
            rows.append([name, bi.fmt_pm(mv, sv, 2), bi.fmt_pm(mq, sq, 2), f"{mv / mq:.2f}",
                         f"{rss['vblk']:.1f}", f"{rss['qemu-img']:.1f}"])
            results.append({"case": name, "ms": times, "peak_rss_mib": rss})
    finally:
        shutil.rmtree(d, ignore_errors=True)
    meta["loadavg_end"] = bi.loadavg()
    print()
    print(bi.render_table(rows))
    print(f"# load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
