#!/usr/bin/env python3
"""Interop: `bench` command line, vblk vs qemu-img.

For option combinations (-c -d -s -S -o -w -t -i -n --pattern -q -f
--flush-interval --no-drain) the first stdout line

    Sending N read|write requests, X bytes each, Y in parallel (starting at offset O, step size S)

must equal qemu-img's exactly, and the last line must match
``^Run completed in \\d+\\.\\d{3} seconds\\.$``.  Writes are checked
byte-for-byte against the expected pattern (qemu-img 7.2 offset rule:
next = (offset + step) % image_size) and against qemu-img's result.
Option errors must match qemu-img's exit code / stdout / stderr.
"""

import os
import re
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (skip_unless_formats, MiB, InteropTestCase, both, file_state, make_image,  # noqa: E402
                    norm_vblk_err, qemu, rand_bytes, read_range, vblk)

RUN_RE = re.compile(r"^Run completed in \d+\.\d{3} seconds\.$")
FIRST_RE = re.compile(r"^Sending (\d+) (read|write) requests, (\d+) bytes each, (\d+) in "
                      r"parallel \(starting at offset (\d+), step size (\d+)\)$")
PROBE_WARNING = (
    "WARNING: Image format was not specified for '%s' and probing guessed raw.\n"
    "         Automatically detecting the format is dangerous for raw images, "
    "write operations on block 0 will be restricted.\n"
    "         Specify the 'raw' format explicitly to remove the restrictions.\n")


def first_line(count, write, bufsize, depth, offset, step):
    return ("Sending %d %s requests, %d bytes each, %d in parallel (starting at offset %d, "
            "step size %d)" % (count, "write" if write else "read", bufsize, depth,
                               offset, step))


def written_offsets(image_size, count, offset, step):
    """Request offsets issued by qemu-img 7.2's bench_cb()."""
    offs = []
    for _ in range(count):
        offs.append(offset)
        offset = (offset + step) % image_size
    return offs


# (name, options, expected first line as (count, write, bufsize, depth, offset, step))
READ_CASES = [
    ("count", ["-c", "100"], (100, False, 4096, 64, 0, 4096)),
    ("count_one", ["-c", "1"], (1, False, 4096, 64, 0, 4096)),
    ("count_zero", ["-c", "0"], (0, False, 4096, 64, 0, 4096)),
    ("count_hex", ["-c", "0x10"], (16, False, 4096, 64, 0, 4096)),
    ("depth", ["-c", "50", "-d", "4"], (50, False, 4096, 4, 0, 4096)),
    ("depth_one", ["-c", "50", "-d", "1"], (50, False, 4096, 1, 0, 4096)),
    ("depth_gt_count", ["-c", "5", "-d", "128"], (5, False, 4096, 128, 0, 4096)),
    ("bufsize", ["-c", "50", "-s", "512"], (50, False, 512, 64, 0, 512)),
    ("bufsize_suffix", ["-c", "20", "-s", "64k"], (20, False, 65536, 64, 0, 65536)),
    ("bufsize_fraction", ["-c", "20", "-s", "1.5k"], (20, False, 1536, 64, 0, 1536)),
    ("bufsize_odd", ["-c", "20", "-s", "100"], (20, False, 100, 64, 0, 100)),
    ("bufsize_zero", ["-c", "20", "-s", "0"], (20, False, 0, 64, 0, 0)),
    ("step", ["-c", "50", "-S", "8192"], (50, False, 4096, 64, 0, 8192)),
    ("step_suffix", ["-c", "50", "-S", "8k"], (50, False, 4096, 64, 0, 8192)),
    ("step_smaller_than_buf", ["-c", "50", "-S", "512"], (50, False, 4096, 64, 0, 512)),
    ("step_zero_means_bufsize", ["-c", "50", "-s", "1k", "-S", "0"],
     (50, False, 1024, 64, 0, 1024)),
    ("offset", ["-c", "50", "-o", "4096"], (50, False, 4096, 64, 4096, 4096)),
    ("offset_suffix", ["-c", "50", "-o", "1k"], (50, False, 4096, 64, 1024, 4096)),
    ("offset_odd", ["-c", "50", "-o", "7", "-s", "100"], (50, False, 100, 64, 7, 100)),
    ("all_numeric", ["-c", "33", "-d", "3", "-s", "2k", "-S", "12k", "-o", "512"],
     (33, False, 2048, 3, 512, 12288)),
    ("quiet_is_noop", ["-c", "10", "-q"], (10, False, 4096, 64, 0, 4096)),
    ("fmt_raw", ["-c", "10", "-f", "raw"], (10, False, 4096, 64, 0, 4096)),
    ("cache_none", ["-c", "10", "-t", "none"], (10, False, 4096, 64, 0, 4096)),
    ("cache_writeback", ["-c", "10", "-t", "writeback"], (10, False, 4096, 64, 0, 4096)),
    ("cache_writethrough", ["-c", "10", "-t", "writethrough"], (10, False, 4096, 64, 0, 4096)),
    ("cache_directsync", ["-c", "10", "-t", "directsync"], (10, False, 4096, 64, 0, 4096)),
    ("cache_unsafe", ["-c", "10", "-t", "unsafe"], (10, False, 4096, 64, 0, 4096)),
    ("aio_threads", ["-c", "10", "-i", "threads"], (10, False, 4096, 64, 0, 4096)),
    ("aio_io_uring", ["-c", "10", "-i", "io_uring"], (10, False, 4096, 64, 0, 4096)),
    ("aio_native_direct", ["-c", "10", "-i", "native", "-t", "none"],
     (10, False, 4096, 64, 0, 4096)),
    ("aio_io_uring_direct", ["-c", "10", "-i", "io_uring", "-t", "none"],
     (10, False, 4096, 64, 0, 4096)),
    ("n_flag_direct", ["-c", "10", "-n", "-t", "none"], (10, False, 4096, 64, 0, 4096)),
    ("pattern_ignored_for_reads", ["-c", "10", "--pattern=0xab"], (10, False, 4096, 64, 0, 4096)),
    ("options_after_filename", None, (10, False, 512, 2, 0, 512)),
    ("wraps_exactly_at_end", ["-c", "600", "-d", "8"], (600, False, 4096, 8, 0, 4096)),
    ("default_count", [], (75000, False, 4096, 64, 0, 4096)),
]

