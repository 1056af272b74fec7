#!/usr/bin/env python3
"""Interop: the FUSE export (type=fuse) as the host uses it: fio with crc32c
verify at QD32 on the mounted file (qemu-storage-daemon 7.2 corrupts data
here), a loop device in both modes with ext4 made, stressed (stress-ng, as
fsstress would), filled, trimmed and checked, holes seen through SEEK_HOLE,
qemu-img and cp on the mount, writers killed mid-write, a killed daemon's
stale mount cleared at the next start, and the errors qemu-storage-daemon
gives for bad mountpoints."""

import hashlib
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, QEMU_IMG, VBLK, InteropTestCase, make_tempdir, rand_bytes, shm_dir  # noqa: E402

FIO = shutil.which("fio")
QSD = shutil.which("qemu-storage-daemon")
# fsstress is not packaged in Debian 12; stress-ng (scripts/deps.sh) stands in.
STRESS_NG = shutil.which("stress-ng")

# stress-ng's file system load, as fsstress -p 4 -n 3000 would give: two
# runs of 4 workers, data (verified by stress-ng) then metadata; each
# worker stops after its bogo ops (a link or symlink op makes and removes
# 8,192 links, a fallocate op a dozen calls on an 8 MiB file).
STRESS_RUNS = (
    ["--hdd", "1", "--hdd-ops", "3000", "--hdd-bytes", "4M", "--hdd-write-size", "4k", "--hdd-opts",
     "wr-rnd,rd-rnd,fdatasync", "--iomix", "1", "--iomix-ops", "3000", "--iomix-bytes", "8M", "--seek", "1",
     "--seek-ops", "3000", "--seek-size", "8M", "--seek-punch", "--fallocate", "1", "--fallocate-ops", "300",
     "--fallocate-bytes", "8M"],
    ["--dir", "1", "--dir-ops", "3000", "--dir-dirs", "64", "--rename", "1", "--rename-ops", "3000", "--link", "1",
     "--link-ops", "1", "--symlink", "1", "--symlink-ops", "1"],
)

# A writer to be killed: loops over [start, start + length) in 1 MiB
# writes until killed, O_DIRECT from 4 threads (the kernel sends one such
# write at a time: it holds the inode lock) or buffered from one thread
# with an fsync every 8 MiB.
WRITER = r"""
import mmap, os, sys, threading
path, mode, start, length = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
direct = mode == "direct"
fd = os.open(path, os.O_WRONLY | (os.O_DIRECT if direct else 0))
def run(first, n):
    buf = mmap.mmap(-1, 1 << 20)
    buf.write(os.urandom(1 << 20))
    i = 0
    while True:
        os.pwrite(fd, buf, first + (i % n) * (1 << 20))
        i += 1
        if not direct and i % 8 == 0:
            os.fsync(fd)
threads = 4 if direct else 1
per = length // (1 << 20) // threads
for t in range(threads):
    threading.Thread(target=run, args=(start + t * per * (1 << 20), per)).start()
"""


def mounted(path):
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


URING_PARAM = "/sys/module/fuse/parameters/enable_uring"


def io_urings(pid):
    """The io_urings a process holds, in descriptor order: (fd, completions
    so far) from /proc/PID/fdinfo."""
    out = []
    fds = sorted(int(n) for n in os.listdir("/proc/%d/fd" % pid))
    for fd in fds:
        try:
            if os.readlink("/proc/%d/fd/%d" % (pid, fd)) != "anon_inode:[io_uring]":
                continue
            with open("/proc/%d/fdinfo/%d" % (pid, fd)) as f:
                info = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        out.append((fd, int(info["CqTail"])))
    return out


