#!/usr/bin/env python3
"""A sanity line, not a ranking: a TCG guest (bench/guest_vm.py) with two
vhost-user-blk disks, one served by `vblk serve`, one by
qemu-storage-daemon 7.2 (same options), each a raw image on tmpfs. In the
guest, busybox dd moves 4 KiB blocks with O_DIRECT (reads, then writes),
the disks taking turns, --reps times. Under TCG the guest's vCPU costs
several times what either daemon does per I/O, so guest IOPS say little
(issue 27); what is reported per disk is guest IOPS, QEMU's CPU per I/O
(utime + stime of qemu-system-x86_64) and the daemon's CPU per I/O.

Usage: VBLK=build/vblk python3 bench/bench_vhost_guest.py [--reps 3] [--count 8192]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest_vm  # noqa: E402
from daemon_bench import Daemon, cpu_seconds  # noqa: E402

MIB = 1 << 20



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vblk", default=os.environ.get("VBLK", "build/vblk"))
    ap.add_argument("--qsd", default=shutil.which("qemu-storage-daemon"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--count", type=int, default=8192, help="4 KiB blocks per dd")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="vblk-bench-vhost-guest-", dir="/dev/shm")
    daemons, guest = {}, None
    try:
        disks = {"vblk": 192, "qsd": 200}  # distinct sizes: the guest tells them apart
        socks = {}
        for name, mib in disks.items():
            img = os.path.join(work, name + ".raw")
            with open(img, "wb") as f:
                f.truncate(mib * MIB)
            sock = socks[name] = os.path.join(work, name + ".sock")
            cmd = [args.vblk, "serve"] if name == "vblk" else [args.qsd]
            daemons[name] = Daemon(cmd + ["--blockdev", "driver=file,filename=%s,node-name=f0" % img,
                                         "--export", "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,"
                                         "addr.path=%s,writable=on,num-queues=1" % sock],
                                   lambda sock=sock: os.path.exists(sock))
        dargs = ["-object", "memory-backend-memfd,id=mem,size=256M,share=on", "-numa", "node,memdev=mem"]
        for i, name in enumerate(disks):
            dargs += ["-chardev", "socket,id=vu%d,path=%s" % (i, socks[name]),
                      "-device", "vhost-user-blk-pci,chardev=vu%d,num-queues=1,event_idx=off" % i]
        guest = guest_vm.Guest(work, None, mem_mib=256, disk_args=dargs, virtio=True)
        if not guest.boot(timeout=400):
            raise RuntimeError("the guest did not boot: %s" % guest.log_tail())
        rc, out = guest.sh("for d in /sys/block/vd*; do echo ${d##*/} $(cat $d/size); done")
        by_size = {int(s) * 512 // MIB: d for d, s in (x.split() for x in out.split("\n") if x.strip())}
        dev = {name: "/dev/" + by_size[mib] for name, mib in disks.items()}
        qemu_pid = guest.proc.pid
        res = {(n, op): [] for n in disks for op in ("read", "write")}
        for rep in range(args.reps):
            order = list(disks)[rep % 2:] + list(disks)[:rep % 2]
            for n in order:
                for op in ("read", "write"):
                    dd = ("dd if=%s of=/dev/null bs=4k count=%d iflag=direct" if op == "read" else
                          "dd if=/dev/zero of=%s bs=4k count=%d oflag=direct") % (dev[n], args.count)
                    q0, d0, t0 = cpu_seconds(qemu_pid), cpu_seconds(daemons[n].pid), time.monotonic()
                    rc, out = guest.sh(dd + " 2>/dev/null", timeout=600)
                    wall = time.monotonic() - t0
                    if rc != 0:
                        raise RuntimeError("guest dd failed: %s" % out)
                    q, d = cpu_seconds(qemu_pid) - q0, cpu_seconds(daemons[n].pid) - d0
                    res[(n, op)].append((args.count / wall, q * 1e6 / args.count, d * 1e6 / args.count))
                    print("run %d %-5s %-5s %7.0f IOPS  qemu %7.1f us/io  daemon %6.2f us/io" %
                          ((rep, n, op) + res[(n, op)][-1]), file=sys.stderr)
    finally:
        if guest:
            guest.kill()
        for d in daemons.values():
            d.stop()
        shutil.rmtree(work, ignore_errors=True)

    def ms(v, f="%.1f"):
        return (f + " ± " + f) % (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0)

    print("# bench_vhost_guest.py --reps %d --count %d: TCG guest, busybox dd 4 KiB O_DIRECT, QD1, "
          "event_idx=off, raw images on tmpfs" % (args.reps, args.count))
    print("%-6s %-6s %16s %20s %20s" % ("op", "daemon", "guest IOPS", "qemu us/io", "daemon us/io"))
    for op in ("read", "write"):
        for n in disks:
            r = res[(n, op)]
            print("%-6s %-6s %16s %20s %20s" % (op, n, ms([x[0] for x in r], "%.0f"), ms([x[1] for x in r]),
                                                ms([x[2] for x in r], "%.2f")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
