#!/usr/bin/env python3
"""Kill soak of the ublk and VDUSE exports: `vblk serve` killed with kill -9
under a mounted ext4 being written, again and again, in the ublk guest
(bench/ublk_guest.py: trixie-backports' kernel with ublk_drv, vduse and
virtio_vdpa, under TCG).

One guest boot; the image is a qcow2 on the host (64 KiB clusters, or
--cluster-size 2M; --backing puts it over a qcow2 base of the same cluster
size whose clusters are compressed, made by qemu-img convert -c), attached
raw as /dev/vda (the base as /dev/vdb), served in the guest with
num-queues=--num-queues by one of two transports (--transport):

  * ublk (the default): type=ublk with recovery=on (or without,
    --no-recovery), as /dev/ublkb7;
  * vduse: type=vduse-blk,name=vduse7, attached with `vdpa dev add name
    vduse7 mgmtdev vduse`; virtio_vdpa makes it the next /dev/vdX (the one
    new name in /sys/block). The device stays attached when its daemon is
    killed (the driver's requests wait), and the same command line again
    takes it over from the log the killed daemon kept ($TMPDIR/vduse-blk-
    vduse7): there is no flag and no other way, so --no-recovery is
    refused. Each takeover's stderr must say it found that log (how many
    answered writes the next flush makes durable: the round line shows it)
    and nothing else.

mkfs.ext4 on the device, mounted. Then each round:

  * two writers start, pinned to CPU 0 and CPU 1 (so two queues both carry
    requests): each writes new files of verifiable content (a name line,
    then 4 KiB-64 x 4 KiB taken at a random offset of a 16 MiB random pool
    in the guest's tmpfs), `dd conv=fsync` each, and appends the file's
    name and md5 to its log on the tmpfs (/mnt, not the device) only after
    dd, its fsync included, returned success;
  * the daemon is killed with kill -9 at a random moment --min-kill to
    --max-kill seconds (0.5-3) after the writers started;
  * recovery (ublk) or takeover (vduse): once the killed daemon is gone
    (as a supervisor waits for it), the same command line again takes the
    device back; the round waits until each writer logged two more files
    (it carried on), stops the writers (a stop file) and checks they ended
    without an error. A start refused because the image was still locked
    (the killed daemon's open file outliving its process) is reported,
    counted and retried a second later;
    without recovery (ublk): each writer must fail (dd's write or fsync
    errors; no hang), the file system is unmounted, the same command line
    again replaces the dead device, and e2fsck -fy replays the journal and
    repairs what it finds (reported), then the file system is mounted again;
  * caches dropped (echo 3 > /proc/sys/vm/drop_caches), every file logged in
    this round and the one before is checked against its md5 (md5sum -c):
    every write the file system flushed must be there. The files of the
    round before that are then deleted (the device does not fill up).

After the rounds: umount, e2fsck -fn must be clean, the export is stopped
(vduse: `vdpa dev del`, then SIGTERM, and the daemon destroys the device
and its log; ublk: SIGTERM, its device goes away), the guest quits, and on
the host `qemu-img check` of the image exits 0, or 3 (leaked clusters only,
which a killed daemon may leave; reported). Any failed round stops the
soak with what was missing (the console's view and the daemon's log).

Usage (the release binary; a guest of 2 vCPUs, TCG):
  VBLK=build/vblk bench/ublk_kill_soak.py [--transport ublk|vduse]
      [--rounds 20] [--num-queues 1|2] [--cluster-size 64K|2M] [--backing]
      [--no-recovery] [--seed N] [--probe] [--keep-going]
--probe (recovery, takeover) first checks that a completed, unflushed 1 MiB
O_DIRECT write to the empty image survives one kill and the restart (a lost
probe fails the soak); --keep-going counts lost files (reported with how
they differ) and carries on.
Prints one line per round (the kill moment, how many files were flushed
by then, restart and resume times, files verified, seconds) and a summary:
`ublk kill soak: 20/20 rounds, N flushed files verified, qemu-img check:
clean (M leaked clusters)` (`vduse kill soak: ...`). Exit status 0 when
every round passed.

`KillSoak` runs the rounds in a guest the caller booted (the interop test
tests/interop/test_ublk_export.py uses it for its short variant, ublk).

Python 3 standard library only.
"""
import argparse
import base64
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import guest_vm  # noqa: E402
import ublk_guest  # noqa: E402

MiB = 1 << 20

