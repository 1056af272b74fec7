#!/usr/bin/env python3
"""Interop: VM state through `vblk serve` (x-vblk-savevm / x-vblk-loadvm),
for a VM whose disk is the daemon's NBD export.

A. A stream over the socket, no VM: random bytes sent to the socket the
   save job listens on become snapshot `tag` of the qcow2 node with that
   VM SIZE (qemu-img snapshot -l after the daemon quits), the job goes
   created -> running -> waiting -> pending -> concluded (JOB_STATUS_CHANGE,
   manual dismiss, as QEMU's snapshot jobs); the load job reverts the disk
   (a write made after the save is gone) and sends the same bytes to a
   listening socket. qemu-img check is clean.
B. The requests QEMU's save_snapshot / load_snapshot refuse are refused
   before any job exists, with their texts: a tag that exists (save) or
   does not (load), an unknown device, a vmstate node outside devices, a
   raw node, a job id in use.
C. A write error injected mid-stream (blkdebug): the job concludes with the
   error in query-jobs, no snapshot entry, the image checks clean. A job
   cancelled while it waits for its peer ends with no snapshot and removes
   its socket.
D. A real guest (Debian kernel + busybox initramfs, bench/guest_vm.py)
   whose disk is the daemon's NBD export: its RAM filled with random data,
   QEMU migrates into x-vblk-savevm's socket; a fresh QEMU with
   `-incoming unix:` gets the stream from x-vblk-loadvm, resumes, and its
   RAM md5 is the one taken before the save.
"""

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, VBLK, InteropTestCase, make_tempdir, qemu, run, shm_dir  # noqa: E402
import qmp_driver  # noqa: E402  (bench/, put on the path by common)
import guest_vm  # noqa: E402
from migration_stream import QEMU_SYSTEM, qemu_migration_stream  # noqa: E402

QEMU_IO = "qemu-io"


def snapshot_rows(img):
    r = qemu("snapshot", "-l", img)
    assert r.rc == 0, r
    return [(f[1], " ".join(f[2:4])) for f in (line.split() for line in r.stdout.splitlines()[2:])]


