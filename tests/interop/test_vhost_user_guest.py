#!/usr/bin/env python3
"""Interop: a real guest on qcow2 images served by `vblk serve` through
vhost-user-blk.

The guest is Debian's kernel with a busybox initramfs that loads the virtio
PCI and virtio-blk modules (bench/guest_vm.py, build_guest(virtio=True)),
booted by qemu-system-x86_64 under TCG with two vCPUs and its RAM in a
shared memfd (memory-backend-memfd,share=on + -numa node,memdev=: a
vhost-user back end maps guest memory). Each disk is a vhost-user-blk-pci
device with event_idx=off (QEMU 7.2 under TCG loses the first completion
interrupt after an idle queue in about one run in four with EVENT_IDX, also
with qemu-storage-daemon) and reconnect=1. The guest tells its disks apart
by their sizes. Patterns are drawn from the guest's /dev/urandom into its
tmpfs; the guest's md5 of what it wrote is checked against the image read
on the host by `qemu-img convert -U` (the daemon keeps the image open) and
the image by `qemu-img check -U`, after the guest flushed; once the guest
and the daemons have quit, every image is checked again without -U.

Both guests also carry the host's fio and its libraries (bench/guest_vm.py,
build_guest(fio=True); 512 MiB of RAM for the 84 MB unpacked): without
fio installed on the host the fio checks skip and the rest runs.

One guest serves the first class (a boot under TCG costs 30-70 s on a busy
two-core machine): one `vblk serve` with five exports, each test on its own
disk, and one qemu-storage-daemon disk for contrast.

1. Pattern: 8 MiB written with O_DIRECT and flushed, read back in the guest
   after dropping caches, and on the host; one queue, and two queues with a
   writer pinned to each vCPU (the guest shows two hardware queues).
1b. fio (the issue's acceptance): on the one-queue disk and on the
   two-queue disk (two jobs, one per vCPU), 16 MiB of 4 KiB random writes
   at queue depth 16 (libaio, O_DIRECT), each block with a crc32c and a
   header naming its offset (--verify=crc32c --do_verify=0), flushed; then
   a separate fio run of the same job with --verify_only reads all 16 MiB
   back and checks every block: exit status 0, no error, no bad block;
   the region's md5 read by the guest equals the image's on the host.
   That the verify-only pass can fail: a 1 MiB job's write, 16 bytes of
   one of its blocks overwritten in the image file on the host, and its
   verify-only pass fails, naming that block's offset. 16-18 s in all
   (measured: 6-8 + 6-7 + 4 s; fio takes 0.6-1.5 s to start under TCG).
2. Flushes: 50 x (4 KiB O_DIRECT write + fsync of /dev/vdX) on clusters
   allocated and flushed before. The daemons run under strace
   (fsync/fdatasync only, seccomp-filtered) and their files use
   aio=threads, so every flush that reaches an image file is a counted
   fdatasync on that file. Write-back (vblk's default, wce=1): the guest
   says "write back" and >= 50 flushes reach the image (measured: 50).
   writethrough=on: the guest says "write through" and sends no flushes;
   every write is FUA: each lands on a cluster not allocated before, and
   right after the 50 writes (no fsync in between or after) the host reads
   all 50 from the image, L2 entries included, and >= 50 fdatasyncs
   happened (measured: 103, data then metadata). qemu-storage-daemon 7.2
   for contrast: it says wce=0 (the guest says "write through" and sends no
   flushes) but caches, so 0 fdatasyncs reach its image (0 in every run;
   3 when the clusters are new: qcow2's own metadata ordering): a guest's
   fsync is not durable there.
3. blockdev-backup (sync=full, over vblk's QMP) while the guest writes:
   pattern A on the disk, the backup starts (rate-limited so it outlasts the
   guest's overwrite), the guest overwrites the region with pattern B and
   flushes while the job still runs; the target holds A, the disk B.

The second class boots its own guest (the daemon dies under it):

4. kill -9 of `vblk serve` while two guest writers (one per queue) have
   requests in flight (a throttle node limits writes so the 16 MiB take
   ~8 s; the kill comes after ~2 s) and a reader beside each writer (same
   vCPU, same ring, reads not limited) completes requests issued after the
   pending writes, and a restart with the same command line (the socket
   file the dead daemon left is bound again). QEMU reconnects
   (reconnect=1) and hands the new daemon the inflight area
   (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD); writers and readers finish with
   status 0, all 16 MiB read back, a pattern written after the restart
   verifies, and the image checks clean. Against vblk before the inflight
   area (0348cba) this fails as it should: QEMU rewinds each ring to its
   used index, the new daemon runs completed reads again and never the
   pending writes; the guest logs "virtio_blk virtio0: req.0:id 1 is not a
   head!" and I/O errors, the readers fail and the writers hang. The region is allocated and flushed before
   the writers start: with wce=1 a crash may lose what the guest did not
   flush (a new cluster's L2 entry waits in the daemon's cache).
   Before all that, fio's job (1b) writes 2 MiB with two jobs, one per
   queue, and flushes; after the restart its verify-only pass, served by
   the new daemon, finds every block.
   Measured once with qemu-storage-daemon 7.2 in its place (one queue, one
   writer, no reader; not a test): qsd has no inflight area, QEMU rewinds the ring to
   the used index ("vhost VQ 0 ring restore failed" in its log) and the
   restarted qsd runs what was outstanding again, so the writer also
   finished with status 0, but the 16 MiB read back were not the pattern
   and the image held no data cluster: qsd says wce=0, so the guest's
   flush of the allocation never reached it, and the kill took qsd's
   cached qcow2 metadata with it.

Skipped, with the reason, where qemu-system-x86_64 is missing or the kernel
/ busybox packages cannot be fetched; the flush counts need strace, the
contrast qemu-storage-daemon.
"""

