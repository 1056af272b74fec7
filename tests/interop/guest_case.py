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

import os
import shutil
import subprocess
import sys
import unittest

from common import VBLK, make_tempdir, shm_dir
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
