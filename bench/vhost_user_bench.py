#!/usr/bin/env python3
"""vhost-user-blk back ends under vblk-vhost-client's bench mode: IOPS,
MiB/s and the back end's CPU time per request (utime + stime of its
/proc/PID/stat, all threads, over the run).

Back ends (--envs; each started for its measurement and stopped after it):
  qsd-thr       qemu-storage-daemon, file node aio=threads, cache.direct=off
  qsd-thr-dio   aio=threads, cache.direct=on
  qsd-native    aio=native, cache.direct=on (native AIO needs O_DIRECT)
  qsd-uring     aio=io_uring, cache.direct=on
  qsd-uring-wb  aio=io_uring, cache.direct=off
  vblk          `vblk serve` (--vblk), the same --blockdev/--export command
                line, file node with vblk's defaults (io_uring, page cache)
  vblk-dio      the same with cache.direct=on
  vblk-b        `vblk serve` of another build (--vblk-b), vblk's command
                line: two builds side by side in one run
Every export has num-queues=--queues; the client uses that many queues.

Cases (--cases REGEX over the names): 4 KiB randread and randwrite at QD1
and QD32, 1 MiB sequential read and write at QD8 (QD per
queue). The image (--size, default 1 GiB, filled with random data; with
--format qcow2 a new empty qcow2 of 64 KiB clusters for every measurement,
so writes allocate, as on a thin VM disk) lives in
--dir (default a temp dir under /var/tmp: a real disk, so cache.direct=on
means the device; on tmpfs O_DIRECT is refused). Environments run
interleaved, the order rotating per run, --runs times (>= 3); reported: mean
± stdev of IOPS and MiB/s, daemon CPU µs per request and client CPU µs per
request, and the fastest qsd configuration per case. Python 3 standard
library only.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = [
    # name, rw, bs, qd (per queue)
    ("randread-4k-qd1", "randread", "4k", 1),
    ("randread-4k-qd32", "randread", "4k", 32),
    ("randwrite-4k-qd1", "randwrite", "4k", 1),
    ("randwrite-4k-qd32", "randwrite", "4k", 32),
    ("read-1M-qd8", "read", "1M", 8),
    ("write-1M-qd8", "write", "1M", 8),
]

QSD_ENVS = {
    "qsd-thr": "aio=threads,cache.direct=off",
    "qsd-thr-dio": "aio=threads,cache.direct=on",
    "qsd-native": "aio=native,cache.direct=on",
    "qsd-uring": "aio=io_uring,cache.direct=on",
    "qsd-uring-wb": "aio=io_uring,cache.direct=off",
}


def wait_socket(path, proc, timeout=20):
    end = time.time() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError("back end exited: %s" % proc.stderr.read().decode("utf-8", "replace"))
        if time.time() > end:
            raise RuntimeError("back end did not listen on %s" % path)
        time.sleep(0.02)


def start_qsd(args, env, image, sock):
    argv = [args.qsd, "--blockdev", "driver=file,filename=%s,node-name=f0,%s" % (image, QSD_ENVS[env]),
            "--blockdev", "driver=%s,file=f0,node-name=d0" % args.format,
            "--export", "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=%s,writable=on,"
            "num-queues=%d" % (sock, args.queues)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


VBLK_ENVS = {
    "vblk": "",
    "vblk-dio": ",cache.direct=on",
    "vblk-b": "",
}


def start_vblk(args, env, image, sock):
    """`vblk serve` with qemu-storage-daemon's command line: a raw node on a
    file node, one vhost-user-blk export (write-back, as qsd's export)."""
    binary = args.vblk_b if env == "vblk-b" else args.vblk
    argv = [binary, "serve", "--blockdev", "driver=file,filename=%s,node-name=f0%s" % (image, VBLK_ENVS[env]),
            "--blockdev", "driver=%s,file=f0,node-name=d0" % args.format,
            "--export", "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=%s,writable=on,"
            "num-queues=%d" % (sock, args.queues)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


# Environment name -> starter(args, env, image, sock) -> Popen.
BACKENDS = {e: start_qsd for e in QSD_ENVS}
BACKENDS.update({e: start_vblk for e in VBLK_ENVS})


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stderr.close()


def make_image(path, size):
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def run_one(args, env, case, image, workdir):
    name, rw, bs, qd = case
    sock = os.path.join(workdir, "vhost.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    if args.format == "qcow2":
        if os.path.exists(image):
            os.unlink(image)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=65536", image,
                        str(args.size << 20)], check=True)
    proc = BACKENDS[env](args, env, image, sock)
    try:
        wait_socket(sock, proc)
        argv = [args.client, "bench", sock, "--rw", rw, "--bs", bs, "--qd", str(qd), "--queues", str(args.queues),
                "--seconds", str(args.seconds), "--daemon-pid", str(proc.pid)]
        p = subprocess.run(argv, capture_output=True, timeout=args.seconds * 4 + 60)
        doc = json.loads(p.stdout)
        if p.returncode != 0 or "error" in doc:
            raise RuntimeError("%s %s: rc=%d %s %s" % (env, name, p.returncode, doc.get("error"), p.stderr))
        return doc
    finally:
        stop(proc)


def mean_sd(xs):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--client", default=os.path.join(ROOT, "build", "tests", "vblk-vhost-client"))
    ap.add_argument("--qsd", default=shutil.which("qemu-storage-daemon"))
    ap.add_argument("--vblk", default=os.path.join(ROOT, "build", "vblk"))
    ap.add_argument("--vblk-b", help="a second vblk build, env vblk-b")
    ap.add_argument("--format", default="raw", choices=("raw", "qcow2"))
    ap.add_argument("--dir", help="image directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--size", type=int, default=1024, help="image size in MiB (1024)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--queues", type=int, default=1)
    ap.add_argument("--envs", default=",".join(QSD_ENVS), help="comma-separated (%s)" % ",".join(BACKENDS))
    ap.add_argument("--cases", default=".", help="regex over case names")
    ap.add_argument("--json", help="write the per-run results here")
    args = ap.parse_args()
    envs = [e for e in args.envs.split(",") if e]
    for e in envs:
        if e not in BACKENDS:
            ap.error("unknown environment %s" % e)
    cases = [c for c in CASES if re.search(args.cases, c[0])]
    if not args.qsd and any(e.startswith("qsd") for e in envs):
        ap.error("qemu-storage-daemon not found")
    if "vblk-b" in envs and not args.vblk_b:
        ap.error("env vblk-b needs --vblk-b")
    workdir = tempfile.mkdtemp(prefix="vblk-vhost-bench-", dir=args.dir or "/var/tmp")
    image = os.path.join(workdir, "disk." + args.format)
    try:
        if args.format == "raw":
            make_image(image, args.size << 20)
        runs = {}
        for r in range(args.runs):
            for case in cases:
                order = envs[r % len(envs):] + envs[:r % len(envs)]
                for env in order:
                    doc = run_one(args, env, case, image, workdir)
                    runs.setdefault((case[0], env), []).append(doc)
                    sys.stderr.write("run %d %-18s %-13s %10.0f IOPS %8.1f MiB/s daemon %6.2f us/op\n" % (
                        r, case[0], env, doc["iops"], doc["mib_s"], doc.get("daemon_cpu_us_per_op", -1)))
        report = []
        print("%-18s %-13s %22s %18s %14s %14s" % ("case", "env", "IOPS", "MiB/s", "daemon us/op",
                                                   "client us/op"))
        for case in cases:
            best = None
            for env in envs:
                docs = runs[(case[0], env)]
                iops = mean_sd([d["iops"] for d in docs])
                mib = mean_sd([d["mib_s"] for d in docs])
                dcpu = mean_sd([d.get("daemon_cpu_us_per_op", 0.0) for d in docs])
                ccpu = mean_sd([d["client_cpu_us_per_op"] for d in docs])
                print("%-18s %-13s %12.0f ± %7.0f %9.1f ± %6.1f %7.2f ± %4.2f %7.2f ± %4.2f" % (
                    case[0], env, iops[0], iops[1], mib[0], mib[1], dcpu[0], dcpu[1], ccpu[0], ccpu[1]))
                report.append({"case": case[0], "env": env, "iops": iops, "mib_s": mib, "daemon_cpu_us_per_op": dcpu,
                               "client_cpu_us_per_op": ccpu, "runs": docs})
                if env.startswith("qsd") and (best is None or iops[0] > best[1]):
                    best = (env, iops[0])
            if best:
                print("%-18s fastest qsd: %s" % (case[0], best[0]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"queues": args.queues, "seconds": args.seconds, "size_mib": args.size, "format": args.format,
                           "results": report}, f, indent=1)
    finally:
        shutil.rmtree(workdir, True)


if __name__ == "__main__":
    main()