import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, VBLK, make_tempdir, shm_dir, wait_unlocked  # noqa: E402
import guest_vm  # noqa: E402  (bench/, put on the path by common)
import qmp_driver  # noqa: E402

QEMU_IMG = shutil.which("qemu-img")
QSD = shutil.which("qemu-storage-daemon")
STRACE = shutil.which("strace")
MEM_MIB = 256
PATTERN_MIB = 8
# The guest that runs fio: its initramfs carries fio and its 64 libraries
# (84 MB, unpacked into the guest's RAM; bench/guest_vm.py,
# build_fio_initramfs). The kernel unpacks it into a rootfs capped at half
# of the RAM it sees then: with 256 MiB the unpacking stops at 58 MB
# ("Initramfs unpacking failed: write error"); with 512 MiB 350 MB are
# left once it is done (186 MB at 256 MiB without fio).
FIO_MEM_MIB = 512
# fio's job: 4 KiB random writes, each block with a crc32c header that names
# its offset, queue depth 16, O_DIRECT through libaio. Every block of the
# region is written once (fio's random map), so a later --verify_only run of
# the same job knows what each block must hold.
FIO_JOB = "--ioengine=libaio --direct=1 --rw=randwrite --bs=4k --iodepth=16 --verify=crc32c --eta=never"
FIO_OFFSET_MIB = 16  # past the pattern test's 8 MiB
FIO_MIB = 16
# fio's own reports of a block that does not verify ("crc32c: verify failed
# at file ... offset ...", "verify: bad magic header ...").
FIO_VERIFY_ERROR = re.compile(r"verify failed|verify: bad")


