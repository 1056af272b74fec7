#!/usr/bin/env python3
"""Interop: `compare`, vblk vs qemu-img.

Exit codes (qemu-img 7.2): 0 identical, 1 different (also: usage errors
such as a wrong number of file names or an unknown option), 2 open
errors / bad cache mode.

Every case checks that exit code, stdout and (program-name normalised)
stderr equal qemu-img's, plus the concrete expected exit code and, where
it is known, the literal stdout.
"""

import os
import re
import shutil
import sys
import tempfile

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (skip_unless_formats, MiB, GiB, InteropTestCase, both, make_image,  # noqa: E402
                    norm_vblk_err, rand_bytes, tree_state)

IDENTICAL = "Images are identical.\n"
SIZE_WARN = "Warning: Image size mismatch!\n"
STRICT_SIZE = "Strict mode: Image size mismatch!\n"


def mismatch(off):
    return "Content mismatch at offset %d!\n" % off


def strict_status(off):
    return "Strict mode: Offset %d block status mismatch!\n" % off


RAND_1M = rand_bytes(MiB, "compare-base")


def flipped(buf, offsets):
    b = bytearray(buf)
    for off in offsets:
        b[off] ^= 0x5A
    return bytes(b)


FLIP_OFFSETS = [0, 1, 511, 512, 513, 4095, 4096 + 17, 65535, 123457,
                MiB // 2, MiB - 512, MiB - 1]


def build_images(d):
    p = lambda n: os.path.join(d, n)  # noqa: E731
    make_image(p("a.img"), MiB, data=[(0, RAND_1M)])
    make_image(p("a_copy.img"), MiB, data=[(0, RAND_1M)])
    for off in FLIP_OFFSETS:
        make_image(p("flip_%d.img" % off), MiB, data=[(0, flipped(RAND_1M, [off]))])
    make_image(p("flip_multi.img"), MiB,
               data=[(0, flipped(RAND_1M, [700000, 300001, 900000]))])
    # different sizes
    make_image(p("a_2m_hole.img"), 2 * MiB, data=[(0, RAND_1M)])
    make_image(p("a_2m_zeros.img"), 2 * MiB, data=[(0, RAND_1M)],
               zeros=[(MiB, MiB)])
    make_image(p("a_2m_data.img"), 2 * MiB,
               data=[(0, RAND_1M), (1500000, b"y")])
    make_image(p("a_1m_plus_1_zero.img"), MiB + 1, data=[(0, RAND_1M)],
               zeros=[(MiB, 1)])
    make_image(p("a_1m_plus_1_data.img"), MiB + 1, data=[(0, RAND_1M + b"z")])
    make_image(p("a_half.img"), MiB // 2, data=[(0, RAND_1M[:MiB // 2])])
    # sparse vs explicitly zeroed (same content)
    make_image(p("sparse.img"), MiB, data=[(8192, b"x" * 100)])
    make_image(p("sparse_copy.img"), MiB, data=[(8192, b"x" * 100)])
    make_image(p("zeroed.img"), MiB, zeros=[(0, MiB)], data=[(8192, b"x" * 100)])
    make_image(p("sparse_diff.img"), MiB, data=[(8192, b"x" * 99 + b"Y")])
    make_image(p("all_hole.img"), MiB)
    make_image(p("all_zero.img"), MiB, zeros=[(0, MiB)])
    # layouts that differ only in allocation
    make_image(p("hole1.img"), MiB,
               data=[(0, RAND_1M[:4096]), (8192, RAND_1M[8192:12288])])
    make_image(p("hole2.img"), MiB,
               data=[(0, RAND_1M[:4096]), (8192, RAND_1M[8192:12288])],
               zeros=[(4096, 4096)])
    make_image(p("half_data.img"), MiB, data=[(0, RAND_1M[:MiB // 2])])
    make_image(p("half_data_zeros.img"), MiB, data=[(0, RAND_1M[:MiB // 2])],
               zeros=[(MiB // 2, MiB // 2)])
    # unaligned sizes: virtual size is rounded up to 512
    r = rand_bytes(10000, "odd")
    make_image(p("s10000.img"), 10000, data=[(0, r)])
    make_image(p("s10000_copy.img"), 10000, data=[(0, r)])
    make_image(p("s10240_tail_data.img"), 10240, data=[(0, r), (10100, b"q")])
    make_image(p("s10240_tail_zero.img"), 10240, data=[(0, r)], zeros=[(10000, 240)])
    make_image(p("s10000_diff_9999.img"), 10000, data=[(0, r[:9999] + b"\x00")])
    make_image(p("s10001.img"), 10001, data=[(0, r + b"\x01")])
    # empty
    make_image(p("empty.img"), 0)
    make_image(p("empty2.img"), 0)
    # large sparse (> 4 GiB offsets, no disk cost)
    make_image(p("big5g.img"), 5 * GiB, data=[(4 * GiB + 12345, b"abc")])
    make_image(p("big5g_copy.img"), 5 * GiB, data=[(4 * GiB + 12345, b"abc")])
    make_image(p("big5g_diff.img"), 5 * GiB,
               data=[(4 * GiB + 12345, b"abc"), (4 * GiB + 3 * MiB + 1000, b"!")])
    os.mkdir(p("adir"))


# (name, argv after "compare", expected rc, expected stdout or None)
CASES = [
    ("identical", ["a.img", "a_copy.img"], 0, IDENTICAL),
    ("identical_self", ["a.img", "a.img"], 0, IDENTICAL),
    ("identical_strict", ["-s", "a.img", "a_copy.img"], 0, IDENTICAL),
    ("identical_fmt_both", ["-f", "raw", "-F", "raw", "a.img", "a_copy.img"], 0, IDENTICAL),
    ("identical_fmt_first", ["-f", "raw", "a.img", "a_copy.img"], 0, IDENTICAL),
    ("identical_fmt_second", ["-F", "raw", "a.img", "a_copy.img"], 0, IDENTICAL),
    ("identical_options_after", ["a.img", "a_copy.img", "-f", "raw", "-s"], 0, IDENTICAL),
    ("identical_T_none", ["-T", "none", "a.img", "a_copy.img"], 0, IDENTICAL),
    ("identical_T_writeback", ["-T", "writeback", "a.img", "a_copy.img"], 0, IDENTICAL),
    ("identical_U", ["-U", "a.img", "a_copy.img"], 0, IDENTICAL),
    ("quiet_identical", ["-q", "a.img", "a_copy.img"], 0, ""),
    ("quiet_differ", ["-q", "a.img", "flip_123457.img"], 1, ""),
    ("quiet_size", ["-q", "-s", "a.img", "a_2m_hole.img"], 1, ""),
    ("multi_diff_first_reported", ["a.img", "flip_multi.img"], 1, mismatch(299520)),
    # sizes
    ("size_hole_tail", ["a.img", "a_2m_hole.img"], 0, SIZE_WARN + IDENTICAL),
    ("size_hole_tail_rev", ["a_2m_hole.img", "a.img"], 0, SIZE_WARN + IDENTICAL),
    ("size_zero_tail", ["a.img", "a_2m_zeros.img"], 0, SIZE_WARN + IDENTICAL),
    ("size_zero_tail_rev", ["a_2m_zeros.img", "a.img"], 0, SIZE_WARN + IDENTICAL),
    ("size_data_tail", ["a.img", "a_2m_data.img"], 1, SIZE_WARN + mismatch(1499648)),
    ("size_data_tail_rev", ["a_2m_data.img", "a.img"], 1, SIZE_WARN + mismatch(1499648)),
    ("size_strict", ["-s", "a.img", "a_2m_hole.img"], 1, STRICT_SIZE),
    ("size_strict_rev", ["-s", "a_2m_hole.img", "a.img"], 1, STRICT_SIZE),
    ("size_strict_data", ["-s", "a.img", "a_2m_data.img"], 1, STRICT_SIZE),
    ("size_plus1_zero", ["a.img", "a_1m_plus_1_zero.img"], 0, SIZE_WARN + IDENTICAL),
    ("size_plus1_data", ["a.img", "a_1m_plus_1_data.img"], 1, SIZE_WARN + mismatch(MiB)),
    ("size_plus1_strict", ["-s", "a.img", "a_1m_plus_1_zero.img"], 1, STRICT_SIZE),
    ("size_half_prefix", ["a_half.img", "a.img"], 1, SIZE_WARN + mismatch(MiB // 2)),
    ("size_half_strict", ["-s", "a_half.img", "a.img"], 1, STRICT_SIZE),
    # sparse vs explicitly zeroed
    ("sparse_vs_zeroed", ["sparse.img", "zeroed.img"], 0, IDENTICAL),
    ("sparse_vs_zeroed_rev", ["zeroed.img", "sparse.img"], 0, IDENTICAL),
    ("sparse_vs_zeroed_strict", ["-s", "sparse.img", "zeroed.img"], 1, strict_status(0)),
    ("sparse_vs_sparse_strict", ["-s", "sparse.img", "sparse_copy.img"], 0, IDENTICAL),
    ("sparse_content_diff", ["sparse.img", "sparse_diff.img"], 1, mismatch(8192)),
    ("sparse_content_diff_strict", ["-s", "sparse.img", "sparse_diff.img"], 1, mismatch(8192)),
    ("hole_vs_zero", ["all_hole.img", "all_zero.img"], 0, IDENTICAL),
    ("hole_vs_zero_strict", ["-s", "all_hole.img", "all_zero.img"], 1, strict_status(0)),
    ("hole_vs_hole_strict", ["-s", "all_hole.img", "all_hole.img"], 0, IDENTICAL),
    ("hole_vs_data", ["all_hole.img", "sparse.img"], 1, mismatch(8192)),
    ("zero_vs_data", ["all_zero.img", "sparse.img"], 1, mismatch(8192)),
    # stdout is "Strict mode: Offset 4096 block status mismatch!" on file
    # systems with 4 KiB hole granularity (ext4, xfs, tmpfs)
    ("hole_layout_strict", ["-s", "hole1.img", "hole2.img"], 1, None),
    ("hole_layout", ["hole1.img", "hole2.img"], 0, IDENTICAL),
    # block status includes an "at EOF" bit: a data extent that reaches
    # EOF differs from one that does not, even at the same offset.
    ("strict_eof_flag", ["-s", "a.img", "half_data.img"], 1, strict_status(0)),
    ("strict_eof_flag2", ["-s", "half_data.img", "half_data_zeros.img"], 1, strict_status(0)),
    ("half_vs_full", ["a.img", "half_data.img"], 1, mismatch(MiB // 2)),
    ("half_vs_halfzeros", ["half_data.img", "half_data_zeros.img"], 0, IDENTICAL),
    ("strict_full_vs_halfzeros", ["-s", "a.img", "half_data_zeros.img"], 1, mismatch(MiB // 2)),
    # unaligned sizes (virtual size rounded up to 512; offsets not aligned)
    ("odd_identical", ["s10000.img", "s10000_copy.img"], 0, IDENTICAL),
    ("odd_identical_strict", ["-s", "s10000.img", "s10000_copy.img"], 0, IDENTICAL),
    ("odd_tail_data", ["s10000.img", "s10240_tail_data.img"], 1, mismatch(10000)),
    ("odd_tail_data_strict", ["-s", "s10000.img", "s10240_tail_data.img"], 1, strict_status(0)),
    ("odd_tail_zero", ["s10000.img", "s10240_tail_zero.img"], 0, IDENTICAL),
    ("odd_tail_zero_strict", ["-s", "s10000.img", "s10240_tail_zero.img"], 1, strict_status(0)),
    ("odd_last_byte", ["s10000.img", "s10000_diff_9999.img"], 1, mismatch(9728)),
    ("odd_10001_vs_10000", ["s10000.img", "s10001.img"], 1, mismatch(10000)),
    ("odd_10001_strict", ["-s", "s10000.img", "s10001.img"], 1, strict_status(10000)),
    # empty images
    ("empty_empty", ["empty.img", "empty2.img"], 0, IDENTICAL),
    ("empty_empty_strict", ["-s", "empty.img", "empty2.img"], 0, IDENTICAL),
    ("empty_vs_hole", ["empty.img", "all_hole.img"], 0, SIZE_WARN + IDENTICAL),
    ("empty_vs_data", ["empty.img", "a.img"], 1, SIZE_WARN + mismatch(0)),
    ("empty_vs_sparse", ["sparse.img", "empty.img"], 1, SIZE_WARN + mismatch(8192)),
    # > 4 GiB offsets
    ("big_identical", ["big5g.img", "big5g_copy.img"], 0, IDENTICAL),
    ("big_identical_strict", ["-s", "big5g.img", "big5g_copy.img"], 0, IDENTICAL),
    ("big_diff", ["big5g.img", "big5g_diff.img"], 1, mismatch(4 * GiB + 3 * MiB + 512)),
    ("big_diff_strict", ["-s", "big5g.img", "big5g_diff.img"], 1, None),
    # errors (exit 2)
    ("missing_first", ["nope.img", "a.img"], 2, ""),
    ("missing_second", ["a.img", "nope.img"], 2, ""),
    ("missing_both", ["nope1.img", "nope2.img"], 2, ""),
    ("directory", ["adir", "a.img"], 2, ""),
    ("not_a_dir", ["a.img/x", "a.img"], 2, ""),
    ("unknown_fmt_first", ["-f", "foo", "a.img", "a_copy.img"], 2, ""),
    ("unknown_fmt_second", ["-F", "foo", "a.img", "a_copy.img"], 2, ""),
    ("wrong_fmt_second", ["-F", "qcow2", "a.img", "a_copy.img"], 2, ""),
    ("bad_cache", ["-T", "foo", "a.img", "a_copy.img"], 2, ""),
    # usage errors (exit 1 -- qemu-img's error_exit())
    ("one_file", ["a.img"], 1, ""),
    ("three_files", ["a.img", "a_copy.img", "a.img"], 1, ""),
    ("no_files", [], 1, ""),
    ("unknown_option", ["--bogus", "a.img", "a_copy.img"], 1, ""),
    ("unknown_short_option", ["-z", "a.img", "a_copy.img"], 1, ""),
    ("missing_option_arg", ["a.img", "a_copy.img", "-f"], 1, ""),
]

for _off in FLIP_OFFSETS:
    CASES.append(("flip_%d" % _off, ["a.img", "flip_%d.img" % _off], 1,
                  mismatch(_off // 512 * 512)))
    CASES.append(("flip_%d_rev" % _off, ["flip_%d.img" % _off, "a.img"], 1,
                  mismatch(_off // 512 * 512)))
    CASES.append(("flip_%d_strict" % _off, ["-s", "a.img", "flip_%d.img" % _off], 1,
                  mismatch(_off // 512 * 512)))

# Expected stderr texts (after normalisation) for the error cases.
EXPECTED_STDERR = {
    "missing_first": "qemu-img: Could not open 'nope.img': Could not open 'nope.img': "
                     "No such file or directory\n",
    "directory": "qemu-img: Could not open 'adir': 'file' driver requires 'adir' to be "
                 "a regular file\n",
    "unknown_fmt_first": "qemu-img: Could not open 'a.img': Unknown driver 'foo'\n",
    "unknown_fmt_second": "qemu-img: Could not open 'a_copy.img': Unknown driver 'foo'\n",
    "bad_cache": "qemu-img: Invalid source cache option: foo\n",
    "one_file": "qemu-img: Expecting two image file names\n"
                "Try 'qemu-img --help' for more information\n",
    "unknown_option": "qemu-img: unrecognized option '--bogus'\n"
                      "Try 'qemu-img --help' for more information\n",
}

# Cases that are usage errors: exit 1, message on stderr, nothing on stdout.
USAGE_ERRORS = {"one_file", "three_files", "no_files", "unknown_option",
                "unknown_short_option", "missing_option_arg"}

PROGRESS_RE = re.compile(r"^\s*\(\d{1,3}\.\d{2}/100%\)$")


class CompareTest(InteropTestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="vblk-interop-compare-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        build_images(cls.dir)

    def _run(self, argv):
        before = tree_state(self.dir)
        v, q = both("compare", *argv, cwd=self.dir)
        self.assertUnchanged(before, tree_state(self.dir), "(compare %r)" % argv)
        return v, q

    def _check_case(self, name, argv, rc, stdout):
        skip_unless_formats(self, argv)
        v, q = self._run(argv)
        # Oracle sanity: our expectations are qemu-img's behaviour.
        self.assertEqual(q.rc, rc, "qemu-img: %r" % q)
        if stdout is not None:
            self.assertEqual(q.stdout, stdout, "qemu-img: %r" % q)
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, rc)
        if stdout is not None:
            self.assertEqual(v.stdout, stdout)
        if rc == 2 or name in EXPECTED_STDERR or name in USAGE_ERRORS:
            self.assertNotEqual(v.stderr, "", "an error must be reported on stderr")
        if name in EXPECTED_STDERR:
            self.assertEqual(norm_vblk_err(v.stderr), EXPECTED_STDERR[name])
        if name in USAGE_ERRORS:
            self.assertTrue(norm_vblk_err(v.stderr).startswith("qemu-img: "), v)
            self.assertTrue(norm_vblk_err(v.stderr).endswith(
                "\nTry 'qemu-img --help' for more information\n"), v)
        elif rc in (0, 1):
            self.assertEqual(v.stderr, "")

    # -p (progress) ---------------------------------------------------------
    def _check_progress(self, argv, rc, result_lines):
        v, q = self._run(["-p"] + argv)
        self.assertEqual(q.rc, rc, q)
        self.assertEqual(v.rc, rc, v)
        self.assertSameStderr(v, q)
        for r in (v, q):
            segs = [s for s in re.split(r"[\r\n]", r.stdout) if s.strip()]
            texts = [s for s in segs if not PROGRESS_RE.match(s)]
            progress = [s for s in segs if PROGRESS_RE.match(s)]
            self.assertEqual(texts, result_lines, "result lines of %r" % r)
            if result_lines:
                self.assertEqual(segs[-1], result_lines[-1], "last line of %r" % r)
                self.assertTrue(progress, "no progress output in %r" % r)
            self.assertTrue(r.stdout.endswith("\n"), r)

    def test_progress_identical(self):
        self._check_progress(["a.img", "a_copy.img"], 0, ["Images are identical."])

    def test_progress_differ(self):
        self._check_progress(["a.img", "flip_123457.img"], 1,
                             ["Content mismatch at offset 123392!"])

    def test_progress_size_mismatch(self):
        self._check_progress(["a.img", "a_2m_hole.img"], 0,
                             ["Warning: Image size mismatch!", "Images are identical."])

    def test_progress_strict(self):
        self._check_progress(["-s", "sparse.img", "zeroed.img"], 1,
                             ["Strict mode: Offset 0 block status mismatch!"])

    def test_progress_missing_file(self):
        v, q = self._run(["-p", "nope.img", "a.img"])
        self.assertEqual(q.rc, 2)
        self.assertSameResult(v, q)
        self.assertEqual(v.rc, 2)

    def test_progress_quiet_suppresses_progress(self):
        v, q = self._run(["-p", "-q", "a.img", "a_copy.img"])
        self.assertSameResult(v, q)
        self.assertEqual((v.rc, v.stdout), (0, ""))


def _make_case_test(name, argv, rc, stdout):
    def test(self):
        self._check_case(name, argv, rc, stdout)
    test.__doc__ = "compare %s" % " ".join(argv)
    return test


for _case in CASES:
    setattr(CompareTest, "test_case_" + _case[0], _make_case_test(*_case))


if __name__ == "__main__":
    unittest.main()