WRITE_CASES = [
    ("write_basic", ["-c", "16", "-w", "-f", "raw"], (16, True, 4096, 64, 0, 4096)),
    ("write_quiet", ["-c", "16", "-w", "-q", "-f", "raw"], (16, True, 4096, 64, 0, 4096)),
    ("write_cache_none", ["-c", "16", "-w", "-t", "none", "-f", "raw"],
     (16, True, 4096, 64, 0, 4096)),
    ("write_depth1", ["-c", "16", "-d", "1", "-w", "-f", "raw"], (16, True, 4096, 1, 0, 4096)),
]


class BenchTest(InteropTestCase):

    IMG_SIZE = MiB

    def setUp(self):
        super().setUp()
        self.dv = self.subdir("v")
        self.dq = self.subdir("q")
        self.initial = rand_bytes(self.IMG_SIZE, "bench")
        for d in (self.dv, self.dq):
            make_image(os.path.join(d, "b.img"), self.IMG_SIZE, data=[(0, self.initial)])

    def _run(self, args):
        v = vblk("bench", *args, cwd=self.dv, timeout=120)
        q = qemu("bench", *args, cwd=self.dq, timeout=120)
        return v, q

    def _check_success(self, v, q, expected_first):
        self.assertEqual(q.rc, 0, "oracle failed: %r" % q)
        self.assertEqual(v.rc, 0, "vblk failed: %r" % v)
        self.assertSameStderr(v, q)
        vl, ql = v.stdout.splitlines(), q.stdout.splitlines()
        self.assertTrue(vl, "no output from vblk: %r" % v)
        self.assertEqual(vl[0], ql[0])
        if expected_first is not None:
            self.assertEqual(vl[0], first_line(*expected_first))
        self.assertEqual(len(vl), len(ql), "number of output lines: %r vs %r" % (v, q))
        self.assertRegex(vl[-1], RUN_RE)
        self.assertTrue(v.stdout.endswith("\n"))
        # everything between first and last line must be identical too
        self.assertEqual(vl[1:-1], ql[1:-1])

    def _check_read(self, opts, expected_first):
        pv = os.path.join(self.dv, "b.img")
        before = file_state(pv)
        v, q = self._run(opts)
        self._check_success(v, q, expected_first)
        self.assertEqual(len(v.stdout.splitlines()), 2, v)
        self.assertUnchanged(before, file_state(pv), "(bench read modified the image)")

    def _check_write(self, opts, expected_first, expect_bytes=None):
        """Run `bench OPTS b.img` (write mode) in both directories."""
        v, q = self._run(opts + ["b.img"])
        self._check_success(v, q, expected_first)
        cv = read_range(os.path.join(self.dv, "b.img"), 0, self.IMG_SIZE + 1)
        cq = read_range(os.path.join(self.dq, "b.img"), 0, self.IMG_SIZE + 1)
        self.assertEqual(len(cv), self.IMG_SIZE, "image size changed")
        if expect_bytes is not None:
            self.assertTrue(cq == expect_bytes, "oracle wrote something unexpected")
            self.assertTrue(cv == expect_bytes, "written data differs from expectation")
        self.assertTrue(cv == cq, "image contents differ from qemu-img's after bench -w")
        return v, q

    def _expected_after_write(self, count, offset, step, bufsize, pattern):
        buf = bytearray(self.initial)
        for off in written_offsets(self.IMG_SIZE, count, offset, step):
            buf[off:off + bufsize] = bytes([pattern]) * bufsize
        return bytes(buf)

    # -- pattern writes -----------------------------------------------------
    def test_write_pattern_0xab(self):
        exp = self._expected_after_write(16, 4096, 8192, 4096, 0xAB)
        self._check_write(["-w", "--pattern=0xab", "-f", "raw", "-c", "16", "-o", "4096",
                           "-S", "8192"], (16, True, 4096, 64, 4096, 8192), exp)
        data = read_range(os.path.join(self.dv, "b.img"), 0, self.IMG_SIZE)
        for i in range(16):
            off = 4096 + i * 8192
            self.assertEqual(data[off:off + 4096], b"\xab" * 4096, "block at %d" % off)
            self.assertEqual(data[off + 4096:off + 8192], self.initial[off + 4096:off + 8192])
        self.assertEqual(data[:4096], self.initial[:4096])

    def test_write_pattern_decimal_and_octal(self):
        for spelling in ("171", "0253", "0xAB"):
            with self.subTest(pattern=spelling):
                for d in (self.dv, self.dq):
                    make_image(os.path.join(d, "b.img"), self.IMG_SIZE,
                               data=[(0, self.initial)])
                exp = self._expected_after_write(8, 0, 4096, 4096, 0xAB)
                self._check_write(["-w", "--pattern", spelling, "-f", "raw", "-c", "8"],
                                  (8, True, 4096, 64, 0, 4096), exp)

    def test_write_default_pattern_is_zero(self):
        exp = self._expected_after_write(10, 65536, 4096, 4096, 0)
        self._check_write(["-w", "-f", "raw", "-c", "10", "-o", "64k"],
                          (10, True, 4096, 64, 65536, 4096), exp)

    def test_write_pattern_ff_unaligned(self):
        exp = self._expected_after_write(20, 7, 1000, 100, 0xFF)
        self._check_write(["-w", "--pattern=255", "-f", "raw", "-c", "20", "-o", "7",
                           "-s", "100", "-S", "1000"], (20, True, 100, 64, 7, 1000), exp)

    def test_write_wraps_modulo_image_size(self):
        # 7.2 rule: offset = (offset + step) % image_size
        exp = self._expected_after_write(300, 8192, 12288, 4096, 0x42)
        self._check_write(["-w", "--pattern=0x42", "-f", "raw", "-c", "300", "-d", "8",
                           "-o", "8192", "-S", "12288"], (300, True, 4096, 8, 8192, 12288), exp)

    def test_write_count_zero_writes_nothing(self):
        self._check_write(["-w", "--pattern=0xab", "-f", "raw", "-c", "0"],
                          (0, True, 4096, 64, 0, 4096), self.initial)

    def test_write_step_smaller_than_bufsize(self):
        exp = self._expected_after_write(5, 0, 1000, 4096, 0x33)
        self._check_write(["-w", "--pattern=0x33", "-f", "raw", "-c", "5", "-d", "1",
                           "-S", "1000"], (5, True, 4096, 1, 0, 1000), exp)

    def test_write_direct_pattern(self):
        exp = self._expected_after_write(32, 512, 4096, 4096, 0xC3)
        self._check_write(["-w", "-t", "none", "--pattern=0xc3", "-f", "raw", "-c", "32",
                           "-o", "512"], (32, True, 4096, 64, 512, 4096), exp)

    def test_write_probed_format_warns(self):
        # Without -f, a write open of a probed raw image prints a 3-line
        # warning on stderr (the run itself succeeds).
        exp = self._expected_after_write(4, 4096, 4096, 4096, 0x77)
        v, q = self._check_write(["-w", "--pattern=0x77", "-c", "4", "-o", "4096"],
                                 (4, True, 4096, 64, 4096, 4096), exp)
        self.assertEqual(norm_vblk_err(v.stderr), PROBE_WARNING % "b.img")

    def test_read_probed_format_no_warning(self):
        v, q = self._run(["-c", "4", "b.img"])
        self._check_success(v, q, (4, False, 4096, 64, 0, 4096))
        self.assertEqual(v.stderr, "")

    # -- flush interval -----------------------------------------------------
    def test_flush_interval(self):
        for extra in ([], ["--no-drain"]):
            with self.subTest(extra=extra):
                v, q = self._check_write(["-w", "-f", "raw", "-c", "64", "-d", "8",
                                          "--flush-interval=8"] + extra,
                                         (64, True, 4096, 8, 0, 4096))
                self.assertEqual(v.stdout.splitlines()[1], "Sending flush every 8 requests")
                self.assertEqual(len(v.stdout.splitlines()), 3)

    # -- errors ---------------------------------------------------------------
    def test_option_errors(self):
        cases = [
            (["-c", "abc"], "qemu-img: Invalid request count specified\n"),
            (["-c", "-1"], None),
            (["-c", "2147483648"], None),
            (["-d", "abc"], "qemu-img: Invalid queue depth specified\n"),
            (["-d", "2147483648"], None),
            (["-s", "12Q"], "qemu-img: Invalid buffer size specified. You may use k, M, G, "
                            "T, P or E suffixes for\nqemu-img: kilobytes, megabytes, "
                            "gigabytes, terabytes, petabytes and exabytes.\n"),
            (["-s", "-1"], None),
            (["-s", "2147483648"], "qemu-img: Invalid buffer size specified. Must be "
                                   "between 0 and 2147483647.\n"),
            (["-S", "12Q"], "qemu-img: Invalid step_size specified. You may use k, M, G, "
                            "T, P or E suffixes for\nqemu-img: kilobytes, megabytes, "
                            "gigabytes, terabytes, petabytes and exabytes.\n"),
            (["-S", "2147483648"], None),
            (["-o", "-1"], None),
            (["-o", "abc"], "qemu-img: Invalid offset specified. You may use k, M, G, T, P "
                            "or E suffixes for\nqemu-img: kilobytes, megabytes, gigabytes, "
                            "terabytes, petabytes and exabytes.\n"),
            (["-o", "8E"], "qemu-img: Invalid offset specified. Must be between 0 and "
                           "9223372036854775807.\n"),
            (["--pattern=256"], "qemu-img: Invalid pattern byte specified\n"),
            (["--pattern=abc"], None),
            (["--pattern=-1"], None),
            (["-t", "foo"], "qemu-img: Invalid cache mode\n"),
            (["-i", "foo"], "qemu-img: Invalid aio option: foo\n"),
            (["-c", "3", "-i", "native"],
             "qemu-img: Could not open 'b.img': aio=native was specified, but it requires "
             "cache.direct=on, which was not specified.\n"),
            (["-c", "3", "-n"], None),
            (["-c", "3", "--flush-interval=64"],
             "qemu-img: --flush-interval is only available in write tests\n"),
            (["-c", "3", "-w", "-d", "8", "--flush-interval=4"],
             "qemu-img: Flush interval can't be smaller than depth\n"),
            (["--flush-interval=abc", "-w"], None),
            (["-f", "foo"], "qemu-img: Could not open 'b.img': Unknown driver 'foo'\n"),
            (["-f", "qcow2"], None),
            (["--bogus"], None),
            (["-c"], None),
        ]
        for opts, expected in cases:
            with self.subTest(opts=opts):
                pv = os.path.join(self.dv, "b.img")
                before = file_state(pv)
                # "-c" without argument must be last (it would eat the name)
                argv = opts if opts == ["-c"] else opts + ["b.img"]
                skip_unless_formats(self, argv)
                v, q = self._run(argv)
                self.assertNotEqual(q.rc, 0, q)
                self.assertEqual(v.rc, q.rc, "%r\n%r" % (v, q))
                self.assertEqual(v.rc, 1)
                self.assertSameStdout(v, q)
                self.assertEqual(v.stdout, "")
                self.assertSameStderr(v, q)
                if expected is not None:
                    self.assertEqual(norm_vblk_err(v.stderr), expected)
                self.assertUnchanged(before, file_state(pv))

    def test_io_error_offset_beyond_end(self):
        # The header is printed, then the first request fails with EIO.
        for opts in (["-c", "10", "-o", "2M"], ["-c", "10", "-s", "2M"],
                     ["-c", "10", "-o", "1M"],
                     # 7.2 wraps modulo the image size, so a request can
                     # straddle the end of the image -> EIO
                     ["-c", "300", "-o", "2048"],
                     ["-c", "300", "-d", "1", "-o", "2048"],
                     ["-c", "10", "-w", "-f", "raw", "-o", "2M"]):
            with self.subTest(opts=opts):
                v, q = self._run(opts + ["b.img"])
                self.assertEqual(q.rc, 1, q)
                self.assertEqual(v.rc, 1, v)
                self.assertSameStdout(v, q)
                self.assertSameStderr(v, q)
                self.assertEqual(norm_vblk_err(v.stderr),
                                 "qemu-img: Failed request: Input/output error\n")
                self.assertEqual(len(v.stdout.splitlines()), 1)
                self.assertRegex(v.stdout.splitlines()[0], FIRST_RE)

    def test_direct_write_needs_aligned_size_unless_format_grows_file(self):
        # QEMU's permission rule: writing without the resize permission needs
        # a file size that is a multiple of the O_DIRECT alignment. raw and a
        # bare file are refused; qcow2 (which takes resize) is not.
        d = self.subdir("odd")
        for size in (1000, 196616):
            with self.subTest(size=size):
                make_image(os.path.join(d, "odd.raw"), size)
                for fmt in ("raw", "file"):
                    v, q = both("bench", "-t", "none", "-w", "-f", fmt, "-c", "1", "-s", "512",
                                "odd.raw", cwd=d)
                    self.assertEqual(q.rc, 1, q)
                    self.assertSameResult(v, q, fmt)
                    self.assertIn("Cannot get 'write' permission without 'resize'", v.stderr)
        for tool in (vblk, qemu):
            with self.subTest(tool=tool.__name__):
                qemu("create", "-q", "-f", "qcow2", os.path.join(d, "q.qcow2"), "64M")
                self.assertNotEqual(os.path.getsize(os.path.join(d, "q.qcow2")) % 512, 0)
                r = tool("bench", "-t", "none", "-w", "-f", "qcow2", "-c", "100", "q.qcow2", cwd=d)
                self.assertEqual(r.rc, 0, r)
                c = qemu("check", "q.qcow2", cwd=d)
                self.assertEqual(c.rc, 0, c)


