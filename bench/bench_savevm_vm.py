#!/usr/bin/env python3
"""Saving and restoring a real VM's state: QEMU's own savevm/loadvm against
QEMU migrating into vblk, side by side in one run.

The VM: the test guest of bench/guest_vm.py (Debian kernel + busybox
initramfs, qemu-system-x86_64 under TCG) with --mem MiB of RAM, --fill MiB
of it filled with random data (a tmpfs file; migration skips only zero
pages, so the stream carries all of it). The disk is a qcow2 in --dir
(default /var/tmp, a real file system: O_DIRECT works there).

Environments (--envs; each boots its own guest per run, runs alternate
the order):
  qemu-none       QEMU's HMP `savevm` into the qcow2 opened with
                  cache.direct=on, `loadvm` in a fresh QEMU (-S);
  qemu-wb         the same with the page cache (cache.direct=off);
  vblk-exec       VM stopped (as libvirt saves), `migrate
                  "exec:vblk savevm -t none disk TAG --vmstate -"` (QEMU
                  holds the image until the stream ends, so vblk spills
                  meanwhile); the time runs until the vblk process has
                  committed the snapshot. Load: a fresh QEMU with
                  `-incoming defer`, `migrate-incoming "exec:vblk loadvm -t
                  none disk TAG --vmstate-out -"` until completed;
  vblk-serve      the disk is `vblk serve`'s NBD export (qcow2,
                  cache.direct=on); VM stopped, `x-vblk-savevm` and
                  `migrate unix:` until the job concluded. Load: a fresh QEMU
                  with `-incoming unix:`, `x-vblk-loadvm` until completed.
  stream-null     the ceiling QEMU's migration itself sets: VM stopped,
                  `migrate "exec:cat > /dev/null"` until completed (no
                  load: the row shows how fast QEMU produces the stream).
Both sides set migrate max-bandwidth to unlimited (QEMU's default 128 MiB/s
would be the limit otherwise; libvirt does the same for a save).

Measured per run: save seconds (command to snapshot committed) and load
seconds (command to the incoming VM's state loaded), and the stream size
(the snapshot's VM SIZE). Prints mean ± stdev and the speed-up of each vblk
row against the faster QEMU row (SPEC: >= 5x QEMU's savevm; loading as
fast). --verify asks the restored guest for its RAM digest (slow under TCG).

Python 3 standard library only.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import guest_vm  # noqa: E402
import qmp_driver  # noqa: E402

REPO = os.path.dirname(HERE)


def wait_gone(pattern, timeout=600):
    """Waits until no process's command line contains `pattern` (the
    savevm QEMU exec'd is QEMU's child, not ours). Zombies count as gone."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open("/proc/%s/stat" % pid) as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if pattern in cmd and state != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.01)
    raise TimeoutError("still running: %s" % pattern)


def vm_size(img):
    r = subprocess.run(["qemu-img", "info", "-U", "--output=json", img], capture_output=True, text=True, check=True)
    sn = json.loads(r.stdout).get("snapshots", [])
    return sn[-1]["vm-state-size"] if sn else 0


