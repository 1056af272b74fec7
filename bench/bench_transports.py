#!/usr/bin/env python3
"""vblk's transports ranked inside one TCG guest (issue 28): the same
qcow2 (64 KiB clusters, preallocation=falloc, one fresh image per
transport on the host's tmpfs) reached by fio in the guest of
bench/ublk_guest.py (trixie-backports' 7.3 kernel with ublk_drv, vduse
and virtio_vdpa; fio in the initramfs) through each way vblk serves it:

  nbd-qemu    `vblk serve` on the host, NBD export on a unix socket;
              QEMU's own NBD client (-blockdev driver=nbd) under a
              virtio-blk-pci device: the reference of the ratios
  vhost-user  `vblk serve` on the host, vhost-user-blk export; QEMU's
              vhost-user-blk-pci (guest RAM a shared memfd)
  ublk        `vblk serve` in the guest on the image attached raw as a
              virtio-blk disk (host_device, cache.direct=on), ublk export
              (/dev/ublkbN), recovery off
  ublk-rec    the same with recovery=on: each write answered only once
              it would outlive the daemon (until 83d7f97 a FUA per
              write, a flush of /dev/vdX each; since, its qcow2 metadata
              written to the file, no flush)
  vduse       `vblk serve` in the guest as for ublk, vduse-blk export,
              `vdpa dev add` -> the kernel's virtio-blk on virtio_vdpa
  raw-virtio  baseline, no vblk: QEMU's virtio-blk of a raw file (the hop
              the in-guest daemons' own disk takes)
  qemu-qcow2  baseline, no vblk: QEMU's own qcow2 driver under virtio-blk
  nbd-kernel  vblk's NBD in the guest + the kernel's nbd: needs nbd.ko and
              an nbd-client in the guest; skipped with the reason when
              they are missing (busybox-static 1.35 has no nbd-client)

Workloads (fio in the guest, direct=1, one job, time_based with a ramp):
4 KiB random read and write at QD32, 1 MiB sequential read and write at
QD4. Per run: guest IOPS and MiB/s (fio's terse output, ramp excluded);
QEMU's host CPU (utime + stime of qemu-system-x86_64, every thread) and
the daemon's CPU over the fio command, per request for the 4 KiB cases
and per MiB for the 1 MiB ones (requests and sectors completed by the
guest's fio target, /sys/block/X/stat, ramp included like the CPU); the
in-guest daemons' CPU is read in the guest (/proc/PID/stat, guest ticks
of USER_HZ = 100: 10 ms resolution) and is emulated by TCG, so it is part
of QEMU's CPU too; "busy" is the guest vCPUs' non-idle share
(/proc/stat). Workloads run one after the other; within one, every
transport in turn, the order reversed on odd repetitions. Ratios are per
repetition against nbd-qemu, then mean ± stdev over --reps.

What this can and cannot show: under TCG every guest instruction is
emulated, so the guest's vCPUs, not the storage path, bound most rows;
an in-guest daemon pays TCG for its own CPU and its I/O takes one more
virtio hop (/dev/vdX) than the host daemons', so in-guest transports
are handicapped here in a way they are not on a host or under KVM. Read
the ratios as "what the hops cost in this guest", not as a ranking on
real hardware. The machine is shared and noisy (2 cores): ratios only.

Usage:
  VBLK=build/vblk python3 bench/bench_transports.py [--reps 3]
      [--runtime 8] [--ramp 2] [--size 1G] [--engine io_uring|libaio]
      [--transports a,b,...] [--workloads a,b,...] [--dir /dev/shm]

Python 3 standard library only.
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest_vm  # noqa: E402
import ublk_guest  # noqa: E402
from daemon_bench import cpu_seconds  # noqa: E402

MIB = 1 << 20
REF = "nbd-qemu"

# name -> (where the daemon runs: "host", "guest" or None, what it is)
TRANSPORTS = {
    "nbd-qemu": ("host", "host vblk NBD (unix) -> QEMU's NBD client -> virtio-blk"),
    "vhost-user": ("host", "host vblk vhost-user-blk -> vhost-user-blk-pci"),
    "ublk": ("guest", "guest vblk on /dev/vdX -> ublk (recovery off)"),
    "ublk-rec": ("guest", "guest vblk on /dev/vdX -> ublk recovery=on"),
    "vduse": ("guest", "guest vblk on /dev/vdX -> VDUSE -> virtio_vdpa"),
    "raw-virtio": (None, "QEMU virtio-blk of a raw file, no vblk"),
    "qemu-qcow2": (None, "QEMU's qcow2 under virtio-blk, no vblk"),
    "nbd-kernel": ("guest", "guest vblk NBD -> the guest kernel's nbd"),
}

# name -> (fio rw, block size, iodepth)
WORKLOADS = {
    "randread-4k": ("randread", "4k", 32),
    "randwrite-4k": ("randwrite", "4k", 32),
    "read-1M": ("read", "1M", 4),
    "write-1M": ("write", "1M", 4),
}


def say(*a):
    print(*a, file=sys.stderr, flush=True)


def run(*argv, timeout=600):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)


def parse_size(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s.upper())
    if not m:
        raise argparse.ArgumentTypeError("size: a number with K, M or G")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def stat_cpu(line):
    """utime + stime in ticks from a /proc/PID/stat line."""
    f = line.rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


class HostDaemon:
    """`vblk serve` on the host, its output in a log file."""

    def __init__(self, argv, sock, log):
        self.log = log
        with open(log, "wb") as f:
            self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        end = time.monotonic() + 30
        while not os.path.exists(sock):
            if self.p.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError("%s did not start: %s" % (" ".join(argv), self.tail()))
            time.sleep(0.02)

    @property
    def pid(self):
        return self.p.pid

    def tail(self):
        try:
            with open(self.log, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.returncode


class Bench:
    def __init__(self, args):
        self.a = args
        self.work = tempfile.mkdtemp(prefix="vblk-bench-transports-", dir=args.dir)
        self.host = {}  # transport -> HostDaemon
        self.gpid = {}  # transport -> pid of its daemon in the guest
        self.dev = {}  # transport -> guest block device name (vdc, ublkb0, ...)
        self.images = {}  # transport -> host image path
        self.guest = None
        self.notes = []

    # --- set-up ---------------------------------------------------------
    def image(self, t, fmt):
        path = os.path.join(self.work, "%s.%s" % (t, fmt))
        opts = "preallocation=%s" % self.a.prealloc
        if fmt == "qcow2":
            opts += ",cluster_size=65536"
        r = run("qemu-img", "create", "-q", "-f", fmt, "-o", opts, path, self.a.size)
        if r.returncode != 0:
            raise RuntimeError("qemu-img create: " + r.stderr)
        self.images[t] = path
        return path

    def host_serve(self, t, export):
        img = self.image(t, "qcow2")
        sock = os.path.join(self.work, t + ".sock")
        argv = [self.a.vblk, "serve", "--blockdev", "driver=file,filename=%s,node-name=f0" % img,
                "--blockdev", "driver=qcow2,file=f0,node-name=d0"]
        if export == "nbd":
            argv += ["--nbd-server", "addr.type=unix,addr.path=%s" % sock,
                     "--export", "type=nbd,id=e0,node-name=d0,name=d0,writable=on"]
        else:
            argv += ["--export", "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=%s,"
                     "writable=on,num-queues=1" % sock]
        self.host[t] = HostDaemon(argv, sock, os.path.join(self.work, t + ".log"))
        return sock

    def start(self):
        ts = self.a.transports
        disks, serial = [], {}  # UblkGuest disks, in /dev/vda... order; serial vblk<i> -> transport
        for t in ("ublk", "ublk-rec", "vduse"):
            if t in ts:
                serial["vblk%d" % len(disks)] = t
                disks.append((self.image(t, "qcow2"), "raw"))
        if "raw-virtio" in ts:
            serial["vblk%d" % len(disks)] = "raw-virtio"
            disks.append((self.image("raw-virtio", "raw"), "raw"))
        if "qemu-qcow2" in ts:
            serial["vblk%d" % len(disks)] = "qemu-qcow2"
            disks.append((self.image("qemu-qcow2", "qcow2"), "qcow2"))
        mem = self.a.mem
        # Shared guest RAM for vhost-user, for every run alike.
        extra = ["-object", "memory-backend-memfd,id=mem,size=%dM,share=on" % mem, "-numa", "node,memdev=mem"]
        if "nbd-qemu" in ts:
            sock = self.host_serve("nbd-qemu", "nbd")
            extra += ["-blockdev", "driver=nbd,server.type=unix,server.path=%s,export=d0,node-name=nbd0" % sock,
                      "-device", "virtio-blk-pci,drive=nbd0,serial=nbdqemu"]
            serial["nbdqemu"] = "nbd-qemu"
        if "vhost-user" in ts:
            sock = self.host_serve("vhost-user", "vhost")
            extra += ["-chardev", "socket,id=vu0,path=%s" % sock,
                      "-device", "vhost-user-blk-pci,chardev=vu0,num-queues=1,event_idx=%s" % self.a.event_idx]
        t0 = time.monotonic()
        self.guest = ublk_guest.UblkGuest(self.work, self.a.vblk, disks=disks, mem_mib=mem, smp=2, extra=extra,
                                          fio=True)
        if not self.guest.boot(timeout=600):
            raise RuntimeError("the guest did not boot: %s" % self.guest.log_tail())
        say("guest up in %.0f s (initramfs %d MiB, %d MiB RAM)" % (
            time.monotonic() - t0, os.path.getsize(self.guest.initrd) >> 20, mem))
        out = self.check("for d in /sys/block/vd*; do echo ${d##*/} $(cat $d/serial 2>/dev/null); done")
        for line in out.splitlines():
            f = line.split()
            if not f:
                continue
            if len(f) > 1 and f[1] in serial:
                self.dev[serial[f[1]]] = f[0]
            elif "vhost-user" in ts:
                if "vhost-user" in self.dev:
                    raise RuntimeError("two disks without a known serial: %s" % out)
                self.dev["vhost-user"] = f[0]
        backing = {t: self.dev[t] for t in ("ublk", "ublk-rec", "vduse") if t in ts}
        for i, t in enumerate(x for x in ("ublk", "ublk-rec") if x in ts):
            self.guest_serve(t, backing[t], "type=ublk,id=e0,node-name=d0,writable=on,dev-id=%d,num-queues=1%s" % (
                i, ",recovery=on" if t == "ublk-rec" else ""))
            self.check("(i=0; until [ -b /dev/ublkb%d ]; do [ $i -lt 600 ] || exit 1; sleep 0.1; i=$((i+1)); done)"
                       % i, 90)
            self.dev[t] = "ublkb%d" % i
        if "vduse" in ts:
            before = set(self.check("ls /sys/block").split())
            self.guest_serve("vduse", backing["vduse"], "type=vduse-blk,id=e0,node-name=d0,writable=on,"
                             "name=vduse0,num-queues=1")
            self.check("i=0; while [ ! -c /dev/vduse/vduse0 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
                       "[ -c /dev/vduse/vduse0 ] && vdpa dev add name vduse0 mgmtdev vduse", 120)
            out = self.check("i=0; while [ $(ls /sys/block | grep -c vd) -le %d ] && [ $i -lt 600 ]; do sleep 0.1; "
                             "i=$((i+1)); done; ls /sys/block" % len([b for b in before if b.startswith("vd")]), 120)
            new = sorted(set(out.split()) - before)
            if len(new) != 1:
                raise RuntimeError("vduse: disks before %s, after %s" % (sorted(before), out.split()))
            self.dev["vduse"] = new[0]
        if "nbd-kernel" in ts:
            rc, out = self.guest.sh("[ -e /sys/module/nbd ] || [ -e /lib/modules/nbd.ko ] || echo NO-NBD-KO; "
                                    "busybox --list | grep -qx nbd-client || which nbd-client >/dev/null || "
                                    "echo NO-NBD-CLIENT")
            why = []
            if "NO-NBD-KO" in out:
                why.append("the guest's initramfs carries no nbd.ko (ublk_guest.MODULES)")
            if "NO-NBD-CLIENT" in out:
                why.append("its busybox has no nbd-client applet")
            if why:
                self.notes.append("nbd-kernel skipped: %s." % " and ".join(why))
                self.a.transports = [t for t in ts if t != "nbd-kernel"]
            else:
                raise RuntimeError("nbd-kernel: the guest has nbd.ko and nbd-client; not written yet")
        missing = [t for t in self.a.transports if t not in self.dev]
        if missing:
            raise RuntimeError("no guest disk found for %s: %s" % (missing, self.dev))
        # Each device readable with O_DIRECT before the first measurement.
        for t in self.a.transports:
            self.check("dd if=/dev/%s of=/dev/null bs=4k count=1 iflag=direct 2>/dev/null" % self.dev[t], 120)
        say("devices: " + ", ".join("%s=/dev/%s" % (t, self.dev[t]) for t in self.a.transports))

    def guest_serve(self, t, disk, export):
        log = "/tmp/%s.log" % t
        argv = ("vblk serve --blockdev driver=host_device,filename=/dev/%s,node-name=f0,cache.direct=on "
                "--blockdev driver=qcow2,file=f0,node-name=d0 --export %s" % (disk, export))
        self.check("(%s > %s 2>&1 & echo $! > %s.pid)" % (argv, log, log))
        self.gpid[t] = int(self.check("cat %s.pid" % log).split()[0])

    def check(self, cmd, timeout=120):
        rc, out = self.guest.sh(cmd, timeout=timeout)
        if rc != 0:
            raise RuntimeError("guest: %r exited %d: %s" % (cmd, rc, out[-2000:]))
        return out

    # --- one measurement ------------------------------------------------
    def measure(self, t, wl):
        rw, bs, qd = WORKLOADS[wl]
        dev = self.dev[t]
        gp = self.gpid.get(t)
        fio = ("/usr/bin/fio --name=%s --filename=/dev/%s --direct=1 --ioengine=%s --rw=%s --bs=%s --iodepth=%d "
               "--numjobs=1 --time_based --runtime=%d --ramp_time=%d --randrepeat=0 --norandommap "
               "--output-format=terse --terse-version=3" % (
                   wl, dev, self.a.engine, rw, bs, qd, self.a.runtime, self.a.ramp))
        snap = ("echo \"P%%s $(cat /proc/%d/stat)\"; " % gp if gp else "echo P%s -; ") + \
            "echo \"D%%s $(cat /sys/block/%s/stat)\"; echo \"C%%s $(head -1 /proc/stat)\"; " \
            "echo \"I%%s $(grep '^intr ' /proc/stat | cut -d' ' -f2)\"" % dev
        cmd = "%s; %s 2>/tmp/fio.err; echo \"F $?\"; %s" % (snap.replace("%s", "0"), fio, snap.replace("%s", "1"))
        hp = self.host[t].pid if t in self.host else None
        q0 = cpu_seconds(self.guest.proc.pid)
        h0 = cpu_seconds(hp) if hp else 0.0
        rc, out = self.guest.sh(cmd, timeout=self.a.runtime + self.a.ramp + 300)
        q1 = cpu_seconds(self.guest.proc.pid)
        h1 = cpu_seconds(hp) if hp else 0.0
        lines = {}
        terse = None
        for line in out.splitlines():
            if line.startswith("3;fio-"):
                terse = line.split(";")
            elif line[:2] in ("P0", "P1", "D0", "D1", "C0", "C1", "I0", "I1", "F "):
                k, _, v = line.partition(" ")
                lines[k] = v.strip()
        if rc != 0 or lines.get("F") != "0" or terse is None:
            err = self.guest.sh("cat /tmp/fio.err; dmesg | tail -20")[1]
            raise RuntimeError("%s %s: fio failed: %s\n%s" % (t, wl, out[-2000:], err[-2000:]))
        read = rw in ("randread", "read")
        # terse v3: 7/8 read KiB/s and IOPS, 48/49 write.
        bw_kib, iops = (float(terse[6]), float(terse[7])) if read else (float(terse[47]), float(terse[48]))
        d0, d1 = [list(map(int, lines[k].split())) for k in ("D0", "D1")]
        reqs = (d1[0] - d0[0]) if read else (d1[4] - d0[4])
        mib = ((d1[2] - d0[2]) if read else (d1[6] - d0[6])) * 512 / MIB
        c0, c1 = [list(map(int, lines[k].split()[1:])) for k in ("C0", "C1")]
        tot = sum(c1) - sum(c0)
        idle = (c1[3] + c1[4]) - (c0[3] + c0[4])
        per = reqs if bs == "4k" else mib
        r = {"iops": iops, "mibs": bw_kib / 1024, "reqs": reqs, "mib": mib,
             "qemu_us": (q1 - q0) * 1e6 / per if per else float("nan"),
             "busy": 100.0 * (tot - idle) / tot if tot else float("nan"),
             "irq": (int(lines["I1"]) - int(lines["I0"])) / reqs if reqs else float("nan")}
        if t in self.host:
            r["daemon_us"] = (h1 - h0) * 1e6 / per if per else float("nan")
        elif gp:
            if lines.get("P0", "-") in ("-", "") or lines.get("P1", "-") in ("-", ""):
                raise RuntimeError("%s: the guest's daemon %d is gone: %s" % (t, gp, self.guest.sh(
                    "cat /tmp/%s.log" % t)[1]))
            # Guest ticks: USER_HZ = 100.
            r["daemon_us"] = (stat_cpu(lines["P1"]) - stat_cpu(lines["P0"])) / 100 * 1e6 / per if per else 0
        return r

    # --- tear-down ------------------------------------------------------
    def stop(self):
        """Stops the guest's daemons (vdpa dev del first), the guest, the
        host's daemons; returns notes on anything that went wrong."""
        notes = []
        g = self.guest
        if g is not None and g.proc.poll() is None:
            try:
                if "vduse" in self.gpid:
                    rc, out = g.sh("vdpa dev del vduse0", timeout=120)
                    if rc:
                        notes.append("vdpa dev del: %s" % out.strip())
                for t, pid in self.gpid.items():
                    rc, out = g.sh("kill -0 %d 2>/dev/null || { echo GONE; cat /tmp/%s.log; }; kill -TERM %d; i=0; "
                                   "while kill -0 %d 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; "
                                   "kill -0 %d 2>/dev/null && echo STUCK" % (pid, t, pid, pid, pid), timeout=120)
                    if "GONE" in out or "STUCK" in out:
                        notes.append("guest daemon %s: %s" % (t, out.strip()[-1000:]))
            except Exception as e:  # noqa: BLE001 - report, then go on stopping
                notes.append("guest tear-down: %s" % e)
            g.quit()
        elif g is not None:
            g.kill()
        for t, d in self.host.items():
            alive = d.p.poll() is None
            rc = d.stop()
            if not alive:
                notes.append("host daemon %s had exited (%s): %s" % (t, rc, d.tail()))
        for t, img in self.images.items():
            if img.endswith(".qcow2"):
                r = run("qemu-img", "check", img)
                if r.returncode != 0:
                    notes.append("qemu-img check %s (%s): exit %d: %s" % (os.path.basename(img), t, r.returncode,
                                                                          (r.stdout + r.stderr).strip()[-500:]))
        return notes

    def cleanup(self):
        if self.guest is not None and self.guest.proc.poll() is None:
            self.guest.kill()
        for d in self.host.values():
            if d.p.poll() is None:
                d.p.kill()
                d.p.wait()
        if self.a.keep:
            say("kept " + self.work)
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def ms(v, f):
    v = [x for x in v if x == x]
    if not v:
        return "-"
    return (f + " ± " + f) % (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vblk", default=os.environ.get("VBLK", "build/vblk"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=8, help="fio seconds measured per run")
    ap.add_argument("--ramp", type=int, default=2, help="fio ramp seconds before each run")
    ap.add_argument("--size", default="1G", help="image size (default 1G)")
    ap.add_argument("--prealloc", default="falloc", choices=("falloc", "full"))
    ap.add_argument("--engine", default="libaio", choices=("libaio", "io_uring"), help="fio's, in the guest")
    ap.add_argument("--event-idx", default="on", choices=("on", "off"), help="vhost-user-blk-pci's event_idx")
    ap.add_argument("--mem", type=int, default=1536, help="guest RAM, MiB")
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dir", default="/dev/shm", help="host directory of the images (tmpfs: RAM)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    parse_size(args.size)
    args.transports = [t for t in args.transports.split(",") if t]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for t in args.transports:
        if t not in TRANSPORTS:
            ap.error("unknown transport %s (%s)" % (t, ", ".join(TRANSPORTS)))
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error("unknown workload %s (%s)" % (w, ", ".join(WORKLOADS)))
    args.vblk = os.path.abspath(args.vblk)
    cmdline = "python3 bench/bench_transports.py " + " ".join(
        a if not a.startswith(args.vblk) else "..." for a in sys.argv[1:])
    load0 = os.getloadavg()
    try:
        ublk_guest.build_ublk_guest(args.vblk, fio=True)
    except guest_vm.GuestUnavailable as e:
        print("no guest: %s" % e)
        return 77

    b = Bench(args)
    res = {}  # (transport, workload) -> [result per rep]
    started = time.monotonic()
    notes = []
    try:
        b.start()
        ts = args.transports
        for rep in range(args.reps):
            order = ts if rep % 2 == 0 else ts[::-1]
            for wl in args.workloads:
                for t in order:
                    r = b.measure(t, wl)
                    res.setdefault((t, wl), []).append(r)
                    say("rep %d %-12s %-10s %9.0f IOPS %8.1f MiB/s  qemu %8.1f us  daemon %7.2f us  busy %3.0f%%  "
                        "irq/req %.2f" % (rep, wl, t, r["iops"], r["mibs"], r["qemu_us"],
                                          r.get("daemon_us", float("nan")), r["busy"], r["irq"]))
        notes = b.stop()
    except (Exception, KeyboardInterrupt):
        if b.guest is not None:
            say("guest log: " + b.guest.log_tail())
        for t, d in b.host.items():
            say("%s log: %s" % (t, d.tail()))
        raise
    finally:
        b.cleanup()
    wall = time.monotonic() - started
    load1 = os.getloadavg()

    ts = args.transports
    print("# %s" % cmdline.strip())
    print("# load average (1, 5, 15 min) at start %.1f %.1f %.1f, at end %.1f %.1f %.1f; %d host CPUs" % (
        load0 + load1 + (os.cpu_count(),)))
    print("# One TCG guest (bench/ublk_guest.py's kernel %s, 2 vCPUs, %d MiB), fio %s in the guest, direct=1, "
          "engine %s, %d s + %d s ramp per run, %d rep(s), order reversed on odd reps; images %s qcow2 "
          "(64 KiB clusters, preallocation=%s) on the host's tmpfs, one per transport; %.0f s in all." % (
              os.path.basename(os.path.dirname(b.guest.kernel)).split("_")[0].replace("linux-image-", ""),
              args.mem, run("fio", "--version").stdout.strip(), args.engine, args.runtime, args.ramp, args.reps,
              args.size, args.prealloc, wall))
    print("# qemu: host CPU of qemu-system-x86_64 (TCG: includes the guest's fio, kernel and any in-guest daemon); "
          "daemon: host CPU of a host vblk, or guest CPU of an in-guest vblk (guest ticks, USER_HZ=100); "
          "per request (4k) or per MiB (1M); busy: guest vCPUs not idle; irq/req: the guest's interrupts "
          "(all, /proc/stat intr) per request completed.")
    print("# vhost-user-blk-pci event_idx=%s; host daemons aio=io_uring on tmpfs (no O_DIRECT there); in-guest "
          "daemons host_device cache.direct=on on the raw-attached /dev/vdX." % args.event_idx)
    print("# vs %s: that run's IOPS (4k) or MiB/s (1M) over %s's in the same repetition." % (REF, REF))
    for t in ts:
        print("#   %-10s %s" % (t, TRANSPORTS[t][1]))
    for n in b.notes + notes:
        print("# NOTE: " + n)
    for wl in args.workloads:
        rw, bs, qd = WORKLOADS[wl]
        unit = "req" if bs == "4k" else "MiB"
        print()
        print("## %s (%s %s QD%d)" % (wl, rw, bs, qd))
        key, label, f = ("iops", "IOPS", "%.0f") if bs == "4k" else ("mibs", "MiB/s", "%.0f")
        print("%-11s %16s %14s %16s %20s %9s %13s" % (
            "transport", label, "vs " + REF, "qemu us/" + unit, "daemon us/" + unit, "busy %", "irq/req"))
        for t in ts:
            rs = res[(t, wl)]
            if REF in ts:
                ratio = ms([r[key] / ref[key] for r, ref in zip(rs, res[(REF, wl)])], "%.2f")
            else:
                ratio = "-"
            where = TRANSPORTS[t][0]
            d = ms([r["daemon_us"] for r in rs], "%.1f") if "daemon_us" in rs[0] else "-"
            if where == "guest" and d != "-":
                d += " g"
            print("%-11s %16s %14s %16s %20s %9s %13s" % (
                t, ms([r[key] for r in rs], f), ratio, ms([r["qemu_us"] for r in rs], "%.0f"), d,
                ms([r["busy"] for r in rs], "%.0f"), ms([r["irq"] for r in rs], "%.2f")))
    if "ublk" in ts and "ublk-rec" in ts:
        print()
        print("## recovery=on against off (ublk-rec / ublk, per repetition)")
        for wl in args.workloads:
            key = "iops" if WORKLOADS[wl][1] == "4k" else "mibs"
            print("%-13s rate %s, daemon CPU %s" % (
                wl, ms([r[key] / o[key] for r, o in zip(res[("ublk-rec", wl)], res[("ublk", wl)])], "%.2f"),
                ms([r["daemon_us"] / o["daemon_us"] if o["daemon_us"] else float("nan")
                    for r, o in zip(res[("ublk-rec", wl)], res[("ublk", wl)])],
                   "%.2f")))
    print()
    print("# g: guest CPU time of the in-guest daemon (emulated by TCG, so also inside qemu us).")
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
