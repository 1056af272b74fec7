#!/usr/bin/env python3
"""Daemon CPU per request and per MiB of the NBD export: `vblk serve`
against qemu-storage-daemon (aio=threads and aio=io_uring), each serving
the same raw image on tmpfs over NBD on a unix socket, in one run,
interleaved (the order rotates each repetition).

The client is `qemu-img bench` over nbd+unix:// (the same client for every
daemon, so its cost cancels out in the ratios): 4 KiB reads at depth 32,
1 MiB reads and writes at depth 8, --count requests each. The daemon's
CPU is utime + stime of its process (all threads) from /proc over the
case; IOPS is count / wall time of the client.

Usage: VBLK=build/vblk python3 bench/bench_nbd_cpu.py [--reps 3]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_bench import Daemon, add_common_args, cpu_seconds, random_image  # noqa: E402

# (name, buffer size, depth, write, count)
CASES = [("read-4k-qd32", 4096, 32, False, 200000),
         ("read-1M-qd8", 1 << 20, 8, False, 6000),
         ("write-1M-qd8", 1 << 20, 8, True, 6000)]



def nbd_daemon(argv, sock):
    if os.path.exists(sock):
        os.unlink(sock)
    return Daemon(argv, lambda: os.path.exists(sock))


def envs(args, img, sock):
    common = ["--nbd-server", "addr.type=unix,addr.path=%s" % sock,
              "--export", "type=nbd,id=e0,node-name=f0,name=disk,writable=on"]
    out = {"vblk": [args.vblk, "serve", "--blockdev", "driver=file,filename=%s,node-name=f0" % img] + common}
    if args.qsd:
        for aio in ("threads", "io_uring"):
            out["qsd-" + aio] = [args.qsd, "--blockdev",
                                 "driver=file,filename=%s,node-name=f0,aio=%s" % (img, aio)] + common
    return out


def bench(sock, size, depth, write, count, img_size):
    argv = ["qemu-img", "bench", "-f", "raw", "-c", str(count), "-d", str(depth), "-s", str(size),
            "-S", str(size), "--no-drain"]
    if write:
        argv += ["-w", "--pattern=0x5a"]
    argv.append("nbd+unix:///disk?socket=%s" % sock)
    # -S wraps at the end of the image.
    t0 = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="vblk-bench-nbd-cpu-", dir=args.dir)
    img = os.path.join(work, "img.raw")
    sock = os.path.join(work, "nbd.sock")
    random_image(img, args.size)
    print("# bench_nbd_cpu.py --size %d --reps %d (image on %s; client qemu-img bench over nbd+unix)" %
          (args.size, args.reps, "tmpfs" if args.dir.startswith("/dev/shm") else args.dir))
    e = envs(args, img, sock)
    names = list(e)
    res = {(n, c[0]): [] for n in names for c in CASES}
    try:
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for n in order:
                d = nbd_daemon(e[n], sock)
                try:
                    for name, size, depth, write, count in CASES:
                        cpu0 = cpu_seconds(d.p.pid)
                        wall = bench(sock, size, depth, write, count, args.size)
                        cpu = cpu_seconds(d.p.pid) - cpu0
                        mib = count * size / (1 << 20)
                        res[(n, name)].append((count / wall, cpu * 1e6 / count, cpu * 1e6 / mib))
                        print("run %d %-14s %-13s %9.0f IOPS daemon %8.2f us/req %8.1f us/MiB" %
                              ((rep, name, n) + res[(n, name)][-1]), file=sys.stderr)
                finally:
                    d.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ms(v, fmt="%.0f"):
        return (fmt + " ± " + fmt) % (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0)

    for name, *_ in CASES:
        print("\n## %s" % name)
        print("%-14s %18s %18s %18s" % ("env", "IOPS", "daemon us/req", "daemon us/MiB"))
        for n in names:
            r = res[(n, name)]
            print("%-14s %18s %18s %18s" % (n, ms([x[0] for x in r]), ms([x[1] for x in r], "%.2f"),
                                             ms([x[2] for x in r], "%.1f")))
        qsds = [n for n in names if n.startswith("qsd")]
        if qsds:
            best = max(qsds, key=lambda n: statistics.mean(x[0] for x in res[(n, name)]))
            v = [statistics.mean(x[i] for x in res[("vblk", name)]) for i in range(3)]
            q = [statistics.mean(x[i] for x in res[(best, name)]) for i in range(3)]
            cheapest = min(qsds, key=lambda n: statistics.mean(x[1] for x in res[(n, name)]))
            c = statistics.mean(x[1] for x in res[(cheapest, name)])
            print("vblk / %s (fastest qsd): %.2fx IOPS, %.2fx daemon CPU per request; "
                  "vblk / %s (cheapest qsd): %.2fx CPU per request" % (best, v[0] / q[0], v[1] / q[1], cheapest,
                                                                       v[1] / c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