class FuseExportTest(InteropTestCase):
    EXPORT_EXTRA = ""  # appended to every export's options

    def setUp(self):
        super().setUp()
        if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
            self.skipTest("needs root and /dev/fuse")
        self.dir = make_tempdir(self, base=shm_dir(), prefix="vblk-fuse-")
        self.mp = os.path.join(self.dir, "disk")
        open(self.mp, "w").close()
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if mounted(self.mp):
            subprocess.run(["umount", "-l", self.mp])
        super().tearDown()

    def serve(self, img, fmt="qcow2", extra="", check_mount=True):
        argv = [VBLK, "serve", "--blockdev", "driver=file,filename=%s,node-name=f0" % img,
                "--blockdev", "driver=%s,file=f0,node-name=d0" % fmt,
                "--export", "type=fuse,id=e0,node-name=d0,mountpoint=%s,writable=on%s%s" % (self.mp, self.EXPORT_EXTRA,
                                                                                           extra)]
        with open(os.path.join(self.dir, "serve.log"), "ab") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.procs.append(p)
        end = time.time() + 20
        while check_mount and not mounted(self.mp):
            self.assertIsNone(p.poll(), self.log())
            self.assertLess(time.time(), end)
            time.sleep(0.02)
        return p

    def log(self):
        with open(os.path.join(self.dir, "serve.log"), errors="replace") as f:
            return f.read()

    def stop(self, p):
        p.send_signal(signal.SIGTERM)
        self.assertEqual(p.wait(60), 0)
        self.assertFalse(mounted(self.mp))

    def image(self, size=128 * MiB, fmt="qcow2"):
        img = os.path.join(self.dir, "img." + fmt)
        subprocess.run([QEMU_IMG, "create", "-q", "-f", fmt, img, str(size)], check=True)
        return img

    def qemu_img_check(self, img, leaks_ok=False):
        """qemu-img check finds no corruption; after a kill -9, leaked
        clusters (exit 3: allocated, not yet referenced) are allowed, as in
        QEMU."""
        r = subprocess.run([QEMU_IMG, "check", img], capture_output=True, text=True)
        self.assertIn(r.returncode, (0, 3) if leaks_ok else (0,), r.stdout + r.stderr)
        self.assertNotIn("ERROR", r.stdout)

    def stress(self, mnt):
        """Runs STRESS_RUNS on the file system at mnt: each must finish all
        its bogo ops (not cut short by the timeout) with no failure."""
        for run in STRESS_RUNS:
            argv = [STRESS_NG, "--temp-path", mnt, "--verify", "--metrics-brief", "--timeout", "300"] + run
            r = subprocess.run(argv, capture_output=True, text=True, timeout=400)
            out = r.stdout + r.stderr
            self.assertEqual(r.returncode, 0, out)
            self.assertIn("successful run completed", out)
            self.assertNotIn(" fail: ", out)
            ops = {}
            for line in out.splitlines():
                f = line.split()
                if len(f) > 4 and f[1] == "metrc:" and f[4].isdigit():
                    ops[f[3]] = int(f[4])
            want = {run[i][2:-4]: int(run[i + 1]) for i in range(len(run)) if run[i].endswith("-ops")}
            self.assertEqual(ops, want, out)

    def fuse_waiting(self):
        """Requests the kernel has sent to the daemon and not seen answered
        (fusectl's `waiting` of the mount's connection)."""
        if not getattr(self, "fusectl", None):
            self.fusectl = make_tempdir(self, base=self.dir, prefix="fusectl-")
            subprocess.run(["mount", "-t", "fusectl", "fusectl", self.fusectl], check=True)
            self.addCleanup(subprocess.run, ["umount", self.fusectl])
        with open(os.path.join(self.fusectl, str(os.minor(os.stat(self.mp).st_dev)), "waiting")) as f:
            return int(f.read())

    def read_direct(self, off, n):
        """n bytes at off of the mounted file, read with O_DIRECT (from the
        daemon, not the page cache)."""
        buf = mmap.mmap(-1, n)
        fd = os.open(self.mp, os.O_RDONLY | os.O_DIRECT)
        try:
            self.assertEqual(os.preadv(fd, [buf], off), n)
        finally:
            os.close(fd)
        return bytes(buf)

    def test_fio_verify_qd32(self):
        if not FIO:
            self.skipTest("fio not installed")
        img = self.image(64 * MiB, "raw")
        p = self.serve(img, "raw")
        for engine, extra in (("io_uring", []), ("libaio", []), ("psync", ["--numjobs=4", "--offset_increment=16M",
                                                                            "--size=16M"])):
            with self.subTest(engine=engine):
                argv = [FIO, "--name=v", "--filename=" + self.mp, "--rw=randwrite", "--bs=4k", "--iodepth=32",
                        "--ioengine=" + engine, "--direct=1", "--verify=crc32c", "--do_verify=1",
                        "--verify_fatal=1", "--randrepeat=0", "--size=64M", "--group_reporting"] + extra
                r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-2000:])
                self.assertIn("err= 0", r.stdout)
        self.stop(p)
        # What the mount held is in the image: verify again on the file itself.
        r = subprocess.run([FIO, "--name=v", "--filename=" + img, "--rw=randwrite", "--bs=4k", "--iodepth=32",
                            "--ioengine=psync", "--verify=crc32c", "--verify_only=1", "--verify_fatal=1",
                            "--numjobs=4", "--offset_increment=16M", "--size=16M", "--randrepeat=0"],
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-2000:])

    def test_ext4_on_loop(self):
        """ext4 on a loop device over the mount, with --direct-io=on and off:
        stress-ng's load (verified) with no failure, three tar/untar rounds
        equal by md5 after dropping caches, fstrim, a clean e2fsck -fn; a
        clean qemu-img check after the daemon stops."""
        # Not skipped: this test is the export's file system check, and CI
        # installs stress-ng with the rest (scripts/deps.sh).
        self.assertTrue(STRESS_NG, "stress-ng not installed (Debian: stress-ng; scripts/deps.sh installs it)")
        img = self.image()
        p = self.serve(img)
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
        for dio in ("on", "off"):
            with self.subTest(direct_io=dio):
                loop = subprocess.run(["losetup", "--direct-io=" + dio, "-f", "--show", self.mp], capture_output=True,
                                      text=True, check=True).stdout.strip()
                try:
                    subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True)
                    mnt = os.path.join(self.dir, "mnt")
                    os.makedirs(mnt, exist_ok=True)
                    subprocess.run(["mount", loop, mnt], check=True)
                    try:
                        t0 = time.time()
                        self.stress(mnt)
                        sys.stderr.write("[stress-ng, direct-io=%s: %.1f s] " % (dio, time.time() - t0))
                        digests = []
                        for i in range(3):
                            subprocess.run(["tar", "cf", os.path.join(mnt, "t%d.tar" % i), "-C", src, "."],
                                           check=True)
                            d = os.path.join(mnt, "x%d" % i)
                            os.mkdir(d)
                            subprocess.run(["tar", "xf", os.path.join(mnt, "t%d.tar" % i), "-C", d], check=True)
                            os.unlink(os.path.join(mnt, "t%d.tar" % i))
                        subprocess.run(["sync"], check=True)
                        with open("/proc/sys/vm/drop_caches", "w") as f:
                            f.write("3")
                        for i in range(3):
                            r = subprocess.run("cd %s && find . -type f | sort | xargs md5sum" % os.path.join(mnt, "x%d" % i),
                                               shell=True, capture_output=True, check=True)
                            digests.append(r.stdout)
                        self.assertEqual(len(set(digests)), 1)
                        subprocess.run(["fstrim", mnt], check=True)
                    finally:
                        subprocess.run(["umount", mnt], check=True)
                    r = subprocess.run(["e2fsck", "-fn", loop], capture_output=True, text=True)
                    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                finally:
                    subprocess.run(["losetup", "-d", loop])
        self.stop(p)
        self.qemu_img_check(img)

    def test_tools_on_the_mount(self):
        img = self.image(64 * MiB)
        p = self.serve(img)
        data = rand_bytes(MiB, "fuse-tools")
        with open(self.mp, "r+b") as f:
            f.seek(8 * MiB)
            f.write(data)
        fd = os.open(self.mp, os.O_RDONLY)
        try:
            self.assertEqual(os.lseek(fd, 0, os.SEEK_DATA), 8 * MiB)
            self.assertEqual(os.lseek(fd, 8 * MiB, os.SEEK_HOLE), 9 * MiB)
            with self.assertRaises(OSError):
                os.lseek(fd, 64 * MiB, os.SEEK_DATA)
        finally:
            os.close(fd)
        # Punched holes read as zeroes; cp keeps them sparse.
        subprocess.run(["fallocate", "-p", "-o", str(8 * MiB), "-l", str(256 * 1024), self.mp], check=True)
        copy = os.path.join(self.dir, "copy.raw")
        subprocess.run(["cp", "--sparse=always", self.mp, copy], check=True)
        with open(copy, "rb") as f:
            f.seek(8 * MiB)
            self.assertEqual(f.read(MiB), bytes(256 * 1024) + data[256 * 1024:])
        self.assertLess(os.stat(copy).st_blocks * 512, 2 * MiB)
        r = subprocess.run([QEMU_IMG, "compare", "-f", "raw", "-F", "raw", self.mp, copy], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # Past the end: a write is cut short, one at the end fails (as qsd).
        with open(self.mp, "r+b", buffering=0) as f:
            f.seek(64 * MiB - 4)
            self.assertEqual(f.write(b"12345678"), 4)
            with self.assertRaises(OSError):
                f.write(b"x")
        self.stop(p)
        self.qemu_img_check(img)
        # The image holds what the mount showed, and the short write's bytes.
        out = os.path.join(self.dir, "out.raw")
        subprocess.run([QEMU_IMG, "convert", "-f", "qcow2", "-O", "raw", img, out], check=True)
        with open(copy, "rb") as c, open(out, "rb") as o:
            self.assertEqual(hashlib.sha256(c.read(64 * MiB - 4)).digest(),
                             hashlib.sha256(o.read(64 * MiB - 4)).digest())
            self.assertEqual(o.read(), b"1234")

    def test_killed_writer(self):
        """Writers killed (SIGKILL) with requests in flight: fio with libaio
        and io_uring at QD32 (O_DIRECT), 4 threads of O_DIRECT pwrite, a
        buffered writer that fsyncs. Each dies at once, no request is left
        waiting, the mount goes on serving (a pattern written, fsynced and
        read back with O_DIRECT), what was fsynced before the writers is
        intact, the daemon stops promptly and the image checks clean and
        holds both patterns."""
        img = self.image(64 * MiB)
        p = self.serve(img)
        kept = rand_bytes(8 * MiB, "fuse-kept")
        fd = os.open(self.mp, os.O_WRONLY)
        try:
            os.pwrite(fd, kept, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        writers = [("python-" + mode, [sys.executable, "-c", WRITER, self.mp, mode, str(16 * MiB), str(16 * MiB)], 1)
                   for mode in ("direct", "buffered")]
        for engine in ("libaio", "io_uring") if FIO else ():
            writers.insert(0, ("fio-" + engine, [FIO, "--name=w", "--filename=" + self.mp, "--rw=randwrite",
                                                 "--bs=64k", "--iodepth=32", "--ioengine=" + engine, "--direct=1",
                                                 "--offset=16M", "--size=16M", "--time_based", "--runtime=120",
                                                 "--thread"], 8))
        after = {}
        for i, (name, argv, in_flight) in enumerate(writers):
            with self.subTest(writer=name):
                w = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
                self.procs.append(w)
                # Kill it while the daemon holds its requests.
                end = time.time() + 30
                while self.fuse_waiting() < in_flight:
                    self.assertIsNone(w.poll())
                    self.assertLess(time.time(), end, "writer has no request in flight")
                w.kill()
                self.assertEqual(w.wait(10), -signal.SIGKILL)
                end = time.time() + 10
                while self.fuse_waiting():
                    self.assertLess(time.time(), end, "FUSE requests left waiting after the kill")
                    time.sleep(0.05)
                # The mount still serves: a pattern past the writer's range.
                off = (36 + 4 * i) * MiB
                after[off] = rand_bytes(4 * MiB, "fuse-after-" + name)
                fd = os.open(self.mp, os.O_WRONLY)
                try:
                    self.assertEqual(os.pwrite(fd, after[off], off), 4 * MiB)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self.assertEqual(self.read_direct(off, 4 * MiB), after[off])
                self.assertEqual(self.read_direct(0, 8 * MiB), kept)
        t0 = time.time()
        self.stop(p)
        self.assertLess(time.time() - t0, 10)
        self.qemu_img_check(img)
        out = os.path.join(self.dir, "out.raw")
        subprocess.run([QEMU_IMG, "convert", "-f", "qcow2", "-O", "raw", img, out], check=True)
        with open(out, "rb") as f:
            self.assertEqual(f.read(8 * MiB), kept)
            for off, data in after.items():
                f.seek(off)
                self.assertEqual(f.read(len(data)), data)

    def test_killed_daemon_and_restart(self):
        img = self.image(64 * MiB)
        p = self.serve(img)
        w = subprocess.Popen(["dd", "if=/dev/urandom", "of=" + self.mp, "bs=64k", "count=512", "oflag=direct",
                              "conv=notrunc"], stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        p.kill()
        p.wait()
        w.wait(30)
        # The stale mount answers ENOTCONN; a new daemon clears it.
        with self.assertRaises(OSError):
            os.stat(self.mp)
        p = self.serve(img, check_mount=False)
        end = time.time() + 60  # under load, the killed connection's teardown takes a while
        while True:
            try:
                if os.stat(self.mp).st_size == 64 * MiB:
                    break
            except OSError:
                pass
            self.assertLess(time.time(), end, "stale mount not replaced: " + self.log())
            time.sleep(0.05)
        self.stop(p)
        self.qemu_img_check(img, leaks_ok=True)

    def test_delete_while_busy(self):
        """block-export-del with a loop device holding the mounted file: mode
        safe refuses; mode hard detaches the mount and aborts its connection, the export goes within
        seconds (BLOCK_EXPORT_DELETED), and the loop device's I/O fails
        instead of hanging."""
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
        import qmp_driver
        img = self.image(16 * MiB, "raw")
        qsock = os.path.join(self.dir, "qmp.sock")
        argv = [VBLK, "serve", "--blockdev", "driver=file,filename=%s,node-name=f0" % img,
                "--export", "type=fuse,id=e0,node-name=f0,mountpoint=%s,writable=on%s" % (self.mp, self.EXPORT_EXTRA),
                "--chardev", "socket,path=%s,server=on,wait=off,id=m0" % qsock, "--monitor", "chardev=m0"]
        with open(os.path.join(self.dir, "serve.log"), "ab") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.procs.append(p)
        end = time.time() + 20
        while not (mounted(self.mp) and os.path.exists(qsock)):
            self.assertLess(time.time(), end, self.log())
            time.sleep(0.02)
        loop = subprocess.run(["losetup", "-f", "--show", self.mp], capture_output=True, text=True,
                              check=True).stdout.strip()
        try:
            q = qmp_driver.QMP(qsock)
            # The loop device is a client: mode safe refuses (QAPI's "no
            # connections"; qemu-storage-daemon 7.2 deletes here).
            r = q.cmd("block-export-del", {"id": "e0"})
            self.assertEqual(r["error"]["desc"], "export 'e0' still in use")
            self.assertTrue(mounted(self.mp))
            t0 = time.time()
            self.assertEqual(q.cmd("block-export-del", {"id": "e0", "mode": "hard"}), {"return": {}})
            self.assertLess(time.time() - t0, 15)
            self.assertEqual(q.event("BLOCK_EXPORT_DELETED", 10)["data"], {"id": "e0"})
            self.assertFalse(mounted(self.mp))
            r = subprocess.run(["dd", "if=" + loop, "of=/dev/null", "bs=4k", "count=1", "iflag=direct"],
                               capture_output=True, timeout=30)
            self.assertNotEqual(r.returncode, 0)
            q.cmd("quit")
            self.assertEqual(p.wait(30), 0)
        finally:
            subprocess.run(["losetup", "-d", loop])

    def test_bad_mountpoints_match_qsd(self):
        img = self.image(16 * MiB, "raw")
        for mp in (os.path.join(self.dir, "missing"), self.dir):
            out = []
            for argv0 in ([VBLK, "serve"], [QSD] if QSD else None):
                if not argv0:
                    continue
                r = subprocess.run(argv0 + ["--blockdev", "driver=file,filename=%s,node-name=f0" % img, "--export",
                                            "type=fuse,id=e0,node-name=f0,mountpoint=%s" % mp],
                                   capture_output=True, text=True, timeout=30)
                self.assertEqual(r.returncode, 1)
                out.append(r.stderr.split(": ", 1)[1].strip())
            self.assertEqual(len(set(out)), 1, out)


class FuseExportUringTest(FuseExportTest):
    """The tests whose paths depend on the transport, again with io-uring=on:
    requests come through FUSE over io_uring (Linux 6.14+, with the
    kernel's fuse.enable_uring, switched on here and restored after)."""
    EXPORT_EXTRA = ",io-uring=on"
    saved = None

    # The same code serves both transports past the request's arrival.
    test_ext4_on_loop = None
    test_tools_on_the_mount = None
    test_bad_mountpoints_match_qsd = None

    @classmethod
    def set_param(cls, value):
        with open(URING_PARAM, "w") as f:
            f.write(value)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        try:
            with open(URING_PARAM) as f:
                saved = f.read().strip()
            cls.set_param("Y")
            cls.saved = saved
        except OSError:
            cls.saved = None

    @classmethod
    def tearDownClass(cls):
        if cls.saved is not None:
            cls.set_param(cls.saved)
        super().tearDownClass()

    def setUp(self):
        super().setUp()
        if self.saved is None:
            self.skipTest("no FUSE over io_uring here (%s)" % URING_PARAM)

    def test_requests_come_through_the_ring(self):
        """The export's own ring (opened after the loop's) completes a
        command for every request: 2,000 O_DIRECT writes and reads."""
        img = self.image(16 * MiB, "raw")
        p = self.serve(img, "raw")
        data = rand_bytes(4096 * 1000)
        buf = mmap.mmap(-1, len(data))
        buf.write(data)
        fd = os.open(self.mp, os.O_RDWR | os.O_DIRECT)
        try:
            before = io_urings(p.pid)
            self.assertGreaterEqual(len(before), 2, before)
            for i in range(1000):
                self.assertEqual(os.pwritev(fd, [memoryview(buf)[i * 4096:(i + 1) * 4096]], i * 4096), 4096)
        finally:
            os.close(fd)
        self.assertEqual(self.read_direct(0, len(data)), data)
        after = io_urings(p.pid)
        self.assertGreaterEqual(after[-1][1] - before[-1][1], 1000, (before, after))
        self.stop(p)
        with open(img, "rb") as f:
            self.assertEqual(f.read(len(data)), data)

    def test_refused_when_the_kernel_disables_it(self):
        """io-uring=on with fuse.enable_uring=N: a clear error, exit 1,
        nothing mounted."""
        img = self.image(16 * MiB, "raw")
        self.set_param("N")
        try:
            r = subprocess.run([VBLK, "serve", "--blockdev", "driver=file,filename=%s,node-name=f0" % img,
                                "--export", "type=fuse,id=e0,node-name=f0,mountpoint=%s,io-uring=on" % self.mp],
                               capture_output=True, text=True, timeout=30)
        finally:
            self.set_param("Y")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("FUSE-over-io_uring is disabled in the kernel", r.stderr)
        self.assertFalse(mounted(self.mp))


if __name__ == "__main__":
    unittest.main()
