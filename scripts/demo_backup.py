#!/usr/bin/env python3
"""The live point-in-time backup demo (vblk's main job).

Starts `vblk serve` with a sample disk image exported over NBD (the same
command line would start qemu-storage-daemon), starts a full backup through
QMP, and while the backup runs a writer rewrites random parts of the disk
through the NBD export, as a guest would. The backup must equal the disk as
it was when the backup started, byte for byte: the copy-before-write filter
copies every range the writer touches first. Prints one summary line with the
backup's throughput.

Usage: demo_backup.py VBLK WORKDIR [SIZE_MIB [START_SPEED_MIB_S]]
"""
import hashlib
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from qmp_driver import QMP  # noqa: E402  (the bench's QMP client)

MiB = 1 << 20


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(4 * MiB)
            if not b:
                return h.hexdigest()
            h.update(b)


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit("demo: %s failed: %s" % (" ".join(cmd), r.stderr.strip()))
    return r.stdout


def main():
    vblk, work = sys.argv[1], sys.argv[2]
    size = int(sys.argv[3]) * MiB if len(sys.argv) > 3 else 1024 * MiB
    start_speed = int(sys.argv[4]) * MiB if len(sys.argv) > 4 else 32 * MiB
    disk, backup = os.path.join(work, "disk.raw"), os.path.join(work, "backup.raw")
    mon, nbd = os.path.join(work, "qmp.sock"), os.path.join(work, "nbd.sock")

    print("== sample disk: %d MiB, data in 1 MiB of every 2 MiB, the rest holes" % (size // MiB))
    run([vblk, "create", "-q", "-f", "raw", disk, str(size)])
    run([vblk, "bench", "-w", "-f", "raw", "-t", "none", "-c", str(size // (2 * MiB)), "-d", "8", "-s", "1M",
         "-S", "2M", "--pattern=0xa5", disk])
    with open(backup, "wb") as f:
        f.truncate(size)
    point_in_time = sha256(disk)

    print("== vblk serve, the disk exported over NBD (qemu-storage-daemon's options)")
    daemon = subprocess.Popen([
        vblk, "serve",
        "--blockdev", "driver=file,node-name=disk,filename=%s,cache.direct=on,aio=io_uring" % disk,
        "--blockdev", "driver=file,node-name=backup,filename=%s,cache.direct=on,aio=io_uring" % backup,
        "--nbd-server", "addr.type=unix,addr.path=%s" % nbd,
        "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on",
        "--chardev", "socket,path=%s,server=on,wait=off,id=mon0" % mon, "--monitor", "chardev=mon0"])
    try:
        end = time.time() + 30
        while not os.path.exists(mon):
            if daemon.poll() is not None or time.time() > end:
                sys.exit("demo: vblk serve did not start")
            time.sleep(0.02)
        q = QMP(mon)

        # The writer: 200 writes of 4 KiB..256 KiB at random offsets, through
        # the NBD export, while the backup runs.
        rng = random.Random(2026)
        cmds = []
        for _ in range(200):
            n = rng.randrange(4096, 256 * 1024, 4096)
            cmds += ["-c", "write -P 0x%02x %d %d" % (rng.randint(1, 255), rng.randrange(0, size - n, 4096), n)]

        print("== blockdev-backup sync=full, and the writer rewriting the disk meanwhile")
        t0 = time.monotonic()
        # The job starts slow (32 MiB/s) so that the writer surely runs during
        # it; once the writer is done the limit is lifted (set-speed takes
        # effect at once) and the rest runs at full speed.
        q.ok("blockdev-backup", {"job-id": "backup0", "device": "disk", "target": "backup", "sync": "full",
                                 "speed": start_speed})
        w = subprocess.run([vblk, "io", "-f", "raw"] + cmds + ["nbd+unix:///disk?socket=" + nbd],
                           capture_output=True, text=True)
        writer_done = time.monotonic() - t0
        if w.returncode != 0:
            sys.exit("demo: writer failed: " + w.stderr.strip())
        jobs = q.ok("query-block-jobs")
        if not jobs:
            sys.exit("demo: the backup ended before the writer did: no overlap to show")
        copied_at_lift = jobs[0]["offset"]
        t_lift = time.monotonic()
        q.ok("block-job-set-speed", {"device": "backup0", "speed": 0})
        done, _ = q.next_event({"BLOCK_JOB_COMPLETED"}, 300)
        t_end = time.monotonic()
        secs = t_end - t0
        if "error" in done["data"]:
            sys.exit("demo: backup failed: " + done["data"]["error"])
        q.ok("quit")
        daemon.wait(60)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()

    ok = sha256(backup) == point_in_time
    changed = sha256(disk) != point_in_time
    print("writer: 200 writes done %.2f s into the backup, %d MiB copied by then (%d MiB/s limit)"
          % (writer_done, copied_at_lift // MiB, start_speed // MiB))
    print("disk changed by the writer: %s; backup equals the disk at backup start: %s"
          % ("yes" if changed else "NO", "yes" if ok else "NO"))
    rest = size - copied_at_lift
    print("live backup: %d MiB in %.2f s; unthrottled part %d MiB in %.2f s = %.0f MiB/s; point in time verified: %s"
          % (size // MiB, secs, rest // MiB, t_end - t_lift, rest / MiB / max(t_end - t_lift, 1e-6),
             "OK" if ok and changed else "FAILED"))
    return 0 if ok and changed else 1


if __name__ == "__main__":
    sys.exit(main())
