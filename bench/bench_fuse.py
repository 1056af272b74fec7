#!/usr/bin/env python3
"""Side-by-side benchmark of FUSE exports with fio: `vblk serve --export
type=fuse` against qemu-storage-daemon 7.2's FUSE export (its file node with
aio=threads and with aio=io_uring; the faster is the anchor) and against the
image file itself, in one run, interleaved (the order rotates per
repetition), on a raw image (--dir, default /dev/shm: no device in the way,
so what is measured is each daemon's own path).

Workloads (fio --ioengine=io_uring --direct=1 on the mounted file):
  4k randread QD32, 4k randwrite QD32, 1M read QD8, 1M write QD8.
Reported per case: IOPS and MiB/s mean ± stdev, the daemon's CPU per request
(utime + stime of the daemon over the run / requests), and vblk's ratio
against the fastest qemu-storage-daemon configuration. The `fuse-ceiling`
row is vblk's FUSE export of a null-co node (no data moved behind the
export): what the kernel's FUSE path and fio leave on this machine for any
FUSE daemon, so no export can beat qsd by more than ceiling / qsd.

When the kernel allows FUSE over io_uring (/sys/module/fuse/parameters/
enable_uring is Y), the `vblk-uring` and `fuse-ceiling-uring` rows run the
same two daemons with the export option io-uring=on (requests through
io_uring rather than read/write on /dev/fuse), interleaved with the others.

Python 3 standard library only; needs root (mount) and /dev/fuse.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_bench import Daemon, add_common_args, cpu_seconds, random_image  # noqa: E402

CASES = [("randread", "4k", 32), ("randwrite", "4k", 32), ("read", "1M", 8), ("write", "1M", 8)]



def mounted(path):
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


class FuseDaemon(Daemon):
    def __init__(self, argv, mp, env=None):
        self.mp = mp
        super().__init__(argv, lambda: mounted(mp), env)

    def stop(self):
        super().stop()
        if mounted(self.mp):
            subprocess.run(["umount", "-l", self.mp])


def uring_enabled():
    try:
        with open("/sys/module/fuse/parameters/enable_uring") as f:
            return f.read().strip() == "Y"
    except OSError:
        return False


def envs(args, img, mp):
    export = "type=fuse,id=e0,node-name=f0,mountpoint=%s,writable=on" % mp
    file_node = "driver=file,filename=%s,node-name=f0" % img
    null_node = "driver=null-co,size=%d,node-name=f0" % args.size
    vblk = [args.vblk, "serve", "--blockdev", file_node, "--export", export]
    null = [args.vblk, "serve", "--blockdev", null_node, "--export", export]
    out = {"file": None, "vblk": vblk, "fuse-ceiling": null}
    if uring_enabled():
        out["vblk-uring"] = vblk[:-1] + [export + ",io-uring=on"]
        out["fuse-ceiling-uring"] = null[:-1] + [export + ",io-uring=on"]
    if args.qsd:
        for aio in ("threads", "io_uring"):
            out["qsd-" + aio] = [args.qsd, "--blockdev", "driver=file,filename=%s,node-name=f0,aio=%s" % (img, aio),
                                 "--export", "type=fuse,id=e0,node-name=f0,mountpoint=%s,writable=on" % mp]
    return out


def fio(target, rw, bs, qd, seconds, size):
    argv = ["fio", "--name=b", "--filename=" + target, "--rw=" + rw, "--bs=" + bs, "--iodepth=%d" % qd,
            "--ioengine=io_uring", "--direct=1", "--time_based", "--runtime=%d" % seconds, "--size=%d" % size,
            "--output-format=json", "--randrepeat=0", "--norandommap"]
    r = subprocess.run(argv, capture_output=True, text=True, check=True)
    j = json.loads(r.stdout)["jobs"][0]
    ops = j["read"]["total_ios"] + j["write"]["total_ios"]
    iops = j["read"]["iops"] + j["write"]["iops"]
    mib = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / (1 << 20)
    return ops, iops, mib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--seconds", type=int, default=5)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="vblk-bench-fuse-", dir=args.dir)
    img = os.path.join(work, "img.raw")
    mp = os.path.join(work, "mnt")
    random_image(img, args.size)
    open(mp, "w").close()
    print("# bench_fuse.py --size %d --seconds %d --reps %d (image on %s)" %
          (args.size, args.seconds, args.reps, "tmpfs" if args.dir.startswith("/dev/shm") else args.dir))
    e = envs(args, img, mp)
    names = list(e)
    res = {(n, c): [] for n in names for c in CASES}
    try:
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for n in order:
                argv, env = e[n] if isinstance(e[n], tuple) else (e[n], None)
                d = FuseDaemon(argv, mp, env) if argv else None
                try:
                    for c in CASES:
                        cpu0 = cpu_seconds(d.p.pid) if d else 0
                        ops, iops, mib = fio(mp if d else img, c[0], c[1], c[2], args.seconds, args.size)
                        cpu = (cpu_seconds(d.p.pid) - cpu0) if d else 0
                        res[(n, c)].append((iops, mib, cpu * 1e6 / max(ops, 1)))
                finally:
                    if d:
                        d.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ms(v):
        return "%.0f ± %.0f" % (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0)

    for c in CASES:
        print("\n## %s %s QD%d" % c)
        print("%-18s %16s %14s %18s" % ("env", "IOPS", "MiB/s", "daemon us/req"))
        for n in names:
            r = res[(n, c)]
            print("%-18s %16s %14s %18s" % (n, ms([x[0] for x in r]), ms([x[1] for x in r]),
                                             "-" if n == "file" else ms([x[2] for x in r])))
        qsds = [n for n in names if n.startswith("qsd")]
        if qsds:
            best = max(qsds, key=lambda n: statistics.mean(x[0] for x in res[(n, c)]))
            v = statistics.mean(x[0] for x in res[("vblk", c)])
            q = statistics.mean(x[0] for x in res[(best, c)])
            vc = statistics.mean(x[2] for x in res[("vblk", c)])
            qc = statistics.mean(x[2] for x in res[(best, c)])
            print("vblk / %s (fastest qsd): %.2fx IOPS, %.2fx daemon CPU per request" % (best, v / q, vc / qc))
            if ("vblk-uring", c) in res:
                u = statistics.mean(x[0] for x in res[("vblk-uring", c)])
                uc = statistics.mean(x[2] for x in res[("vblk-uring", c)])
                print("vblk-uring / %s (fastest qsd): %.2fx IOPS, %.2fx daemon CPU per request" %
                      (best, u / q, uc / qc))
            for ce in ("fuse-ceiling", "fuse-ceiling-uring"):
                if (ce, c) in res:
                    ceil = statistics.mean(x[0] for x in res[(ce, c)])
                    print("%s / %s: %.2fx IOPS (the most any FUSE export could beat it by here)" %
                          (ce, best, ceil / q))
    return 0


if __name__ == "__main__":
    sys.exit(main())
