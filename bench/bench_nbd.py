#!/usr/bin/env python3
"""Side-by-side benchmark of NBD servers with fio: `vblk nbd` against
`qemu-nbd` in each of its aio modes and against the NBD client's ceiling (the
same fio client against `nbdkit null`), in one run on the same images.

Images (--size, default 2 GiB, on a real disk under /var/tmp):
  raw           raw, fully written with random data
  qcow2-full    qcow2 with preallocation=falloc, then fully written with
                random data (through qemu-img convert -n)
  qcow2-falloc  (--images) qcow2 created with -o preallocation=falloc (every
                cluster allocated, the data area never written)

Workloads: fio 4 KiB randread and randwrite (--rw adds randrw, 50 % reads)
at iodepth 32, with 1 and with 4 jobs (one NBD connection per job),
--runtime seconds each after a --ramp second ramp.

Environments:
  device    fio --ioengine=io_uring --direct=1 on the raw image file (fio
            writing into a qcow2 file would break it): the device limit for
            every image, measured in the same run
  client    fio's nbd engine against `nbdkit null` (a server that does no
            I/O at all): the most fio's NBD client can do on this machine,
            whatever the server; "%cli" columns divide by it
  vblk      vblk nbd -f FMT --cache=none --aio=io_uring -e 8 -t, unix socket
  vblk-wb   vblk nbd ... --cache=writeback --aio=threads (the page cache, as
            qemu-nbd's default; the like-for-like of qn-thr-wb)
  qn-native qemu-nbd -f FMT --cache=none --aio=native -e 8 -t (native AIO
            needs O_DIRECT, so cache=none only)
  qn-uring  qemu-nbd ... --cache=none --aio=io_uring
  qn-thr    qemu-nbd ... --cache=none --aio=threads
  qn-thr-wb qemu-nbd ... --cache=writeback --aio=threads (qemu-nbd's default
            cache mode, through the host page cache: the page cache is
            dropped before each run)
  nbdkit    (--envs) nbdkit file FILE fadvise=random (raw only; nbdkit's
            file plugin has no O_DIRECT)
--page-cache (for images on tmpfs, --dir /dev/shm/...): no device in the way,
so what is left is each server's own path against the client's: device is
fio without O_DIRECT, every server runs with --cache=writeback (vblk and
vblk-wb, qn-uring and qn-thr; qn-native, which needs O_DIRECT, and
qn-thr-wb, then the same as qn-thr, are left out).
fio reaches the servers with --ioengine=nbd --uri=nbd+unix:///?socket=...
Each server is started for its measurement and stopped after it; the
environments run interleaved, the order rotating per run.

Reported: IOPS (read + write) mean ± stdev per environment, the fastest
qemu-nbd configuration of each case, and vblk's ratio against it and against
the client ceiling (mean over mean). Python 3 standard library only.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402



# qemu-nbd configurations: (cache, aio).
QEMU_NBD = {"qn-native": ("none", "native"), "qn-uring": ("none", "io_uring"), "qn-thr": ("none", "threads"),
            "qn-thr-wb": ("writeback", "threads")}


def wait_socket(path, proc, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        if os.path.exists(path):
            try:
                out = subprocess.run(["nbdinfo", "--size", f"nbd+unix:///?socket={path}"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=5)
                if out.returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.05)
    raise SystemExit(f"server socket {path} did not come up")


def server_argv(env, vblk, fmt, image, sock, baseline=None, page_cache=False):
    argv = _server_argv(env, vblk, fmt, image, sock, baseline)
    return [("--cache=writeback" if a == "--cache=none" else a) for a in argv] if page_cache else argv


def _server_argv(env, vblk, fmt, image, sock, baseline=None):
    if env == "vblk-base":
        return [baseline, "nbd", "-f", fmt, "--cache=none", "--aio=io_uring", "-e", "8", "-t", "-k", sock, image]
    if env == "vblk":
        return [vblk, "nbd", "-f", fmt, "--cache=none", "--aio=io_uring", "-e", "8", "-t", "-k", sock, image]
    if env == "vblk-wb":
        return [vblk, "nbd", "-f", fmt, "--cache=writeback", "--aio=threads", "-e", "8", "-t", "-k", sock, image]
    if env in QEMU_NBD:
        cache, aio = QEMU_NBD[env]
        return ["qemu-nbd", "-f", fmt, f"--cache={cache}", f"--aio={aio}", "-e", "8", "-t", "-k", sock, image]
    if env == "nbdkit":
        return ["nbdkit", "-f", "--exit-with-parent", "-U", sock, "file", image, "fadvise=random"]
    if env == "client":
        return ["nbdkit", "-f", "--exit-with-parent", "-U", sock, "null", str(os.path.getsize(image))]
    raise AssertionError(env)


def fio_argv(target, rw, jobs, args):
    argv = ["fio", "--output-format=json", "--name=job", f"--rw={rw}", "--bs=4k", "--iodepth=32",
            f"--numjobs={jobs}", "--group_reporting", "--time_based", f"--runtime={args.runtime}",
            f"--ramp_time={args.ramp}", "--norandommap", "--randrepeat=0"]
    if rw == "randrw":
        argv.append("--rwmixread=50")
    if target.startswith("nbd"):
        argv += ["--ioengine=nbd", f"--uri={target}"]
    else:
        argv += ["--ioengine=io_uring", f"--direct={0 if args.page_cache else 1}", f"--filename={target}",
                 f"--size={os.path.getsize(target)}"]
    return argv


def run_fio(argv):
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-2000:])
        raise SystemExit(f"FAILED (exit status {p.returncode}): {shlex.join(argv)}")
    j = json.loads(p.stdout[p.stdout.index("{"):])
    job = j["jobs"][0]
    return job["read"]["iops"] + job["write"]["iops"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=bi.parse_size, default=bi.parse_size("2G"))
    ap.add_argument("--runtime", type=int, default=5, help="seconds per fio run (after the ramp)")
    ap.add_argument("--ramp", type=int, default=1)
    ap.add_argument("--only", default=None, metavar="REGEX", help="cases (image/rw/jobs) matching REGEX")
    ap.add_argument("--images", default="raw,qcow2-full", help="comma-separated: raw, qcow2-full, qcow2-falloc")
    ap.add_argument("--rw", default="randread,randwrite", help="comma-separated fio rw modes")
    ap.add_argument("--jobs", default="1,4", help="comma-separated connection counts")
    ap.add_argument("--envs", default=None, metavar="REGEX", help="environments matching REGEX")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--page-cache", action="store_true",
                    help="servers through the page cache (images on tmpfs): each server's own path, no device")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--baseline", default=None, metavar="VBLK",
                    help="an earlier vblk binary, run as environment vblk-base beside the others (regressions)")
    args = ap.parse_args()
    vblk = bi.resolve_tool(args.vblk, "vblk")
    baseline = bi.resolve_tool(args.baseline, "vblk") if args.baseline else None
    for tool in ("qemu-nbd", "qemu-img", "nbdkit", "nbdinfo", "fio"):
        bi.resolve_tool(tool, tool)
    own_dir = not args.dir
    workdir = tempfile.mkdtemp(prefix="vblk-bench-nbd-", dir="/var/tmp") if own_dir else os.path.abspath(args.dir)
    os.makedirs(workdir, exist_ok=True)
    W = lambda n: os.path.join(workdir, n)  # noqa: E731
    all_images = {"raw": ("raw", "raw", W("img.raw")), "qcow2-full": ("qcow2-full", "qcow2", W("full.qcow2")),
                  "qcow2-falloc": ("qcow2-falloc", "qcow2", W("falloc.qcow2"))}
    images = [all_images[i] for i in args.images.split(",")]
    cases = [(img, rw, int(jobs)) for img in images for rw in args.rw.split(",") for jobs in args.jobs.split(",")]
    if args.only:
        cases = [c for c in cases if re.search(args.only, f"{c[0][0]}/{c[1]}/{c[2]}")]
    envs = ["device", "client", "vblk", "vblk-wb"] + (["vblk-base"] if baseline else []) + list(QEMU_NBD) + ["nbdkit"]
    envs = [e for e in envs if re.search(args.envs, e)] if args.envs else [e for e in envs if e != "nbdkit"]
    if args.page_cache:
        envs = [e for e in envs if e not in ("qn-native", "qn-thr-wb")]
    meta = bi.run_meta(vblk, {"qemu_nbd_version": ["qemu-nbd", "--version"], "nbdkit_version": ["nbdkit", "--version"],
                              "fio_version": ["fio", "--version"]},
                       image_fs=bi.fs_of(workdir), runs=args.runs, runtime=args.runtime, ramp=args.ramp)
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']} ({meta['vblk']}); {meta['qemu_nbd_version']}; "
          f"{meta['nbdkit_version']}; {meta['fio_version']}")
    print(f"# images:   {bi.human_size(args.size)} on {meta['image_fs']}"
          + ("; every server with --cache=writeback (--page-cache)" if args.page_cache else ""))
    print(f"# load:     {meta['loadavg_start']} (1/5/15 min) at start")
    print(f"# runs:     {args.runs} per case and environment, interleaved, order rotating; fio 4k iodepth 32, "
          f"{args.runtime} s + {args.ramp} s ramp", flush=True)
    t_start = time.monotonic()
    sock = W("nbd.sock")
    results = []
    try:
        print("creating images ...", file=sys.stderr, flush=True)
        bi.make_image(W("img.raw"), args.size)
        names = {i[0] for i in images}
        if "qcow2-falloc" in names:
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=falloc",
                            W("falloc.qcow2"), str(args.size)], check=True)
        if "qcow2-full" in names:
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=falloc",
                            W("full.qcow2"), str(args.size)], check=True)
            cache = "writeback" if args.page_cache else "none"
            subprocess.run(["qemu-img", "convert", "-n", "-t", cache, "-f", "raw", "-O", "qcow2", W("img.raw"),
                            W("full.qcow2")], check=True)
        iops = {f"{c[0][0]}/{c[1]}/{c[2]}": {} for c in cases}
        for r in range(args.runs):
            for (name, fmt, image), rw, jobs in cases:
                key = f"{name}/{rw}/{jobs}"
                case_envs = [e for e in envs if e != "nbdkit" or fmt == "raw"]
                k = r % len(case_envs)
                for env in case_envs[k:] + case_envs[:k]:
                    if env == "device":
                        v = run_fio(fio_argv(W("img.raw"), rw, jobs, args))
                    else:
                        if os.path.exists(sock):
                            os.unlink(sock)
                        bi.drop_cache(image)
                        argv = server_argv(env, vblk, fmt, image, sock, baseline, args.page_cache)
                        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                        try:
                            wait_socket(sock, proc)
                            v = run_fio(fio_argv(f"nbd+unix:///?socket={sock}", rw, jobs, args))
                        finally:
                            proc.send_signal(signal.SIGTERM)
                            try:
                                proc.wait(timeout=30)
                            except subprocess.TimeoutExpired:
                                proc.kill()
                                proc.wait()
                    iops[key].setdefault(env, []).append(v)
                    print(f"run {r + 1}/{args.runs} {key:<24} {env:<9} {v:9.0f} IOPS", file=sys.stderr, flush=True)
        # The images must still be valid after all the writes.
        for name, fmt, image in images:
            if fmt == "qcow2":
                p = subprocess.run(["qemu-img", "check", "-q", image])
                if p.returncode != 0:
                    print(f"WARNING: qemu-img check failed on {name}", file=sys.stderr)
                meta[f"check_{name}"] = p.returncode
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["elapsed_seconds"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = bi.loadavg()
    qn = [e for e in envs if e in QEMU_NBD]
    ours = [e for e in ("vblk", "vblk-wb") if e in envs]
    header = (["case"] + [f"{e} IOPS" for e in envs] + ["fastest qemu-nbd"] +
              [h for e in ours for h in (f"{e} %dev", f"{e} %cli", f"{e}/qn-best")] +
              (["vblk/base"] if baseline else []))
    rows = [header]
    short_cli = {e: [] for e in ours}
    short_qn = {e: [] for e in ours}
    mean = lambda per, e: statistics.fmean(per[e]) if per.get(e) else None  # noqa: E731
    for key, per in iops.items():
        dev, cli = mean(per, "device"), mean(per, "client")
        best = max((e for e in qn if per.get(e)), key=lambda e: mean(per, e), default=None)
        row = [key] + [bi.fmt_pm(*bi.mean_sd(per[e]), 0) if per.get(e) else "" for e in envs]
        row.append(f"{best} {mean(per, best):.0f}" if best else "")
        res = {"case": key, "iops": per}
        for e in ours:
            v = mean(per, e)
            row.append(f"{100 * v / dev:.0f} %" if v and dev else "")
            row.append(f"{100 * v / cli:.0f} %" if v and cli else "")
            row.append(f"{v / mean(per, best):.2f}" if v and best else "")
            if v and cli and 100 * v / cli < 90:
                short_cli[e].append(key)
            if v and best:
                res[f"{e}_over_fastest_qemu_nbd"] = v / mean(per, best)
                if v / mean(per, best) < 1.5:
                    short_qn[e].append(key)
        if baseline:
            v, b = mean(per, "vblk"), mean(per, "vblk-base")
            row.append(f"{v / b:.2f}" if v and b else "")
        rows.append(row)
        if dev:
            res["percent_of_device"] = {e: 100 * mean(per, e) / dev for e in per if e != "device"}
        if cli:
            res["percent_of_client"] = {e: 100 * mean(per, e) / cli for e in per if e not in ("device", "client")}
        if best:
            res["fastest_qemu_nbd"] = best
        results.append(res)
    print()
    print(bi.render_table(rows))
    print()
    for e in ours:
        print(f"{e} >= 90 % of the client ceiling in every case" if not short_cli[e]
              else f"{e} below 90 % of the client ceiling in: {', '.join(short_cli[e])}")
        print(f"{e} >= 1.5x the fastest qemu-nbd in every case" if not short_qn[e]
              else f"{e} below 1.5x the fastest qemu-nbd in: {', '.join(short_qn[e])}")
    print(f"# total wall time {meta['elapsed_seconds']:.0f} s; load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
