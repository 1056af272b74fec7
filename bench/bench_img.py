#!/usr/bin/env python3
"""Side-by-side benchmark of `vblk bench` and `qemu-img bench`.

Both tools are run in one invocation of this script, on the same raw image
file, with the same qemu-img-compatible options, and the results are printed
as a table (mean ± stdev over --runs runs) and optionally written as JSON.

Image
    A raw file of --size bytes (default 1G) is created in --dir (default a new
    temporary directory under /var/tmp, i.e. a real disk, not tmpfs) and fully
    written with data from /dev/urandom, so every read hits allocated, non-zero
    blocks.  All cases pass `-f raw` explicitly.  Write cases rewrite the same
    image.  The file is deleted at the end unless --keep is given.

Cases (all with O_DIRECT, i.e. `-t none`)
    rand-4k-{read,write}-qd{1,32}-{io_uring,threads}
        4 KiB requests at queue depth 1 and 32, `-i io_uring` and `-i threads`.
    seq-1m-{read,write}-qd32-io_uring
        1 MiB sequential requests (default step = request size), depth 32.

"Random" 4 KiB access
    qemu-img bench only knows sequential access with a fixed step: request n
    goes to offset (o + n * step) mod image_size.  To emulate random access we
    use a step S = k * 4096 where k is close to 0.618 * (image_size / 4096)
    (golden-ratio stride) and gcd(k, image_size / 4096) == 1.  Because k is
    co-prime with the number of 4 KiB blocks, the sequence visits every block
    exactly once before repeating (no block is hit twice as long as count <=
    number of blocks), and consecutive requests land hundreds of MiB apart, so
    neither the guest page cache (bypassed anyway by O_DIRECT) nor readahead or
    sequential detection in the host/virtual disk can help.  S is also capped
    at INT32_MAX, the limit both tools put on -S.

Fairness
    For every run and every case the two tools run back to back (interleaved,
    A B A B ...), and the order alternates between runs (vblk first on even
    runs, qemu-img first on odd runs) so neither tool systematically benefits
    from running first/second.  Page caches cannot be dropped here; the cases
    rely on O_DIRECT instead.

    After the image is created, --warmup rounds (default 1) of every case
    with both tools are run and discarded, so the freshly written image and
    the (virtual) disk settle before measuring.

Timing
    The time reported by each tool ("Run completed in X seconds.") is used;
    it excludes process start-up and image open/close.  A tool that exits
    non-zero, or whose output lacks that line, aborts the whole run.

Speed ratio
    "vblk/qemu" is mean(vblk speed) / mean(qemu-img speed); > 1 means vblk is
    faster.  The ± is the stdev of the per-run paired ratios.

Python 3 standard library only.
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_RE = re.compile(r"^Run completed in ([0-9.]+) seconds\.$", re.M)
INT32_MAX = 2**31 - 1
BLOCK = 4096

# Request counts, chosen so that one qemu-img run takes roughly 1-3 s on the
# reference machine (2 vCPUs, virtio disk, ~13k IOPS at QD1, ~80k (threads) /
# ~180k (io_uring) IOPS at QD32, ~3 GB/s sequential).  --quick divides them.
FULL_COUNTS = {
    ("rand", 1, "io_uring"): 20000,
    ("rand", 1, "threads"): 20000,
    ("rand", 32, "io_uring"): 200000,
    ("rand", 32, "threads"): 60000,
    ("seq", 32, "io_uring"): 4000,
}
QUICK_DIVISOR = 10


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size: {text!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(m.group(1)) * mult


def human_size(n):
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def scatter_step(image_size):
    """A 4 KiB-multiple step co-prime with the block count (see header)."""
    nblocks = image_size // BLOCK
    if nblocks < 2:
        raise SystemExit("image too small for a scattered step")
    k = min(int(round(nblocks * 0.6180339887)), INT32_MAX // BLOCK, nblocks - 1)
    k = max(k, 1)
    while k > 1 and math.gcd(k, nblocks) != 1:
        k -= 1
    return k * BLOCK


def build_cases(image_size, quick):
    div = QUICK_DIVISOR if quick else 1
    nblocks = image_size // BLOCK
    step = scatter_step(image_size)
    cases = []
    for aio in ("io_uring", "threads"):
        for depth in (1, 32):
            for write in (False, True):
                count = max(FULL_COUNTS[("rand", depth, aio)] // div, depth)
                # Keep every request on a distinct block.
                count = min(count, nblocks)
                cases.append({
                    "name": f"rand-4k-{'write' if write else 'read'}-qd{depth}-{aio}",
                    "kind": "rand", "write": write, "depth": depth, "aio": aio,
                    "size": BLOCK, "step": step, "count": count,
                })
    for write in (False, True):
        count = max(FULL_COUNTS[("seq", 32, "io_uring")] // div, 32)
        cases.append({
            "name": f"seq-1m-{'write' if write else 'read'}-qd32-io_uring",
            "kind": "seq", "write": write, "depth": 32, "aio": "io_uring",
            "size": 1 << 20, "step": None, "count": count,
        })
    return cases


def bench_argv(tool_path, case, image):
    argv = [tool_path, "bench", "-f", "raw", "-t", "none", "-i", case["aio"],
            "-c", str(case["count"]), "-d", str(case["depth"]),
            "-s", str(case["size"])]
    if case["step"] is not None:
        argv += ["-S", str(case["step"])]
    if case["write"]:
        argv += ["-w", "--pattern=165"]
    argv.append(image)
    return argv


def run_tool(argv, timeout):
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"FAILED (timeout after {timeout}s): {shlex.join(argv)}")
    if p.returncode != 0:
        sys.stderr.write(p.stdout)
        sys.stderr.write(p.stderr)
        raise SystemExit(f"FAILED (exit status {p.returncode}): {shlex.join(argv)}")
    m = RUN_RE.search(p.stdout)
    if not m:
        sys.stderr.write(p.stdout)
        sys.stderr.write(p.stderr)
        raise SystemExit(f"FAILED (no 'Run completed' line): {shlex.join(argv)}")
    return float(m.group(1))


def first_line(argv):
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return f"<{e}>"
    return (p.stdout.strip().splitlines() or ["<no output>"])[0]


def resolve_tool(path, what):
    if os.sep not in path:
        found = shutil.which(path)
        if not found:
            raise SystemExit(f"{what} not found in PATH: {path}")
        path = found
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SystemExit(f"{what} is not an executable file: {path}")
    return os.path.abspath(path)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fs_of(path):
    try:
        p = subprocess.run(["df", "-T", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        fields = p.stdout.strip().splitlines()[-1].split()
        return f"{fields[0]} ({fields[1]})"
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def make_image(path, size):
    """Fully write `size` bytes of random data (O_DIRECT writes, then fsync)."""
    mib = 1 << 20
    if size % mib == 0:
        subprocess.run(["dd", "if=/dev/urandom", f"of={path}", f"bs={mib}",
                        f"count={size // mib}", "oflag=direct", "conv=fsync",
                        "status=none"], check=True)
    else:
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, mib)
                f.write(os.urandom(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
    if os.path.getsize(path) != size:
        raise SystemExit(f"image {path} has the wrong size")


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def mean_sd(xs):
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return m, sd


def fmt_pm(m, sd, digits):
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def speed_of(case, seconds):
    """IOPS for 4 KiB cases, MiB/s for 1 MiB sequential cases."""
    if case["kind"] == "seq":
        return case["count"] * case["size"] / seconds / (1 << 20)
    return case["count"] / seconds


def render_table(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        cells = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)]
        out.append(" | ".join(cells))
        if n == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


# -- helpers the other bench scripts share (bench_convert, bench_nbd, bench_backup) --

def drop_cache(path):
    """Evicts a file from the page cache, so the next run reads the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rm(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def run_meta(vblk, versions, **fields):
    """What every results file records about the run: command line, date,
    kernel, cpu, the vblk binary (path, version, sha256), each tool's
    version (`versions`: key -> argv printing it first) and `fields`."""
    meta = {
        "command": shlex.join(["python3"] + sys.argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "kernel": " ".join([platform.system(), platform.release(), platform.machine()]),
        "cpu": f"{os.cpu_count()} x {cpu_model()}",
        "vblk": os.path.relpath(vblk, REPO_ROOT) if vblk.startswith(REPO_ROOT) else os.path.basename(vblk),
        "vblk_version": first_line([vblk, "--version"]),
        "vblk_sha256": sha256_of(vblk),
    }
    meta.update({k: first_line(argv) for k, argv in versions.items()})
    meta.update(fields)
    meta["loadavg_start"] = loadavg()
    return meta


def write_json(path, meta, results):
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
            f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vblk", default=os.path.join(REPO_ROOT, "build", "vblk"),
                    help="vblk binary (default: <repo>/build/vblk)")
    ap.add_argument("--qemu-img", default="qemu-img", help="qemu-img binary (default: from PATH)")
    ap.add_argument("--runs", type=int, default=None, help="runs per case and tool (default 5, 2 with --quick)")
    ap.add_argument("--dir", default=None,
                    help="directory for the image (default: new temp dir under /var/tmp)")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"), help="image size (default 1G)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: request counts / {QUICK_DIVISOR}, 2 runs unless --runs is given")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write results as JSON to FILE")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="run only the cases whose name matches REGEX (e.g. 'seq-1m')")
    ap.add_argument("--keep", action="store_true", help="keep the image file afterwards")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed rounds of all cases before measuring (default 1, 0 with --quick)")
    ap.add_argument("--timeout", type=float, default=600, help="per-invocation timeout in seconds")
    args = ap.parse_args()

    runs = args.runs if args.runs is not None else (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if runs < 1:
        ap.error("--runs must be >= 1")
    if warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.size % (1 << 20) != 0:
        ap.error("--size must be a multiple of 1 MiB")
    vblk = resolve_tool(args.vblk, "vblk")
    qemu = resolve_tool(args.qemu_img, "qemu-img")
    tools = [("vblk", vblk), ("qemu-img", qemu)]

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        workdir, own_dir = os.path.abspath(args.dir), False
    else:
        workdir, own_dir = tempfile.mkdtemp(prefix="vblk-bench-", dir="/var/tmp"), True
    image = os.path.join(workdir, f"bench-{human_size(args.size)}.raw")

    cases = build_cases(args.size, args.quick)
    if args.only:
        cases = [c for c in cases if re.search(args.only, c["name"])]
        if not cases:
            ap.error(f"--only {args.only!r} matches no case")
    started = datetime.datetime.now().astimezone()
    meta = {
        "command": shlex.join(["python3"] + sys.argv),
        "date": started.isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": " ".join([platform.system(), platform.release(), platform.machine()]),
        "cpu": f"{os.cpu_count()} x {cpu_model()}",
        "vblk": os.path.relpath(vblk, REPO_ROOT) if vblk.startswith(REPO_ROOT) else os.path.basename(vblk),
        "vblk_version": first_line([vblk, "--version"]),
        "vblk_sha256": sha256_of(vblk),
        "qemu_img": qemu,
        "qemu_img_version": first_line([qemu, "--version"]),
        "image": image,
        "image_size": args.size,
        "image_fs": fs_of(workdir),
        "runs": runs,
        "warmup_rounds": warmup,
        "quick": args.quick,
        "random_step": scatter_step(args.size),
        "loadavg_start": loadavg(),
    }
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}")
    print(f"# host:     {meta['host']}; kernel: {meta['kernel']}")
    print(f"# cpu:      {meta['cpu']}")
    print(f"# vblk:     {meta['vblk_version']}  ({meta['vblk']})")
    print(f"# qemu-img: {meta['qemu_img_version']}  ({qemu})")
    print(f"# load:     {meta['loadavg_start']} (1/5/15 min) at start")
    print(f"# image:    {image}, {human_size(args.size)} raw, random data, on {meta['image_fs']}")
    print(f"# runs:     {runs} per case per tool, interleaved, order alternating per run"
          f"{'  [QUICK]' if args.quick else ''}; {warmup} warm-up round(s) discarded")
    print(f"# 4k 'random' step: -S {meta['random_step']} "
          f"({meta['random_step'] // BLOCK} blocks of 4 KiB, co-prime with {args.size // BLOCK})")
    print("# all cases: -f raw -t none (O_DIRECT)")
    print(flush=True)

    t0 = time.monotonic()
    try:
        print(f"creating {image} ...", file=sys.stderr, flush=True)
        make_image(image, args.size)
        for w in range(warmup):
            for case in cases:
                for name, path in tools:
                    t = run_tool(bench_argv(path, case, image), args.timeout)
                    print(f"warm-up {w + 1}/{warmup} {case['name']:<32} {name:<8} {t:7.3f} s",
                          file=sys.stderr, flush=True)
        times = {c["name"]: {name: [] for name, _ in tools} for c in cases}
        for r in range(runs):
            order = tools if r % 2 == 0 else tools[::-1]
            for case in cases:
                for name, path in order:
                    t = run_tool(bench_argv(path, case, image), args.timeout)
                    times[case["name"]][name].append(t)
                    print(f"run {r + 1}/{runs} {case['name']:<32} {name:<8} {t:7.3f} s",
                          file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            try:
                os.unlink(image)
            except FileNotFoundError:
                pass
            if own_dir:
                shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - t0
    meta["loadavg_end"] = loadavg()
    if sha256_of(vblk) != meta["vblk_sha256"]:
        print(f"WARNING: {vblk} changed during the benchmark; results mix two builds",
              file=sys.stderr)
        meta["vblk_changed_during_run"] = True

    rows = [["case", "count", "vblk (s)", "qemu-img (s)", "vblk speed", "qemu-img speed", "unit",
             "vblk/qemu"]]
    results = []
    for case in cases:
        tv, tq = times[case["name"]]["vblk"], times[case["name"]]["qemu-img"]
        sv = [speed_of(case, t) for t in tv]
        sq = [speed_of(case, t) for t in tq]
        (mtv, sdtv), (mtq, sdtq) = mean_sd(tv), mean_sd(tq)
        (msv, sdsv), (msq, sdsq) = mean_sd(sv), mean_sd(sq)
        paired = [a / b for a, b in zip(sv, sq)]
        ratio = msv / msq
        ratio_sd = statistics.stdev(paired) if len(paired) > 1 else 0.0
        unit = "MiB/s" if case["kind"] == "seq" else "IOPS"
        rows.append([case["name"], str(case["count"]), fmt_pm(mtv, sdtv, 3), fmt_pm(mtq, sdtq, 3),
                     fmt_pm(msv, sdsv, 0), fmt_pm(msq, sdsq, 0), unit,
                     f"{ratio:.2f} ± {ratio_sd:.2f}"])
        results.append({
            "case": case["name"],
            "params": {k: case[k] for k in ("kind", "write", "depth", "aio", "size", "step", "count")},
            "argv": {name: bench_argv(path, case, image)[1:] for name, path in tools},
            "unit": unit,
            "vblk": {"seconds": tv, "speed": sv, "seconds_mean": mtv, "seconds_stdev": sdtv,
                     "speed_mean": msv, "speed_stdev": sdsv},
            "qemu-img": {"seconds": tq, "speed": sq, "seconds_mean": mtq, "seconds_stdev": sdtq,
                         "speed_mean": msq, "speed_stdev": sdsq},
            "ratio_vblk_over_qemu": ratio,
            "paired_ratios": paired,
            "paired_ratio_stdev": ratio_sd,
        })

    print(render_table(rows))
    print()
    slower = [r for r in results if r["ratio_vblk_over_qemu"] < 1.0]
    if slower:
        print("vblk slower than qemu-img in: " + ", ".join(
            f"{r['case']} ({(1 - r['ratio_vblk_over_qemu']) * 100:.1f}% slower)" for r in slower))
    else:
        print("vblk at least as fast as qemu-img in every case")
    print(f"# total wall time {elapsed:.0f} s; load {meta['loadavg_end']} at end")

    meta["elapsed_seconds"] = round(elapsed, 1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
