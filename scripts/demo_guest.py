#!/usr/bin/env python3
"""What a guest feels while it is backed up: the demo's three lines of IOPS.

Starts `vblk serve` with a disk of random data exported over NBD and a
backup target that takes only TARGET_MB_S (a `throttle` node: a slow backup
server), and runs a fio guest (randwrite 32 KiB, iodepth 8, fio's nbd engine)
for SECONDS three times:
  1. alone;
  2. while a full backup runs without a buffer: every write to a range not
     yet copied must first copy the old data to the slow target;
  3. while a full backup runs with vblk's copy-before-write buffer: 256 MiB
     of memory and a spill file in WORKDIR as large as the disk
     (blockdev-backup x-perf cow-buffer-size, cow-spill-dir, cow-spill-size):
     the old data is parked there and the write goes on at once.
Each backup is cancelled after its phase. Prints one line per phase (a
vblk without the COW buffer says so on the third line). The same as
bench/bench_guest.py's vblk and vblk-spill rows, in short.

Usage: demo_guest.py VBLK WORKDIR [SIZE_MIB [SECONDS [TARGET_MB_S]]]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bench_guest as bg  # noqa: E402
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon  # noqa: E402

MiB = 1 << 20
BUFFER = 256 * MiB
LABEL3 = "during a backup, COW buffer + spill:"


def line(what, r, alone=None):
    iops, mean, p99 = r
    pct = iops / alone[0] * 100 if alone else 0
    kept = f"  ({pct:.{1 if pct >= 1 else 2}f} % of alone)" if alone else ""
    return f"{what:38s} {iops:8.0f} IOPS  mean {mean:8.2f} ms  p99 {p99:8.2f} ms{kept}"


def backup_phase(q, sock, job, x_perf, secs):
    args = {"job-id": job, "device": "disk", "target": "target", "sync": "full"}
    if x_perf:
        args["x-perf"] = x_perf
    bg.qmp_setup(q, "blockdev-backup", args)
    r = bg.fio_guest(sock, secs, 8, os.path.dirname(sock))
    if q.ok("query-block-jobs"):
        q.ok("block-job-cancel", {"device": job, "force": True})
        q.next_event({"BLOCK_JOB_CANCELLED", "BLOCK_JOB_COMPLETED"}, 600)
    return r


def main():
    vblk, work = sys.argv[1], sys.argv[2]
    size = int(sys.argv[3]) * MiB if len(sys.argv) > 3 else 512 * MiB
    secs = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    rate = int(float(sys.argv[5]) * 1e6) if len(sys.argv) > 5 else 50 * 1000 * 1000
    src, dst = os.path.join(work, "guest-disk.raw"), os.path.join(work, "guest-backup.raw")
    bi.make_image(src, size)
    with open(dst, "wb") as f:
        f.truncate(size)
    sock = os.path.join(work, "nbd.sock")
    bi.rm(sock)
    print(f"== a {size // MiB} MiB disk exported by vblk serve; fio writes 32 KiB blocks at random offsets through "
          f"NBD for {secs} s per line; the backup target takes {rate / 1e6:.0f} MB/s")
    d = Daemon([vblk, "serve"] + bg.daemon_args(work, src, dst, rate), os.path.join(work, "qmp.sock"),
               os.path.join(work, "daemon.log"))
    try:
        alone = bg.fio_guest(sock, secs, 8, work)
        print(line("guest alone:", alone), flush=True)
        r = backup_phase(d.qmp, sock, "b0", None, secs)
        print(line("during a backup, no buffer:", r, alone), flush=True)
        try:
            r = backup_phase(d.qmp, sock, "b1", {"cow-buffer-size": BUFFER, "cow-spill-dir": work,
                                                  "cow-spill-size": size}, secs)
            print(line(LABEL3, r, alone))
        except bg.Unsupported as e:
            print(f"{LABEL3:38s} not in this build ({e})")
        d.quit(120)
        d = None
    finally:
        if d is not None:
            d.kill()
        for p in (src, dst):
            bi.rm(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
