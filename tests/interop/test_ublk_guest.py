#!/usr/bin/env python3
"""Interop: the ublk guest (bench/ublk_guest.py) boots and vblk runs in it.

The host's kernel may have no ublk driver; this guest's kernel does
(bookworm-backports' 6.12, CONFIG_BLK_DEV_UBLK=m), and its initramfs
carries the vblk under test ($VBLK) with its libraries. One guest, booted
under TCG with three raw virtio-blk disks: vda carries a qcow2 image made
on the host (qemu-img create, a pattern written by qemu-io), vdb is an empty
64 MiB scratch disk, vdc an empty carrier for an image made in the guest.

1. /init loaded ublk_drv (and the others) without a failure:
   /dev/ublk-control is a character device.
2. `vblk --version` in the guest prints what it prints on the host.
3. `vblk info --output=json` of the qcow2 on /dev/vda (a block device:
   host_device) and of its copy in the guest's tmpfs agree with the host's
   `vblk info` of the file; `vblk io` in the guest reads the host's pattern
   through qcow2 on /dev/vda, and writes another at 8 MiB, into clusters
   the image did not have (the carrier is larger than the image).
   qemu-img check and qemu-io on the host, while the guest runs (-U), find
   both patterns and a clean image.
4. An image made in the guest (`vblk create`, `vblk io` write) goes out
   through vdc (copy_out) and checks clean on the host with its pattern.
5. mkfs.ext4 + e2fsck -fn inside the guest on a loop device over a tmpfs
   file and on /dev/vdb, each mounted with a file written in between; the
   host's e2fsck -fn agrees on vdb's file system.

Skipped, with the reason, where qemu-system-x86_64, qemu-img or qemu-io is
missing or the kernel / busybox packages cannot be fetched.
"""

import json
import os
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, VBLK, make_tempdir, shm_dir  # noqa: E402
import guest_vm  # noqa: E402  (bench/, put on the path by common)
import ublk_guest  # noqa: E402

QEMU_IMG = shutil.which("qemu-img")
QEMU_IO = shutil.which("qemu-io")
E2FSCK = shutil.which("e2fsck") or "/sbin/e2fsck"


def run(*argv, timeout=120):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)