class Env:
    def __init__(self, args, name, work):
        self.args, self.name, self.work = args, name, work
        self.disk = os.path.join(work, name + ".qcow2")
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", self.disk, "1G"], check=True)
        self.daemon = None

    def guest(self, tag, extra=()):
        a = self.args
        if self.name == "vblk-serve":
            nbd = "driver=nbd,server.type=unix,server.path=%s,export=disk" % self.nbd_sock
            return guest_vm.Guest(self.work, None, mem_mib=a.mem, extra=extra, name=tag, drive=nbd)
        cache = "none" if self.name in ("qemu-none",) else "writeback"
        return guest_vm.Guest(self.work, self.disk, mem_mib=a.mem, extra=extra, name=tag, cache=cache)

    def start_daemon(self):
        self.nbd_sock = os.path.join(self.work, "nbd.sock")
        argv = [self.args.vblk, "serve", "--blockdev",
                "driver=qcow2,node-name=disk,file.driver=file,file.filename=%s,file.cache.direct=on" % self.disk,
                "--nbd-server", "addr.type=unix,addr.path=%s" % self.nbd_sock,
                "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]
        self.daemon = qmp_driver.Daemon(argv, os.path.join(self.work, "qmp.sock"),
                                        os.path.join(self.work, "serve.log"))

    def job_done(self, job_id, timeout=900):
        q = self.daemon.qmp
        while True:
            e = q.event("JOB_STATUS_CHANGE", timeout=timeout)
            if e["data"]["id"] == job_id and e["data"]["status"] == "concluded":
                break
        j = [x for x in q.ok("query-jobs") if x["id"] == job_id][0]
        if "error" in j:
            raise RuntimeError("%s: %s" % (job_id, j["error"]))
        q.ok("job-dismiss", id=job_id)

    def save(self, g):
        """Returns the seconds from command to snapshot committed."""
        vb = self.args.vblk
        if self.name.startswith("qemu"):
            t0 = time.monotonic()
            out = g.hmp("savevm s1", timeout=900)
            t = time.monotonic() - t0
            if out:
                raise RuntimeError("savevm: %s" % out)
            return t
        g.hmp("stop")
        g.qmp.ok("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        if self.name == "stream-null":
            t0 = time.monotonic()
            g.qmp.ok("migrate", {"uri": "exec:cat > /dev/null"})
            if g.wait_migration(900) != "completed":
                raise RuntimeError("migration failed: %s" % g.log_tail())
            return time.monotonic() - t0
        if self.name == "vblk-exec":
            cmd = "%s savevm -t none %s s1 --vmstate -" % (vb, self.disk)
            t0 = time.monotonic()
            g.qmp.ok("migrate", {"uri": "exec:" + cmd})
            if g.wait_migration(900) != "completed":
                raise RuntimeError("migration failed: %s" % g.log_tail())
            wait_gone(cmd)
            return time.monotonic() - t0
        sock = os.path.join(self.work, "save.sock")
        t0 = time.monotonic()
        self.daemon.qmp.ok("x-vblk-savevm", {"job-id": "sv", "tag": "s1", "vmstate": "disk", "devices": ["disk"],
                                            "addr": {"type": "unix", "path": sock}})
        g.qmp.ok("migrate", {"uri": "unix:" + sock})
        if g.wait_migration(900) != "completed":
            raise RuntimeError("migration failed: %s" % g.log_tail())
        self.job_done("sv")
        return time.monotonic() - t0

    def load(self):
        """A fresh QEMU; returns (seconds to the state loaded, the guest)."""
        vb = self.args.vblk
        if self.name.startswith("qemu"):
            g = self.guest("load", ["-S"])
            t0 = time.monotonic()
            out = g.hmp("loadvm s1", timeout=900)
            t = time.monotonic() - t0
            if out:
                raise RuntimeError("loadvm: %s" % out)
            return t, g
        if self.name == "vblk-exec":
            g = self.guest("load", ["-incoming", "defer"])
            g.qmp.ok("migrate-set-parameters", {"max-bandwidth": 1 << 40})
            t0 = time.monotonic()
            g.qmp.ok("migrate-incoming", {"uri": "exec:%s loadvm -t none %s s1 --vmstate-out -" % (vb, self.disk)})
            if g.wait_migration(900) != "completed":
                raise RuntimeError("incoming failed: %s" % g.log_tail())
            return time.monotonic() - t0, g
        sock = os.path.join(self.work, "in.sock")
        g = self.guest("load", ["-incoming", "unix:" + sock])
        end = time.monotonic() + 30
        while not os.path.exists(sock) and time.monotonic() < end:
            time.sleep(0.01)
        t0 = time.monotonic()
        self.daemon.qmp.ok("x-vblk-loadvm", {"job-id": "ld", "tag": "s1", "vmstate": "disk", "devices": ["disk"],
                                            "addr": {"type": "unix", "path": sock}})
        if g.wait_migration(900) != "completed":
            raise RuntimeError("incoming failed: %s" % g.log_tail())
        t = time.monotonic() - t0
        self.job_done("ld")
        return t, g

    def run(self):
        if self.name == "vblk-serve":
            self.start_daemon()
        try:
            g = self.guest("save")
            try:
                if not g.boot(timeout=600):
                    raise RuntimeError("the guest did not boot")
                digest = g.fill_ram(self.args.fill, seed_mib=64)
                save_s = self.save(g)
            finally:
                g.quit()
            if self.name == "stream-null":
                return save_s, float("nan"), 0
            size = vm_size(self.disk)
            load_s, g = self.load()
            try:
                if self.args.verify:
                    if g.status() != "running":  # paused, or prelaunch after -S
                        g.qmp.ok("cont")
                    if g.ram_digest() != digest:
                        raise RuntimeError("%s: the restored RAM differs" % self.name)
            finally:
                g.quit()
        finally:
            if self.daemon:
                self.daemon.quit()
        return save_s, load_s, size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(REPO, "build", "vblk"))
    ap.add_argument("--mem", type=int, default=2048, help="guest RAM, MiB")
    ap.add_argument("--fill", type=int, default=1664, help="MiB of it filled (a multiple of 64)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--envs", default="qemu-none,qemu-wb,vblk-exec,vblk-serve")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.vblk = os.path.abspath(args.vblk)
    envs = args.envs.split(",")
    res = {e: [] for e in envs}
    for run in range(args.runs):
        order = envs if run % 2 == 0 else list(reversed(envs))
        for name in order:
            work = tempfile.mkdtemp(prefix="vblk-savevm-vm-", dir=args.dir)
            try:
                s, l, size = Env(args, name, work).run()
            finally:
                shutil.rmtree(work, ignore_errors=True)
            res[name].append((s, l, size))
            print("run %d %-11s save %6.2f s  load %6.2f s  state %d MiB" % (run, name, s, l, size >> 20),
                  file=sys.stderr)

    def st(name, i):
        v = [x[i] for x in res[name]]
        return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)

    qemu_rows = [e for e in envs if e.startswith("qemu-")]
    best_save = min(qemu_rows, key=lambda e: st(e, 0)[0]) if qemu_rows else None
    best_load = min(qemu_rows, key=lambda e: st(e, 1)[0]) if qemu_rows else None
    print("A %d MiB guest, %d MiB of RAM filled, disk in %s, %d runs" % (args.mem, args.fill, args.dir, args.runs))
    print("%-11s %16s %9s %16s %9s %10s" % ("env", "save s", "speed-up", "load s", "speed-up", "state MiB"))
    for e in envs:
        (sm, ss), (lm, ls) = st(e, 0), st(e, 1)
        su = "%8.2fx" % (st(best_save, 0)[0] / sm) if best_save else "        -"
        lu = "%8.2fx" % (st(best_load, 1)[0] / lm) if best_load else "        -"
        print("%-11s %9.2f ± %4.2f %s %9.2f ± %4.2f %s %10d" % (e, sm, ss, su, lm, ls, lu,
                                                              int(st(e, 2)[0]) >> 20))
    if best_save:
        print("speed-ups against QEMU's faster rows: save %s, load %s" % (best_save, best_load))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mem": args.mem, "fill": args.fill, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
