#!/usr/bin/env python3
"""Saving a VM state: vblk's buffered async writer against fio's sequential write.

Cases, each run --runs times with the tools alternating, all O_DIRECT on
one file system (default a temp dir under /var/tmp):
  fio-seq-1m      fio, 1 MiB sequential writes at queue depth 8 with
                  io_uring into a fresh file (the bound for a stream);
  vblk-16-4k      vblk_vmstate_bench: the stream in random pieces of 16 B
                  to 4 KiB (what migration code writes) into a fresh qcow2
                  (64 KiB clusters), through VmstateWriter (1 MiB buffers,
                  8 workers), then the snapshot;
  vblk-64k        the same in 64 KiB pieces.
Prints mean ± stdev MB/s and the ratio to fio (SPEC part 6's bar: >= 90 %).
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


def run_fio(path, size):
    r = subprocess.run(["fio", "--output-format=json", "--name=seq", "--filename=" + path, "--rw=write",
                        "--bs=1M", "--iodepth=8", "--ioengine=io_uring", "--direct=1", "--size=%d" % size,
                        "--end_fsync=1"], capture_output=True, text=True, check=True)
    job = json.loads(r.stdout)["jobs"][0]
    # Elapsed including the final fsync, as the writer's flush counts too.
    secs = job["job_runtime"] / 1000.0
    return size / secs / 1e6


def run_vblk(tool, path, size, lo, hi):
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", path, "1G"], check=True)
    r = subprocess.run([tool, path, str(size), str(lo), str(hi), "direct"], capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout)["mb_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool", default=os.path.join(REPO, "build", "vblk_vmstate_bench"))
    ap.add_argument("--size", type=parse_size, default=parse_size("2G"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="256 MiB, 2 runs")
    args = ap.parse_args()
    if args.quick:
        args.size, args.runs = 256 << 20, 2
    if not shutil.which("fio"):
        sys.exit("fio not found")
    d = tempfile.mkdtemp(prefix="vblk-bench-vmstate-", dir=args.dir or "/var/tmp")
    cases = [("fio-seq-1m", lambda p: run_fio(p, args.size)),
             ("vblk-16-4k", lambda p: run_vblk(args.tool, p, args.size, 16, 4096)),
             ("vblk-64k", lambda p: run_vblk(args.tool, p, args.size, 65536, 65536))]
    res = {name: [] for name, _ in cases}
    try:
        for run in range(args.runs):
            order = cases if run % 2 == 0 else list(reversed(cases))
            for name, fn in order:
                path = os.path.join(d, name)
                mbs = fn(path)
                os.unlink(path)
                res[name].append(mbs)
                print("run %d %-12s %8.1f MB/s" % (run, name, mbs), file=sys.stderr)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    fio = statistics.mean(res["fio-seq-1m"])
    print("VM state of %d MiB, O_DIRECT, %d runs" % (args.size >> 20, args.runs))
    print("%-12s %18s %8s" % ("case", "MB/s", "vs fio"))
    for name, _ in cases:
        v = res[name]
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        print("%-12s %10.1f ± %5.1f %7.0f%%" % (name, statistics.mean(v), sd, 100 * statistics.mean(v) / fio))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
