#!/usr/bin/env python3
"""Interop: error handling on bad input, vblk vs qemu-img.

Each case is run by vblk and by qemu-img in two separate, identically
populated directories (relative file names, so messages are identical).
Checked:
  * exit code equals qemu-img's and is non-zero,
  * stdout equals qemu-img's,
  * stderr equals qemu-img's after program-name normalisation
    ("qemu-img: " / "Try 'qemu-img --help'"), and has the expected number
    of lines (one for plain error_report() failures),
  * the file system is unchanged (no file created, existing images keep
    size, sha256 and mtime) -- or, for the few cases where qemu-img does
    touch the file system on failure, changed in exactly the same way.

Also covers O_DIRECT (cache.direct=on / -t none) on tmpfs.
"""

import json
import os
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (skip_unless_formats, IS_ROOT, KiB, MiB, InteropTestCase, file_state,  # noqa: E402
                    make_image, make_tempdir, norm_qemu_err, norm_vblk_err, qemu,
                    rand_bytes, read_range, shm_dir, tree_state, vblk)

INVALID_SIZE = ("qemu-img: Invalid image size specified. You may use k, M, G, T, P or E "
                "suffixes for\n"
                "qemu-img: kilobytes, megabytes, gigabytes, terabytes, petabytes and "
                "exabytes.\n")
TRY_HELP = "Try 'qemu-img --help' for more information\n"


def populate(d):
    make_image(os.path.join(d, "exist.img"), 64 * KiB,
               data=[(0, rand_bytes(64 * KiB, "bad-input"))])
    make_image(os.path.join(d, "sparse.img"), MiB + 1, data=[(8192, b"data")])
    os.mkdir(os.path.join(d, "adir"))
    r = qemu("create", "-q", "-f", "qcow2", os.path.join(d, "q.qcow2"), "1M")
    assert r.rc == 0, r
    os.symlink("nowhere.img", os.path.join(d, "dangling.img"))
    os.symlink("loop2", os.path.join(d, "loop1"))
    os.symlink("loop1", os.path.join(d, "loop2"))


# Case flags
ONE_LINE = "one_line"      # stderr must be exactly one line
TWO_LINES = "two_lines"    # stderr must be exactly two lines
FS_ORACLE = "fs_oracle"    # qemu-img changes the FS: vblk must change it the same way
RC_ORACLE = "rc_oracle"    # do not insist on non-zero exit (platform dependent)

