#!/usr/bin/env python3
"""Side-by-side benchmark of NBD servers with fio: `vblk nbd`, `qemu-nbd` and
`nbdkit file`, against fio on the image file itself (the device limit), in
one run on the same images.

Images (--size, default 2 GiB, on a real disk under /var/tmp):
  raw           raw, fully written with random data
  qcow2-falloc  qcow2 created with -o preallocation=falloc (every cluster
                allocated, the data area never written)
  qcow2-full    qcow2 with preallocation=falloc, then fully written with
                random data (through qemu-img convert -n)

Workloads: fio 4 KiB randread, randwrite and randrw (50 % reads) at iodepth
32, with 1 and with 4 jobs (one NBD connection per job), --runtime seconds
each after a --ramp second ramp.

Environments:
  device    fio --ioengine=io_uring --direct=1 on the raw image file (fio
            writing into a qcow2 file would break it): the device limit for
            every image, measured in the same run
  client    fio's nbd engine against `nbdkit null` (a server that does no
            I/O at all): the most fio's NBD client can do on this machine,
            whatever the server; "%cli" columns divide by it
  vblk      vblk nbd -f FMT --cache=none --aio=io_uring -e 8 -t, unix socket
  qemu-nbd  qemu-nbd -f FMT --cache=none --aio=io_uring -e 8 -t, unix socket
  nbdkit    nbdkit file FILE fadvise=random (raw only; nbdkit's file plugin
            has no O_DIRECT, so its reads may hit the page cache, which is
            dropped before each run)
fio reaches the servers with --ioengine=nbd --uri=nbd+unix:///?socket=...
Each server is started for its measurement and stopped after it; the
environments run interleaved, the order rotating per run.

Reported: IOPS (read + write) mean ± stdev and % of the device limit (mean
over mean). Python 3 standard library only.
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


def server_argv(env, vblk, fmt, image, sock, baseline=None):
    if env == "vblk-base":
        return [baseline, "nbd", "-f", fmt, "--cache=none", "--aio=io_uring", "-e", "8", "-t", "-k", sock, image]
    if env == "vblk":
        return [vblk, "nbd", "-f", fmt, "--cache=none", "--aio=io_uring", "-e", "8", "-t", "-k", sock, image]
    if env == "qemu-nbd":
        return ["qemu-nbd", "-f", fmt, "--cache=none", "--aio=io_uring", "-e", "8", "-t", "-k", sock, image]
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
        argv += ["--ioengine=io_uring", "--direct=1", f"--filename={target}", f"--size={os.path.getsize(target)}"]
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
    ap.add_argument("--envs", default=None, metavar="REGEX", help="environments matching REGEX")
    ap.add_argument("--dir", default=None)
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
    images = [("raw", "raw", W("img.raw")), ("qcow2-falloc", "qcow2", W("falloc.qcow2")),
              ("qcow2-full", "qcow2", W("full.qcow2"))]
    cases = [(img, rw, jobs) for img in images for rw in ("randread", "randwrite", "randrw") for jobs in (1, 4)]
    if args.only:
        cases = [c for c in cases if re.search(args.only, f"{c[0][0]}/{c[1]}/{c[2]}")]
    envs = ["device", "client", "vblk"] + (["vblk-base"] if baseline else []) + ["qemu-nbd", "nbdkit"]
    if args.envs:
        envs = [e for e in envs if re.search(args.envs, e)]
    meta = bi.run_meta(vblk, {"qemu_nbd_version": ["qemu-nbd", "--version"], "nbdkit_version": ["nbdkit", "--version"],
                              "fio_version": ["fio", "--version"]},
                       image_fs=bi.fs_of(workdir), runs=args.runs, runtime=args.runtime, ramp=args.ramp)
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']} ({meta['vblk']}); {meta['qemu_nbd_version']}; "
          f"{meta['nbdkit_version']}; {meta['fio_version']}")
    print(f"# images:   {bi.human_size(args.size)} on {meta['image_fs']}")
    print(f"# load:     {meta['loadavg_start']} (1/5/15 min) at start")
    print(f"# runs:     {args.runs} per case and environment, interleaved, order rotating; fio 4k iodepth 32, "
          f"{args.runtime} s + {args.ramp} s ramp", flush=True)
    t_start = time.monotonic()
    sock = W("nbd.sock")
    results = []
    try:
        print("creating images ...", file=sys.stderr, flush=True)
        bi.make_image(W("img.raw"), args.size)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=falloc", W("falloc.qcow2"),
                        str(args.size)], check=True)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=falloc", W("full.qcow2"),
                        str(args.size)], check=True)
        subprocess.run(["qemu-img", "convert", "-n", "-t", "none", "-f", "raw", "-O", "qcow2", W("img.raw"),
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
                        proc = subprocess.Popen(server_argv(env, vblk, fmt, image, sock, baseline), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE)
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
                    print(f"run {r + 1}/{args.runs} {key:<26} {env:<9} {v:9.0f} IOPS", file=sys.stderr, flush=True)
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
    servers = [e for e in envs if e not in ("device", "client")]
    header = (["case"] + [f"{e} IOPS" for e in envs] + [f"{e} %dev" for e in servers] +
              [f"{e} %cli" for e in servers if e != "nbdkit"] + ["vblk/qemu-nbd"] +
              (["vblk/base"] if baseline else []))
    rows = [header]
    short = []
    for key, per in iops.items():
        dev = statistics.fmean(per["device"]) if per.get("device") else None
        cli = statistics.fmean(per["client"]) if per.get("client") else None
        row = [key]
        for e in envs:
            row.append(bi.fmt_pm(*bi.mean_sd(per[e]), 0) if per.get(e) else "")
        for e in servers:
            row.append(f"{100 * statistics.fmean(per[e]) / dev:.0f} %" if per.get(e) and dev else "")
        for e in servers:
            if e != "nbdkit":
                row.append(f"{100 * statistics.fmean(per[e]) / cli:.0f} %" if per.get(e) and cli else "")
        ratio = ""
        if per.get("vblk") and per.get("qemu-nbd"):
            ratio = f"{statistics.fmean(per['vblk']) / statistics.fmean(per['qemu-nbd']):.2f}"
        row.append(ratio)
        if baseline:
            row.append(f"{statistics.fmean(per['vblk']) / statistics.fmean(per['vblk-base']):.2f}"
                       if per.get("vblk") and per.get("vblk-base") else "")
        rows.append(row)
        res = {"case": key, "iops": per}
        if dev:
            res["percent_of_device"] = {e: 100 * statistics.fmean(v) / dev for e, v in per.items() if e != "device"}
        if cli:
            res["percent_of_client"] = {e: 100 * statistics.fmean(v) / cli for e, v in per.items()
                                        if e not in ("device", "client")}
            if per.get("vblk") and key.endswith("/1") and "randrw" not in key and res["percent_of_device"]["vblk"] < 90:
                short.append(key)
        results.append(res)
    print()
    print(bi.render_table(rows))
    print()
    print("vblk >= 90 % of the device limit in every 1-connection read/write case" if not short
          else f"vblk below 90 % of the device limit in: {', '.join(short)}")
    print(f"# total wall time {meta['elapsed_seconds']:.0f} s; load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
