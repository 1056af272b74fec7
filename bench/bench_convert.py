#!/usr/bin/env python3
"""Side-by-side benchmark of `vblk convert` against qemu-img convert, nbdcopy,
cp and fio (the device limit), in one run on the same images.

Cases (source -> target, the target created new by each tool):
  raw-full      1 GiB raw, fully written with random data  -> raw
  raw-sparse    4 GiB raw, 10 % random data in scattered extents (64 KiB-4 MiB,
                the rest holes)                             -> raw
  qcow2-full    the raw-full data as qcow2 (64 KiB clusters) -> qcow2
  qcow2-sparse  the raw-sparse data as qcow2                 -> qcow2
(--size scales the full image; the sparse one is 4x that.)

Environments (all tools with their own defaults unless named):
  qemu-img            qemu-img convert -f F -O F
  qemu-img-direct     ... -t none -T none (O_DIRECT both sides)
  qemu-img-m16W       ... -t none -T none -m 16 -W
  nbdcopy             nbdcopy SRC DST (raw: on the files; qcow2: through
                      qemu-nbd --cache=none --aio=native on each side)
  nbdcopy-r16         nbdcopy --requests=16 --request-size=1048576
  cp                  cp --sparse=always (a byte copy of the file)
  vblk                vblk convert -f F -O F
  vblk-direct         ... -t none -T none
  vblk-m16W           ... -t none -T none -m 16 -W
Device limit (on the fully written cases, sizes of the source file):
  fio-read            fio sequential read of the source, 1 MiB, depth 16,
                      io_uring, O_DIRECT
  fio-write           fio sequential write of a new file of the same size
  fio-copy            both jobs at once in one fio run (for information:
                      on the virtual disks measured, fio's two jobs contend
                      and take longer than either alone, so this is no bound)
  The device limit ("% bound" divides by it) is the slower of fio-read and
  fio-write, each run alone: a copy must read and write every byte, so on a
  device that reads and writes in parallel it needs at least that long.
  (fio's times are its own job run time plus the fsync, without fio's
  start-up and file lay-out, which can take seconds on a loaded machine)

Timing: wall time of the tool plus an fsync of the target afterwards, so a
tool that leaves dirty pages in the page cache (cp, nbdcopy, cache=unsafe)
pays for writing them like the O_DIRECT ones. Before every run the source's
clean page cache is dropped (posix_fadvise DONTNEED) and the old target is
deleted. Environments run interleaved, the order rotating per run. Peak RSS
comes from /usr/bin/time -v. Every target is checked once with
`qemu-img compare` against the source (first run), and vblk's block-copy
memory peak (env VBLK_COPY_STATS=1) is recorded against its cap.

Ratios: "vs best" is (best other tool's mean time) / (this mean time); > 1
means faster than every non-vblk tool. Python 3 standard library only.
"""
import argparse
import datetime
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402

MIB = 1 << 20





