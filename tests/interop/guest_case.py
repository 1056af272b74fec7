"""A unittest base for the tests that boot the ublk guest
(bench/ublk_guest.py: trixie-backports' kernel with ublk_drv, vduse and
virtio_vdpa, vblk inside, under TCG) once per class, with disks of their
own: a subclass's make_disks() makes the host files in cls.dir and
returns them in /dev/vda, /dev/vdb, ... order; after_boot() may check the
guest further (raise unittest.SkipTest there for what it lacks).

Skipped, with the reason, where qemu-system-x86_64, qemu-img or the
kernel packages are not available. VBLK_UBLK_GUEST_KEEP=1 keeps the work
directory.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import unittest

from common import MiB, VBLK, make_tempdir, shm_dir
import guest_vm  # bench/, put on the path by common
import ublk_guest

QEMU_IMG = shutil.which("qemu-img")


def run(*argv, timeout=120):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)


def qcow2(path, size, cluster_size, carrier, backing=None):
    """A qcow2 at `path` padded to `carrier` bytes: room on its /dev/vdX
    for the clusters vblk allocates in the guest."""
    argv = [QEMU_IMG, "create", "-q", "-f", "qcow2", "-o", "cluster_size=%d" % cluster_size]
    if backing:
        argv += ["-b", backing, "-F", "qcow2"]
    r = run(*(argv + [path] + ([size] if size else [])))
    assert r.returncode == 0, r.stderr
    ublk_guest.carrier_disk(path, carrier)
    return path


class GuestCase(unittest.TestCase):
    smp = 2

    @classmethod
    def make_disks(cls):
        raise NotImplementedError

    @classmethod
    def after_boot(cls):
        pass

    @classmethod
    def setUpClass(cls):
        if not QEMU_IMG:
            raise unittest.SkipTest("qemu-img is needed")
        try:
            ublk_guest.build_ublk_guest(VBLK)
        except guest_vm.GuestUnavailable as e:
            raise unittest.SkipTest("no guest: %s" % e)
        cls.dir = make_tempdir(base=shm_dir())
        cls.guest = None
        try:
            disks = cls.make_disks()
            cls.guest = ublk_guest.UblkGuest(cls.dir, VBLK, disks=disks, smp=cls.smp)
            if not cls.guest.boot(timeout=300):
                raise AssertionError("the guest did not boot: %s" % cls.guest.log_tail())
            cls.after_boot()
        except BaseException:
            cls.cleanup()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.cleanup()

    @classmethod
    def cleanup(cls):
        if cls.guest is not None:
            cls.guest.quit()
            cls.guest = None
        if os.environ.get("VBLK_UBLK_GUEST_KEEP"):
            print("\nkept %s" % cls.dir, file=sys.stderr)
        else:
            shutil.rmtree(cls.dir, ignore_errors=True)

    def gsh(self, command, timeout=300):
        rc, out = self.guest.sh(command, timeout=timeout)
        self.assertEqual(rc, 0, "guest: %s: %s" % (command, out))
        return out

    def pattern_through(self, dev, image):
        """8 MiB written at 200 MiB of `dev` with O_DIRECT and fsync read
        back in the guest after dropping caches, and on the host from
        `image` (a qcow2 or raw file the node sits on)."""
        want = self.gsh("dd if=/dev/urandom of=/mnt/p bs=1M count=8 2>/dev/null && md5sum < /mnt/p").split()[0]
        # conv=fsync: the device's flush (sync(1) flushes no block device's
        # cache), which makes vblk write the qcow2 metadata behind it.
        self.gsh("dd if=/mnt/p of=%s bs=1M seek=200 oflag=direct conv=fsync 2>/dev/null" % dev)
        got = self.gsh("echo 3 > /proc/sys/vm/drop_caches; dd if=%s bs=1M skip=200 count=8 iflag=direct "
                       "2>/dev/null | md5sum" % dev).split()[0]
        self.assertEqual(got, want)
        conv = os.path.join(self.dir, "conv.raw")
        r = run(QEMU_IMG, "convert", "-U", "-O", "raw", image, conv)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(conv, "rb") as f:
            f.seek(200 * MiB)
            self.assertEqual(hashlib.md5(f.read(8 * MiB)).hexdigest(), want, "the image on the host")
        os.unlink(conv)

    def ext4_workout(self, dev):
        """ext4 made on `dev`: stress-ng (verified), a tree copied in and
        compared after dropping caches, fstrim, umount, e2fsck -fn clean."""
        self.gsh("mkfs.ext4 -q -F %s && mkdir -p /mnt/fs && mount -t ext4 %s /mnt/fs" % (dev, dev))
        try:
            out = self.gsh("stress-ng --temp-path /mnt/fs --verify --hdd 2 --hdd-ops 400 --hdd-bytes 4M "
                           "--hdd-write-size 4k --timeout 240 2>&1", timeout=300)
            self.assertIn("successful run completed", out)
            self.gsh("mkdir -p /mnt/fs/t && cp -a /bin /lib /mnt/fs/t/ && (cd / && find bin lib -type f | sort | "
                     "xargs md5sum > /mnt/tree.md5) && sync && echo 3 > /proc/sys/vm/drop_caches && "
                     "(cd /mnt/fs/t && md5sum -c -s /mnt/tree.md5)", timeout=300)
            self.gsh("rm -rf /mnt/fs/t && fstrim -v /mnt/fs", timeout=120)
        finally:
            self.guest.sh("cd /; umount /mnt/fs", timeout=120)
        self.assertIn("Pass 5", self.gsh("e2fsck -fn %s 2>&1" % dev))
