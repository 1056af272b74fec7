#!/usr/bin/env python3
"""Interop: VM state in qcow2 internal snapshots (`vblk savevm` / `loadvm`).

A. Round trips: streams of random sizes (0 B to a few hundred MiB), fed
   through a pipe in random piece sizes, saved by ``vblk savevm`` into
   qcow2 images of cluster size 512 B, 64 KiB and 2 MiB, with the page
   cache and with O_DIRECT (``-t none``), come back bit-exact from
   ``vblk loadvm``; ``qemu-img snapshot -l`` shows the VM SIZE vblk
   recorded and ``vblk snapshot -l`` prints what qemu-img prints;
   ``qemu-img check`` finds nothing; the disk is unchanged.

B. QEMU reads what vblk stored: after ``qemu-img snapshot -a``, qemu-io's
   ``read -b`` (the VM state area of the active image) sees the stream at
   the place QEMU's qcow2 puts it; and vblk reads what QEMU stored:
   qemu-io's ``write -b`` followed by vblk taking the snapshot.

C. A write error injected mid-save (blkdebug) makes savevm fail: exit
   code 1, a clear message, no snapshot entry, the image checks clean.

D. With qemu-system-x86_64 present: a real ``savevm`` (a VM with no
   guest still saves its device state): ``snapshot -l`` and ``info``
   (human and JSON) of vblk equal qemu-img's, ``vblk loadvm`` gives back
   what QEMU stored; and QEMU's migration into ``exec:vblk savevm`` is a
   snapshot QEMU's own ``loadvm`` restores, and ``-incoming exec:vblk
   loadvm`` restores it.
"""

import fcntl
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (KiB, MiB, QEMU_IMG, VBLK, InteropTestCase, make_tempdir,  # noqa: E402
                    qemu, run, shm_dir, vblk, _BASE_ENV)

QEMU_IO = os.environ.get("QEMU_IO") or os.path.join(os.path.dirname(QEMU_IMG), "qemu-io")
if not os.access(QEMU_IO, os.X_OK):
    QEMU_IO = shutil.which("qemu-io")
QEMU_SYSTEM = shutil.which("qemu-system-x86_64")
NO_ERRORS = "No errors were found on the image.\n"
# O_DIRECT needs a real file system (tmpfs has none).
DIRECT_BASE = "/var/tmp"
RNG = random.Random(int(os.environ.get("VBLK_VMSTATE_SEED", "1302")))


def stream_bytes(n, seed):
    return random.Random(seed).randbytes(n)


def feed(argv, data, rng, timeout=300):
    """Runs argv with `data` on its stdin, written in random piece sizes
    (1 B to 64 KiB, mostly small), as a migration stream arrives."""
    import tempfile
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, env=_BASE_ENV)
        pos = 0
        # Small pieces for the first MiB (per-piece cost in Python), big after.
        try:
            while pos < len(data):
                n = rng.randint(1, 64 * KiB) if pos > MiB or rng.random() < 0.3 else rng.randint(1, 300)
                p.stdin.write(data[pos:pos + n])
                pos += n
        except BrokenPipeError:
            pass
        try:
            p.stdin.close()
        except BrokenPipeError:
            pass
        rc = p.wait(timeout=timeout)
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read().decode("utf-8", "replace")


def snapshot_list(img):
    """[(id, tag, vm_size_text)] from qemu-img snapshot -l."""
    r = qemu("snapshot", "-l", img)
    assert r.rc == 0, r
    rows = []
    for line in r.stdout.splitlines()[2:]:
        f = line.split()
        rows.append((f[0], f[1], " ".join(f[2:4])))
    return rows


def qemu_io_read_vmstate(img, length, chunk=1 * MiB):
    """The active image's VM state [0, length) as qemu-io reads it."""
    out = bytearray()
    pos = 0
    # qemu-io reads whole sectors: read the last one whole and cut.
    want = length
    length = (length + 511) // 512 * 512
    while pos < length:
        n = min(chunk, length - pos)
        r = run([QEMU_IO, "-f", "qcow2", "-c", "read -b -v %d %d" % (pos, n), img], timeout=120)
        assert r.rc == 0 and "read %d/%d bytes" % (n, n) in r.stdout, r
        for line in r.stdout.splitlines():
            m = re.match(r"^[0-9a-f]{8}:  ((?:[0-9a-f]{2} )+)", line)
            if m:
                out += bytes.fromhex(m.group(1).replace(" ", ""))
        pos += n
    assert len(out) == length, (len(out), length)
    return bytes(out[:want])