@unittest.skipUnless(QEMU_SYSTEM, "qemu-system-x86_64 not installed (the streams are QEMU's)")
class ServeVmstate(InteropTestCase):

    def setUp(self):
        super().setUp()
        self.dir = make_tempdir(self, base=shm_dir())
        self.img = os.path.join(self.dir, "disk.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", self.img, "64M").rc, 0)
        self.daemons = []

    def tearDown(self):
        for dm in self.daemons:
            dm.kill()
        super().tearDown()

    def serve(self, blockdev=None, nbd=False):
        args = [VBLK, "serve", "--blockdev",
                blockdev or "driver=qcow2,node-name=disk,file.driver=file,file.filename=%s" % self.img,
                "--blockdev", "driver=file,node-name=rawnode,filename=%s" % os.path.join(self.dir, "raw.img")]
        with open(os.path.join(self.dir, "raw.img"), "wb") as f:
            f.truncate(MiB)
        if nbd:
            self.nbd_sock = os.path.join(self.dir, "nbd.sock")
            args += ["--nbd-server", "addr.type=unix,addr.path=%s" % self.nbd_sock,
                     "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]
        dm = qmp_driver.Daemon(args, os.path.join(self.dir, "qmp.sock"), os.path.join(self.dir, "serve.log"))
        self.daemons.append(dm)
        return dm

    def job_statuses(self, q, job_id, until="concluded", timeout=120):
        seen = []
        while not seen or seen[-1] != until:
            e = q.event("JOB_STATUS_CHANGE", timeout=timeout)
            self.assertEqual(e["data"]["id"], job_id)
            seen.append(e["data"]["status"])
        return seen

    def save_args(self, sock, tag="s1", **kw):
        a = {"job-id": "sv", "tag": tag, "vmstate": "disk", "devices": ["disk"],
             "addr": {"type": "unix", "path": sock}}
        a.update(kw)
        return a

    # --- A ---------------------------------------------------------------
    def test_stream_round_trip_over_sockets(self):
        dm = self.serve()
        q = dm.qmp
        data = self.stream()
        # The disk before the save, and a write after it that loadvm undoes.
        sock = os.path.join(self.dir, "save.sock")
        self.assertEqual(q.ok("x-vblk-savevm", self.save_args(sock)), {})
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        rng = random.Random(6)
        pos = 0
        while pos < len(data):
            n = rng.randint(1, 70000)
            s.sendall(data[pos:pos + n])
            pos += n
        s.close()
        self.assertEqual(self.job_statuses(q, "sv"), ["created", "running", "waiting", "pending", "concluded"])
        jobs = q.ok("query-jobs")
        self.assertEqual([(j["id"], j["type"], j["status"], j["current-progress"]) for j in jobs],
                         [("sv", "snapshot-save", "concluded", len(data))])
        self.assertNotIn("error", jobs[0])
        self.assertEqual(q.ok("job-dismiss", id="sv"), {})
        self.assertEqual(q.event("JOB_STATUS_CHANGE")["data"]["status"], "null")
        self.assertFalse(os.path.exists(sock), "the save socket was left behind")
        # The load: the daemon connects to a listener (QEMU's -incoming unix:).
        lsock = os.path.join(self.dir, "load.sock")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(lsock)
        srv.listen(1)
        got = bytearray()

        def take():
            c, _ = srv.accept()
            while True:
                b = c.recv(1 << 20)
                if not b:
                    break
                got.extend(b)
            c.close()

        t = threading.Thread(target=take)
        t.start()
        self.assertEqual(q.ok("x-vblk-loadvm", self.save_args(lsock, **{"job-id": "ld"})), {})
        self.assertEqual(self.job_statuses(q, "ld"), ["created", "running", "waiting", "pending", "concluded"])
        t.join(60)
        srv.close()
        self.assertEqual(len(got), len(data))
        self.assertTrue(bytes(got) == data, "the stream came back different")
        self.assertEqual(q.ok("query-jobs")[0]["type"], "snapshot-load")
        dm.quit()
        self.assertEqual(snapshot_rows(self.img), [("s1", "6.44 MiB")])
        r = qemu("check", self.img)
        self.assertEqual(r.rc, 0, r)

    def test_load_reverts_the_disk(self):
        dm = self.serve(nbd=True)
        q = dm.qmp
        uri = "nbd+unix:///disk?socket=%s" % self.nbd_sock

        def io(cmd):
            r = run([QEMU_IO, "-f", "raw", "-c", cmd, uri])
            self.assertEqual(r.rc, 0, r)
            self.assertNotIn("fail", r.stdout, r)

        io("write -P 0xa1 0 64k")
        sock = os.path.join(self.dir, "save.sock")
        q.ok("x-vblk-savevm", self.save_args(sock))
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.sendall(self.stream())
        s.close()
        self.assertEqual(self.job_statuses(q, "sv")[-1], "concluded")
        io("write -P 0xb2 0 64k")
        lsock = os.path.join(self.dir, "load.sock")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(lsock)
        srv.listen(1)
        q.ok("x-vblk-loadvm", self.save_args(lsock, **{"job-id": "ld"}))
        c, _ = srv.accept()
        buf = b""
        while True:
            b = c.recv(65536)
            if not b:
                break
            buf += b
        c.close()
        srv.close()
        self.assertTrue(buf == self.stream())
        self.assertEqual(self.job_statuses(q, "ld")[-1], "concluded")
        io("read -P 0xa1 0 64k")  # the disk is the one of the save again
        dm.quit()

    def test_failed_load_leaves_the_disk(self):
        """x-vblk-loadvm to an address nobody listens on fails the command
        before any disk changes; a peer that goes away mid-stream fails the
        job, and the revert is taken back: the disk holds the writes made
        after the save, the snapshot list is the same, check is clean."""
        dm = self.serve(nbd=True)
        q = dm.qmp
        uri = "nbd+unix:///disk?socket=%s" % self.nbd_sock

        def io(cmd):
            r = run([QEMU_IO, "-f", "raw", "-c", cmd, uri])
            self.assertEqual(r.rc, 0, r)
            self.assertNotIn("fail", r.stdout, r)

        io("write -P 0xa1 0 1M")
        sock = os.path.join(self.dir, "save.sock")
        q.ok("x-vblk-savevm", self.save_args(sock))
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.sendall(self.stream())
        s.close()
        self.assertEqual(self.job_statuses(q, "sv")[-1], "concluded")
        q.ok("job-dismiss", id="sv")
        self.assertEqual(self.job_statuses(q, "sv", until="null"), ["null"])
        io("write -P 0xb2 512k 1M")
        # A mistyped address: no job, the disk untouched.
        r = q.cmd("x-vblk-loadvm", self.save_args(os.path.join(self.dir, "typo.sock"), **{"job-id": "ld"}))
        self.assertEqual(r.get("error", {}).get("desc"),
                         "Failed to connect to '%s': No such file or directory" % os.path.join(self.dir, "typo.sock"))
        self.assertEqual(q.ok("query-jobs"), [])
        io("read -P 0xa1 0 512k")
        io("read -P 0xb2 512k 1M")
        # A peer that reads a little and closes.
        lsock = os.path.join(self.dir, "load.sock")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(lsock)
        srv.listen(1)
        q.ok("x-vblk-loadvm", self.save_args(lsock, **{"job-id": "ld", "buffer-size": 65536, "workers": 1}))
        c, _ = srv.accept()
        c.recv(1000)
        c.close()
        srv.close()
        self.assertEqual(self.job_statuses(q, "ld")[-2:], ["aborting", "concluded"])
        self.assertRegex(q.ok("query-jobs")[0]["error"],
                         r"^Error while sending VM state: (Broken pipe|Connection reset by peer)$")
        io("read -P 0xa1 0 512k")
        io("read -P 0xb2 512k 1M")
        io("read -P 0 1536k 1M")
        dm.quit()
        self.assertEqual([t for t, _ in snapshot_rows(self.img)], ["s1"])
        r = qemu("check", self.img)
        self.assertEqual(r.rc, 0, r)

    def stream(self):
        """A VM state to save: QEMU's, 6.4 MiB (6 MiB of it random RAM)."""
        return qemu_migration_stream()

    def test_incomplete_streams_are_refused(self):
        """Only a whole QEMU migration stream becomes a snapshot: a sender
        killed mid-stream, one that closes after 2 MiB, one that stops one
        byte short, and 100 KB of random bytes each end the job with the
        error, no snapshot, and no leaked cluster."""
        dm = self.serve()
        q = dm.qmp
        data = self.stream()
        sock = os.path.join(self.dir, "s.sock")

        def killed(s):
            # A process that sends 3 MiB, then is killed (SIGKILL) while
            # the rest is still to come.
            s.close()
            p = subprocess.Popen([sys.executable, "-c",
                                  "import socket,sys,time\n"
                                  "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                                  "s.sendall(sys.stdin.buffer.read(3 << 20)); print('sent', flush=True)\n"
                                  "time.sleep(60)\n", sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            p.stdin.write(data[:3 * MiB])
            p.stdin.close()
            self.assertEqual(p.stdout.readline(), b"sent\n")
            p.kill()
            p.wait()
            p.stdout.close()

        cases = [("killed", killed, "ends early"),
                 ("2 MiB", lambda s: s.sendall(data[:2 * MiB]), "ends early"),
                 ("one byte short", lambda s: s.sendall(data[:-1]), "ends early, at offset %d in its "
                  "vmdescription" % (len(data) - 1)),
                 ("random", lambda s: s.sendall(random.Random(3).randbytes(100 * 1000)),
                  "Invalid VM state stream at offset 0: not a QEMU migration stream (no QEVM magic)")]
        for i, (what, send, text) in enumerate(cases):
            jid = "j%d" % i
            q.ok("x-vblk-savevm", self.save_args(sock, **{"job-id": jid}))
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            try:
                send(s)
            except OSError:
                pass  # the job may stop reading once it refused the stream
            s.close()
            self.assertEqual(self.job_statuses(q, jid)[-2:], ["aborting", "concluded"], what)
            err = q.ok("query-jobs")[0]["error"]
            self.assertTrue(err.startswith("Invalid VM state stream"), (what, err))
            self.assertIn(text, err, what)
            q.ok("job-dismiss", id=jid)
            self.assertEqual(self.job_statuses(q, jid, until="null"), ["null"])
        dm.quit()
        self.assertEqual(snapshot_rows(self.img), [])
        r = qemu("check", self.img)
        self.assertEqual((r.rc, r.stdout.splitlines()[0]), (0, "No errors were found on the image."), r)

    # --- B ---------------------------------------------------------------
    def test_refusals_make_no_job(self):
        dm = self.serve()
        q = dm.qmp
        sock = os.path.join(self.dir, "s.sock")
        self.assertEqual(qemu("snapshot", "-c", "old", self.img).rc, 1)  # the daemon holds the lock
        cases = [
            (self.save_args(sock, devices=["nope"]), "No block device node 'nope'"),
            (self.save_args(sock, vmstate="rawnode", devices=["disk"]),
             "vmstate block device 'rawnode' does not exist"),
            (self.save_args(sock, vmstate="rawnode", devices=["rawnode"]),
             "Device 'rawnode' is writable but does not support snapshots"),
            (self.save_args(sock, tag=""), "Snapshot tag cannot be empty"),
            (self.save_args(sock, **{"job-id": "1bad"}), "Invalid job ID '1bad'"),
            (self.save_args(sock, workers=0), "Parameter 'workers' expects a value between 1 and 64"),
        ]
        for args, text in cases:
            r = q.cmd("x-vblk-savevm", args)
            self.assertEqual(r.get("error"), {"class": "GenericError", "desc": text}, args)
        r = q.cmd("x-vblk-savevm", {"job-id": "sv", "tag": "t"})
        self.assertEqual(r["error"]["class"], "GenericError")
        self.assertIn("vmstate", r["error"]["desc"])
        r = q.cmd("x-vblk-loadvm", self.save_args(sock, tag="never"))
        self.assertEqual(r["error"]["desc"], "Snapshot 'never' does not exist in one or more devices")
        self.assertEqual(q.ok("query-jobs"), [])
        self.assertFalse(os.path.exists(sock))
        # An existing tag, and a job id in use.
        q.ok("x-vblk-savevm", self.save_args(sock))
        r = q.cmd("x-vblk-savevm", self.save_args(sock + "2", tag="other"))
        self.assertEqual(r["error"]["desc"], "Job ID 'sv' already in use")
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.sendall(self.stream())
        s.close()
        self.job_statuses(q, "sv")
        q.ok("job-dismiss", id="sv")
        r = q.cmd("x-vblk-savevm", self.save_args(sock))
        self.assertEqual(r["error"]["desc"], "Snapshot 's1' already exists in one or more devices")
        dm.quit()
        self.assertEqual(snapshot_rows(self.img), [("s1", "6.44 MiB")])

    def test_device_listed_twice_is_refused(self):
        """QEMU's snapshot-save takes `devices` as they come (two snapshots
        of one name on a node listed twice); vblk refuses the request."""
        dm = self.serve()
        q = dm.qmp
        sock = os.path.join(self.dir, "s.sock")
        for devices in (["disk", "disk"],):
            r = q.cmd("x-vblk-savevm", self.save_args(sock, devices=devices))
            self.assertEqual(r.get("error"), {"class": "GenericError",
                                              "desc": "Device 'disk' is listed twice in 'devices'"}, devices)
        self.assertEqual(q.ok("query-jobs"), [])
        self.assertFalse(os.path.exists(sock))
        dm.quit()
        self.assertEqual(snapshot_rows(self.img), [])

    def test_listens_on_local_addresses_only(self):
        """The first peer's stream becomes the snapshot: a socket other hosts
        can reach is refused unless allow-remote says so."""
        dm = self.serve()
        q = dm.qmp
        for host in ("0.0.0.0", "::"):
            args = self.save_args(None, addr={"type": "inet", "host": host, "port": "0"})
            r = q.cmd("x-vblk-savevm", args)
            self.assertEqual(r.get("error", {}).get("desc"),
                             "Address '%s:0' can be reached from other hosts; listen on a unix socket or a "
                             "loopback address, or set 'allow-remote'" % host, host)
        self.assertEqual(q.ok("query-jobs"), [])
        # Loopback, and a remote address the client asked for, are taken.
        for i, (host, extra) in enumerate((("127.0.0.1", {}), ("::1", {}), ("localhost", {}),
                                           ("0.0.0.0", {"allow-remote": True}))):
            jid = "j%d" % i
            args = self.save_args(None, addr={"type": "inet", "host": host, "port": "0"}, **{"job-id": jid})
            args.update(extra)
            self.assertEqual(q.ok("x-vblk-savevm", args), {}, host)
            q.ok("job-cancel", id=jid)
            self.assertEqual(self.job_statuses(q, jid)[-1], "concluded")
            q.ok("job-dismiss", id=jid)
            self.assertEqual(self.job_statuses(q, jid, until="null"), ["null"])
        dm.quit()
        self.assertEqual(snapshot_rows(self.img), [])

    # --- C ---------------------------------------------------------------
    def test_write_error_and_cancel_leave_no_snapshot(self):
        opts = ("driver=qcow2,node-name=disk,file.driver=blkdebug,file.image.driver=file,"
                "file.image.filename=%s,file.inject-error.0.event=write_aio,"
                "file.inject-error.0.sector=%d,file.inject-error.0.once=on" % (self.img, 4 * MiB // 512))
        dm = self.serve(blockdev=opts)
        q = dm.qmp
        sock = os.path.join(self.dir, "s.sock")
        q.ok("x-vblk-savevm", self.save_args(sock))
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        try:
            s.sendall(self.stream())
        except OSError:
            pass  # the job may stop reading once it failed
        s.close()
        self.assertEqual(self.job_statuses(q, "sv"), ["created", "running", "aborting", "concluded"])
        job = q.ok("query-jobs")[0]
        self.assertEqual(job["error"], "Error while writing VM state: Input/output error")
        q.ok("job-dismiss", id="sv")
        self.assertEqual(self.job_statuses(q, "sv", until="null"), ["null"])
        # Cancelled while waiting for its peer.
        q.ok("x-vblk-savevm", self.save_args(sock, **{"job-id": "c"}))
        self.assertTrue(os.path.exists(sock))
        self.assertEqual(q.ok("job-cancel", id="c"), {})
        self.assertEqual(self.job_statuses(q, "c")[-2:], ["aborting", "concluded"])
        self.assertFalse(os.path.exists(sock))
        dm.quit()
        self.assertEqual(snapshot_rows(self.img), [])
        r = qemu("check", self.img)
        self.assertEqual(r.rc, 0, r)

    # --- D ---------------------------------------------------------------
    def test_guest_saved_and_restored_through_the_daemon(self):
        try:
            guest_vm.build_guest()
        except guest_vm.GuestUnavailable as e:
            self.skipTest("no test guest: %s" % e)
        dm = self.serve(nbd=True)
        q = dm.qmp
        nbd = "driver=nbd,server.type=unix,server.path=%s,export=disk" % self.nbd_sock
        g = guest_vm.Guest(self.dir, None, mem_mib=256, drive=nbd, name="orig")
        try:
            self.assertTrue(g.boot(timeout=300))
            digest = g.fill_ram(144)
            sock = os.path.join(self.dir, "save.sock")
            q.ok("x-vblk-savevm", self.save_args(sock))
            g.hmp("stop")
            g.qmp.ok("migrate-set-parameters", {"max-bandwidth": 1 << 40})
            g.qmp.ok("migrate", {"uri": "unix:%s" % sock})
            self.assertEqual(g.wait_migration(), "completed", g.log_tail())
            self.assertEqual(self.job_statuses(q, "sv", timeout=300)[-1], "concluded")
            self.assertNotIn("error", q.ok("query-jobs")[0])
        finally:
            g.quit()
        lsock = os.path.join(self.dir, "in.sock")
        g2 = guest_vm.Guest(self.dir, None, mem_mib=256, drive=nbd, name="back",
                            extra=["-incoming", "unix:%s" % lsock])
        try:
            end = time.monotonic() + 30
            while not os.path.exists(lsock) and time.monotonic() < end:
                time.sleep(0.05)
            q.ok("x-vblk-loadvm", self.save_args(lsock, **{"job-id": "ld"}))
            self.assertEqual(g2.wait_migration(), "completed", g2.log_tail())
            self.assertEqual(self.job_statuses(q, "ld", timeout=300)[-1], "concluded")
            while g2.status() != "running":
                if g2.status() == "paused":
                    g2.qmp.ok("cont")
                time.sleep(0.1)
            self.assertEqual(g2.ram_digest(), digest, "the guest's RAM did not come back")
        finally:
            g2.quit()
        dm.quit()
        rows = snapshot_rows(self.img)
        self.assertEqual([t for t, _ in rows], ["s1"])
        r = qemu("check", self.img)
        self.assertEqual(r.rc, 0, r)


if __name__ == "__main__":
    unittest.main()