# (name, argv, flags, expected normalised stderr or None)
CASES = [
    # --- option values QEMU checks although it may not act on them -------
    ("qcow2_cache_clean_negative",
     ["info", "--image-opts", "driver=qcow2,file.filename=q.qcow2,cache-clean-interval=-5"], {ONE_LINE},
     "qemu-img: Could not open 'driver=qcow2,file.filename=q.qcow2,cache-clean-interval=-5': "
     "Cache clean interval too big\n"),
    ("qcow2_cache_clean_huge",
     ["info", "--image-opts", "driver=qcow2,file.filename=q.qcow2,cache-clean-interval=4294967296"], {ONE_LINE},
     None),
    ("qcow2_cache_clean_word",
     ["info", "--image-opts", "driver=qcow2,file.filename=q.qcow2,cache-clean-interval=soon"], {ONE_LINE},
     "qemu-img: Could not open 'driver=qcow2,file.filename=q.qcow2,cache-clean-interval=soon': "
     "Parameter 'cache-clean-interval' expects a number\n"),
    # --- missing / unopenable files --------------------------------------
    ("info_missing", ["info", "nope.img"], {ONE_LINE},
     "qemu-img: Could not open 'nope.img': Could not open 'nope.img': "
     "No such file or directory\n"),
    ("info_missing_fraw", ["info", "-f", "raw", "nope.img"], {ONE_LINE}, None),
    ("info_missing_json", ["info", "--output=json", "nope.img"], {ONE_LINE}, None),
    ("map_missing", ["map", "nope.img"], {ONE_LINE}, None),
    ("map_missing_json", ["map", "--output=json", "-f", "raw", "nope.img"], {ONE_LINE}, None),
    ("compare_missing", ["compare", "nope.img", "exist.img"], {ONE_LINE}, None),
    ("bench_missing", ["bench", "-c", "1", "nope.img"], {ONE_LINE}, None),
    ("bench_missing_write", ["bench", "-c", "1", "-w", "-f", "raw", "nope.img"], {ONE_LINE}, None),
    ("info_missing_dir", ["info", "nodir/x.img"], {ONE_LINE}, None),
    ("info_not_a_dir", ["info", "exist.img/x"], {ONE_LINE},
     "qemu-img: Could not open 'exist.img/x': Could not open 'exist.img/x': "
     "Not a directory\n"),
    ("map_not_a_dir", ["map", "exist.img/x"], {ONE_LINE}, None),
    ("info_directory", ["info", "adir"], {ONE_LINE},
     "qemu-img: Could not open 'adir': 'file' driver requires 'adir' to be a "
     "regular file\n"),
    ("info_directory_fraw", ["info", "-f", "raw", "adir"], {ONE_LINE}, None),
    ("map_directory", ["map", "adir"], {ONE_LINE}, None),
    ("compare_directory", ["compare", "exist.img", "adir"], {ONE_LINE}, None),
    ("bench_directory", ["bench", "-c", "1", "adir"], {ONE_LINE}, None),
    ("info_dangling_symlink", ["info", "dangling.img"], {ONE_LINE}, None),
    ("info_symlink_loop", ["info", "loop1"], {ONE_LINE},
     "qemu-img: Could not open 'loop1': Could not open 'loop1': "
     "Too many levels of symbolic links\n"),
    ("info_empty_name", ["info", ""], {ONE_LINE},
     "qemu-img: Could not open '': The 'file' block driver requires a file name\n"),
    ("map_empty_name", ["map", ""], {ONE_LINE}, None),
    ("info_name_too_long", ["info", "x" * 300], {ONE_LINE}, None),
    ("create_missing_dir", ["create", "-f", "raw", "nodir/new.img", "1M"], {ONE_LINE}, None),
    ("create_not_a_dir", ["create", "-f", "raw", "exist.img/new.img", "1M"], {ONE_LINE}, None),
    ("create_on_directory", ["create", "-f", "raw", "adir", "1M"], {ONE_LINE},
     "qemu-img: adir: Could not create 'adir': Is a directory\n"),
    # --- bad size strings (create) ---------------------------------------
    ("size_12Q", ["create", "-f", "raw", "new.img", "12Q"], {TWO_LINES}, INVALID_SIZE),
    ("size_12Q_existing", ["create", "-f", "raw", "exist.img", "12Q"], {TWO_LINES}, INVALID_SIZE),
    ("size_1.5.3", ["create", "-f", "raw", "new.img", "1.5.3"], {TWO_LINES}, INVALID_SIZE),
    ("size_empty", ["create", "-f", "raw", "new.img", ""], {TWO_LINES}, INVALID_SIZE),
    ("size_1e3", ["create", "-f", "raw", "new.img", "1e3"], {TWO_LINES}, INVALID_SIZE),
    ("size_1.5_no_suffix", ["create", "-f", "raw", "new.img", "1.5"], {TWO_LINES}, INVALID_SIZE),
    ("size_trailing_space", ["create", "-f", "raw", "new.img", "5 "], {TWO_LINES}, INVALID_SIZE),
    ("size_1kB", ["create", "-f", "raw", "new.img", "1kB"], {TWO_LINES}, INVALID_SIZE),
    ("size_0x", ["create", "-f", "raw", "new.img", "0x"], {TWO_LINES}, INVALID_SIZE),
    ("size_dot5k", ["create", "-f", "raw", "new.img", ".5k"], {TWO_LINES}, INVALID_SIZE),
    ("size_negative_after_ddash", ["create", "-f", "raw", "new.img", "--", "-5"],
     {TWO_LINES}, INVALID_SIZE),
    # "-5" is parsed by getopt as an (unknown) option
    ("size_negative", ["create", "-f", "raw", "new.img", "-5"], {TWO_LINES},
     "qemu-img: unrecognized option '-5'\n" + TRY_HELP),
    ("size_8E", ["create", "-f", "raw", "new.img", "8E"], {ONE_LINE},
     "qemu-img: Invalid image size specified. Must be between 0 and "
     "9223372036854775807.\n"),
    ("size_2_64", ["create", "-f", "raw", "new.img", "18446744073709551616"], {ONE_LINE}, None),
    ("size_missing", ["create", "-f", "raw", "new.img"], {ONE_LINE},
     "qemu-img: new.img: Image creation needs a size parameter\n"),
    # Size too large for the file system: qemu-img prints "Formatting" and
    # leaves an empty file behind (on ext4); elsewhere it may even succeed.
    ("size_1P", ["create", "-f", "raw", "new.img", "1P"], {FS_ORACLE, RC_ORACLE}, None),
    # --- unknown format ----------------------------------------------------
    ("create_fmt_foo", ["create", "-f", "foo", "new.img", "1M"], {ONE_LINE},
     "qemu-img: new.img: Unknown file format 'foo'\n"),
    ("create_fmt_foo_existing", ["create", "-f", "foo", "exist.img", "1M"], {ONE_LINE}, None),
    ("info_fmt_foo", ["info", "-f", "foo", "exist.img"], {ONE_LINE},
     "qemu-img: Could not open 'exist.img': Unknown driver 'foo'\n"),
    ("info_fmt_foo_missing", ["info", "-f", "foo", "nope.img"], {ONE_LINE},
     "qemu-img: Could not open 'nope.img': Unknown driver 'foo'\n"),
    ("map_fmt_foo", ["map", "-f", "foo", "exist.img"], {ONE_LINE}, None),
    ("map_fmt_foo_json", ["map", "--output=json", "-f", "foo", "exist.img"], {ONE_LINE}, None),
    ("compare_fmt_foo", ["compare", "-f", "foo", "exist.img", "sparse.img"], {ONE_LINE}, None),
    ("compare_Fmt_foo", ["compare", "-F", "foo", "exist.img", "sparse.img"], {ONE_LINE},
     "qemu-img: Could not open 'sparse.img': Unknown driver 'foo'\n"),
    ("bench_fmt_foo", ["bench", "-c", "1", "-f", "foo", "exist.img"], {ONE_LINE}, None),
    ("info_fmt_qcow2_on_raw", ["info", "-f", "qcow2", "exist.img"], {ONE_LINE},
     "qemu-img: Could not open 'exist.img': Image is not in qcow2 format\n"),
    ("map_fmt_qcow2_on_raw", ["map", "-f", "qcow2", "exist.img"], {ONE_LINE}, None),
    # --- bad -o options (create) ------------------------------------------
    ("create_o_unknown", ["create", "-f", "raw", "-o", "foo=bar", "new.img", "1M"], {ONE_LINE},
     "qemu-img: new.img: Invalid parameter 'foo'\n"),
    ("create_o_unknown_existing", ["create", "-f", "raw", "-o", "foo=bar", "exist.img", "1M"],
     {ONE_LINE}, None),
    ("create_o_backing_file", ["create", "-f", "raw", "-o", "backing_file=x", "new.img", "1M"],
     {ONE_LINE}, None),
    ("create_o_prealloc_bogus", ["create", "-f", "raw", "-o", "preallocation=bogus",
                                 "new.img", "1M"], {ONE_LINE},
     "qemu-img: new.img: invalid parameter value: bogus\n"),
    ("create_o_prealloc_bogus_existing", ["create", "-f", "raw", "-o", "preallocation=bogus",
                                          "exist.img", "1M"], {ONE_LINE}, None),
    ("create_o_prealloc_novalue", ["create", "-f", "raw", "-o", "preallocation",
                                   "new.img", "1M"], {ONE_LINE}, None),
    ("create_o_nocow_bad_bool", ["create", "-f", "raw", "-o", "nocow=maybe", "new.img", "1M"],
     {ONE_LINE}, "qemu-img: new.img: Parameter 'nocow' expects 'on' or 'off'\n"),
    ("create_o_empty", ["create", "-f", "raw", "-o", "", "new.img", "1M"], {ONE_LINE},
     "qemu-img: Invalid option list: \n"),
    ("create_o_size_twice", ["create", "-f", "raw", "-o", "size=1M", "new.img", "1M"],
     {ONE_LINE}, "qemu-img: new.img: The image size must be specified only once\n"),
    # three lines, and only the first one carries the program-name prefix
    ("create_o_size_bad", ["create", "-f", "raw", "-o", "size=12Q", "new.img"], set(),
     "qemu-img: new.img: Parameter 'size' expects a non-negative number below 2^64\n"
     "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"
     "and exabytes, respectively.\n"),
    # preallocation=metadata is accepted by the option parser, then rejected
    # by the raw driver *after* the file was created/truncated.
    ("create_o_prealloc_metadata", ["create", "-f", "raw", "-o", "preallocation=metadata",
                                    "new.img", "1M"], {ONE_LINE, FS_ORACLE},
     "qemu-img: new.img: Unsupported preallocation mode: metadata\n"),
    ("create_o_prealloc_metadata_existing", ["create", "-f", "raw", "-o",
                                             "preallocation=metadata", "exist.img", "1M"],
     {ONE_LINE, FS_ORACLE}, None),
    # --- unknown command-line options / usage errors ----------------------
    ("create_unknown_long", ["create", "--bogus", "-f", "raw", "new.img", "1M"], {TWO_LINES},
     "qemu-img: unrecognized option '--bogus'\n" + TRY_HELP),
    ("create_unknown_short", ["create", "-x", "-f", "raw", "new.img", "1M"], {TWO_LINES},
     "qemu-img: unrecognized option '-x'\n" + TRY_HELP),
    ("create_unknown_existing", ["create", "--bogus", "-f", "raw", "exist.img", "1M"],
     {TWO_LINES}, None),
    ("create_no_args", ["create"], {TWO_LINES},
     "qemu-img: Expecting image file name\n" + TRY_HELP),
    ("create_extra_arg", ["create", "-f", "raw", "new.img", "1M", "extra"], {TWO_LINES},
     "qemu-img: Unexpected argument: extra\n" + TRY_HELP),
    ("create_missing_optarg", ["create", "new.img", "1M", "-f"], {TWO_LINES},
     "qemu-img: missing argument for option '-f'\n" + TRY_HELP),
    ("info_unknown_long", ["info", "--bogus", "exist.img"], {TWO_LINES}, None),
    ("info_unknown_short", ["info", "-z", "exist.img"], {TWO_LINES}, None),
    ("info_no_file", ["info"], {TWO_LINES},
     "qemu-img: Expecting one image file name\n" + TRY_HELP),
    ("info_two_files", ["info", "exist.img", "sparse.img"], {TWO_LINES}, None),
    ("info_missing_optarg", ["info", "exist.img", "-f"], {TWO_LINES}, None),
    ("map_unknown_long", ["map", "--bogus", "exist.img"], {TWO_LINES}, None),
    ("map_unknown_short", ["map", "-z", "exist.img"], {TWO_LINES}, None),
    ("map_no_file", ["map"], {TWO_LINES}, None),
    ("map_two_files", ["map", "exist.img", "sparse.img"], {TWO_LINES}, None),
    ("compare_unknown_long", ["compare", "--bogus", "exist.img", "exist.img"], {TWO_LINES}, None),
    ("bench_unknown_long", ["bench", "--bogus", "exist.img"], {TWO_LINES}, None),
    ("bench_unknown_short", ["bench", "-z", "exist.img"], {TWO_LINES}, None),
    ("bench_no_file", ["bench"], {TWO_LINES}, None),
    ("toplevel_unknown_option", ["--bogus", "info", "exist.img"], {TWO_LINES},
     "qemu-img: unrecognized option '--bogus'\n" + TRY_HELP),
    ("toplevel_unknown_command", ["frobnicate", "exist.img"], {TWO_LINES},
     "qemu-img: Command not found: frobnicate\n" + TRY_HELP),
    ("toplevel_no_args", [], {TWO_LINES},
     "qemu-img: Not enough arguments\n" + TRY_HELP),
    # --- --output ---------------------------------------------------------
    ("info_output_xml", ["info", "--output=xml", "exist.img"], {ONE_LINE},
     "qemu-img: --output must be used with human or json as argument.\n"),
    ("info_output_xml_missing_file", ["info", "--output=xml", "nope.img"], {ONE_LINE}, None),
    ("info_output_uppercase", ["info", "--output=JSON", "exist.img"], {ONE_LINE}, None),
    ("info_output_empty", ["info", "--output=", "exist.img"], {ONE_LINE}, None),
    ("map_output_xml", ["map", "--output=xml", "exist.img"], {ONE_LINE},
     "qemu-img: --output must be used with human or json as argument.\n"),
    ("map_output_xml_fraw", ["map", "-f", "raw", "--output=xml", "exist.img"], {ONE_LINE}, None),
    # "--output FILE" swallows the file name -> usage error, not a format error
    ("info_output_swallows_name", ["info", "--output", "exist.img"], {TWO_LINES},
     "qemu-img: Expecting one image file name\n" + TRY_HELP),
    ("info_output_xml_no_file", ["info", "--output=xml"], {TWO_LINES}, None),
]