def _make_read_test(name, opts, expected):
    def test(self):
        if opts is None:
            # GNU getopt permutation: options may follow the file name
            self._check_read(["b.img", "-c", "10", "-s", "512", "-d", "2"], expected)
        else:
            self._check_read(opts + ["b.img"], expected)
    return test


def _make_write_test(name, opts, expected):
    def test(self):
        c = expected[0]
        exp = self._expected_after_write(c, expected[4], expected[5], expected[2], 0)
        self._check_write(opts, expected, exp)
    return test


for _n, _o, _e in READ_CASES:
    setattr(BenchTest, "test_read_" + _n, _make_read_test(_n, _o, _e))
for _n, _o, _e in WRITE_CASES:
    setattr(BenchTest, "test_" + _n, _make_write_test(_n, _o, _e))


class BenchSmallImageTest(BenchTest):
    """Image smaller than the buffer / not a multiple of 512."""

    IMG_SIZE = 10000

    # The inherited table tests assume a 1 MiB image; run only these.
    def test_small_reads(self):
        # virtual size is rounded up to 10240; reads that fit succeed
        for opts, exp in ((["-c", "3", "-s", "512"], (3, False, 512, 64, 0, 512)),
                          (["-c", "2", "-s", "100", "-S", "5000"],
                           (2, False, 100, 64, 0, 5000))):
            with self.subTest(opts=opts):
                self._check_read(opts + ["-f", "raw", "b.img"], exp)

    def test_small_write_past_eof_region(self):
        # The file (10000 bytes) is shorter than the virtual size (10240);
        # a write into that tail extends the file.
        v, q = self._run(["-c", "1", "-w", "-f", "raw", "--pattern=0x99", "-o", "9984",
                          "-s", "256", "b.img"])
        self._check_success(v, q, (1, True, 256, 64, 9984, 256))
        self.assertEqual(read_range(os.path.join(self.dv, "b.img"), 9984, 1000),
                         b"\x99" * 256)
        self.assertEqual(read_range(os.path.join(self.dv, "b.img"), 0, 20000),
                         read_range(os.path.join(self.dq, "b.img"), 0, 20000))
        self.assertEqual(os.path.getsize(os.path.join(self.dv, "b.img")),
                         os.path.getsize(os.path.join(self.dq, "b.img")))


# Keep BenchSmallImageTest to its own tests only.
for _attr in list(vars(BenchTest)):
    if _attr.startswith("test_") and _attr not in vars(BenchSmallImageTest):
        setattr(BenchSmallImageTest, _attr, None)


if __name__ == "__main__":
    unittest.main()