def make_sparse(path, size, seed=1):
    """10 % random data in extents of 64 KiB-4 MiB at random aligned offsets."""
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_WRONLY)
    try:
        target, written, taken = size // 10, 0, set()
        while written < target:
            n = min(rng.choice([64 << 10, 256 << 10, MIB, 4 * MIB]), target - written)
            off = rng.randrange(0, size // (64 << 10)) * (64 << 10)
            if off + n > size or any(o in taken for o in range(off >> 16, (off + n) >> 16)):
                continue
            taken.update(range(off >> 16, (off + n) >> 16))
            os.pwrite(fd, os.urandom(n), off)
            written += n
        os.fsync(fd)
    finally:
        os.close(fd)


def time_v(argv, env=None, timeout=900):
    """Runs argv under /usr/bin/time -v; returns (seconds, peak RSS KiB, stderr)."""
    t0 = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-v"] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=timeout, env=env)
    dt = time.monotonic() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"FAILED (exit status {p.returncode}): {shlex.join(argv)}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    if argv[0] == "fio":
        # fio's own run time: its start-up and file lay-out are not the device's.
        jobs = json.loads(p.stdout[p.stdout.index("{"):])["jobs"]
        dt = max(j["job_runtime"] for j in jobs) / 1000.0
    return dt, int(m.group(1)) if m else 0, p.stderr


def fio_argv(jobs, size):
    argv = ["fio", "--output-format=json", "--ioengine=io_uring", "--direct=1", "--bs=1M", "--iodepth=16",
            f"--size={size}"]
    for name, rw, path in jobs:
        argv += [f"--name={name}", f"--rw={rw}", f"--filename={path}"]
    return argv


def report(res, show_load=True):
    """Prints one case's table; returns True if a vblk environment is the fastest tool."""
    t = res["seconds"]
    mean = {e: statistics.fmean(v) for e, v in t.items()}
    others = [e for e in t if not e.startswith("vblk") and not e.startswith("fio")]
    best = min(others, key=lambda e: mean[e]) if others else None
    bound = max(mean["fio-read"], mean["fio-write"]) if "fio-read" in mean and "fio-write" in mean else None
    res["mean"], res["best_other"] = mean, best
    rows = [["environment", "time (s)", "MiB/s", "peak RSS (MiB)", "vs best", "% bound", "ok"]]
    for e, v in t.items():
        m, sd = bi.mean_sd(v)
        mbs = res["source_bytes"] / MIB / m
        vs = "" if e.startswith("fio") or not best else f"{mean[best] / m:.2f}"
        pct = f"{100 * bound / m:.0f} %" if bound and not e.startswith("fio") else ""
        ok = "" if e not in res["verified"] else ("yes" if res["verified"][e] else "NO")
        rows.append([e, bi.fmt_pm(m, sd, 3), f"{mbs:.0f}", f"{max(res['peak_rss_kib'][e]) / 1024:.0f}", vs, pct, ok])
    print(f"\n## {res['case']} (source file {bi.human_size(res['source_bytes'])}; best other tool: {best})")
    print(bi.render_table(rows))
    mem = res["vblk_copy_memory_peak"]
    if mem:
        print("block-copy memory peak: " + ", ".join(f"{e} {v / MIB:.0f} MiB" for e, v in mem.items() if e != "cap")
              + f" (cap {mem.get('cap', 0) / MIB:.0f} MiB)")
    if show_load:
        print(f"# load {bi.loadavg()} after this case", flush=True)
    vb = [e for e in t if e.startswith("vblk")]
    fastest = min(vb, key=lambda e: mean[e]) if vb else None
    return not (fastest and best and mean[fastest] > mean[best])


def from_log(path, sizes):
    """Results of an interrupted run, from its progress lines on stderr."""
    per = {}
    for line in open(path):
        m = re.match(r"run \d+/\d+ (\S+)\s+(\S+)\s+([0-9.]+) s\s+(\d+) MiB", line)
        if m:
            case, env, t, rss = m.group(1), m.group(2), float(m.group(3)), int(m.group(4))
            if case not in sizes:
                continue
            r = per.setdefault(case, {"case": case, "source_bytes": sizes[case], "seconds": {}, "peak_rss_kib": {},
                                      "vblk_copy_memory_peak": {}, "verified": {}})
            r["seconds"].setdefault(env, []).append(t)
            r["peak_rss_kib"].setdefault(env, []).append(rss * 1024)
    return list(per.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--qemu-img", default="qemu-img")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("1G"),
                    help="fully written image size (default 1G; the sparse one is 4x)")
    ap.add_argument("--only", default=None, metavar="REGEX", help="cases matching REGEX")
    ap.add_argument("--envs", default=None, metavar="REGEX", help="environments matching REGEX")
    ap.add_argument("--dir", default=None, help="image directory (default: temp dir under /var/tmp)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--no-verify", action="store_true", help="skip the qemu-img compare of every target")
    ap.add_argument("--from-log", default=None, metavar="FILE",
                    help="only print the tables of an interrupted run from its stderr progress log")
    args = ap.parse_args()
    if args.from_log:
        sizes = {"raw-full": args.size, "raw-sparse": 4 * args.size}
        print(f"# tables from the progress log of an interrupted run ({os.path.basename(args.from_log)}); "
              f"no compare results or memory peaks in it")
        for res in from_log(args.from_log, sizes):
            report(res, show_load=False)
        return
    vblk = bi.resolve_tool(args.vblk, "vblk")
    qemu = bi.resolve_tool(args.qemu_img, "qemu-img")
    for tool in ("nbdcopy", "qemu-nbd", "fio"):
        bi.resolve_tool(tool, tool)
    own_dir = not args.dir
    workdir = tempfile.mkdtemp(prefix="vblk-bench-convert-", dir="/var/tmp") if own_dir else os.path.abspath(args.dir)
    os.makedirs(workdir, exist_ok=True)
    W = lambda n: os.path.join(workdir, n)  # noqa: E731
    cases = [
        {"name": "raw-full", "src": W("full.raw"), "fmt": "raw", "full": True},
        {"name": "raw-sparse", "src": W("sparse.raw"), "fmt": "raw", "full": False},
        {"name": "qcow2-full", "src": W("full.qcow2"), "fmt": "qcow2", "full": True},
        {"name": "qcow2-sparse", "src": W("sparse.qcow2"), "fmt": "qcow2", "full": False},
    ]
    if args.only:
        cases = [c for c in cases if re.search(args.only, c["name"])]

    def qnbd(fmt, path, ro):
        return ["[", "qemu-nbd", "-f", fmt, "--cache=none", "--aio=native"] + (["-r"] if ro else []) + [path, "]"]

    def env_argv(env, case, dst):
        f, src = case["fmt"], case["src"]
        if env.startswith("qemu-img") or env.startswith("vblk"):
            tool = qemu if env.startswith("qemu-img") else vblk
            a = [tool, "convert", "-f", f, "-O", f]
            if env.endswith("-direct") or env.endswith("-m16W"):
                a += ["-t", "none", "-T", "none"]
            if env.endswith("-m16W"):
                a += ["-m", "16", "-W"]
            return a + [src, dst]
        if env.startswith("nbdcopy"):
            a = ["nbdcopy"]
            if env == "nbdcopy-r16":
                a += ["--requests=16", "--request-size=1048576"]
            if f == "raw":
                return a + [src, dst]
            return a + ["--"] + qnbd(f, src, True) + qnbd(f, dst, False)
        if env == "cp":
            return ["cp", "--sparse=always", src, dst]
        raise AssertionError(env)

    envs = ["qemu-img", "qemu-img-direct", "qemu-img-m16W", "nbdcopy", "nbdcopy-r16", "cp",
            "vblk", "vblk-direct", "vblk-m16W"]
    if args.envs:
        envs = [e for e in envs if re.search(args.envs, e)]
    fio_envs = ["fio-read", "fio-write", "fio-copy"]
    started = datetime.datetime.now().astimezone()
    meta = bi.run_meta(vblk, {"qemu_img_version": [qemu, "--version"], "nbdcopy_version": ["nbdcopy", "--version"],
                              "fio_version": ["fio", "--version"]},
                       image_fs=bi.fs_of(workdir), runs=args.runs)
    meta["date"] = started.isoformat(timespec="seconds")
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']} ({meta['vblk']}); {meta['qemu_img_version']}; "
          f"{meta['nbdcopy_version']}; {meta['fio_version']}")
    print(f"# images:   on {meta['image_fs']}; full {bi.human_size(args.size)}, sparse {bi.human_size(4 * args.size)} "
          f"with 10 % data")
    print(f"# load:     {meta['loadavg_start']} (1/5/15 min) at start")
    print(f"# runs:     {args.runs} per case and environment, interleaved, order rotating; time = tool + fsync(target), "
          f"source page cache dropped before each run", flush=True)

    t_start = time.monotonic()
    results = []
    try:
        print("creating images ...", file=sys.stderr, flush=True)
        names = {c["name"] for c in cases}
        if names & {"raw-full", "qcow2-full"}:
            bi.make_image(W("full.raw"), args.size)
        if names & {"raw-sparse", "qcow2-sparse"}:
            make_sparse(W("sparse.raw"), 4 * args.size)
        for c in cases:
            if c["fmt"] == "qcow2":
                raw = W("full.raw") if c["full"] else W("sparse.raw")
                subprocess.run([qemu, "convert", "-f", "raw", "-O", "qcow2", raw, c["src"]], check=True)
                bi.fsync_path(c["src"])
        env_vblk = dict(os.environ, VBLK_COPY_STATS="1")
        for case in cases:
            dst = W("dst." + case["fmt"])
            src_bytes = os.path.getsize(case["src"])
            case_envs = envs + (fio_envs if case["full"] else [])
            times = {e: [] for e in case_envs}
            rss = {e: [] for e in case_envs}
            mem = {}
            verified = {}
            for r in range(args.runs):
                k = r % len(case_envs)
                for env in case_envs[k:] + case_envs[:k]:
                    bi.rm(dst)
                    bi.drop_cache(case["src"])
                    if env.startswith("fio"):
                        jobs = {"fio-read": [("r", "read", case["src"])],
                                "fio-write": [("w", "write", dst)],
                                "fio-copy": [("r", "read", case["src"]), ("w", "write", dst)]}[env]
                        t, m, _ = time_v(fio_argv(jobs, src_bytes))
                        if env != "fio-read":
                            t0 = time.monotonic()
                            bi.fsync_path(dst)
                            t += time.monotonic() - t0
                    else:
                        if env.startswith("nbdcopy") and case["fmt"] == "qcow2":
                            vsize = json.loads(subprocess.run([qemu, "info", "--output=json", case["src"]],
                                               stdout=subprocess.PIPE, check=True).stdout)["virtual-size"]
                            subprocess.run([qemu, "create", "-q", "-f", "qcow2", dst, str(vsize)], check=True)
                        t0 = time.monotonic()
                        _, m, err = time_v(env_argv(env, case, dst), env=env_vblk)
                        bi.fsync_path(dst)
                        t = time.monotonic() - t0
                        mm = re.search(r"block-copy: memory peak (\d+) of cap (\d+)", err)
                        if mm:
                            mem[env] = max(mem.get(env, 0), int(mm.group(1)))
                            mem["cap"] = int(mm.group(2))
                        if r == 0 and not args.no_verify:
                            p = subprocess.run([qemu, "compare", "-q", "-f", case["fmt"], "-F", case["fmt"],
                                                case["src"], dst])
                            verified[env] = p.returncode == 0
                            if p.returncode != 0:
                                print(f"WARNING: {env} {case['name']}: target differs from source", file=sys.stderr)
                    times[env].append(t)
                    rss[env].append(m)
                    print(f"run {r + 1}/{args.runs} {case['name']:<13} {env:<16} {t:7.3f} s  {m // 1024:5d} MiB",
                          file=sys.stderr, flush=True)
            bi.rm(dst)
            results.append({"case": case["name"], "source_bytes": src_bytes, "seconds": times,
                            "peak_rss_kib": rss, "vblk_copy_memory_peak": mem, "verified": verified})
            # Each case's table as soon as it is done (a long run can be cut short).
            results[-1]["vblk_fastest"] = report(results[-1])
            bi.write_json(args.json, meta, results)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["elapsed_seconds"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = bi.loadavg()

    slower = [res["case"] for res in results if not res.get("vblk_fastest", True)]
    print()
    print("vblk fastest in every case" if not slower else f"vblk not fastest in: {', '.join(slower)}")
    print(f"# total wall time {meta['elapsed_seconds']:.0f} s; load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