class BadInputTest(InteropTestCase):

    def _run_case(self, name, argv, flags, expected_err):
        dv = self.subdir("v")
        dq = self.subdir("q")
        populate(dv)
        populate(dq)
        before_v = tree_state(dv)
        before_q = tree_state(dq)
        v = vblk(*argv, cwd=dv)
        q = qemu(*argv, cwd=dq)
        after_v = tree_state(dv)
        after_q = tree_state(dq)

        if RC_ORACLE not in flags:
            self.assertNotEqual(q.rc, 0, "oracle unexpectedly succeeded: %r" % q)
            self.assertNotEqual(v.rc, 0, "vblk must fail: %r" % v)
        self.assertSameResult(v, q)

        ev, eq = norm_vblk_err(v.stderr), norm_qemu_err(q.stderr)
        if expected_err is not None:
            self.assertEqual(eq, expected_err, "oracle stderr: %r" % q)
            self.assertEqual(ev, expected_err)
        if ONE_LINE in flags:
            self.assertEqual(len(eq.splitlines()), 1, q)
            self.assertEqual(len(ev.splitlines()), 1, v)
            self.assertTrue(ev.endswith("\n"))
        if TWO_LINES in flags:
            self.assertEqual(len(eq.splitlines()), 2, q)
            self.assertEqual(len(ev.splitlines()), 2, v)
        if v.rc != 0 and RC_ORACLE not in flags:
            self.assertTrue(ev.startswith("qemu-img: "),
                            "errors must be prefixed with the program name: %r" % v)

        if FS_ORACLE in flags:
            # qemu-img itself modifies the file system here; vblk must leave
            # it in the same state (contents/sizes/modes; mtimes differ).
            strip = lambda snap: {k: s[:4] for k, s in snap.items()}  # noqa: E731
            self.assertEqual(strip(after_v), strip(after_q),
                             "file system differs from qemu-img's after the command")
        else:
            self.assertUnchanged(before_q, after_q, "by qemu-img (oracle) %r" % argv)
            self.assertUnchanged(before_v, after_v, "by vblk %r" % argv)
        return v, q

    def test_unreadable_file(self):
        if IS_ROOT:
            self.skipTest("running as root: chmod 000 does not prevent reading, "
                          "so the permission-denied case cannot be provoked")
        for argv in (["info", "locked.img"], ["map", "locked.img"],
                     ["compare", "locked.img", "exist.img"],
                     ["bench", "-c", "1", "locked.img"]):
            with self.subTest(argv=argv):
                dv = make_tempdir(self)
                dq = make_tempdir(self)
                for d in (dv, dq):
                    populate(d)
                    make_image(os.path.join(d, "locked.img"), 4096, data=[(0, b"x")])
                    os.chmod(os.path.join(d, "locked.img"), 0)
                    self.addCleanup(os.chmod, os.path.join(d, "locked.img"), 0o644)
                bv, bq = tree_state(dv), tree_state(dq)
                v = vblk(*argv, cwd=dv)
                q = qemu(*argv, cwd=dq)
                self.assertNotEqual(q.rc, 0, q)
                self.assertSameResult(v, q)
                self.assertIn("Permission denied", norm_vblk_err(v.stderr))
                self.assertEqual(len(v.stderr.splitlines()), 1, v)
                self.assertUnchanged(bv, tree_state(dv))
                self.assertUnchanged(bq, tree_state(dq))

    def test_unwritable_create_target(self):
        if IS_ROOT:
            self.skipTest("running as root: a read-only directory does not prevent "
                          "file creation")
        dv = make_tempdir(self)
        dq = make_tempdir(self)
        for d in (dv, dq):
            os.mkdir(os.path.join(d, "ro"))
            os.chmod(os.path.join(d, "ro"), 0o555)
            self.addCleanup(os.chmod, os.path.join(d, "ro"), 0o755)
        v = vblk("create", "-f", "raw", "ro/new.img", "1M", cwd=dv)
        q = qemu("create", "-f", "raw", "ro/new.img", "1M", cwd=dq)
        self.assertNotEqual(q.rc, 0)
        self.assertSameResult(v, q)
        self.assertFalse(os.path.exists(os.path.join(dv, "ro", "new.img")))