class VmstateRoundTrip(InteropTestCase):

    def check_clean(self, img):
        r = qemu("check", img)
        self.assertEqual((r.rc, r.stdout.splitlines()[0] + "\n" if r.stdout else ""), (0, NO_ERRORS), r)

    def round_trip(self, d, cluster_size, direct, size, seed):
        img = os.path.join(d, "disk-%d-%d.qcow2" % (cluster_size, seed))
        r = qemu("create", "-f", "qcow2", "-o", "cluster_size=%d" % cluster_size, img, "5M")
        self.assertEqual(r.rc, 0, r)
        r = run([QEMU_IO, "-f", "qcow2", "-c", "write -P 0x5a 1M 1M", img])
        self.assertEqual(r.rc, 0, r)
        data = stream_bytes(size, seed)
        cache = ["-t", "none"] if direct else []
        rc, _, err = feed([VBLK, "savevm"] + cache + ["--vmstate", "-", img, "s%d" % seed], data, RNG)
        self.assertEqual((rc, err), (0, ""), "savevm of %d bytes, cluster %d" % (size, cluster_size))
        rows = snapshot_list(img)
        self.assertEqual(len(rows), 1)
        # VM SIZE as qemu-img prints it, from the size vblk recorded.
        v = vblk("snapshot", "-l", img)
        q = qemu("snapshot", "-l", img)
        self.assertSameResult(v, q, "snapshot -l")
        self.assertEqual(q.stdout.splitlines()[2].split()[1], "s%d" % seed)
        self.check_clean(img)
        out = os.path.join(d, "out-%d" % seed)
        r = vblk("loadvm", *cache, "--vmstate-out", out, img, "s%d" % seed, timeout=300)
        self.assertEqual((r.rc, r.stderr), (0, ""), r)
        with open(out, "rb") as f:
            back = f.read()
        self.assertEqual(len(back), size)
        self.assertTrue(back == data, "stream differs (size %d, cluster %d, direct %s)" % (size, cluster_size, direct))
        os.unlink(out)
        # The disk itself is what it was.
        r = run([QEMU_IO, "-f", "qcow2", "-c", "read -P 0x5a 1M 1M", "-c", "read -P 0 0 1M",
                 "-c", "read -P 0 2M 3M", img])
        self.assertNotIn("fail", r.stdout + r.stderr, r)
        self.check_clean(img)
        return img, data

    def test_round_trips(self):
        # (cluster size, O_DIRECT, stream size): the sizes random, but every
        # cluster size sees an empty, a tiny, an unaligned and a multi-MiB one.
        cases = []
        for cs in (512, 64 * KiB, 2 * MiB):
            for direct in (False, True):
                sizes = [0, RNG.randint(1, 4000), RNG.randint(MiB, 12 * MiB)]
                cases += [(cs, direct, s) for s in sizes]
        # One big stream (the CI bound: a few hundred MiB).
        cases.append((64 * KiB, True, RNG.randint(150 * MiB, 250 * MiB)))
        cases.append((2 * MiB, False, RNG.randint(60 * MiB, 100 * MiB)))
        d_direct = make_tempdir(self, base=DIRECT_BASE)
        d_cached = make_tempdir(self, base=shm_dir())
        for i, (cs, direct, size) in enumerate(cases):
            with self.subTest(cluster_size=cs, direct=direct, size=size):
                img, _ = self.round_trip(d_direct if direct else d_cached, cs, direct, size, 100 + i)
                os.unlink(img)

    def test_three_gib_round_trip(self):
        """A 3 GiB stream, O_DIRECT (past the 2 GiB and 32-bit-sector marks of a
        signed offset), piece sizes 1 B - 64 KiB, generated and checked on
        the fly (sha256) so the test holds 64 MiB, not 3 GiB: 48 distinct
        rotations of a random 64 MiB block, so a piece written at the wrong
        place changes the digest."""
        size = 3 * 1024 * MiB
        block = RNG.randbytes(64 * MiB)
        rot = [RNG.randrange(len(block)) for _ in range(size // len(block))]
        # On disk with O_DIRECT: tmpfs here fills fresh pages at ~200 MB/s.
        d = make_tempdir(self, base=DIRECT_BASE)
        img = os.path.join(d, "big.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "64M").rc, 0)
        want = hashlib.sha256()
        p = subprocess.Popen([VBLK, "savevm", "-t", "none", "--vmstate", "-", img, "big"], stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=_BASE_ENV)
        try:  # a bigger pipe: fewer wake-ups of both sides (the pieces stay small)
            fcntl.fcntl(p.stdin.fileno(), 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        rng = random.Random(7)
        for r in rot:
            part = memoryview(block[r:] + block[:r])
            want.update(part)
            pos = 0
            while pos < len(part):
                n = rng.randint(1, 64 * KiB)
                p.stdin.write(part[pos:pos + n])
                pos += n
        p.stdin.close()
        err = p.stderr.read().decode()
        self.assertEqual((p.wait(timeout=600), err), (0, ""))
        self.assertEqual(snapshot_list(img)[0][1:], ("big", "3 GiB"))
        self.check_clean(img)
        got = hashlib.sha256()
        p = subprocess.Popen([VBLK, "loadvm", "-t", "none", "--state-only", "--vmstate-out", "-", img, "big"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_BASE_ENV)
        n = 0
        while True:
            chunk = p.stdout.read(4 * MiB)
            if not chunk:
                break
            got.update(chunk)
            n += len(chunk)
        err = p.stderr.read().decode()
        self.assertEqual((p.wait(timeout=600), err), (0, ""))
        self.assertEqual(n, size)
        self.assertEqual(got.hexdigest(), want.hexdigest(), "the 3 GiB stream came back different")

    def test_qemu_reads_what_vblk_stored(self):
        d = make_tempdir(self, base=shm_dir())
        for cs in (512, 64 * KiB):
            img, data = self.round_trip(d, cs, False, 3 * MiB + 12345, 7 + cs)
            # qemu-img snapshot -a makes the snapshot's L1 table (and so its
            # VM state) the active one; qemu-io reads the state area.
            r = qemu("snapshot", "-a", "s%d" % (7 + cs), img)
            self.assertEqual(r.rc, 0, r)
            self.assertTrue(qemu_io_read_vmstate(img, len(data)) == data, "cluster %d" % cs)
            self.check_clean(img)

    def test_vblk_reads_what_qemu_stored(self):
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "q.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", "-o", "cluster_size=4096", img, "3M").rc, 0)
        # qemu-io writes the active VM state area in QEMU's layout.
        r = run([QEMU_IO, "-f", "qcow2", "-c", "write -b -P 0xa5 0 700k", "-c", "write -b -P 0x3c 700k 512",
                 img])
        self.assertEqual(r.rc, 0, r)
        # qemu-img's snapshot -c copies the L1 table (state area included)
        # but records no VM state size; the entry is patched to carry it,
        # as QEMU's savevm would have recorded it.
        r = qemu("snapshot", "-c", "q1", img)
        self.assertEqual(r.rc, 0, r)
        patch_vm_state_size(img, 0, 700 * KiB + 333)
        v = vblk("snapshot", "-l", img)
        q = qemu("snapshot", "-l", img)
        self.assertSameResult(v, q, "snapshot -l")
        self.assertIn(" 700 KiB ", q.stdout)
        out = os.path.join(d, "out")
        r = vblk("loadvm", "--state-only", "-U", "--vmstate-out", out, img, "q1")
        self.assertEqual((r.rc, r.stderr), (0, ""), r)
        with open(out, "rb") as f:
            back = f.read()
        self.assertEqual(back, b"\xa5" * (700 * KiB) + b"\x3c" * 333)

    def test_io_b_beside_qemu_io(self):
        """`vblk io` read -b / write -b (the VM state area) beside qemu-io:
        each reads what the other wrote; outputs and errors equal."""
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "io.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", "-o", "cluster_size=4096", img, "1M").rc, 0)
        timing = re.compile(r"\(.*\)$|; [0-9.:]+ sec.*$", re.M)
        steps = [("q", "write -b -P 0x17 0 9k"), ("v", "write -b -P 0x29 8k 64k"),
                 ("q", "read -b -P 0x17 0 8k"), ("v", "read -b -P 0x17 0 8k"),
                 ("q", "read -b -P 0x29 8k 64k"), ("v", "read -b -v 70k 1k"),
                 ("v", "write -b 3 512"), ("v", "read -b 0 5"), ("v", "write -b -z 0 512"),
                 ("v", "write -b -f 0 512")]
        for who, cmd in steps:
            if cmd.startswith("write") and "P" in cmd:
                # One of them writes; the reads after check both see it.
                r = run([VBLK, "io", "-f", "qcow2", "-c", cmd, img] if who == "v"
                        else [QEMU_IO, "-f", "qcow2", "-c", cmd, img])
                self.assertEqual(r.rc, 0, r)
                self.assertIn("wrote", r.stdout, r)
                continue
            v = run([VBLK, "io", "-f", "qcow2", "-c", cmd, img])
            q = run([QEMU_IO, "-f", "qcow2", "-c", cmd, img])
            self.assertEqual((v.rc, timing.sub("", v.stdout)), (q.rc, timing.sub("", q.stdout)), cmd)
            self.assertNotIn("Pattern verification failed", q.stdout, cmd)
        self.check_clean(img)

    def test_write_error_mid_save_leaves_no_snapshot(self):
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "e.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "8M").rc, 0)
        self.assertEqual(qemu("snapshot", "-c", "before", img).rc, 0)
        data = stream_bytes(40 * MiB, 3)
        # A write reaching host offset 16 MiB fails once, deep in the stream.
        opts = ("driver=qcow2,file.driver=blkdebug,file.image.driver=file,file.image.filename=%s,"
                "file.inject-error.0.event=write_aio,file.inject-error.0.sector=%d,"
                "file.inject-error.0.once=on" % (img, 16 * MiB // 512))
        rc, _, err = feed([VBLK, "savevm", "--image-opts", "--vmstate", "-", opts, "s1"], data, RNG)
        self.assertEqual(rc, 1, err)
        self.assertRegex(err, r"^[^:\n]+: Error while writing VM state: Input/output error\n$")
        self.assertEqual([t for _, t, _ in snapshot_list(img)], ["before"])
        self.check_clean(img)
        # And the image still takes a good save.
        self.round_trip_existing(img, d)

    def round_trip_existing(self, img, d):
        data = stream_bytes(5 * MiB + 1, 4)
        rc, _, err = feed([VBLK, "savevm", "--vmstate", "-", img, "s2"], data, RNG)
        self.assertEqual((rc, err), (0, ""))
        out = os.path.join(d, "o")
        r = vblk("loadvm", "--vmstate-out", out, img, "s2")
        self.assertEqual(r.rc, 0, r)
        with open(out, "rb") as f:
            self.assertTrue(f.read() == data)
        self.check_clean(img)

    def test_same_tag_replaces_and_errors(self):
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "t.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "1M").rc, 0)
        for n in (1000, 2 * MiB):
            rc, _, err = feed([VBLK, "savevm", "--vmstate", "-", img, "tag"], stream_bytes(n, n), RNG)
            self.assertEqual((rc, err), (0, ""))
        rows = snapshot_list(img)
        self.assertEqual([(t, s) for _, t, s in rows], [("tag", "2 MiB")])
        self.check_clean(img)
        r = vblk("loadvm", "--vmstate-out", os.path.join(d, "x"), img, "nope")
        self.assertEqual(r.rc, 1)
        self.assertIn("Snapshot 'nope' does not exist", r.stderr)
        raw = os.path.join(d, "r.raw")
        self.assertEqual(qemu("create", "-f", "raw", raw, "1M").rc, 0)
        rc, _, err = feed([VBLK, "savevm", "-f", "raw", "--vmstate", "-", raw, "x"], b"abc", RNG)
        self.assertEqual(rc, 1)
        self.assertIn("does not support VM state snapshots", err)
        # A writer holding the image: savevm refuses as every writer does.
        holder = subprocess.Popen([QEMU_IO, "-f", "qcow2", img], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            time.sleep(0.5)
            rc, _, err = feed([VBLK, "savevm", "--vmstate", "-", img, "y"], b"abc", RNG)
            self.assertEqual(rc, 1)
            self.assertIn('Failed to get "write" lock', err)
        finally:
            holder.communicate(b"quit\n", timeout=30)
        self.assertEqual([t for _, t, _ in snapshot_list(img)], ["tag"])

    def test_failed_loadvm_leaves_the_disk(self):
        """A loadvm whose output fails (a full device, a directory that does
        not exist, a consumer that goes away early) must not leave the disk
        reverted: afterwards it holds what it held before, the snapshot
        list is the same (no undo snapshot left behind) and check is clean."""
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "l.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "8M").rc, 0)
        self.assertEqual(run([QEMU_IO, "-f", "qcow2", "-c", "write -P 0x11 0 2M", img]).rc, 0)
        rc, _, err = feed([VBLK, "savevm", "--vmstate", "-", img, "s1"], stream_bytes(6 * MiB, 9), RNG)
        self.assertEqual((rc, err), (0, ""))
        # The writes a failed loadvm must not lose.
        r = run([QEMU_IO, "-f", "qcow2", "-c", "write -P 0x22 1M 3M", "-c", "write -P 0x33 7M 64k", img])
        self.assertEqual(r.rc, 0, r)
        before = (disk_digest(img, d), snapshot_list(img))

        def after(what):
            self.assertEqual((disk_digest(img, d), snapshot_list(img)), before, what)
            self.check_clean(img)

        r = vblk("loadvm", "--vmstate-out", "/dev/full", img, "s1")
        self.assertEqual(r.rc, 1, r)
        self.assertEqual(r.stderr, "%s: Error while writing VM state: No space left on device\n" % os.path.basename(VBLK))
        after("/dev/full")
        r = vblk("loadvm", "--vmstate-out", "/nonexistent/dir/x", img, "s1")
        self.assertEqual(r.rc, 1, r)
        self.assertIn("Could not open '/nonexistent/dir/x': No such file or directory", r.stderr)
        after("a directory that does not exist")
        # A consumer that reads a little and goes away (QEMU refusing the stream).
        p = subprocess.Popen([VBLK, "loadvm", "--vmstate-out", "-", img, "s1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=_BASE_ENV)
        p.stdout.read(100 * KiB)
        p.stdout.close()
        err = p.stderr.read().decode()
        self.assertEqual(p.wait(timeout=120), 1, err)
        self.assertIn("Error while writing VM state: Broken pipe", err)
        after("a consumer that closed early")
        # And a load that goes through still reverts.
        out = os.path.join(d, "o")
        r = vblk("loadvm", "--vmstate-out", out, img, "s1")
        self.assertEqual((r.rc, r.stderr), (0, ""), r)
        self.assertEqual(os.path.getsize(out), 6 * MiB)
        r = run([QEMU_IO, "-f", "qcow2", "-c", "read -P 0x11 0 2M", "-c", "read -P 0 2M 6M", img])
        self.assertNotIn("fail", r.stdout + r.stderr, r)
        self.assertEqual(snapshot_list(img), before[1])
        self.check_clean(img)

    @unittest.skipUnless(QEMU_SYSTEM, "qemu-system-x86_64 not installed")
    def test_cut_qemu_stream_is_refused(self):
        """A stream starting with QEMU's magic must be a whole migration
        stream: cut at 2 MiB, one byte short, or at 3 bytes, savevm
        refuses it (no snapshot, nothing leaked); whole, it is stored; a
        stream without the magic is stored as it is."""
        from migration_stream import qemu_migration_stream
        data = qemu_migration_stream()
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "c.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "8M").rc, 0)
        for what, part in (("2 MiB", data[:2 * MiB]), ("one byte short", data[:-1]), ("3 bytes", data[:3]),
                           ("a byte more", data + b"\0")):
            rc, _, err = feed([VBLK, "savevm", "--vmstate", "-", img, "s1"], part, RNG)
            self.assertEqual(rc, 1, what)
            self.assertRegex(err, r"^[^:\n]+: Invalid VM state stream.*\n$", what)
            self.assertEqual(snapshot_list(img), [], what)
            self.check_clean(img)
        path = os.path.join(d, "cut")
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
        r = vblk("savevm", "--vmstate", path, img, "s1")
        self.assertEqual(r.rc, 1, r)
        self.assertIn("it ends early", r.stderr)
        self.assertEqual(snapshot_list(img), [])
        self.check_clean(img)
        rc, _, err = feed([VBLK, "savevm", "--vmstate", "-", img, "s1"], data, RNG)
        self.assertEqual((rc, err), (0, ""))
        rc, _, err = feed([VBLK, "savevm", "--vmstate", "-", img, "s2"], b"QEVX" + data[4:2 * MiB], RNG)
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual([(t, s) for _, t, s in snapshot_list(img)], [("s1", "6.44 MiB"), ("s2", "2 MiB")])
        self.check_clean(img)

    def test_snapshot_with_inactive_l1_on_the_active_one(self):
        """A snapshot whose L1 table lies where the active one does (crafted:
        its offset patched). qemu-img snapshot -c only rewrites COPIED
        flags there (unchecked, qcow2_update_snapshot_refcount) and
        succeeds; vblk snapshot -c marked the image corrupt and failed. Now
        both succeed, the image is not marked corrupt and checks the same."""
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "ol.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "64M").rc, 0)
        self.assertEqual(run([QEMU_IO, "-f", "qcow2", "-c", "write -P 1 0 4M", img]).rc, 0)
        self.assertEqual(qemu("snapshot", "-c", "q1", img).rc, 0)
        self.assertEqual(run([QEMU_IO, "-f", "qcow2", "-c", "write -P 2 1M 1M", img]).rc, 0)
        import struct
        with open(img, "r+b") as f:
            h = f.read(72)
            l1_off = struct.unpack(">Q", h[40:48])[0]
            snap_off = struct.unpack(">Q", h[64:72])[0]
            f.seek(snap_off)
            f.write(struct.pack(">Q", l1_off))
        out = {}
        for who, tool in (("qemu", qemu), ("vblk", vblk)):
            copy = os.path.join(d, who + ".qcow2")
            shutil.copy(img, copy)
            r = tool("snapshot", "-c", "s2", copy)
            info = qemu("info", "--output=json", copy)
            chk = qemu("check", copy)
            out[who] = (r.rc, r.stderr, '"corrupt": true' in info.stdout, chk.rc, chk.stdout,
                        [t for _, t, _ in snapshot_list(copy)])
        self.assertEqual(out["vblk"], out["qemu"])
        self.assertEqual(out["qemu"][:3], (0, "", False))


def disk_digest(img, d):
    """sha256 of the guest-visible disk (qemu-img convert -O raw)."""
    raw = os.path.join(d, "digest.raw")
    r = qemu("convert", "-O", "raw", img, raw)
    assert r.rc == 0, r
    with open(raw, "rb") as f:
        h = hashlib.sha256(f.read()).hexdigest()
    os.unlink(raw)
    return h


def patch_vm_state_size(img, index, size):
    """Sets vm_state_size (both fields) of snapshot entry `index`."""
    import struct
    with open(img, "r+b") as f:
        hdr = f.read(72)
        nb, off = struct.unpack(">IQ", hdr[60:72])
        assert index < nb
        pos = off
        for i in range(index + 1):
            f.seek(pos)
            e = f.read(40)
            id_len, name_len = struct.unpack(">HH", e[12:16])
            extra = struct.unpack(">I", e[36:40])[0]
            if i == index:
                assert extra >= 8
                f.seek(pos + 32)
                f.write(struct.pack(">I", size))
                f.seek(pos + 40)
                f.write(struct.pack(">Q", size))
                return
            pos += 40 + extra + id_len + name_len
            pos = (pos + 7) & ~7


@unittest.skipUnless(QEMU_SYSTEM, "qemu-system-x86_64 not installed")
class VmstateWithQemu(InteropTestCase):
    """A real QEMU (no guest: its devices still have state) saving and
    loading through vblk."""

    def qemu_vm(self, img, extra=(), paused=True):
        argv = [QEMU_SYSTEM, "-nodefaults", "-display", "none", "-accel", "tcg", "-m", "64",
                "-drive", "file=%s,if=none,id=d0,format=qcow2" % img,
                "-device", "virtio-blk,drive=d0", "-monitor", "stdio"] + (["-S"] if paused else []) + list(extra)
        return argv

    def hmp(self, argv, commands, timeout=120, delay=0.0):
        """Runs the VM, sends the HMP commands after `delay` seconds (the
        VM clock runs meanwhile unless paused), then quit."""
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=_BASE_ENV)
        try:
            time.sleep(delay)
            out, err = p.communicate(("\n".join(commands) + "\nquit\n").encode(), timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        from common import Result
        return Result(argv, p.returncode, out, err)

    def test_qemu_savevm_lists_and_loads(self):
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "vm.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "16M").rc, 0)
        # A VM that ran a while: its VM clock is recorded too.
        r = self.hmp(self.qemu_vm(img, paused=False), ["stop", "savevm s1"], delay=1.5)
        self.assertEqual(r.rc, 0, r)
        rows = snapshot_list(img)
        self.assertEqual(len(rows), 1, rows)
        self.assertNotEqual(rows[0][2], "0 B", "QEMU saved no state")
        self.assertNotIn("00:00:00.000", qemu("snapshot", "-l", img).stdout, "the VM clock did not run")
        for args in (["snapshot", "-l"], ["info"], ["info", "--output=json"]):
            v = vblk(*args, img)
            q = qemu(*args, img)
            self.assertSameResult(v, q, " ".join(args))
        # The stream vblk gives back is the one QEMU reads after its loadvm.
        out = os.path.join(d, "s1.state")
        r = vblk("loadvm", "--state-only", "--vmstate-out", out, img, "s1")
        self.assertEqual((r.rc, r.stderr), (0, ""), r)
        with open(out, "rb") as f:
            mine = f.read()
        copy = os.path.join(d, "copy.qcow2")
        shutil.copy(img, copy)
        self.assertEqual(qemu("snapshot", "-a", "s1", copy).rc, 0)
        self.assertTrue(qemu_io_read_vmstate(copy, len(mine)) == mine)
        # And QEMU restores a vblk-saved copy of that very stream.
        img2 = os.path.join(d, "vm2.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img2, "16M").rc, 0)
        r = run([VBLK, "savevm", "--vmstate", out, img2, "s1"])
        self.assertEqual((r.rc, r.stderr), (0, ""), r)
        r = self.hmp(self.qemu_vm(img2), ["loadvm s1", "info status"])
        self.assertEqual(r.rc, 0, r)
        self.assertNotIn("Error", r.stdout + r.stderr, r)
        self.assertIn("VM status: paused", r.stdout, r)

    def test_migrate_into_vblk_and_back(self):
        d = make_tempdir(self, base=shm_dir())
        img = os.path.join(d, "m.qcow2")
        self.assertEqual(qemu("create", "-f", "qcow2", img, "16M").rc, 0)
        r = run([QEMU_IO, "-f", "qcow2", "-c", "write -P 0x11 0 1M", img])
        self.assertEqual(r.rc, 0, r)
        # QEMU's savevm the libvirt way: stop, migrate to a program, then the
        # snapshot holds disk and state together.
        cmd = "%s savevm %s m1 --vmstate -" % (VBLK, img)
        r = self.hmp(self.qemu_vm(img), ["migrate \"exec:%s\"" % cmd, "info migrate"])
        self.assertEqual(r.rc, 0, r)
        self.assertIn("Migration status: completed", r.stdout, r)
        rows = snapshot_list(img)
        self.assertEqual([t for _, t, _ in rows], ["m1"], r)
        r = qemu("check", img)
        self.assertEqual(r.rc, 0, r)
        # QEMU's own loadvm restores it ...
        r = self.hmp(self.qemu_vm(img), ["loadvm m1", "info status"])
        self.assertEqual(r.rc, 0, r)
        self.assertNotIn("Error", r.stdout + r.stderr, r)
        self.assertIn("VM status: paused", r.stdout, r)
        # ... and so does an incoming migration from vblk loadvm.
        cmd = "%s loadvm %s m1 --vmstate-out -" % (VBLK, img)
        argv = self.qemu_vm(img, ["-incoming", "exec:%s" % cmd])
        # The incoming side reports once the whole stream is in; a slow
        # machine gets more time.
        for delay in (2.0, 5.0, 15.0):
            r = self.hmp(argv, ["info migrate", "info status"], delay=delay)
            if "Migration status: active" not in r.stdout and "Migration status: setup" not in r.stdout:
                break
        self.assertEqual(r.rc, 0, r)
        self.assertIn("Migration status: completed", r.stdout, r)
        self.assertIn("VM status: paused", r.stdout, r)
        self.assertNotIn("load of migration failed", r.stderr, r)
        r = qemu("check", img)
        self.assertEqual(r.rc, 0, r)


if __name__ == "__main__":
    unittest.main()
