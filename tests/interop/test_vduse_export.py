#!/usr/bin/env python3
"""Interop: the VDUSE export (`vblk serve --export type=vduse-blk`) as the
kernel's own virtio-blk driver uses it, in the ublk guest
(bench/ublk_guest.py: trixie-backports' kernel with vduse, vdpa and
virtio_vdpa, iproute2's vdpa tool and vblk inside, under TCG; the host's
kernel here has neither).

1. A qcow2 (64 KiB clusters) on /dev/vda served with two queues, attached
   with `vdpa dev add` as the next /dev/vdX: a pattern written with O_DIRECT and
   fsync reads back in the guest and, on the host, from the image; ext4
   made on the device, stress-ng (verified), a tree copied in and
   compared after dropping caches, trimmed, unmounted and checked
   (e2fsck -fn); `vdpa dev del`, then SIGTERM: the daemon destroys the
   device; qemu-img check of the image is clean.
2. Careless operators: no name, a name with a slash, a queue size that is not a
   power of two, a second daemon for a device that is attached and
   served — each refused with the reason, exit 1, and the attached device
   still serves.
3. kill -9 of the daemon (a qcow2, two queues) right after a completed,
   unflushed 1 MiB write that allocated clusters: the same command line
   takes the device over from the log the killed daemon left
   ($TMPDIR/vduse-blk-NAME) and the write reads back (the daemon answers
   a write only once its data and qcow2 metadata are in the kernel's
   hands). Then kill -9 under a writer: the writer waits (no error), the
   next takeover serves it on, its first flush succeeds (it makes the
   killed daemon's answered writes durable), and a pattern written then
   reads back here and, with the probe, on the host; the image checks.
   Then the careless ways: a log another user owns is refused; with the
   log deleted the takeover still serves, and its first flush fails (what
   the previous daemon did is unknown).

4. With VBLK_GUEST_MATRIX=1 (not in CI: a minute or two more per
   variant), the ext4 workout of test 1 on the other variants issue 28
   names: one queue, an overlay with 2 MiB clusters over a base whose
   2 MiB clusters are compressed; both images then check clean on the host.

Skipped, with the reason, where qemu-system-x86_64, qemu-img or the
kernel packages are not available.
"""

import hashlib
import os
import re
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB  # noqa: E402
from guest_case import GuestCase, QEMU_IMG, qcow2, run  # noqa: E402
import ublk_guest  # noqa: E402
import ublk_kill_soak  # noqa: E402

MATRIX = os.environ.get("VBLK_GUEST_MATRIX") == "1"

