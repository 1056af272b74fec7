"""Crash safety: SIGKILL a writing vblk at random moments, then check.

The writer (tests/tools/crash_writer.cc) issues random concurrent writes,
write-zeroes and discards into a qcow2 image through vblk's block layer and
flushes now and then, logging every operation before issuing it and every
completed flush. After each kill:
  * `qemu-img check` must find no corruption (leaked clusters are allowed);
  * every 4 KiB block must hold either its state as of the last completed
    flush, or the content of a later operation that touched it — so every
    write acknowledged before the last completed flush reads back intact.
VBLK_CRASH_ROUNDS sets the number of kills (default 100; the sanitizer
build runs a few, where it would mostly measure ASan's speed).

A second test does the same with internal snapshots created (and the
oldest deleted) between batches, so kills land inside snapshot creation and
deletion too. There, `qemu-img check` may also report OFLAG_COPIED
mismatches of the conservative kind only (an entry without the COPIED flag
whose cluster has refcount one: an unneeded copy on the next write, never a
write into a shared cluster), and `qemu-img check -r all` must then leave a
clean image. Every snapshot whose creation completed (and whose deletion did
not start) must exist, and every snapshot that exists must hold exactly the
state after the operation it was taken at.
"""
import re
import json
import os
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import InteropTestCase, make_tempdir, QEMU_IMG, VBLK, wait_unlocked  # noqa: E402

WRITER = os.environ.get("VBLK_CRASH_WRITER", "")
QEMU_IO = os.environ.get("QEMU_IO") or os.path.join(os.path.dirname(QEMU_IMG), "qemu-io")
VBLK_NAME = os.path.basename(VBLK)
BLOCK = 4096


def block_content(block, seq):
    out = bytearray(BLOCK)
    out[0:8] = block.to_bytes(8, "little")
    out[8:16] = seq.to_bytes(8, "little")
    mask = (1 << 64) - 1
    x = ((block * 0x9E3779B97F4A7C15) & mask) ^ seq
    for i in range(16, BLOCK, 8):
        x ^= (x << 13) & mask
        x ^= x >> 7
        x ^= (x << 17) & mask
        out[i:i + 8] = x.to_bytes(8, "little")
    return bytes(out)


def describe(got):
    if got == bytes(BLOCK):
        return "zeroes"
    b = int.from_bytes(got[0:8], "little")
    s = int.from_bytes(got[8:16], "little")
    return "block %d seq %d%s" % (b, s, "" if got == block_content(b, s) else " (torn)")


def parse_log(path, snaps=None):
    """Operations and the last flush; with `snaps` (a dict), fills it with
    name -> {"seq", "done", "deleting"} for the snapshot lines."""
    ops, flushed = [], 0
    if not os.path.exists(path):
        return ops, flushed  # killed before it wrote anything
    with open(path) as f:
        for line in f:
            parts = line.split()
            if not line.endswith("\n"):
                break  # a line torn by the kill
            if len(parts) == 4 and parts[0] in "WZ":
                ops.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
            elif len(parts) == 2 and parts[0] == "F":
                flushed = int(parts[1])
            elif snaps is not None and parts[0] == "S":
                snaps[parts[1]] = {"seq": int(parts[2]), "done": False, "deleting": False}
            elif snaps is not None and parts[0] == "SS":
                snaps[parts[1]]["done"] = True
            elif snaps is not None and parts[0] == "D":
                snaps[parts[1]]["deleting"] = True
            elif snaps is not None and parts[0] == "DD":
                del snaps[parts[1]]
    return ops, flushed


# qemu-img check's OFLAG_COPIED reports; harmless when the entry lacks the
# flag and the refcount is one.
COPIED_RE = re.compile(r"^ERROR OFLAG_COPIED (?:L2 cluster: l1_index=\d+ l1_entry|data cluster: l2_entry)="
                       r"([0-9a-f]+) refcount=(\d+)$")


def only_conservative_copied_errors(stderr):
    errors = [l for l in stderr.splitlines() if l.startswith("ERROR")]
    for line in errors:
        m = COPIED_RE.match(line)
        if not m or int(m.group(2)) != 1 or int(m.group(1), 16) & (1 << 63):
            return False
    return bool(errors)


