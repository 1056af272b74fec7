#!/usr/bin/env python3
"""Interop: a real guest's memory through vblk's VM-state path and back.

The guest is Debian's kernel with a busybox initramfs (bench/guest_vm.py
builds it from Debian's packages and caches it), booted by
qemu-system-x86_64 under TCG. It fills most of its RAM (a tmpfs file: no
swap) with random data and prints the data's md5. A guest that comes back
from a snapshot or an incoming migration is asked for the md5 again: the
same digest means every page of the filled RAM came back bit-exact; the
data was drawn at random after boot, so only a restore of this very guest
can give it.

1. QEMU's own `savevm` into a qcow2; `vblk loadvm --state-only` writes the
   stream out with the length QEMU recorded; a fresh QEMU with
   `-incoming exec:cat STREAM` resumes the guest, and its RAM checks.
2. QEMU migrates (VM stopped, as libvirt saves) into
   `exec:vblk savevm disk TAG --vmstate -`; `qemu-system-x86_64 -loadvm
   TAG` resumes the guest, and so does `-incoming "exec:vblk loadvm disk
   TAG --vmstate-out -"`; the RAM checks each time and `qemu-img check` is
   clean.

Skipped, with the reason, only where qemu-system-x86_64 is missing or the
kernel / busybox packages cannot be fetched.
"""

import os
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import VBLK, InteropTestCase, make_tempdir, qemu, shm_dir, vblk  # noqa: E402
import guest_vm  # noqa: E402  (bench/, put on the path by common)

MEM_MIB = 256   # the guest sees ~206 MiB of it
FILL_MIB = 144  # most of what it sees (the fill needs 8 MiB more while it runs)


def snapshot_tags(img):
    out = qemu("snapshot", "-l", img).stdout
    return [line.split()[1] for line in out.splitlines()[2:] if line.strip()]


class GuestVmstate(InteropTestCase):

    @classmethod
    def setUpClass(cls):
        try:
            guest_vm.build_guest()
        except guest_vm.GuestUnavailable as e:
            raise unittest.SkipTest("no test guest: %s" % e)

    def setUp(self):
        super().setUp()
        self.dir = make_tempdir(self, base=shm_dir())
        self.disk = os.path.join(self.dir, "disk.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", self.disk, "64M").rc, 0)
        self.guests = []

    def tearDown(self):
        for g in self.guests:
            g.kill()
        super().tearDown()

    def guest(self, name, extra=()):
        g = guest_vm.Guest(self.dir, self.disk, mem_mib=MEM_MIB, extra=extra, name=name)
        self.guests.append(g)
        return g

    def booted_and_filled(self):
        g = self.guest("orig")
        self.assertTrue(g.boot(timeout=300), "the guest did not boot")
        digest = g.fill_ram(FILL_MIB)
        self.assertRegex(digest, r"^[0-9a-f]{32}$")
        return g, digest

    def wait_running(self, g, timeout=300):
        """A guest saved while stopped (as libvirt saves) comes back paused,
        as QEMU keeps the run state the stream recorded; resume it as
        libvirt does."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = g.status()
            if st == "running":
                return
            if st == "paused":
                g.qmp.ok("cont")
                continue
            self.assertNotIn(st, ("inmigrate-failed", "internal-error", "shutdown", "guest-panicked"),
                             g.log_tail())
            time.sleep(0.1)
        self.fail("the restored guest never ran: %s; %s" % (g.status(), g.log_tail()))

    def assertRamBack(self, g, digest, how):
        self.wait_running(g)
        self.assertEqual(g.ram_digest(), digest, "%s: the guest's RAM did not come back" % how)
        # And the guest is alive beyond the digest: it can still write and read.
        rc, out = g.sh("echo $((6*7)) > /mnt/x && cat /mnt/x")
        self.assertEqual((rc, out.strip()), (0, "42"), how)

    def test_qemu_savevm_restored_through_vblk_loadvm(self):
        g, digest = self.booted_and_filled()
        out = g.hmp("savevm s1")
        self.assertEqual(out, "", out)
        g.quit()
        self.assertEqual(snapshot_tags(self.disk), ["s1"])
        stream = os.path.join(self.dir, "s1.state")
        r = vblk("loadvm", "--state-only", "--vmstate-out", stream, self.disk, "s1", timeout=300)
        self.assertEqual((r.rc, r.stderr), (0, ""), r)
        # The length QEMU recorded is what vblk wrote out; the guest's
        # filled RAM is all in it (zero pages are not sent, these are not zero).
        info = qemu("info", "--output=json", self.disk)
        import json
        sizes = [s["vm-state-size"] for s in json.loads(info.stdout)["snapshots"]]
        self.assertEqual(sizes, [os.path.getsize(stream)])
        self.assertGreater(os.path.getsize(stream), FILL_MIB << 20)
        g2 = self.guest("restored", ["-incoming", "exec:cat %s" % stream])
        self.assertEqual(g2.wait_migration(), "completed", g2.log_tail())
        self.assertRamBack(g2, digest, "QEMU savevm -> vblk loadvm -> -incoming")
        g2.quit()
        self.assertEqual(qemu("check", self.disk).rc, 0)

    def test_migrate_into_vblk_savevm_then_qemu_restores(self):
        g, digest = self.booted_and_filled()
        g.hmp("stop")
        g.qmp.ok("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        g.qmp.ok("migrate", {"uri": "exec:%s savevm %s m1 --vmstate -" % (VBLK, self.disk)})
        self.assertEqual(g.wait_migration(), "completed", g.log_tail())
        g.quit()
        self.assertEqual(snapshot_tags(self.disk), ["m1"])
        r = qemu("check", self.disk)
        self.assertEqual(r.rc, 0, r)
        # QEMU's own -loadvm.
        g2 = self.guest("loadvm", ["-loadvm", "m1"])
        self.assertRamBack(g2, digest, "migrate -> vblk savevm -> -loadvm")
        g2.quit()
        # An incoming migration from vblk loadvm (which reverts the disk to m1 first).
        g3 = self.guest("incoming", ["-incoming", "exec:%s loadvm %s m1 --vmstate-out -" % (VBLK, self.disk)])
        self.assertEqual(g3.wait_migration(), "completed", g3.log_tail())
        self.assertRamBack(g3, digest, "migrate -> vblk savevm -> vblk loadvm -> -incoming")
        g3.quit()
        r = qemu("check", self.disk)
        self.assertEqual(r.rc, 0, r)


if __name__ == "__main__":
    unittest.main()
