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
"""
import os
import random
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import InteropTestCase, make_tempdir, QEMU_IMG, VBLK  # noqa: E402

WRITER = os.environ.get("VBLK_CRASH_WRITER", "")
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


def parse_log(path):
    ops, flushed = [], 0
    if not os.path.exists(path):
        return ops, flushed  # killed before it wrote anything
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 4 and parts[0] in "WZ":
                ops.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
            elif len(parts) == 2 and parts[0] == "F":
                flushed = int(parts[1])
    return ops, flushed


class CrashTest(InteropTestCase):
    def setUp(self):
        super().setUp()
        if not WRITER or not os.path.exists(WRITER):
            self.skipTest("VBLK_CRASH_WRITER not built")
        self.dir = make_tempdir(self)

    def one_round(self, rnd, seed, fmt_opts):
        img = os.path.join(self.dir, "crash.qcow2")
        log = os.path.join(self.dir, "crash.log")
        subprocess.run([VBLK, "create", "-q", "-f", "qcow2", "-o", fmt_opts, img, "16M"], check=True)
        # A writer killed before it opens its log must not be judged by the
        # previous round's log.
        if os.path.exists(log):
            os.unlink(log)
        p = subprocess.Popen([WRITER, img, "qcow2", str(seed), log])
        time.sleep(rnd.uniform(0.02, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.assertEqual(p.returncode, -signal.SIGKILL, "writer died on its own")
        chk = subprocess.run([QEMU_IMG, "check", img], capture_output=True, text=True)
        # 0: clean, 3: leaked clusters only. 2 means corruption.
        self.assertIn(chk.returncode, (0, 3), "seed %d (%s):\n%s%s" % (seed, fmt_opts, chk.stdout, chk.stderr))
        raw = os.path.join(self.dir, "crash.raw")
        subprocess.run([QEMU_IMG, "convert", "-O", "raw", img, raw], check=True)
        with open(raw, "rb") as f:
            data = f.read()
        ops, flushed = parse_log(log)
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


if __name__ == "__main__":
    unittest.main()