def replay(ops, upto):
    """Block -> ("W", seq) / ("Z", 0) after every operation with seq <= upto."""
    state = {}
    for kind, seq, first, count in ops:
        if seq <= upto:
            for b in range(first, first + count):
                state[b] = ("W", seq) if kind == "W" else ("Z", 0)
    return state


class CrashTest(InteropTestCase):
    def setUp(self):
        super().setUp()
        if not WRITER or not os.path.exists(WRITER):
            self.skipTest("VBLK_CRASH_WRITER not built")
        self.dir = make_tempdir(self)

    def one_round(self, rnd, seed, fmt_opts, snapshots=False):
        img = os.path.join(self.dir, "crash.qcow2")
        log = os.path.join(self.dir, "crash.log")
        subprocess.run([VBLK, "create", "-q", "-f", "qcow2", "-o", fmt_opts, img, "16M"], check=True)
        # A writer killed before it opens its log must not be judged by the
        # previous round's log.
        if os.path.exists(log):
            os.unlink(log)
        p = subprocess.Popen([WRITER, img, "qcow2", str(seed), log] + (["snapshots"] if snapshots else []))
        # The kill lands at a random moment of the writing, counted from when
        # the writer has opened its log: a slow start (a sanitizer build on a
        # loaded machine) must not turn rounds into kills before any write.
        deadline = time.time() + 20
        while not os.path.exists(log) and p.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(rnd.uniform(0.02, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.assertEqual(p.returncode, -signal.SIGKILL, "writer died on its own")
        wait_unlocked(img)
        chk = subprocess.run([QEMU_IMG, "check", img], capture_output=True, text=True)
        # 0: clean, 3: leaked clusters only. 2 means corruption, unless (with
        # snapshots) it is only conservative OFLAG_COPIED mismatches, which a
        # repair must then remove.
        if snapshots and chk.returncode == 2 and only_conservative_copied_errors(chk.stderr):
            subprocess.run([QEMU_IMG, "check", "-q", "-r", "all", img], capture_output=True)
            chk = subprocess.run([QEMU_IMG, "check", img], capture_output=True, text=True)
            self.assertEqual(chk.returncode, 0, "seed %d (%s) after -r all:\n%s%s"
                             % (seed, fmt_opts, chk.stdout, chk.stderr))
        self.assertIn(chk.returncode, (0, 3), "seed %d (%s):\n%s%s" % (seed, fmt_opts, chk.stdout, chk.stderr))
        return self.verify_data(img, log, seed, fmt_opts, snapshots)

    def verify_data(self, img, log, seed, fmt_opts, snapshots=False):
        """Every block holds its state as of the last completed flush or the
        content of a later operation. Returns (ops, flushed seq)."""
        raw = os.path.join(self.dir, "crash.raw")
        subprocess.run([QEMU_IMG, "convert", "-O", "raw", img, raw], check=True)
        with open(raw, "rb") as f:
            data = f.read()
        snaps = {} if snapshots else None
        ops, flushed = parse_log(log, snaps)
        if snapshots:
            self.check_snapshots(img, ops, snaps, seed, fmt_opts)
        # Per block: the state at the last flush, then every later candidate.
        durable = {}
        later = {}
        for kind, seq, first, count in ops:
            for b in range(first, first + count):
                state = ("W", seq) if kind == "W" else ("Z", 0)
                if seq <= flushed:
                    durable[b] = state
                else:
                    later.setdefault(b, []).append(state)
        zero = bytes(BLOCK)
        for b in set(durable) | set(later):
            got = data[b * BLOCK:(b + 1) * BLOCK]
            cands = [durable.get(b, ("Z", 0))] + later.get(b, [])
            contents = [zero if k == "Z" else block_content(b, s) for k, s in cands]
            # A crash may tear an unflushed write at cluster granularity, and
            # clusters can be 512 bytes: judge each 512-byte sector alone.
            ok = all(any(got[i:i + 512] == c[i:i + 512] for c in contents) for i in range(0, BLOCK, 512))
            self.assertTrue(ok, "seed %d (%s): block %d holds none of %r (flushed up to %d); it holds %s"
                            % (seed, fmt_opts, b, cands, flushed, describe(got)))
        return len(ops), flushed

    def check_snapshots(self, img, ops, snaps, seed, fmt_opts):
        info = subprocess.run([QEMU_IMG, "info", "--output=json", img], capture_output=True, text=True)
        self.assertEqual(info.returncode, 0, info.stderr)
        present = [s["name"] for s in json.loads(info.stdout).get("snapshots", [])]
        for name, st in snaps.items():
            if st["done"] and not st["deleting"]:
                self.assertIn(name, present, "seed %d (%s): snapshot %s lost" % (seed, fmt_opts, name))
        raw = os.path.join(self.dir, "snap.raw")
        for name in present:
            self.assertIn(name, snaps, "seed %d (%s): unknown snapshot %s" % (seed, fmt_opts, name))
            subprocess.run([QEMU_IMG, "convert", "-l", "snapshot.name=" + name, "-O", "raw", img, raw], check=True)
            with open(raw, "rb") as f:
                data = f.read()
            state = replay(ops, snaps[name]["seq"])
            zero = bytes(BLOCK)
            for b in range(len(data) // BLOCK):
                k, s = state.get(b, ("Z", 0))
                want = zero if k == "Z" else block_content(b, s)
                got = data[b * BLOCK:(b + 1) * BLOCK]
                self.assertTrue(got == want, "seed %d (%s): snapshot %s block %d holds %s, not %s"
                                % (seed, fmt_opts, name, b, describe(got), (k, s)))

    def test_sigkill_with_snapshots(self):
        rounds = max(2, int(os.environ.get("VBLK_CRASH_ROUNDS", "100")) // 2)
        rnd = random.Random(4321)
        variants = ["cluster_size=65536", "cluster_size=4096,refcount_bits=4",
                    "cluster_size=512", "cluster_size=65536,refcount_bits=64",
                    "compat=0.10", "cluster_size=32768,extended_l2=on"]
        total_ops = 0
        for i in range(rounds):
            seed = rnd.randrange(1 << 30)
            with self.subTest(round=i, seed=seed):
                n, _ = self.one_round(rnd, seed, variants[i % len(variants)], snapshots=True)
                total_ops += n
        self.assertGreater(total_ops, rounds)

    def test_sigkill_during_random_io(self):
        rounds = int(os.environ.get("VBLK_CRASH_ROUNDS", "100"))
        rnd = random.Random(1234)
        variants = ["cluster_size=65536", "cluster_size=4096,refcount_bits=1",
                    "cluster_size=512", "cluster_size=65536,refcount_bits=64",
                    "compat=0.10"]
        total_ops = 0
        for i in range(rounds):
            seed = rnd.randrange(1 << 30)
            with self.subTest(round=i, seed=seed):
                n, _ = self.one_round(rnd, seed, variants[i % len(variants)])
                total_ops += n
        self.assertGreater(total_ops, rounds)  # the writer really wrote


class LazyRefcountsTest(CrashTest):
    """lazy_refcounts: the dirty bit, repair on a read-write open, and the
    corrupt bit, with qemu-img and qemu-io as the oracles."""

    test_sigkill_during_random_io = None  # CrashTest's soak, not again

    def _json(self, *argv):
        r = subprocess.run(list(argv), capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r)
        return json.loads(r.stdout)

    def _run(self, *argv):
        return subprocess.run(list(argv), capture_output=True, text=True, cwd=self.dir)

    def assertSameRun(self, v, q, what):
        # (bench's run time is the one line that may differ)
        def out(r, name):
            return re.sub(r"Run completed in [0-9.]+ seconds", "Run completed", r.stdout.replace(name, "X"))
        self.assertEqual(v.returncode, q.returncode, "%s: %r / %r" % (what, v, q))
        self.assertEqual(out(v, "b.qcow2"), out(q, "a.qcow2"), what)
        self.assertEqual(v.stderr.replace(VBLK_NAME + ":", "qemu-img:").replace("b.qcow2", "X"),
                         q.stderr.replace("a.qcow2", "X"), what)

    def _dirty(self, img):
        return self._json(QEMU_IMG, "info", "--output=json", img).get("dirty-flag")

    def test_sigkill_leaves_dirty_image_repaired_on_rw_open(self):
        img = os.path.join(self.dir, "lazy.qcow2")
        log = os.path.join(self.dir, "lazy.log")
        rnd = random.Random(99)
        for rnd_i in range(3):
            seed = rnd.randrange(1 << 30)
            with self.subTest(round=rnd_i, seed=seed):
                subprocess.run([VBLK, "create", "-q", "-f", "qcow2", "-o",
                                "lazy_refcounts=on,cluster_size=4096", img, "16M"], check=True)
                if os.path.exists(log):
                    os.unlink(log)
                p = subprocess.Popen([WRITER, img, "qcow2", str(seed), log])
                # Killed once it has flushed at least once (so it wrote).
                deadline = time.time() + 20
                while time.time() < deadline:
                    if os.path.exists(log) and "\nF " in "\n" + open(log).read():
                        break
                    time.sleep(0.01)
                time.sleep(rnd.uniform(0.0, 0.1))
                p.send_signal(signal.SIGKILL)
                p.wait()
                wait_unlocked(img)
                # Dirty, and both tools see it the same way.
                vi = self._json(VBLK, "info", "--output=json", img)
                qi = self._json(QEMU_IMG, "info", "--output=json", img)
                self.assertTrue(qi.get("dirty-flag"), qi)
                self.assertEqual(vi.get("dirty-flag"), qi.get("dirty-flag"))
                shutil.copy(img, os.path.join(self.dir, "a.qcow2"))
                shutil.copy(img, os.path.join(self.dir, "b.qcow2"))
                self.assertSameRun(self._run(VBLK, "check", "b.qcow2"),
                                   self._run(QEMU_IMG, "check", "a.qcow2"), "check of the dirty image")
                # Read-only use needs no repair and changes nothing.
                before = open(img, "rb").read()
                self.assertSameRun(self._run(VBLK, "map", "--output=json", "b.qcow2"),
                                   self._run(QEMU_IMG, "map", "--output=json", "a.qcow2"), "map")
                self.assertEqual(open(os.path.join(self.dir, "b.qcow2"), "rb").read(), before)
                # A read-write open repairs (same messages as QEMU's) and
                # clears the bit.
                self.assertSameRun(self._run(VBLK, "resize", "-f", "qcow2", "b.qcow2", "16M"),
                                   self._run(QEMU_IMG, "resize", "-f", "qcow2", "a.qcow2", "16M"),
                                   "read-write open of the dirty image")
                for name in ("a.qcow2", "b.qcow2"):
                    path = os.path.join(self.dir, name)
                    self.assertFalse(self._dirty(path), name)
                    chk = self._run(QEMU_IMG, "check", path)
                    self.assertEqual(chk.returncode, 0, chk)
                cmp_ = self._run(QEMU_IMG, "compare", "a.qcow2", "b.qcow2")
                self.assertEqual(cmp_.returncode, 0, cmp_)
                n, _ = self.verify_data(os.path.join(self.dir, "b.qcow2"), log, seed, "lazy")
                self.assertGreater(n, 0)

    def test_qemu_crash_with_refcount_errors_repaired_like_qemu(self):
        # qemu-io's "abort" leaves L2 entries whose refcounts never reached
        # the disk: errors, not just leaks. Opening read-write repairs them.
        img = os.path.join(self.dir, "a.qcow2")
        subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on",
                        img, "16M"], check=True)
        subprocess.run([QEMU_IO, "-c", "write -P 0x11 0 1M", "-c", "write -P 0x22 4M 64k",
                        "-c", "abort", img], capture_output=True)
        shutil.copy(img, os.path.join(self.dir, "b.qcow2"))
        q = self._run(QEMU_IMG, "check", "a.qcow2")
        self.assertEqual(q.returncode, 2, q)  # corruptions, as the oracle says
        self.assertSameRun(self._run(VBLK, "check", "b.qcow2"), q, "check")
        q = self._run(QEMU_IMG, "resize", "-f", "qcow2", "a.qcow2", "16M")
        self.assertIn("Rebuilding refcount structure", q.stderr)  # the oracle did repair
        self.assertSameRun(self._run(VBLK, "resize", "-f", "qcow2", "b.qcow2", "16M"), q, "repairing open")
        for name in ("a.qcow2", "b.qcow2"):
            chk = self._run(QEMU_IMG, "check", name)
            self.assertEqual(chk.returncode, 0, chk)
            self.assertFalse(self._dirty(os.path.join(self.dir, name)))
        r = self._run(QEMU_IO, "-r", "-c", "read -P 0x11 0 1M", "-c", "read -P 0x22 4M 64k", "b.qcow2")
        self.assertNotIn("fail", r.stdout + r.stderr, r)

    def test_clean_close_clears_dirty_bit(self):
        img = os.path.join(self.dir, "c.qcow2")
        subprocess.run([VBLK, "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", img, "8M"],
                       check=True)
        r = self._run(VBLK, "bench", "-w", "-c", "200", "-s", "4k", "-S", "65536", "-f", "qcow2", img)
        self.assertEqual(r.returncode, 0, r)
        self.assertFalse(self._dirty(img))
        chk = self._run(QEMU_IMG, "check", img)
        self.assertEqual(chk.returncode, 0, chk)
        info = self._json(QEMU_IMG, "info", "--output=json", img)
        self.assertTrue(info["format-specific"]["data"]["lazy-refcounts"])

    def test_runtime_corruption_sets_corrupt_bit_and_check_clears_it(self):
        # An unaligned L2 table offset, found by a write: both mark the image
        # corrupt, refuse the write, refuse read-write opens afterwards, and
        # `check -r all` clears the bit.
        img = os.path.join(self.dir, "a.qcow2")
        subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", img, "1M"], check=True)
        subprocess.run([QEMU_IO, "-c", "write -P 1 0 128k", img], check=True, capture_output=True)
        with open(img, "r+b") as f:
            f.seek(40)
            l1 = int.from_bytes(f.read(8), "big")
            f.seek(l1)
            e = int.from_bytes(f.read(8), "big")
            f.seek(l1)
            f.write((e + 512).to_bytes(8, "big"))
        shutil.copy(img, os.path.join(self.dir, "b.qcow2"))
        bench = ["bench", "-w", "-c", "1", "-s", "4k", "-f", "qcow2"]
        self.assertSameRun(self._run(VBLK, *bench, "b.qcow2"), self._run(QEMU_IMG, *bench, "a.qcow2"),
                           "write hitting the corruption")
        for name in ("a.qcow2", "b.qcow2"):
            info = self._json(QEMU_IMG, "info", "--output=json", os.path.join(self.dir, name))
            self.assertTrue(info["format-specific"]["data"]["corrupt"], name)
        self.assertSameRun(self._run(VBLK, *bench, "b.qcow2"), self._run(QEMU_IMG, *bench, "a.qcow2"),
                           "read-write open of a corrupt image")
        # The unaligned L2 offset is beyond repair: the bit stays, in both.
        self.assertSameRun(self._run(VBLK, "check", "-r", "all", "b.qcow2"),
                           self._run(QEMU_IMG, "check", "-r", "all", "a.qcow2"), "check -r all")
        for name in ("a.qcow2", "b.qcow2"):
            info = self._json(QEMU_IMG, "info", "--output=json", os.path.join(self.dir, name))
            self.assertTrue(info["format-specific"]["data"]["corrupt"], name)
        # Where the repair leaves no corruption, `check -r all` clears the
        # bit, and the image can be written again.
        for name in ("a.qcow2", "b.qcow2"):
            path = os.path.join(self.dir, name)
            subprocess.run([QEMU_IMG, "create", "-q", "-f", "qcow2", path, "1M"], check=True)
            subprocess.run([QEMU_IO, "-c", "write -P 1 0 128k", path], check=True, capture_output=True)
            with open(path, "r+b") as f:
                f.seek(72)
                f.write((2).to_bytes(8, "big"))  # the corrupt bit alone
        self.assertSameRun(self._run(VBLK, *bench, "b.qcow2"), self._run(QEMU_IMG, *bench, "a.qcow2"),
                           "read-write open of an image marked corrupt")
        self.assertSameRun(self._run(VBLK, "check", "-r", "all", "b.qcow2"),
                           self._run(QEMU_IMG, "check", "-r", "all", "a.qcow2"), "check -r all")
        for name in ("a.qcow2", "b.qcow2"):
            info = self._json(QEMU_IMG, "info", "--output=json", os.path.join(self.dir, name))
            self.assertFalse(info["format-specific"]["data"]["corrupt"], name)
        self.assertSameRun(self._run(VBLK, *bench, "b.qcow2"), self._run(QEMU_IMG, *bench, "a.qcow2"),
                           "write after the repair")


if __name__ == "__main__":
    unittest.main()