class VduseExportTest(GuestCase):

    @classmethod
    def make_disks(cls):
        cls.img = qcow2(os.path.join(cls.dir, "img.qcow2"), 256 * MiB, 65536, 320 * MiB)
        cls.raw = ublk_guest.carrier_disk(os.path.join(cls.dir, "raw.img"), 64 * MiB)
        cls.kimg = qcow2(os.path.join(cls.dir, "kill.qcow2"), 64 * MiB, 65536, 96 * MiB)
        disks = [cls.img, cls.raw, cls.kimg]
        if MATRIX:
            # Test 4: an overlay over a compressed base, 2 MiB clusters both.
            os.mkdir(os.path.join(cls.dir, "matrix"))
            cls.overlay, cls.base = ublk_kill_soak.make_images(os.path.join(cls.dir, "matrix"), 256 * MiB, 2 * MiB,
                                                               True, QEMU_IMG)
            disks += [cls.base, cls.overlay]
        return disks

    @classmethod
    def after_boot(cls):
        rc, out = cls.guest.sh("[ -c /dev/vduse/control ] && [ -x /sbin/vdpa ]")
        if rc != 0:
            raise unittest.SkipTest("the guest's kernel has no vduse, or there is no vdpa tool (iproute2)")

    def serve(self, blockdevs, export, log):
        """Starts `vblk serve` in the guest, waits for /dev/vduse/NAME,
        attaches it and returns the disk virtio_vdpa made of it."""
        name = re.search(r"(?:^|,)name=([^,]+)", export).group(1)
        before = set(self.gsh("ls /sys/block").split())
        argv = "vblk serve %s --export type=vduse-blk,id=v0,%s" % (
            " ".join("--blockdev " + b for b in blockdevs), export)
        self.gsh("(%s > %s 2>&1 & echo $! > %s.pid)" % (argv, log, log))
        self.gsh("i=0; while [ ! -c /dev/vduse/%s ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; "
                 "[ -c /dev/vduse/%s ] || { cat %s; false; }" % (name, name, log), timeout=120)
        self.gsh("vdpa dev add name %s mgmtdev vduse" % name, timeout=120)
        # virtio_vdpa binds it, and its probe reads the partition table
        # through the daemon before the disk shows.
        out = self.gsh("i=0; while [ $(ls /sys/block | grep -c vd) -le %d ] && [ $i -lt 300 ]; do sleep 0.1; "
                       "i=$((i+1)); done; ls /sys/block" % len([b for b in before if b.startswith("vd")]),
                       timeout=120)
        new = sorted(set(out.split()) - before)
        self.assertEqual(len(new), 1, "disks before %s, after %s: %s" % (sorted(before), out.split(),
                                                                          self.guest.sh("cat " + log)[1]))
        return "/dev/" + new[0]

    def stop(self, name, log):
        self.gsh("vdpa dev del %s" % name, timeout=120)
        self.gsh("p=$(cat %s.pid); kill -TERM $p; i=0; while kill -0 $p 2>/dev/null && [ $i -lt 300 ]; do "
                 "sleep 0.1; i=$((i+1)); done; ! kill -0 $p 2>/dev/null" % log, timeout=120)
        self.gsh("i=0; while [ -e /dev/vduse/%s ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; "
                 "[ ! -e /dev/vduse/%s ] || { cat %s; false; }" % (name, name, log))

    def flush_after_takeover(self, dev, want, fails, why):
        """/mnt/e (md5 `want`) written with fsync after a takeover: the
        first flush fails if `fails` (else succeeds), the next succeeds,
        and it reads back."""
        rc, _ = self.guest.sh("dd if=/mnt/e of=%s bs=1M oflag=direct conv=fsync 2>/dev/null" % dev)
        self.assertEqual(rc != 0, fails, why)
        self.gsh("dd if=/mnt/e of=%s bs=1M oflag=direct conv=fsync 2>/dev/null" % dev)
        got = self.gsh("echo 3 > /proc/sys/vm/drop_caches; dd if=%s bs=1M count=4 iflag=direct 2>/dev/null | "
                       "md5sum" % dev).split()[0]
        self.assertEqual(got, want)

    def test_1_qcow2_ext4_two_queues(self):
        dev = self.serve(["driver=host_device,filename=/dev/vda,node-name=f0", "driver=qcow2,file=f0,node-name=d0"],
                         "node-name=d0,writable=on,name=vduse0,num-queues=2", "/tmp/v1.log")
        self.assertEqual(self.gsh("ls /sys/block/%s/mq | wc -l" % os.path.basename(dev)).strip(), "2")
        self.pattern_through(dev, self.img)
        self.ext4_workout(dev)
        self.stop("vduse0", "/tmp/v1.log")
        self.assertEqual(self.gsh("cat /tmp/v1.log"), "")
        r = run(QEMU_IMG, "check", "-U", self.img)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_2_careless_operator(self):
        base = "vblk serve --blockdev driver=host_device,filename=/dev/vdb,node-name=r0 --export type=vduse-blk,id=v0,"
        for export, why in (("node-name=r0", "Parameter 'name' is missing"),
                            ("node-name=r0,name=a/b", "Invalid VDUSE device name"),
                            ("node-name=r0,name=q3,queue-size=100", "queue-size is invalid"),
                            ("node-name=r0,name=q4,num-queues=0", "num-queues must be greater than 0")):
            # timeout: a daemon that wrongly starts must not hold the console.
            rc, out = self.guest.sh("timeout 60 " + base + export + " 2>&1", timeout=120)
            self.assertEqual(rc, 1, out)
            self.assertIn(why, out)
        self.gsh("[ -z \"$(ls /dev/vduse | grep -v control)\" ]")
        # A second daemon for a device that is attached and served.
        dev = self.serve(["driver=host_device,filename=/dev/vdb,node-name=r0"], "node-name=r0,writable=on,name=vduse1",
                         "/tmp/v2.log")
        rc, out = self.guest.sh("timeout 60 " + base + "node-name=r0,writable=on,name=vduse1 2>&1", timeout=120)
        self.assertEqual(rc, 1, out)
        self.assertIn("is served by another process", out)
        want = self.gsh("dd if=/dev/urandom of=/mnt/c bs=1M count=4 2>/dev/null && md5sum < /mnt/c").split()[0]
        got = self.gsh("dd if=/mnt/c of=%s bs=1M oflag=direct conv=fsync 2>/dev/null && "
                       "echo 3 > /proc/sys/vm/drop_caches && dd if=%s bs=1M count=4 iflag=direct 2>/dev/null | "
                       "md5sum" % (dev, dev)).split()[0]
        self.assertEqual(got, want)
        self.stop("vduse1", "/tmp/v2.log")
        with open(self.raw, "rb") as f:
            self.assertEqual(hashlib.md5(f.read(4 * MiB)).hexdigest(), want, "the raw disk on the host")

    def test_3_killed_daemon_taken_over(self):
        blockdevs = ["driver=host_device,filename=/dev/vdc,node-name=f0", "driver=qcow2,file=f0,node-name=d0"]
        export = "node-name=d0,writable=on,name=vduse2,num-queues=2"
        argv = "vblk serve %s --export type=vduse-blk,id=v0,%s" % (" ".join("--blockdev " + b for b in blockdevs),
                                                                   export)
        dev = self.serve(blockdevs, export, "/tmp/v3.log")
        self.gsh("[ -s /tmp/vduse-blk-vduse2 ]")
        # A completed write, never flushed, that allocated clusters; then
        # kill -9 and the takeover: it is there.
        probe = self.gsh("dd if=/dev/urandom of=/mnt/p bs=1M count=1 2>/dev/null && md5sum < /mnt/p && "
                         "dd if=/mnt/p of=%s bs=1M seek=40 oflag=direct 2>/dev/null && "
                         "kill -9 $(cat /tmp/v3.log.pid)" % dev).split()[0]
        self.gsh("sleep 1; (%s > /tmp/v3a.log 2>&1 & echo $! > /tmp/v3a.log.pid); sleep 2; cat /tmp/v3a.log" % argv)
        got = self.gsh("echo 3 > /proc/sys/vm/drop_caches; dd if=%s bs=1M skip=40 count=1 iflag=direct 2>/dev/null"
                       " | md5sum" % dev).split()[0]
        self.assertEqual(got, probe, "a completed write was lost with the killed daemon")
        # Passes over the device with no flush, until told to stop.
        self.gsh("rm -f /tmp/stop3; (sh -c 'i=0; while [ ! -e /tmp/stop3 ]; do dd if=/dev/zero of=%s bs=64k "
                 "count=256 oflag=direct 2>/dev/null || exit 1; i=$((i+1)); done; echo W-END $i' > /tmp/w3.log "
                 "2>&1 &)" % dev)
        self.gsh("sleep 1; kill -9 $(cat /tmp/v3a.log.pid); sleep 1; [ ! -s /tmp/w3.log ]")
        self.gsh("(%s > /tmp/v3b.log 2>&1 & echo $! > /tmp/v3b.log.pid); sleep 2; cat /tmp/v3b.log" % argv)
        out = self.gsh("touch /tmp/stop3; i=0; while ! grep -q W-END /tmp/w3.log && [ $i -lt 600 ]; do sleep 0.1; "
                       "i=$((i+1)); done; cat /tmp/w3.log; cat /tmp/v3b.log", timeout=120)
        self.assertIn("W-END", out)
        self.assertIn("taking over the device", out)
        self.assertIn("to be made durable by the next flush", out)
        want = self.gsh("dd if=/dev/urandom of=/mnt/e bs=1M count=4 2>/dev/null && md5sum < /mnt/e").split()[0]
        self.flush_after_takeover(dev, want, False, "the first flush after a takeover with the log failed")
        # Careless: a log someone else owns is refused (the device and the
        # log are left as they were); with the log gone, the takeover
        # starts after what was completed and its first flush fails.
        self.gsh("kill -9 $(cat /tmp/v3b.log.pid); sleep 1; chown 1000 /tmp/vduse-blk-vduse2")
        rc, out = self.guest.sh("timeout 60 %s 2>&1" % argv, timeout=120)
        self.assertEqual(rc, 1, out)
        self.assertIn("is not a file of this user", out)
        self.gsh("[ -c /dev/vduse/vduse2 ] && rm /tmp/vduse-blk-vduse2")
        # (The report comes once the daemon has opened the image: later
        # under ASan than a fixed sleep allowed.)
        self.gsh("(%s > /tmp/v3c.log 2>&1 & echo $! > /tmp/v3c.log.pid)" % argv)
        self.assertIn("left unflushed is unknown",
                      self.gsh("i=0; while ! grep -q 'left unflushed' /tmp/v3c.log && [ $i -lt 600 ]; do sleep 0.1; "
                               "i=$((i+1)); done; cat /tmp/v3c.log", timeout=120))
        self.flush_after_takeover(dev, want, True, "the first flush after a takeover without a log vouched")
        self.stop("vduse2", "/tmp/v3c.log")
        self.gsh("[ ! -e /tmp/vduse-blk-vduse2 ]")
        r = run(QEMU_IMG, "check", "-U", self.kimg)
        self.assertIn(r.returncode, (0, 3), r.stdout + r.stderr)
        self.assertNotIn("ERROR", r.stdout + r.stderr)
        out = os.path.join(self.dir, "kill.raw")
        r = run(QEMU_IMG, "convert", "-U", "-O", "raw", self.kimg, out)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out, "rb") as f:
            data = f.read(41 * MiB)
        self.assertEqual(hashlib.md5(data[:4 * MiB]).hexdigest(), want, "the pattern in the image on the host")
        self.assertEqual(hashlib.md5(data[40 * MiB:]).hexdigest(), probe, "the probe in the image on the host")

    @unittest.skipUnless(MATRIX, "VBLK_GUEST_MATRIX=1 runs the other variants")
    def test_4_variants(self):
        dev = self.serve(["driver=host_device,filename=/dev/vdd,node-name=bf,read-only=on",
                          "driver=qcow2,file=bf,node-name=b0,read-only=on",
                          "driver=host_device,filename=/dev/vde,node-name=of",
                          "driver=qcow2,file=of,backing=b0,node-name=o0"],
                         "node-name=o0,writable=on,name=vduse3,num-queues=1", "/tmp/v4.log")
        self.assertEqual(self.gsh("ls /sys/block/%s/mq | wc -l" % os.path.basename(dev)).strip(), "1")
        self.ext4_workout(dev)
        self.stop("vduse3", "/tmp/v4.log")
        self.assertEqual(self.gsh("cat /tmp/v4.log"), "")
        for img in (self.overlay, self.base):
            r = run(QEMU_IMG, "check", "-U", img)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
