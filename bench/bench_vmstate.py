#!/usr/bin/env python3
"""Saving and loading a VM state: vblk's buffered async writer and reader
against fio's sequential write and read of the same size, same file system.

Cases, each run --runs times with the order alternating:
  fio-direct      fio, 1 MiB sequential writes at queue depth 8 with
                  io_uring, O_DIRECT, into a fresh file (+ final fsync), then
                  the same reads: the bound for a stream on this disk;
  fio-direct-4m   the same in 4 MiB writes and reads (the ratios are
                  against the faster fio row of the same cache mode);
  fio-cached      the same through the page cache (the read after the
                  file's cache was dropped);
  vblk-direct     vblk_vmstate_bench: the stream in random pieces of 16 B
                  to 4 KiB (what migration code writes) into a fresh qcow2
                  (64 KiB clusters), through VmstateWriter (4 MiB buffers,
                  8 workers), then the snapshot; loaded back through
                  VmstateReader; O_DIRECT;
  vblk-cached     the same through the page cache (+ flush; the load after
                  the cache was dropped);
  qemufile-direct the same pieces written unbuffered, QEMU 7.2's way
                  through the same node API: a 32 KiB QEMUFile buffer, each
                  written synchronously, one at a time (and loaded so);
  qemufile-cached the same, through the page cache.
Prints mean ± stdev MB/s of save and load and the ratio to fio's write and
read with the same cache mode (SPEC part 6's bar: vblk-direct >= 90 % of
fio-direct). QEMU's own savevm of a real VM is bench_savevm_vm.py.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def fio_job(path, size, rw, direct, bs):
    argv = ["fio", "--output-format=json", "--name=seq", "--filename=" + path, "--rw=" + rw, "--bs=" + bs,
            "--iodepth=8", "--ioengine=io_uring", "--direct=%d" % direct, "--size=%d" % size]
    if rw == "write":
        argv.append("--end_fsync=1")
    r = subprocess.run(argv, capture_output=True, text=True, check=True)
    job = json.loads(r.stdout)["jobs"][0]
    # Elapsed including the final fsync, as the writer's flush counts too.
    return size / (job["job_runtime"] / 1000.0) / 1e6


def drop_cache(path):
    subprocess.run(["dd", "if=" + path, "iflag=nocache", "count=0", "status=none"], check=True)


def run_fio(path, size, direct, bs="1M"):
    w = fio_job(path, size, "write", direct, bs)
    drop_cache(path)
    return w, fio_job(path, size, "read", direct, bs)


def run_vblk(tool, path, size, cache, mode):
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", path, "1G"], check=True)
    r = subprocess.run([tool, path, str(size), "16", "4096", cache, "8", "0", mode], capture_output=True,
                       text=True, check=True)
    j = json.loads(r.stdout)
    return j["mb_per_s"], j["load_mb_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool", default=os.path.join(REPO, "build", "vblk_vmstate_bench"))
    ap.add_argument("--size", type=parse_size, default=parse_size("2G"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="256 MiB, 2 runs")
    ap.add_argument("--cases", default="", help="comma-separated subset of the cases")
    args = ap.parse_args()
    if args.quick:
        args.size, args.runs = 256 << 20, 2
    if not shutil.which("fio"):
        sys.exit("fio not found")
    d = tempfile.mkdtemp(prefix="vblk-bench-vmstate-", dir=args.dir or "/var/tmp")
    cases = [("fio-direct", lambda p: run_fio(p, args.size, 1)),
             ("fio-direct-4m", lambda p: run_fio(p, args.size, 1, "4M")),
             ("fio-cached", lambda p: run_fio(p, args.size, 0)),
             ("vblk-direct", lambda p: run_vblk(args.tool, p, args.size, "direct", "buffered")),
             ("vblk-cached", lambda p: run_vblk(args.tool, p, args.size, "cached", "buffered")),
             ("qemufile-direct", lambda p: run_vblk(args.tool, p, args.size, "direct", "qemufile")),
             ("qemufile-cached", lambda p: run_vblk(args.tool, p, args.size, "cached", "qemufile"))]
    cases = [c for c in cases if not args.cases or c[0] in args.cases.split(",")]
    res = {name: [] for name, _ in cases}
    try:
        for run in range(args.runs):
            order = cases if run % 2 == 0 else list(reversed(cases))
            for name, fn in order:
                path = os.path.join(d, name)
                save, load = fn(path)
                os.unlink(path)
                res[name].append((save, load))
                print("run %d %-16s save %8.1f MB/s  load %8.1f MB/s" % (run, name, save, load), file=sys.stderr)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    def stat(name, i):
        v = [x[i] for x in res[name]]
        return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)

    print("VM state of %d MiB in pieces of 16 B - 4 KiB, %d runs, in %s" % (args.size >> 20, args.runs,
                                                                           args.dir or "/var/tmp"))
    print("%-16s %18s %8s %18s %8s" % ("case", "save MB/s", "vs fio", "load MB/s", "vs fio"))
    for name, _ in cases:
        refs = [r for r in res if r.startswith("fio-" + ("direct" if "direct" in name else "cached"))]
        (sm, ss), (lm, ls) = stat(name, 0), stat(name, 1)
        rs = "%7.0f%%" % (100 * sm / max(stat(r, 0)[0] for r in refs)) if refs else "       -"
        rl = "%7.0f%%" % (100 * lm / max(stat(r, 1)[0] for r in refs)) if refs else "       -"
        print("%-16s %10.1f ± %5.1f %s %10.1f ± %5.1f %s" % (name, sm, ss, rs, lm, ls, rl))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