# The writer, run as `sh /mnt/ublk_w.sh DIR LOG TAG STOPFILE` in the guest.
# A file's line goes to LOG only once dd (with conv=fsync: the fsync of the
# file, on ext4 a journal commit with the device's flush) returned 0.
WRITER = r"""d=$1; log=$2; tag=$3; stop=$4
mkdir -p $d || { echo W-ERR mkdir; exit 1; }
i=0
while [ ! -e $stop ]; do
  n=$tag-$i
  s=$((RANDOM % 4032)); c=$((RANDOM % 64 + 1))
  { echo "$n"; dd if=/mnt/pool bs=4k skip=$s count=$c 2>/dev/null; } > $log.tmp
  m=$(md5sum < $log.tmp); m=${m%% *}
  if ! dd if=$log.tmp of=$d/$n bs=64k conv=fsync 2>$log.err; then echo "W-ERR $n $(tail -1 $log.err)"; exit 1; fi
  echo "$m  $n" >> $log
  echo "$n $s $c" >> $log.meta
  i=$((i+1))
done
echo "W-END $i"
"""
WRITERS = 2


class SoakFailure(AssertionError):
    pass


def run(*argv, timeout=600):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)


def make_images(workdir, size, cluster_size, backing, qemu_img="qemu-img", carrier=None):
    """(image, base or None) on the host: a qcow2 of `size` bytes with
    `cluster_size`; with `backing`, over a qcow2 base with the same cluster
    size and compressed clusters (convert -c of a pattern: 64 KiB of random
    bytes, then text, per MiB). The image file is grown to `carrier` bytes
    (sparse; default 2 x size + 64 MiB) for the clusters vblk allocates on
    /dev/vda in the guest."""
    img = os.path.join(workdir, "img.qcow2")
    base = None
    opts = "cluster_size=%d" % cluster_size
    if backing:
        pattern = os.path.join(workdir, "pattern.raw")
        with open(pattern, "wb") as f:
            for i in range(size // MiB):
                line = ("vblk base MiB %d\n" % i).encode()
                text = line * ((MiB - 65536) // len(line) + 1)
                f.write(os.urandom(65536) + text[:MiB - 65536])
        base = os.path.join(workdir, "base.qcow2")
        r = run(qemu_img, "convert", "-c", "-f", "raw", "-O", "qcow2", "-o", opts, pattern, base)
        os.unlink(pattern)
        if r.returncode != 0:
            raise SoakFailure("qemu-img convert -c: " + r.stderr)
        r = run(qemu_img, "create", "-q", "-f", "qcow2", "-o", opts, "-b", base, "-F", "qcow2", img)
    else:
        r = run(qemu_img, "create", "-q", "-f", "qcow2", "-o", opts, img, size)
    if r.returncode != 0:
        raise SoakFailure("qemu-img create: " + r.stderr)
    ublk_guest.carrier_disk(img, carrier or 2 * size + 64 * MiB)
    return img, base


def qemu_img_check(img, qemu_img="qemu-img", force_share=False):
    """(exit code, leaked clusters, corruptions, text) of qemu-img check."""
    r = run(qemu_img, "check", *(["-U"] if force_share else []), img)
    text = (r.stdout + r.stderr).strip()
    m = re.search(r"(\d+) leaked clusters", text)
    c = re.search(r"(\d+) errors were found", text)
    return r.returncode, int(m.group(1)) if m else 0, int(c.group(1)) if c else 0, text


def check_line(rc, leaks):
    if rc == 0:
        return "clean (0 leaked clusters)"
    if rc == 3:
        return "clean (%d leaked clusters)" % leaks
    return "FAILED (exit %d)" % rc


class KillSoak:
    """The rounds, in a booted UblkGuest `guest`: img_dev (/dev/vda) holds
    the qcow2, base_dev its compressed base when there is one. say: a
    function taking one line of progress."""

    def __init__(self, guest, img_dev="/dev/vda", base_dev=None, dev_id=7, num_queues=1, recovery=True,
                 min_kill=0.5, max_kill=3.0, seed=None, say=print, mkfs_opts="-b 4096", keep_going=False,
                 transport="ublk"):
        if transport not in ("ublk", "vduse"):
            raise ValueError("transport: ublk or vduse, not %r" % transport)
        if transport == "vduse" and not recovery:
            # A VDUSE device outlives its daemon; the next one always takes it over.
            raise ValueError("a VDUSE export is always taken over: recovery=False has no meaning")
        self.g = guest
        self.transport = transport
        self.dev_id = dev_id
        # ublk: /dev/ublkbN exists while a daemon serves it. VDUSE: the
        # device NAME is attached with `vdpa dev add` and virtio_vdpa makes
        # the next /dev/vdX of it (found by attach()); it stays attached
        # across kills until stop().
        self.name = "vduse%d" % dev_id
        self.dev = "/dev/ublkb%d" % dev_id if transport == "ublk" else None
        self.attached = False
        self.takeovers = []  # vduse: (answered, to be made durable) the killed daemon's log held
        self.recovery = recovery
        self.num_queues = num_queues
        self.min_kill, self.max_kill = min_kill, max_kill
        self.rng = random.Random(seed)
        self.say = say
        self.mkfs_opts = mkfs_opts + (" -E nodiscard" if base_dev else "")
        bd = ["driver=host_device,filename=%s,node-name=f0" % img_dev]
        if base_dev:
            bd += ["driver=host_device,filename=%s,node-name=bf,read-only=on" % base_dev,
                   "driver=qcow2,file=bf,node-name=b0,read-only=on",
                   "driver=qcow2,file=f0,backing=b0,node-name=d0"]
        else:
            bd += ["driver=qcow2,file=f0,node-name=d0"]
        if transport == "ublk":
            export = "type=ublk,id=u0,node-name=d0,writable=on,dev-id=%d,num-queues=%d%s" % (
                dev_id, num_queues, ",recovery=on" if recovery else "")
        else:
            export = "type=vduse-blk,id=v0,node-name=d0,writable=on,name=%s,num-queues=%d" % (self.name, num_queues)
        self.argv = "vblk serve %s --export %s" % (" ".join("--blockdev " + b for b in bd), export)
        self.serves = 0
        self.rounds_done = 0
        self.verified = set()  # distinct flushed files checked after a kill
        self.checks = 0  # md5 checks, all rounds
        self.fsck_notes = []
        self.mounted = False
        self.keep_going = keep_going  # a lost file is counted, not the end of the soak
        self.lost = []  # [(round, [file names])]
        self.lock_retries = []  # [round] of each restart refused for the image's lock (restart())

    # --- guest helpers --------------------------------------------------
    def sh(self, cmd, timeout=120):
        return self.g.sh(cmd, timeout=timeout)

    def check(self, cmd, timeout=120, what=None):
        rc, out = self.sh(cmd, timeout)
        if rc != 0:
            raise SoakFailure("%s: %r exited %d: %s\n%s" % (what or "guest", cmd, rc, out[-3000:], self.diag()))
        return out

    def diag(self):
        rc, out = self.g.sh("echo '--- writers'; cat /mnt/wout?; ls -la %s 2>&1" % (
            "/dev/ublk*" if self.transport == "ublk" else "/dev/vduse /dev/vd*; vdpa dev show"), timeout=60)
        return out + self.hang_diag()

    def bg(self, cmd, timeout, what):
        """Runs `cmd` in the guest in the background and polls for its end:
        a command stuck in the kernel (I/O that never completes) leaves the
        console free to say where (hang_diag()). Returns its output; raises
        unless it exits 0."""
        script = base64.b64encode(cmd.encode()).decode()
        self.check("rm -f /mnt/bg.rc; echo %s | base64 -d > /mnt/bg.sh; ((sh /mnt/bg.sh > /mnt/bg.out 2>&1; "
                   "echo $? > /mnt/bg.rc) &)" % script)
        end = time.monotonic() + timeout
        while True:
            rc, out = self.sh("cat /mnt/bg.rc 2>/dev/null")
            if out.strip():
                break
            if time.monotonic() > end:
                raise SoakFailure("%s: no end in %d s (a hang?): %r\n%s" % (what, timeout, cmd, self.hang_diag()))
            time.sleep(0.5)
        rc = int(out.split()[0])
        out = self.check("cat /mnt/bg.out")
        if rc != 0:
            raise SoakFailure("%s: %r exited %d: %s\n%s" % (what, cmd, rc, out[-3000:], self.diag()))
        return out

    def hang_diag(self):
        """Who waits on what: D-state tasks and their kernel stacks, the
        daemon's threads, the device's in-flight counts, sysrq-w."""
        rc, out = self.g.sh(
            "echo '--- daemon'; p=$(cat /tmp/ublk_serve.pid); kill -0 $p && echo alive $p; "
            "for t in /proc/$p/task/*; do echo \"$t $(cat $t/comm) $(cat $t/wchan)\"; cat $t/stack; done; "
            "echo '--- D tasks'; for d in /proc/[0-9]*; do st=$(awk '{print $3}' $d/stat 2>/dev/null); "
            "[ \"$st\" = D ] || continue; echo \"$d $(cat $d/comm) $(cat $d/wchan)\"; cat $d/stack; done; "
            "echo '--- inflight'; cat /sys/block/%s/inflight; ls /sys/block/%s/mq/; "
            "echo '--- daemon log'; cat %s; echo w > /proc/sysrq-trigger; echo '--- dmesg'; dmesg | tail -120"
            % (self.blk, self.blk, self.log), timeout=120)
        return out

    @property
    def log(self):
        return "/tmp/ublk_serve%d.log" % self.serves  # (the same guest paths for both transports)

    @property
    def blk(self):
        """The device's name in /sys/block (a glob before a VDUSE attach)."""
        return os.path.basename(self.dev) if self.dev else "vd*"

    def start_daemon(self):
        """Starts `vblk serve` (a restart after a kill: the same command
        line). VDUSE: the first start also attaches the device (attach())."""
        self.serves += 1
        self.check("(%s > %s 2>&1 & echo $! > /tmp/ublk_serve.pid)" % (self.argv, self.log))
        if self.transport == "vduse" and not self.attached:
            self.attach()

    def attach(self):
        """VDUSE: waits for /dev/vduse/NAME, attaches it to the vDPA bus
        (`vdpa dev add`) and finds the disk virtio_vdpa made of it: the one
        new name in /sys/block."""
        before = set(self.check("ls /sys/block").split())
        self.check("(i=0; until [ -c /dev/vduse/%s ]; do [ $i -lt 300 ] || exit 1; kill -0 $(cat /tmp/ublk_serve.pid)"
                   " || exit 2; sleep 0.1; i=$((i+1)); done)" % self.name, 60, "no /dev/vduse/%s" % self.name)
        self.check("vdpa dev add name %s mgmtdev vduse" % self.name, 120, "vdpa dev add")
        self.attached = True
        # virtio_vdpa's probe reads the partition table through the daemon
        # before the disk shows.
        out = self.check("(i=0; while [ $(ls /sys/block | wc -l) -le %d ]; do [ $i -lt 600 ] || exit 1; sleep 0.1; "
                         "i=$((i+1)); done; ls /sys/block)" % len(before), 120, "no disk after vdpa dev add")
        new = sorted(set(out.split()) - before)
        if len(new) != 1:
            raise SoakFailure("vdpa dev add: disks before %s, after %s" % (sorted(before), out.split()))
        self.dev = "/dev/" + new[0]
        mq = self.check("ls /sys/block/%s/mq | wc -l" % new[0]).strip()
        if mq != str(self.num_queues):
            raise SoakFailure("%s has %s hardware queues, not num-queues=%d" % (self.dev, mq, self.num_queues))

    def stop(self):
        """Ends the export: ublk: SIGTERM, the device goes. VDUSE: `vdpa
        dev del`, then SIGTERM: the daemon destroys the device, and its
        log ($TMPDIR/vduse-blk-NAME) goes with it."""
        if self.transport == "vduse":
            self.check("vdpa dev del %s" % self.name, 120, "vdpa dev del")
            self.attached = False
        self.check("p=$(cat /tmp/ublk_serve.pid); kill -TERM $p; i=0; while kill -0 $p 2>/dev/null; do "
                   "[ $i -lt 300 ] || exit 1; sleep 0.1; i=$((i+1)); done; [ ! -e %s ]" % self.dev, 120,
                   "SIGTERM stop")
        if self.transport == "vduse":
            # The last daemon's log: its takeover's line at most, no error.
            self.check("[ ! -e /dev/vduse/%s ] && [ ! -e /tmp/vduse-blk-%s ] && ! grep -v 'taking over the device' %s"
                       % (self.name, self.name, self.log), 60, "the device, its log or errors left after the stop")
            self.dev = None

    def restart(self, k):
        """After a kill -9: waits until the killed daemon is gone (as a
        supervisor does before it restarts a service), then starts the same
        command line and waits until the device reads. A start refused
        because the image's lock is still held (the killed daemon's open
        file outlived its process: `Failed to get "write" lock`) is
        counted in lock_retries, reported, and started again a second
        later, up to three times; any other failed start fails the round.
        Returns the seconds the killed daemon took to go."""
        t = time.monotonic()
        self.check("(p=$(cat /tmp/ublk_serve.pid); i=0; while kill -0 $p 2>/dev/null; do [ $i -lt 600 ] || exit 1; "
                   "sleep 0.05; i=$((i+1)); done)", 90, "round %d: the killed daemon did not go" % k)
        gone = time.monotonic() - t
        for attempt in range(4):
            self.start_daemon()
            rc, out = self.sh("(i=0; until dd if=%s of=/dev/null bs=4k count=1 iflag=direct 2>/dev/null; do "
                              "[ $i -lt 600 ] || exit 1; kill -0 $(cat /tmp/ublk_serve.pid) || exit 2; sleep 0.1; "
                              "i=$((i+1)); done)" % self.dev, 90)
            if rc == 0:
                return gone
            log = self.sh("cat %s" % self.log)[1]
            if rc != 2 or 'Failed to get "write" lock' not in log or attempt == 3:
                raise SoakFailure("round %d: the restart %d exited (%d): %s\n%s" % (k, attempt + 1, rc, log,
                                                                                  self.diag()))
            self.lock_retries.append(k)
            self.say("round %d: restart refused %.2f s after the killed daemon went, the image still locked: %s" % (
                k, time.monotonic() - t - gone, log.strip().replace("\n", " ")))
            time.sleep(1)

    def alive(self):
        return self.sh("kill -0 $(cat /tmp/ublk_serve.pid) 2>/dev/null")[0] == 0

    def wait_readable(self, timeout=60):
        """Until a direct read of the device's first block succeeds."""
        # In a subshell: its exit ends the loop, not the guest's console.
        self.check("(i=0; until dd if=%s of=/dev/null bs=4k count=1 iflag=direct 2>/dev/null; do "
                   "[ $i -lt %d ] || exit 1; kill -0 $(cat /tmp/ublk_serve.pid) || exit 2; sleep 0.1; "
                   "i=$((i+1)); done)" % (self.dev, timeout * 10), timeout + 30, "the device is not served")

    def counts(self, k):
        out = self.check("for w in %s; do cat /mnt/ublk_log.w$w.r%d 2>/dev/null | wc -l; done" % (
            " ".join(map(str, range(WRITERS))), k))
        return [int(x) for x in out.split()]

    # --- phases ---------------------------------------------------------
    def setup(self):
        t = time.monotonic()
        script = base64.b64encode(WRITER.encode()).decode()
        self.check("echo %s | base64 -d > /mnt/ublk_w.sh && dd if=/dev/urandom of=/mnt/pool bs=1M count=16 "
                   "2>/dev/null && echo $RANDOM | grep -q '^[0-9][0-9]*$'" % script, what="setup")
        if not self.serves or not self.alive():
            self.start_daemon()
        self.check("(i=0; until [ -b %s ]; do [ $i -lt 300 ] || exit 1; sleep 0.1; i=$((i+1)); done)" % self.dev,
                   60, "the device did not appear")
        self.wait_readable()
        self.check("mkfs.ext4 -q -F %s %s && mkdir -p /mnt/fs && mount -t ext4 %s /mnt/fs" % (
            self.mkfs_opts, self.dev, self.dev), 300, "mkfs")
        self.mounted = True
        return time.monotonic() - t

    def start_writers(self, k, delay):
        """Starts the writers of round k, kills the daemon `delay` seconds
        later (one guest command: the console's latency is not in it)."""
        cmds = ["rm -f /mnt/ublk_stop"]
        for w in range(WRITERS):
            cmds.append("(taskset %d sh /mnt/ublk_w.sh /mnt/fs/w%d /mnt/ublk_log.w%d.r%d r%d-%d /mnt/ublk_stop "
                        "> /mnt/wout%d 2>&1 & echo $! > /mnt/wout%d.pid)" % (1 << (w % 2), w, w, k, k, w, w, w))
        cmds.append("sleep %.3f; kill -9 $(cat /tmp/ublk_serve.pid)" % delay)
        self.check("; ".join(cmds), 60, "start the writers and kill")

    def writers_state(self):
        """[None (running) | 'W-END n' | 'W-ERR ...'] per writer."""
        out = self.check("for w in %s; do if kill -0 $(cat /mnt/wout$w.pid) 2>/dev/null; then echo RUN; "
                         "else echo \"S $(tail -1 /mnt/wout$w)\"; fi; done" % " ".join(map(str, range(WRITERS))))
        lines = [x.strip() for x in out.splitlines() if x.strip() in ("RUN", "S") or x.startswith("S ")]
        return [None if x == "RUN" else x[2:] for x in lines]

    def wait_writers(self, timeout):
        end = time.monotonic() + timeout
        while True:
            st = self.writers_state()
            if all(s is not None for s in st) or time.monotonic() > end:
                return st
            time.sleep(0.3)

    def verify(self, k):
        """md5sum -c of the logs of rounds k-1 and k after dropping caches;
        returns the number of files checked."""
        t = time.monotonic()
        out = self.bg("echo 3 > /proc/sys/vm/drop_caches; for w in %s; do for r in %d %d; do "
                      "l=/mnt/ublk_log.w$w.r$r; [ -s $l ] || continue; (cd /mnt/fs/w$w && md5sum -c $l 2>&1) "
                      "| grep -v ': OK$'; cat $l | wc -l | sed \"s/^/COUNT /\"; "
                      "cut -c35- $l | sed \"s/^/NAME w$w\\//\"; done; done; true" % (
                          " ".join(map(str, range(WRITERS))), k - 1, k), 120, "round %d: verify" % k)
        bad = [x for x in out.splitlines() if x.strip() and not x.startswith(("COUNT ", "NAME "))]
        lost = [x.split(":")[0].strip() for x in bad if re.match(r"r\d+-\d+-\d+: FAILED", x.strip())]
        if bad:
            report = bad + self.explain(bad[:3])
            if not self.keep_going or len(lost) != len([x for x in bad if "FAILED" in x and "WARNING" not in x]):
                raise SoakFailure("round %d: flushed files differ or are missing after the kill:\n%s\n%s" % (
                    k, "\n".join(report[:60]), self.diag()))
            self.say("round %d: LOST %d flushed file(s): %s\n  %s" % (k, len(lost), " ".join(lost),
                                                                    "\n  ".join(report).replace("\n", "\n  ")))
            self.lost.append((k, lost))
            # Not reported again: out of the logs.
            for name in lost:
                w, r = name.split("-")[1], name.split("-")[0][1:]
                self.check("sed -i '/  %s$/d' /mnt/ublk_log.w%s.r%s" % (name, int(w), int(r)))
        n = sum(int(x.split()[1]) for x in out.splitlines() if x.startswith("COUNT "))
        self.verified.update(x[5:] for x in out.splitlines() if x.startswith("NAME "))
        self.checks += n
        return n, time.monotonic() - t

    def explain(self, bad):
        """For each FAILED file: how it differs from what the writer wrote
        (the 4 KiB blocks that differ, and whether they read as zeroes),
        read twice (a second drop_caches) to tell a stable from a changing
        read."""
        lines = []
        for x in bad:
            m = re.match(r"(r(\d+)-(\d+)-\d+): FAILED", x.strip())
            if not m:
                continue
            name, r, w = m.group(1), m.group(2), m.group(3)
            _, out = self.sh(
                "f=/mnt/fs/w%s/%s; set -- $(grep '^%s ' /mnt/ublk_log.w%s.r%s.meta); "
                "{ echo $1; dd if=/mnt/pool bs=4k skip=$2 count=$3 2>/dev/null; } > /mnt/exp; "
                "echo \"$f: size $(stat -c %%s $f), written $(stat -c %%s /mnt/exp) (pool block $2, $3 blocks)\"; "
                "cmp -l /mnt/exp $f 2>&1 | awk '{print int(($1-1)/4096)}' | uniq | wc -l | "
                "sed 's/^/  4 KiB blocks that differ: /'; "
                "cmp -l /mnt/exp $f 2>/dev/null | awk '$3 != 0' | wc -l | sed 's/^/  nonzero differing bytes: /'; "
                "cp $f /mnt/got1; echo 3 > /proc/sys/vm/drop_caches; cmp /mnt/got1 $f && echo '  reread: same'; "
                "md5sum /mnt/got1 /mnt/exp" % (w, name, name, w, r), 120)
            lines.append(out.strip())
        return lines

    def round(self, k):
        t0 = time.monotonic()
        delay = self.rng.uniform(self.min_kill, self.max_kill)
        self.start_writers(k, delay)
        at_kill = self.counts(k)
        info = "round %2d: kill at %.2f s (%s files flushed)" % (k, delay, "+".join(map(str, at_kill)))
        if self.recovery:
            st = self.writers_state()
            if any(s is not None for s in st):
                raise SoakFailure("round %d: a writer ended while the device waited for its daemon: %s\n%s" % (
                    k, st, self.diag()))
            t = time.monotonic()
            gone = self.restart(k)
            # The writers carry on: two more files each.
            before = self.counts(k)
            out = self.check("(i=0; while :; do ok=1; %s [ $ok = 1 ] && break; [ $i -lt 1200 ] || exit 1; "
                             "kill -0 $(cat /tmp/ublk_serve.pid) || exit 2; sleep 0.1; i=$((i+1)); done)" % "".join(
                                 "[ $(cat /mnt/ublk_log.w%d.r%d 2>/dev/null | wc -l) -ge %d ] || ok=0; " % (
                                     w, k, before[w] + 2) for w in range(WRITERS)), 200,
                             "round %d: the writers did not carry on after the restart" % k)
            resumed = time.monotonic() - t
            took = "taken back" if self.transport == "ublk" else "taken over" + self.takeover_info(k)
            self.check("touch /mnt/ublk_stop")
            st = self.wait_writers(120)
            if not all(s and s.startswith("W-END") for s in st):
                raise SoakFailure("round %d: writers after the stop: %s\n%s" % (k, st, self.diag()))
            info += ", %.2f s more until it was gone, %s, writers resumed in %.2f s" % (gone, took, resumed)
        else:
            t = time.monotonic()
            st = self.wait_writers(120)
            failed = time.monotonic() - t
            if not all(s and s.startswith("W-ERR") for s in st):
                raise SoakFailure("round %d: without recovery, each writer must fail (no hang): %s\n%s" % (
                    k, st, self.diag()))
            if self.alive():
                raise SoakFailure("round %d: the killed daemon is alive" % k)
            rc, out = self.sh("cd /; umount /mnt/fs 2>&1", 120)
            if rc != 0:
                raise SoakFailure("round %d: umount of the dead device: %s\n%s" % (k, out, self.diag()))
            self.mounted = False
            t = time.monotonic()
            self.start_daemon()
            self.wait_readable()
            restart = time.monotonic() - t
            rc, out = self.sh("e2fsck -fy %s 2>&1" % self.dev, 300)
            if rc not in (0, 1):
                raise SoakFailure("round %d: e2fsck -fy exited %d:\n%s" % (k, rc, out))
            notes = [x.strip() for x in out.splitlines() if x.strip() and not re.match(
                r"(Pass \d|e2fsck \d|Fix\? yes|/dev/ublkb\d+: \d+/\d+ files)", x.strip())]
            self.fsck_notes.append((k, rc, notes))
            self.check("mount -t ext4 %s /mnt/fs" % self.dev, 120, "mount after e2fsck")
            self.mounted = True
            info += ", writers failed in %.2f s (%s), restart %.2f s, e2fsck -fy %d%s" % (
                failed, "; ".join(s.split(":")[-1].strip() for s in st), restart, rc,
                (" (" + "; ".join(notes) + ")") if notes else "")
        n, vt = self.verify(k)
        if not self.alive():
            raise SoakFailure("round %d: the daemon died\n%s" % (k, self.diag()))
        self.check("rm -f /mnt/fs/w*/r%d-* /mnt/ublk_log.w*.r%d" % (k - 2, k - 2))
        self.rounds_done += 1
        self.say("%s; %d files verified in %.2f s; round %.1f s" % (info, n, vt, time.monotonic() - t0))

    def takeover_info(self, k):
        """VDUSE: the takeover's stderr must say it found the killed daemon's
        log (its first flush then vouches for the writes that daemon
        answered) and nothing else; returns " (U of A answered writes
        unflushed)", from that log's ledger (A: answered since the device
        was made, U: of them not yet covered by a flush)."""
        out = self.check("cat %s" % self.log)
        m = re.search(r"taking over the device of a daemon that is gone \((\d+) writes answered, (\d+) of them", out)
        if not m or "unknown" in out or "failed" in out:
            raise SoakFailure("round %d: the takeover's log:\n%s\n%s" % (k, out, self.diag()))
        self.takeovers.append((int(m.group(1)), int(m.group(2))))
        return " (%s of %s answered writes unflushed)" % (m.group(2), m.group(1))

    def probe_completed_write(self, offset_mib=None):
        """Before the file system: 1 MiB written to the device with O_DIRECT
        and no flush (the write completed), the daemon killed with kill -9,
        the same command line again. Returns (what was written, what reads
        back after the recovery) as md5s: a recovery must not lose a
        completed write, since the kernel will not send it again and the
        file system's next flush, answered by the new daemon, tells it the
        write is stable."""
        off = offset_mib if offset_mib is not None else self.rng.randrange(64, 128)
        want = self.check("dd if=/dev/urandom of=/mnt/probe bs=1M count=1 2>/dev/null && md5sum < /mnt/probe && "
                          "dd if=/mnt/probe of=%s bs=1M seek=%d oflag=direct 2>/dev/null && "
                          "kill -9 $(cat /tmp/ublk_serve.pid)" % (self.dev, off)).split()[0]
        self.restart(0)
        got = self.check("echo 3 > /proc/sys/vm/drop_caches; dd if=%s bs=1M skip=%d count=1 iflag=direct "
                         "2>/dev/null | md5sum" % (self.dev, off)).split()[0]
        return want, got

    def finish(self):
        """umount, e2fsck -fn (clean), stop() (VDUSE: vdpa dev del first)."""
        if self.mounted:
            self.check("cd /; umount /mnt/fs", 120, "umount")
            self.mounted = False
        out = self.check("e2fsck -fn %s 2>&1" % self.dev, 300, "e2fsck -fn")
        if "Pass 5" not in out:
            raise SoakFailure("e2fsck -fn: %s" % out)
        self.stop()
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.environ.get("VBLK", "build/vblk"))
    ap.add_argument("--qemu-img", default=shutil.which("qemu-img") or "qemu-img")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--num-queues", type=int, default=1, choices=(1, 2))
    ap.add_argument("--cluster-size", default="64K", choices=("64K", "2M"))
    ap.add_argument("--backing", action="store_true", help="over a compressed qcow2 base")
    ap.add_argument("--transport", default="ublk", choices=("ublk", "vduse"),
                    help="ublk (recovery=on unless --no-recovery) or vduse-blk (always taken over)")
    ap.add_argument("--no-recovery", action="store_true", help="ublk: the device fails with its daemon")
    ap.add_argument("--size-mib", type=int, default=256, help="virtual size of the image")
    ap.add_argument("--min-kill", type=float, default=0.5)
    ap.add_argument("--max-kill", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under /var/tmp)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--keep-going", action="store_true",
                    help="count lost flushed files (reported) and carry on with the next round")
    ap.add_argument("--probe", action="store_true",
                    help="recovery, takeover: first kill once after a completed, unflushed 1 MiB write and read "
                         "it back")
    a = ap.parse_args(argv)
    if a.transport == "vduse" and a.no_recovery:
        ap.error("--no-recovery: a VDUSE device waits for the next daemon, which always takes it over")
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    cluster = {"64K": 65536, "2M": 2 * MiB}[a.cluster_size]
    workdir = a.dir or tempfile.mkdtemp(prefix="%s-kills-" % a.transport, dir="/var/tmp")
    os.makedirs(workdir, exist_ok=True)

    def say(line):
        print(line, flush=True)

    say("seed %d, %s, %d queue(s), %s clusters%s, %d MiB, kill at %.1f-%.1f s, vblk %s" % (
        seed, "vduse-blk (takeover)" if a.transport == "vduse" else "ublk, no recovery" if a.no_recovery
        else "ublk, recovery=on", a.num_queues, a.cluster_size,
        " over a compressed base" if a.backing else "", a.size_mib, a.min_kill, a.max_kill, a.vblk))
    guest = None
    ok = False
    t0 = time.monotonic()
    soak = None
    probe_lost = False
    try:
        img, base = make_images(workdir, a.size_mib * MiB, cluster, a.backing, a.qemu_img)
        guest = ublk_guest.UblkGuest(workdir, a.vblk, disks=[img] + ([base] if base else []), smp=2)
        if not guest.boot(timeout=300):
            raise SoakFailure("the guest did not boot: " + guest.log_tail())
        say("guest up in %.1f s" % guest.boot_seconds)
        soak = KillSoak(guest, "/dev/vda", "/dev/vdb" if base else None, num_queues=a.num_queues,
                        recovery=not a.no_recovery, min_kill=a.min_kill, max_kill=a.max_kill, seed=seed, say=say,
                        keep_going=a.keep_going, transport=a.transport)
        if a.probe and not a.no_recovery:
            soak.start_daemon()
            soak.wait_readable()
            want, got = soak.probe_completed_write()
            probe_lost = want != got
            say("probe: 1 MiB written with O_DIRECT, no flush, kill -9, taken %s: %s (written %s, read %s)" % (
                "back" if a.transport == "ublk" else "over" + soak.takeover_info(0), "kept" if want == got
                else "LOST", want, got))
            soak.stop()
        say("served, ext4 made and mounted in %.1f s" % soak.setup())
        say("  %s" % soak.argv)
        for k in range(1, a.rounds + 1):
            soak.round(k)
        out = soak.finish()
        say("e2fsck -fn: clean (%s)" % out.strip().splitlines()[-1])
        guest.quit()
        guest = None
        rc, leaks, errors, text = qemu_img_check(img, a.qemu_img)
        say("qemu-img check: exit %d\n  %s" % (rc, text.replace("\n", "\n  ")))
        if base:
            brc, _, _, btext = qemu_img_check(base, a.qemu_img)
            if brc != 0:
                raise SoakFailure("the base does not check clean: " + btext)
        ok = rc in (0, 3) and errors == 0 and not soak.lost and not probe_lost
        lost = sum(len(x) for _, x in soak.lost)
        say("%s kill soak: %d/%d rounds, %d flushed files verified (%d md5 checks)%s, qemu-img check: %s; %.0f s" % (
            a.transport, soak.rounds_done - len(soak.lost), a.rounds, len(soak.verified), soak.checks,
            ", %d LOST in %d rounds (%s)" % (lost, len(soak.lost), ", ".join(str(k) for k, _ in soak.lost))
            if lost else "", check_line(rc, leaks), time.monotonic() - t0))
        if soak.lock_retries:
            say("  %d restarts refused for the image's lock (the killed daemon's file still open), rounds %s" % (
                len(soak.lock_retries), ", ".join(map(str, soak.lock_retries))))
        if soak.takeovers:
            say("  %d takeovers found the killed daemon's log; %d of them with answered, unflushed writes (%d in "
                "all), which the next daemon's first flush made durable" % (
                    len(soak.takeovers), sum(1 for _, u in soak.takeovers if u), sum(u for _, u in soak.takeovers)))
    except (SoakFailure, TimeoutError, guest_vm.GuestUnavailable) as e:
        say("FAILED: %s" % e)
        if soak is not None:
            say("%s kill soak: %d/%d rounds, %d flushed files verified before the failure" % (
                a.transport, soak.rounds_done, a.rounds, len(soak.verified)))
    finally:
        if guest is not None:
            guest.quit()
        if a.keep or not ok:
            say("work directory kept: %s" % workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