def _make_case(name, argv, flags, err):
    def test(self):
        skip_unless_formats(self, argv)
        self._run_case(name, argv, flags, err)
    test.__doc__ = " ".join(argv)
    return test


for _c in CASES:
    setattr(BadInputTest, "test_" + _c[0].replace(".", "_"), _make_case(*_c))


class ODirectTest(InteropTestCase):
    """O_DIRECT (cache.direct=on / -t none), preferably on tmpfs.

    Older kernels reject O_DIRECT on tmpfs (EINVAL), newer ones accept it;
    vblk must do whatever qemu-img does on the running system."""

    def setUp(self):
        super().setUp()
        base = shm_dir()
        if base is None:
            self.skipTest("no tmpfs (/dev/shm) available")
        self.shm = make_tempdir(self, base=base)
        self.img = os.path.join(self.shm, "t.img")
        make_image(self.img, MiB + 10000 - 1,
                   data=[(0, rand_bytes(10000, "odirect")), (MiB, b"tail")])
        self.odd = os.path.join(self.shm, "odd.img")
        make_image(self.odd, 10000, data=[(0, rand_bytes(10000, "odd"))])

    def _both(self, *argv):
        states = {p: file_state(p) for p in (self.img, self.odd)}
        v = vblk(*argv, cwd=self.shm)
        q = qemu(*argv, cwd=self.shm)
        for p, st in states.items():
            self.assertUnchanged(st, file_state(p), "(%s)" % p)
        self.assertSameResult(v, q)
        return v, q

    def test_info_image_opts_file_direct(self):
        for out in ([], ["--output=json"]):
            for name in ("t.img", "odd.img"):
                with self.subTest(out=out, name=name):
                    v, q = self._both("info", *out, "--image-opts",
                                      "driver=file,filename=%s,cache.direct=on" % name)
                    if q.rc == 0 and out:
                        self.assertEqual(json.loads(v.stdout), json.loads(q.stdout))
                        self.assertEqual(json.loads(v.stdout)["format"], "file")
                    if q.rc != 0:
                        self.assertEqual(len(norm_vblk_err(v.stderr).splitlines()), 1)

    def test_info_image_opts_raw_direct(self):
        for out in ([], ["--output=json"]):
            with self.subTest(out=out):
                self._both("info", *out, "--image-opts",
                           "driver=raw,file.driver=file,file.filename=t.img,cache.direct=on")

    def test_info_image_opts_absolute(self):
        self._both("info", "--output=json", "--image-opts",
                   "driver=file,filename=%s,cache.direct=on" % self.img)

    def test_info_image_opts_cache_direct_off(self):
        self._both("info", "--image-opts", "driver=file,filename=t.img,cache.direct=off")

    def test_map_image_opts_direct(self):
        # With O_DIRECT the request alignment is >1, which changes how a
        # partial last sector is reported.
        for out in ([], ["--output=json"]):
            for name in ("t.img", "odd.img"):
                with self.subTest(out=out, name=name):
                    self._both("map", *out, "--image-opts",
                               "driver=file,filename=%s,cache.direct=on" % name)

    def test_image_opts_missing_file(self):
        v, q = self._both("info", "--image-opts",
                          "driver=file,filename=nope.img,cache.direct=on")
        self.assertNotEqual(v.rc, 0)
        self.assertEqual(len(norm_vblk_err(v.stderr).splitlines()), 1)

    def test_bench_t_none_read(self):
        for extra in ([], ["-s", "512"], ["-s", "100", "-o", "7"], ["-i", "native"],
                      ["-n"]):
            with self.subTest(extra=extra):
                argv = ["bench", "-c", "16", "-d", "4", "-t", "none"] + extra + ["t.img"]
                v = vblk(*argv, cwd=self.shm)
                q = qemu(*argv, cwd=self.shm)
                self.assertEqual(v.rc, q.rc, "%r\n%r" % (v, q))
                self.assertEqual(norm_vblk_err(v.stderr), norm_qemu_err(q.stderr))
                self.assertEqual(v.stdout.splitlines()[:1], q.stdout.splitlines()[:1])

    def test_bench_t_none_write(self):
        argv = ["bench", "-c", "16", "-d", "4", "-t", "none", "-w", "-f", "raw",
                "--pattern=0x5a", "-o", "8192", "t.img"]
        original = read_range(self.img, 0, MiB + 10000)
        v = vblk(*argv, cwd=self.shm)
        after_v = read_range(self.img, 0, MiB + 10000)
        make_image(self.img, MiB + 10000 - 1, data=[(0, original[:MiB + 9999])])
        q = qemu(*argv, cwd=self.shm)
        after_q = read_range(self.img, 0, MiB + 10000)
        self.assertEqual(v.rc, q.rc, "%r\n%r" % (v, q))
        self.assertEqual(norm_vblk_err(v.stderr), norm_qemu_err(q.stderr))
        self.assertEqual(v.stdout.splitlines()[:1], q.stdout.splitlines()[:1])
        self.assertEqual(after_v, after_q, "image contents differ after bench -w")
        if q.rc == 0:
            self.assertEqual(after_v[8192:8192 + 16 * 4096], b"\x5a" * (16 * 4096))
            self.assertEqual(after_v[:8192], original[:8192])
            self.assertEqual(after_v[8192 + 16 * 4096:], original[8192 + 16 * 4096:])


if __name__ == "__main__":
    unittest.main()