def qemu_img(*args, timeout=120):
    return subprocess.run([QEMU_IMG] + [str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def image_region(img, workdir, offset, length):
    """Bytes [offset, offset + length) of a qcow2 image as qemu-img reads it,
    shared with the daemon that has it open (-U)."""
    raw = os.path.join(workdir, "read.raw")
    r = qemu_img("convert", "-U", "-f", "qcow2", "-O", "raw", img, raw)
    if r.returncode != 0:
        raise AssertionError("qemu-img convert %s: %s" % (img, r.stderr))
    try:
        with open(raw, "rb") as f:
            f.seek(offset)
            return f.read(length)
    finally:
        os.unlink(raw)


def md5(data):
    return hashlib.md5(data).hexdigest()


class ServeDaemon:
    """`vblk serve` or qemu-storage-daemon with a QMP monitor, optionally
    under strace counting fsync/fdatasync per file. The daemon's own PID
    comes from --pidfile (strace's PID is not the daemon's); it is stopped
    by QMP quit, or killed by that PID."""

    def __init__(self, workdir, name, args, qsd=False, trace=False):
        self.workdir = workdir
        self.name = name
        self.trace_path = os.path.join(workdir, name + ".strace") if trace else None
        self.pidfile = os.path.join(workdir, name + ".pid")
        self.args = list(args)
        self.qsd = qsd
        self.starts = 0
        self.start()

    def start(self):
        if os.path.exists(self.pidfile):
            os.unlink(self.pidfile)
        self.starts += 1
        argv0 = [QSD] if self.qsd else [VBLK, "serve"]
        if self.trace_path:
            # LeakSanitizer cannot run its exit check under ptrace: in the
            # sanitizer build a traced vblk would fail its exit for that.
            asan = os.environ.get("ASAN_OPTIONS", "")
            argv0 = ["env", "ASAN_OPTIONS=%s%sdetect_leaks=0" % (asan, ":" if asan else "")] + argv0
            argv0 = [STRACE, "-f", "--seccomp-bpf", "-qq", "-y", "-e", "trace=fsync,fdatasync", "-e", "signal=none",
                     "-o", self.trace_path] + argv0
        self.d = qmp_driver.Daemon(argv0 + ["--pidfile", self.pidfile] + self.args,
                                   os.path.join(self.workdir, self.name + ".qmp"),
                                   os.path.join(self.workdir, "%s.%d.log" % (self.name, self.starts)))
        end = time.monotonic() + 30
        while True:
            try:
                with open(self.pidfile) as f:
                    self.pid = int(f.read().strip())
                break
            except (OSError, ValueError):
                if time.monotonic() > end:
                    self.kill_all()
                    raise AssertionError("%s wrote no pidfile: %s" % (self.name, self.d.log_tail()))
                time.sleep(0.02)

    @property
    def qmp(self):
        return self.d.qmp

    def flushes(self, path):
        """fsync/fdatasync calls on `path` that returned so far."""
        if not self.trace_path or not os.path.exists(self.trace_path):
            return 0
        tag = "<%s>" % os.path.realpath(path)
        n = 0
        with open(self.trace_path, errors="replace") as f:
            for line in f:
                if ("fdatasync(" in line or "fsync(" in line) and tag in line and "= 0" in line:
                    n += 1
        return n

    def kill9(self):
        """SIGKILL to the daemon itself (not strace); waits for its exit."""
        os.kill(self.pid, signal.SIGKILL)
        self.d.proc.wait(30)  # vblk itself, or strace, which exits with it
        self.d.qmp.close()

    def quit(self):
        """QMP quit; the daemon's exit code."""
        self.d.quit(timeout=60)
        return self.d.proc.returncode

    def kill_all(self):
        if self.d.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (OSError, AttributeError):
                pass
            self.d.kill()


def vhost_disk_args(socks, mem_mib):
    """QEMU arguments for one vhost-user-blk-pci per (socket, num-queues)."""
    args = ["-object", "memory-backend-memfd,id=mem,size=%dM,share=on" % mem_mib, "-numa", "node,memdev=mem"]
    for i, (sock, nq) in enumerate(socks):
        args += ["-chardev", "socket,id=vu%d,path=%s,reconnect=1" % (i, sock),
                 "-device", "vhost-user-blk-pci,chardev=vu%d,num-queues=%d,event_idx=off" % (i, nq)]
    return args


def export_args(i, img, sock, nq, extra="", throttle=False):
    args = ["--blockdev", "driver=file,filename=%s,node-name=f%d,aio=threads" % (img, i),
            "--blockdev", "driver=qcow2,file=f%d,node-name=%s%d" % (i, "q" if throttle else "d", i)]
    if throttle:
        args += ["--blockdev", "driver=throttle,throttle-group=tg0,file=q%d,node-name=d%d" % (i, i)]
    args += ["--export", "type=vhost-user-blk,id=e%d,node-name=d%d,addr.type=unix,addr.path=%s,writable=on,"
             "num-queues=%d%s" % (i, i, sock, nq, extra)]
    return args


class GuestBase(unittest.TestCase):
    """A class-wide guest and its daemons; subclasses set them up."""

    fio_missing = "this guest is booted without fio"

    @classmethod
    def need_guest(cls):
        if not QEMU_IMG:
            raise unittest.SkipTest("qemu-img is not installed")
        try:
            guest_vm.build_guest(virtio=True)
        except guest_vm.GuestUnavailable as e:
            raise unittest.SkipTest("no test guest: %s" % e)

    @classmethod
    def make_images(cls, sizes):
        for name, size in sizes.items():
            path = os.path.join(cls.dir, name + ".qcow2")
            r = qemu_img("create", "-q", "-f", "qcow2", path, size * MiB)
            if r.returncode != 0:
                raise AssertionError(r.stderr)
            cls.images[name] = path
            cls.sizes[name] = size

    @classmethod
    def fio_unavailable(cls):
        """Why the guest cannot have fio (None when it can)."""
        try:
            guest_vm.build_guest(fio=True)
            return None
        except guest_vm.GuestUnavailable as e:
            return str(e)

    @classmethod
    def boot(cls, socks, name="g", fio=False):
        mem = FIO_MEM_MIB if fio else MEM_MIB
        cls.guest = guest_vm.Guest(cls.dir, None, mem_mib=mem, extra=["-smp", "2"], name=name,
                                   disk_args=vhost_disk_args(socks, mem), virtio=True, fio=fio)
        t0 = time.monotonic()
        if not cls.guest.boot(timeout=400):
            raise AssertionError("the guest did not boot: %s" % cls.guest.log_tail())
        cls.boot_seconds = time.monotonic() - t0
        # Which /dev/vdX is which image: by size (512-byte sectors).
        rc, out = cls.guest.sh("for d in /sys/block/vd*; do echo ${d##*/} $(cat $d/size); done")
        by_sectors = {int(s): d for d, s in (line.split() for line in out.split("\n") if line.strip())}
        cls.vd = {}
        for name, size in cls.sizes.items():
            if size * MiB // 512 in by_sectors:
                cls.vd[name] = "/dev/" + by_sectors[size * MiB // 512]
        missing = [n for n in cls.served if n not in cls.vd]
        if missing:
            raise AssertionError("the guest has no disk for %s: %s; %s" % (missing, out, cls.guest.log_tail()))

    @classmethod
    def shutdown_and_check(cls):
        """Ends the guest, quits the daemons, and checks every image with
        the daemons gone (no -U). Raises (tearDownClass reports it) when a
        daemon does not exit 0 or an image is not clean."""
        problems = []
        if getattr(cls, "guest", None):
            cls.guest.quit()
        for d in cls.daemons:
            try:
                rc = d.quit()
                if rc != 0:
                    problems.append("%s exited %s: %s" % (d.name, rc, d.d.log_tail()))
            except Exception as e:  # noqa: BLE001 - reported below
                problems.append("%s: %s" % (d.name, e))
                d.kill_all()
        for name, img in cls.images.items():
            r = qemu_img("check", img)
            if r.returncode != 0:
                problems.append("qemu-img check %s: %s%s" % (name, r.stdout, r.stderr))
        if problems:
            raise AssertionError("; ".join(problems))

    @classmethod
    def tearDownClass(cls):
        try:
            cls.shutdown_and_check()
        finally:
            cls.cleanup()

    @classmethod
    def cleanup(cls):
        if getattr(cls, "guest", None):
            cls.guest.kill()
        for d in getattr(cls, "daemons", []):
            d.kill_all()
        if os.environ.get("VBLK_VHOST_GUEST_KEEP"):  # debugging: keep the logs and images
            print("\nkept %s" % cls.dir, file=sys.stderr)
        else:
            shutil.rmtree(cls.dir, ignore_errors=True)

    # --- helpers in the guest ------------------------------------------------
    def gsh(self, command, timeout=300):
        rc, out = self.guest.sh(command, timeout=timeout)
        self.assertEqual(rc, 0, "guest: %s: %s\n%s" % (command, out, self.stall_reports()))
        return out

    def stall_reports(self):
        """What vblk's stall watch (60 s) said, to tell a hang on the
        daemon's side (requests popped and not completed, or not popped)
        from one on the front end's (completions signalled, not consumed;
        with event_idx=off a lost interrupt leaves the daemon idle, so
        silence says the same)."""
        lines = []
        for f in sorted(glob.glob(os.path.join(self.dir, "*.log"))):
            with open(f, errors="replace") as fh:
                lines += ["%s: %s" % (os.path.basename(f), x.rstrip()) for x in fh
                          if "stalled for" in x or "moving again" in x]
        return "stall watch: " + ("\n".join(lines) if lines else "no queue with work outstanding stalled")

    def new_pattern(self, name, mib=PATTERN_MIB):
        """A random file of `mib` MiB in the guest's tmpfs; its md5."""
        return self.gsh("dd if=/dev/urandom of=/mnt/%s bs=1M count=%d 2>/dev/null && md5sum /mnt/%s"
                        % (name, mib, name)).split()[0]

    def guest_read_md5(self, dev, offset_mib, mib):
        """The md5 of a region of the disk read by the guest with O_DIRECT,
        after dropping its caches."""
        return self.gsh("echo 3 > /proc/sys/vm/drop_caches; dd if=%s bs=1M skip=%d count=%d iflag=direct "
                        "2>/dev/null | md5sum" % (dev, offset_mib, mib)).split()[0]

    def assertImageClean(self, img):
        r = qemu_img("check", "-U", img)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def fio(self, dev, offset_mib, mib, jobs, *extra):
        """fio's job (FIO_JOB) in the guest on `mib` MiB of `dev` from
        offset_mib, split between `jobs` jobs, each pinned to its own vCPU
        (and so its own hardware queue when there are two); extra: the
        pass's own options. Returns (exit status, what fio printed besides
        its report, [(error, bytes read, bytes written) of each job] from
        its JSON report)."""
        if self.fio_missing:
            self.skipTest("no fio in the guest: %s" % self.fio_missing)
        per = mib // jobs
        rc, out = self.guest.sh("cd /mnt && rm -f fio.json && /usr/bin/fio --name=crc --filename=%s %s --offset=%dM "
                                "--size=%dM --numjobs=%d --offset_increment=%dM --cpus_allowed=0-%d "
                                "--cpus_allowed_policy=split --output-format=json --output=fio.json %s 2>&1"
                                % (dev, FIO_JOB, offset_mib, per, jobs, per, jobs - 1, " ".join(extra)), timeout=600)
        report = self.gsh("cat /mnt/fio.json")
        # Notices ("multiple writers may overwrite blocks...": the jobs'
        # regions do not overlap) come before the JSON.
        start = report.find("\n{") + 1 if not report.startswith("{") else 0
        try:
            doc = json.loads(report[start:])
        except ValueError:
            raise AssertionError("fio wrote no report (exit %d): %s\n%s" % (rc, out, report[-2000:]))
        return rc, out, [(j["error"], j["read"]["io_bytes"], j["write"]["io_bytes"]) for j in doc["jobs"]]

    def assertFioPassed(self, result, jobs, key, mib, what):
        """fio exited 0, reported no error and no block that failed to
        verify, and its jobs moved `mib` MiB (key: 1 = bytes read, 2 =
        written)."""
        rc, out, per_job = result
        msg = "fio %s: exit %d, jobs (error, read, written) %s: %s" % (what, rc, per_job, out)
        self.assertEqual(rc, 0, msg)
        self.assertNotRegex(out, FIO_VERIFY_ERROR, msg)
        self.assertEqual([j[0] for j in per_job], [0] * jobs, msg)
        self.assertEqual(sum(j[key] for j in per_job), mib * MiB, msg)


class VhostUserGuest(GuestBase):

    @classmethod
    def setUpClass(cls):
        cls.need_guest()
        cls.dir = make_tempdir(base=shm_dir(), prefix="vblk-vhost-guest-")
        cls.images, cls.sizes, cls.daemons, cls.guest = {}, {}, [], None
        try:
            # Distinct sizes: the guest finds each disk by its size.
            cls.make_images({"one": 64, "two": 72, "wb": 80, "wt": 88, "backup": 96, "qsd": 104})
            socks, args = [], []
            vblk_disks = [("one", 1, ""), ("two", 2, ""), ("wb", 1, ""), ("wt", 1, ",writethrough=on"),
                          ("backup", 2, "")]
            for i, (name, nq, extra) in enumerate(vblk_disks):
                sock = os.path.join(cls.dir, name + ".sock")
                args += export_args(i, cls.images[name], sock, nq, extra)
                socks.append((sock, nq))
            cls.traced = STRACE is not None
            cls.vblk = ServeDaemon(cls.dir, "vblk", args, trace=cls.traced)
            cls.daemons.append(cls.vblk)
            cls.served = [n for n, _, _ in vblk_disks]
            cls.qsd = None
            if QSD:
                sock = os.path.join(cls.dir, "qsd.sock")
                cls.qsd = ServeDaemon(cls.dir, "qsd", export_args(0, cls.images["qsd"], sock, 1), qsd=True,
                                      trace=cls.traced)
                cls.daemons.append(cls.qsd)
                socks.append((sock, 1))
                cls.served.append("qsd")
            cls.fio_missing = cls.fio_unavailable()
            cls.boot(socks, fio=not cls.fio_missing)
        except BaseException:
            cls.cleanup()
            raise

    # --- 1. pattern -------------------------------------------------------------
    def pattern_round_trip(self, name, writers):
        dev, img = self.vd[name], self.images[name]
        want = self.new_pattern("p-" + name)
        # Each writer its own slice of the pattern, pinned to its own vCPU
        # (and so its own hardware queue when there are two).
        per = PATTERN_MIB // writers
        cmds = ["taskset %d dd if=/mnt/p-%s of=%s bs=1M skip=%d seek=%d count=%d oflag=direct 2>/dev/null"
                % (1 << w, name, dev, w * per, w * per, per) for w in range(writers)]
        # In a subshell: the console's interactive shell would print job notices.
        self.gsh("(" + " & ".join(cmds) + " & wait) && sync %s" % dev)
        self.assertEqual(self.guest_read_md5(dev, 0, PATTERN_MIB), want, "guest read-back of %s" % name)
        self.assertImageClean(img)
        self.assertEqual(md5(image_region(img, self.dir, 0, PATTERN_MIB * MiB)), want,
                         "the pattern in %s read on the host" % name)

    def test_pattern_one_queue(self):
        self.assertEqual(self.gsh("ls /sys/block/%s/mq" % self.vd["one"][5:]).split(), ["0"])
        self.pattern_round_trip("one", 1)

    def test_pattern_two_queues(self):
        self.assertEqual(self.gsh("ls /sys/block/%s/mq" % self.vd["two"][5:]).split(), ["0", "1"])
        self.pattern_round_trip("two", 2)

    # --- 1b. fio --------------------------------------------------------------
    def fio_round_trip(self, name, jobs):
        dev, img = self.vd[name], self.images[name]
        # The write pass (no verification), flushed at its end (end_fsync:
        # a FLUSH to the daemon, so the image holds it for the host's read).
        self.assertFioPassed(self.fio(dev, FIO_OFFSET_MIB, FIO_MIB, jobs, "--do_verify=0", "--end_fsync=1"),
                             jobs, 2, FIO_MIB, "write")
        # A separate run of the same job that only reads and verifies: every
        # block's crc32c and header (its offset, the job's seed).
        self.assertFioPassed(self.fio(dev, FIO_OFFSET_MIB, FIO_MIB, jobs, "--verify_only"), jobs, 1, FIO_MIB,
                             "verify_only")
        self.assertImageClean(img)
        self.assertEqual(md5(image_region(img, self.dir, FIO_OFFSET_MIB * MiB, FIO_MIB * MiB)),
                         self.guest_read_md5(dev, FIO_OFFSET_MIB, FIO_MIB),
                         "what fio wrote to %s, read by the guest and on the host" % name)

    def test_fio_one_queue(self):
        self.fio_round_trip("one", 1)

    def test_fio_two_queues(self):
        # One job per vCPU: both hardware queues carry writes.
        self.fio_round_trip("two", 2)

    def test_fio_verify_catches_corruption(self):
        """The verify-only pass fails on one block corrupted on the host:
        the fio checks above can fail. A small job of its own (1 MiB on the
        one-queue disk, past the region test_fio_one_queue writes); between
        its write and its verify-only pass, 16 bytes in the middle of one
        block (its header intact: the block's crc32c has to catch it) are
        overwritten in the image file while the export is idle (the daemon
        caches qcow2 metadata, not data: its next read of the block reads
        the file). fio stops at the first bad block and names its offset:
        that it is the corrupted one says the rest verified."""
        dev, img = self.vd["one"], self.images["one"]
        offset_mib, mib = FIO_OFFSET_MIB + FIO_MIB, 1
        rc, out, per_job = self.fio(dev, offset_mib, mib, 1, "--do_verify=0", "--end_fsync=1")
        self.assertEqual((rc, per_job), (0, [(0, 0, mib * MiB)]), out)
        bad = offset_mib * MiB + 100 * 4096  # the guest's offset of the block
        r = qemu_img("map", "-U", "--output=json", "-f", "qcow2", img)
        self.assertEqual(r.returncode, 0, r.stderr)
        ext = [e for e in json.loads(r.stdout) if e["start"] <= bad < e["start"] + e["length"]]
        self.assertTrue(ext and ext[0]["data"] and "offset" in ext[0], r.stdout)
        fd = os.open(img, os.O_WRONLY)
        try:
            os.pwrite(fd, os.urandom(16), ext[0]["offset"] + bad - ext[0]["start"] + 2048)
        finally:
            os.close(fd)
        rc, out, per_job = self.fio(dev, offset_mib, mib, 1, "--verify_only")
        self.assertNotEqual(rc, 0, "fio's verify-only pass did not see the corrupt block: %s" % out)
        self.assertNotEqual(per_job[0][0], 0, out)
        self.assertIn("crc32c: verify failed at file %s offset %d," % (dev, bad), out)

    # --- 2. flushes -------------------------------------------------------------
    def fifty_fsynced_writes(self, daemon, name, fsync=True, stride_kib=4):
        """50 x (4 KiB O_DIRECT write [+ fsync of the device]); returns
        (the guest's write-cache mode, fsync/fdatasync calls on the image
        during the loop, md5 of the 4 KiB block)."""
        dev, img = self.vd[name], self.images[name]
        mode = self.gsh("cat /sys/block/%s/queue/write_cache" % dev[5:]).strip()
        blk = self.gsh("dd if=/dev/urandom of=/mnt/b4k bs=4k count=1 2>/dev/null && md5sum /mnt/b4k").split()[0]
        if fsync:
            # Allocated and flushed before counting: the count is the
            # guest's flushes, not the format's metadata ordering.
            self.gsh("dd if=/dev/zero of=%s bs=4k count=%d oflag=direct 2>/dev/null && sync %s"
                     % (dev, 50 * stride_kib // 4, dev))
        time.sleep(0.5)
        before = daemon.flushes(img)
        self.gsh("i=0; while [ $i -lt 50 ]; do dd if=/mnt/b4k of=%s bs=4k count=1 seek=$((i*%d)) oflag=direct %s"
                 "2>/dev/null || exit 1; i=$((i+1)); done" % (dev, stride_kib // 4, "conv=fsync " if fsync else ""))
        time.sleep(0.5)  # strace's lines for the last calls
        return mode, daemon.flushes(img) - before, blk

    def assertBlocksInImage(self, img, blk, stride_kib, msg):
        data = image_region(img, self.dir, 0, 50 * stride_kib * 1024)
        got = [md5(data[i * stride_kib * 1024:i * stride_kib * 1024 + 4096]) for i in range(50)]
        self.assertEqual(got, [blk] * 50, msg)

    @unittest.skipUnless(STRACE, "counting flushes needs strace")
    def test_flush_write_back(self):
        mode, flushes, blk = self.fifty_fsynced_writes(self.vblk, "wb")
        print("\nvblk write-back: guest says %r, %d flushes reached the image for 50 write+fsync"
              % (mode, flushes), file=sys.stderr)
        self.assertEqual(mode, "write back")
        self.assertGreaterEqual(flushes, 50)
        self.assertBlocksInImage(self.images["wb"], blk, 4, "the 50 fsynced blocks")
        self.assertImageClean(self.images["wb"])

    @unittest.skipUnless(STRACE, "counting flushes needs strace")
    def test_flush_write_through(self):
        # Every write on its own 64 KiB cluster, none allocated before, and
        # no fsync: what makes each durable is its FUA, data and L2 entry.
        mode, flushes, blk = self.fifty_fsynced_writes(self.vblk, "wt", fsync=False, stride_kib=64)
        print("\nvblk writethrough=on: guest says %r, %d flushes for 50 writes (no fsync)" % (mode, flushes),
              file=sys.stderr)
        self.assertEqual(mode, "write through")
        self.assertBlocksInImage(self.images["wt"], blk, 64, "the 50 writes right after completion")
        self.assertGreaterEqual(flushes, 50)
        self.assertImageClean(self.images["wt"])

    @unittest.skipUnless(STRACE and QSD, "needs strace and qemu-storage-daemon")
    def test_flush_qsd_contrast(self):
        mode, flushes, blk = self.fifty_fsynced_writes(self.qsd, "qsd")
        print("\nqemu-storage-daemon: guest says %r, %d flushes reached the image for 50 write+fsync"
              % (mode, flushes), file=sys.stderr)
        self.assertEqual(mode, "write through")
        self.assertEqual(flushes, 0)

    # --- 3. point-in-time backup --------------------------------------------------
    def test_backup_point_in_time(self):
        name = "backup"
        dev, img = self.vd[name], self.images[name]
        q = self.vblk.qmp
        a = self.new_pattern("pA")
        b = self.new_pattern("pB")
        self.gsh("dd if=/mnt/pA of=%s bs=1M oflag=direct 2>/dev/null && sync %s" % (dev, dev))
        tgt = os.path.join(self.dir, "backup-target.qcow2")
        r = qemu_img("create", "-q", "-f", "qcow2", tgt, self.sizes[name] * MiB)
        self.assertEqual(r.returncode, 0, r.stderr)
        q.ok("blockdev-add", {"driver": "qcow2", "node-name": "bt",
                              "file": {"driver": "file", "filename": tgt}})
        q.drain_events()
        # 1 MiB/s: the 8 MiB written take ~8 s, the guest's overwrite well under that.
        q.ok("blockdev-backup", {"job-id": "bk", "device": "d4", "target": "bt", "sync": "full",
                                 "speed": 1 * MiB})
        self.gsh("dd if=/mnt/pB of=%s bs=1M oflag=direct 2>/dev/null && sync %s" % (dev, dev))
        jobs = q.ok("query-block-jobs")
        self.assertEqual([j["device"] for j in jobs], ["bk"],
                         "the backup ended before the guest's overwrite did: the test proves nothing")
        q.ok("block-job-set-speed", {"device": "bk", "speed": 0})
        ev = q.event("BLOCK_JOB_COMPLETED", 120)
        self.assertNotIn("error", ev["data"], ev)
        q.ok("blockdev-del", {"node-name": "bt"})
        r = qemu_img("check", tgt)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(md5(image_region(tgt, self.dir, 0, PATTERN_MIB * MiB)), a,
                         "the backup holds what the disk held when it started")
        self.assertEqual(self.guest_read_md5(dev, 0, PATTERN_MIB), b)
        self.assertEqual(md5(image_region(img, self.dir, 0, PATTERN_MIB * MiB)), b)
        self.assertImageClean(img)


class VhostUserGuestRestart(GuestBase):
    """The daemon is killed under a running guest and started again."""

    QSD = False  # qemu-storage-daemon instead of vblk (to see what QEMU does with it)

    @classmethod
    def setUpClass(cls):
        cls.need_guest()
        cls.dir = make_tempdir(base=shm_dir(), prefix="vblk-vhost-restart-")
        cls.images, cls.sizes, cls.daemons, cls.guest = {}, {}, [], None
        try:
            cls.make_images({"disk": 64})
            cls.sock = os.path.join(cls.dir, "disk.sock")
            # Writes at 2 MB/s: the writers' 16 MiB take ~8 s, so requests are
            # in flight whenever the kill comes. Reads are not limited: the
            # readers' requests, queued behind a pending write on the same
            # ring, complete before it (out of order).
            args = ["--object", "throttle-group,id=tg0,x-bps-write=%d" % (2 * 1000 * 1000)]
            args += export_args(0, cls.images["disk"], cls.sock, 2, throttle=True)
            cls.vblk = ServeDaemon(cls.dir, "vblk", args, qsd=cls.QSD)
            cls.daemons.append(cls.vblk)
            cls.served = ["disk"]
            cls.fio_missing = cls.fio_unavailable()
            cls.boot([(cls.sock, 2)], name="r", fio=not cls.fio_missing)
        except BaseException:
            cls.cleanup()
            raise

    def wait_guest_file(self, path, timeout):
        end = time.monotonic() + timeout
        while True:
            rc, out = self.guest.sh("cat %s 2>/dev/null" % path, timeout=60)
            if rc == 0 and out.strip():
                return out.strip()
            if time.monotonic() > end:
                return None
            time.sleep(0.5)

    def test_kill9_and_restart_under_io(self):
        dev, img = self.vd["disk"], self.images["disk"]
        # fio's blocks (2 MiB: writes are throttled to 2 MB/s), written by
        # two jobs, one per queue, and flushed before the kill; verified
        # after the restart, when the new daemon serves them.
        fio_at, fio_mib = 48, 2
        if not self.fio_missing:
            self.assertFioPassed(self.fio(dev, fio_at, fio_mib, 2, "--do_verify=0", "--end_fsync=1"), 2, 2, fio_mib,
                                 "write")
        want = self.new_pattern("p1", 16)
        # Allocated and flushed first: write-back (wce=1) allows a crash to
        # lose writes the guest did not flush, and a new cluster's L2 entry
        # waits in the daemon's cache until a flush. On allocated clusters
        # a completed write is in the file, so after the kill all 16 MiB
        # must be there: completed before, or run again from the inflight
        # area after the restart.
        self.gsh("dd if=/dev/zero of=%s bs=1M count=16 oflag=direct 2>/dev/null && sync %s" % (dev, dev))
        # Two writers, one per vCPU and queue, 64 KiB O_DIRECT requests, in
        # the background: each leaves its exit status in a file. Beside each
        # writer, on the same vCPU and so the same ring, a reader of another
        # region (4 KiB O_DIRECT, in a loop until the writers are done): its
        # reads complete while a write issued before them waits, so when the
        # kill comes the used ring is not a prefix of the avail ring.
        # Rewinding the ring to the used index (what QEMU does without an
        # inflight area) then runs completed reads again and never the
        # pending write; the inflight area names exactly what was pending.
        self.gsh("rm -f /mnt/w0 /mnt/w1 /mnt/r0 /mnt/r1; ( "
                 "(taskset 1 dd if=/mnt/p1 of=%s bs=64k count=128 oflag=direct 2>/dev/null; echo $? > /mnt/w0) & "
                 "(taskset 2 dd if=/mnt/p1 of=%s bs=64k skip=128 seek=128 count=128 oflag=direct 2>/dev/null; "
                 "echo $? > /mnt/w1) & )" % (dev, dev))
        for r in range(2):
            self.gsh("( (taskset %d sh -c 'n=0; while [ ! -e /mnt/w%d ]; do "
                     "dd if=%s of=/dev/null bs=4k count=16 skip=%d iflag=direct 2>/dev/null || exit 1; n=$((n+1)); "
                     "done; echo $n'; echo $? > /mnt/r%d.rc) > /mnt/r%d & )" % (1 << r, r, dev, 8192 + 16 * r, r, r))
        time.sleep(2)
        self.assertEqual(self.gsh("cat /mnt/w0 /mnt/w1 2>/dev/null; true").strip(), "",
                         "the writers ended before the kill")
        old_pid = self.vblk.pid
        self.vblk.kill9()
        wait_unlocked(img)
        # The same command line; the socket file the killed daemon left is
        # bound again.
        self.vblk.start()
        self.assertNotEqual(self.vblk.pid, old_pid)
        t0 = time.monotonic()
        end = t0 + 90  # ~8 s of throttled writes left
        statuses = [self.wait_guest_file("/mnt/w%d" % w, end - time.monotonic()) for w in range(2)]
        took = time.monotonic() - t0
        readers = [self.wait_guest_file("/mnt/r%d.rc" % r, 30) for r in range(2)]
        loops = self.gsh("cat /mnt/r0 /mnt/r1").split()
        print("\nwriters done %.1f s after the restart; reader loops %s" % (took, loops), file=sys.stderr)
        self.assertEqual(statuses, ["0", "0"], "the guest's writers after the restart; %s; %s"
                         % (self.gsh("dmesg | tail -20"), self.vblk.d.log_tail()))
        self.assertEqual(readers, ["0", "0"], "the guest's readers; %s" % self.gsh("dmesg | tail -20"))
        self.gsh("sync %s" % dev)
        self.assertEqual(self.guest_read_md5(dev, 0, 16), want, "what was in flight at the kill")
        if not self.fio_missing:
            self.assertFioPassed(self.fio(dev, fio_at, fio_mib, 2, "--verify_only"), 2, 1, fio_mib,
                                 "verify_only after the restart")
        # And the disk goes on working: a new pattern after the restart.
        want2 = self.new_pattern("p2")
        self.gsh("dd if=/mnt/p2 of=%s bs=1M seek=32 oflag=direct 2>/dev/null && sync %s" % (dev, dev))
        self.assertEqual(self.guest_read_md5(dev, 32, PATTERN_MIB), want2)
        self.assertImageClean(img)
        self.assertEqual(md5(image_region(img, self.dir, 0, 16 * MiB)), want)
        self.assertEqual(md5(image_region(img, self.dir, 32 * MiB, PATTERN_MIB * MiB)), want2)


if __name__ == "__main__":
    unittest.main()