class UblkGuest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not QEMU_IMG or not QEMU_IO:
            raise unittest.SkipTest("qemu-img and qemu-io are needed")
        t0 = time.monotonic()
        try:
            kernel, initrd = ublk_guest.build_ublk_guest(VBLK)
        except guest_vm.GuestUnavailable as e:
            raise unittest.SkipTest("no ublk guest: %s" % e)
        cls.build_seconds = time.monotonic() - t0
        cls.initrd_size = os.path.getsize(initrd)
        cls.dir = make_tempdir(base=shm_dir())
        cls.guest = None
        try:
            cls.img = os.path.join(cls.dir, "img.qcow2")
            r = run(QEMU_IMG, "create", "-q", "-f", "qcow2", cls.img, 64 * MiB)
            assert r.returncode == 0, r.stderr
            r = run(QEMU_IO, "-c", "write -P 0x5a 1M 1M", cls.img)
            assert r.returncode == 0, r.stdout + r.stderr
            cls.img_bytes = os.path.getsize(cls.img)
            ublk_guest.carrier_disk(cls.img, 32 * MiB)  # room for vblk to allocate clusters on /dev/vda
            cls.scratch = ublk_guest.carrier_disk(os.path.join(cls.dir, "scratch.raw"), 64 * MiB)
            cls.out = ublk_guest.carrier_disk(os.path.join(cls.dir, "out.raw"), 32 * MiB)
            cls.guest = ublk_guest.UblkGuest(cls.dir, VBLK, disks=[cls.img, cls.scratch, cls.out])
            if not cls.guest.boot(timeout=300):
                raise AssertionError("the guest did not boot: %s" % cls.guest.log_tail())
        except BaseException:
            cls.cleanup()
            raise
        print("\nublk guest: %s, initramfs %.1f MiB (built in %.1f s), %d MiB RAM, booted in %.1f s" % (
            os.path.basename(os.path.dirname(kernel)), cls.initrd_size / MiB, cls.build_seconds, cls.guest.mem_mib,
            cls.guest.boot_seconds), file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.cleanup()

    @classmethod
    def cleanup(cls):
        if cls.guest is not None:
            cls.guest.quit()
            cls.guest = None
        if os.environ.get("VBLK_UBLK_GUEST_KEEP"):  # debugging: keep the logs and images
            print("\nkept %s" % cls.dir, file=sys.stderr)
        else:
            shutil.rmtree(cls.dir, ignore_errors=True)

    def gsh(self, command, timeout=300):
        rc, out = self.guest.sh(command, timeout=timeout)
        self.assertEqual(rc, 0, "guest: %s: %s" % (command, out))
        return out

    def test_1_ublk_control(self):
        self.assertNotIn("INSMOD-FAILED", self.guest.boot_messages)
        self.assertNotIn("NO-UBLK-CONTROL", self.guest.boot_messages)
        self.gsh("[ -c /dev/ublk-control ]")
        self.assertIn("ublk_drv", self.gsh("lsmod"))

    def test_2_version(self):
        host = run(VBLK, "--version")
        self.assertEqual(host.returncode, 0)
        self.assertEqual(self.gsh("vblk --version"), host.stdout)

    def test_3_qcow2_on_virtio_disk(self):
        host = json.loads(run(VBLK, "info", "--output=json", "-U", self.img).stdout)
        on_dev = json.loads(self.gsh("vblk info --output=json /dev/vda"))
        self.guest.copy_in("/dev/vda", "/mnt/img.qcow2", self.img_bytes)
        in_tmpfs = json.loads(self.gsh("vblk info --output=json /mnt/img.qcow2"))
        for key in ("format", "virtual-size", "cluster-size", "format-specific"):
            self.assertEqual(on_dev[key], host[key], key)
            self.assertEqual(in_tmpfs[key], host[key], key)
        self.assertEqual(on_dev["filename"], "/dev/vda")

        out = self.gsh("vblk io -c 'read -P 0x5a 1M 1M' -c 'read -P 0 0 1M' /dev/vda")
        self.assertNotIn("Pattern verification failed", out)
        out = self.gsh("vblk io -c 'write -P 0xc3 8M 1M' /dev/vda && sync")
        self.assertIn("wrote 1048576/1048576 bytes", out)
        r = run(QEMU_IMG, "check", "-U", self.img)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = run(QEMU_IO, "-U", "-r", "-c", "read -P 0x5a 1M 1M", "-c", "read -P 0xc3 8M 1M", "-c", "read -P 0 2M 6M",
                self.img)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("Pattern verification failed", r.stdout)

    def test_4_image_out(self):
        self.gsh("vblk create -q -f qcow2 /mnt/new.qcow2 16M && vblk io -c 'write -P 0x77 4M 2M' /mnt/new.qcow2")
        size = self.guest.copy_out("/mnt/new.qcow2", "/dev/vdc")
        got = ublk_guest.read_back(self.out, size, os.path.join(self.dir, "new.qcow2"))
        r = run(QEMU_IMG, "check", got)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = run(QEMU_IO, "-r", "-c", "read -P 0x77 4M 2M", "-c", "read -P 0 0 4M", got)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("Pattern verification failed", r.stdout)
        self.assertEqual(json.loads(run(QEMU_IMG, "info", "--output=json", got).stdout)["virtual-size"], 16 * MiB)

    def mkfs_check(self, dev):
        self.gsh("mkfs.ext4 -q -F %s" % dev)
        self.assertIn("Pass 5", self.gsh("e2fsck -fn %s" % dev))
        self.gsh("mkdir -p /mnt/fs && mount -t ext4 %s /mnt/fs && dd if=/dev/urandom of=/mnt/fs/f bs=1M count=4 "
                 "2>/dev/null && md5sum /mnt/fs/f > /mnt/f.md5 && umount /mnt/fs" % dev)
        self.gsh("e2fsck -fn %s" % dev)
        self.gsh("mount -t ext4 -o ro %s /mnt/fs && md5sum -c /mnt/f.md5 | sed s,/mnt/fs/,, && umount /mnt/fs" % dev)

    def test_5_ext4_on_loop(self):
        self.gsh("truncate -s 64M /mnt/fs.img && losetup /dev/loop0 /mnt/fs.img")
        try:
            self.mkfs_check("/dev/loop0")
        finally:
            self.guest.sh("losetup -d /dev/loop0; rm -f /mnt/fs.img")

    def test_5_ext4_on_virtio(self):
        self.mkfs_check("/dev/vdb")
        self.gsh("sync")
        r = run(E2FSCK, "-fn", self.scratch)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
