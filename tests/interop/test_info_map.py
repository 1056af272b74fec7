#!/usr/bin/env python3
"""Interop: `info`, `map` and `create` on raw images, vblk vs qemu-img.

For a catalogue of raw images (empty, random, sparse with holes at odd
offsets, sizes that are not multiples of 4 KiB or 512 B, explicitly
written zeros, fallocated ranges, a >4 GiB sparse image, awkward file
names) this checks that

    info [--output=json|human] [-f raw] IMG
    map  [--output=json|human] [-f raw] IMG

produce exactly qemu-img's exit code, stdout (byte-exact *and*, for
JSON, structurally equal) and stderr, and that the image is untouched.

`create -f raw` is checked for stdout ("Formatting ..."), exit code and
the resulting file (size, content, allocation as seen by qemu-img map /
info) for size suffixes, odd sizes and -o preallocation=off|falloc|full.
"""

import json
import os
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

import shutil  # noqa: E402
import tempfile  # noqa: E402

from common import (KiB, MiB, GiB, InteropTestCase, both, file_state,  # noqa: E402
                    make_image, make_tempdir, qemu, rand_bytes, vblk)

MAP_HUMAN_HEADER = "Offset          Length          Mapped to       File"


def round_up(n, a):
    return (n + a - 1) // a * a


# ---------------------------------------------------------------------------
# Image catalogue.  Each builder gets a directory and returns the path
# (relative to that directory) to pass on the command line, plus the raw
# file size.
# ---------------------------------------------------------------------------

def _img_created_by_vblk(d):
    r = vblk("create", "-f", "raw", "created_vblk.img", "1M", cwd=d)
    if r.rc != 0 or not os.path.isfile(os.path.join(d, "created_vblk.img")):
        # Fall back so the info/map tests still exercise something; the
        # create tests below report the create failure itself.
        make_image(os.path.join(d, "created_vblk.img"), MiB)
    return "created_vblk.img"


def _img_created_by_qemu(d):
    r = qemu("create", "-f", "raw", "created_qemu.img", "1M", cwd=d)
    assert r.rc == 0, r
    return "created_qemu.img"


def _img_created_by_vblk_odd(d):
    r = vblk("create", "-f", "raw", "created_vblk_odd.img", "10000", cwd=d)
    if r.rc != 0 or not os.path.isfile(os.path.join(d, "created_vblk_odd.img")):
        make_image(os.path.join(d, "created_vblk_odd.img"), 10240)
    return "created_vblk_odd.img"


def _simple(name, size, data=(), zeros=(), fallocs=()):
    def build(d):
        make_image(os.path.join(d, name), size, data=data, zeros=zeros,
                   fallocs=fallocs)
        return name
    return build


IMAGES = {
    # empty images
    "created_by_vblk": _img_created_by_vblk,
    "created_by_qemu": _img_created_by_qemu,
    "created_by_vblk_10000": _img_created_by_vblk_odd,
    "zero_length": _simple("zero_length.img", 0),
    "all_hole_3m": _simple("all_hole.img", 3 * MiB),
    "all_hole_odd_size": _simple("all_hole_odd.img", MiB + 1),
    # fully written random data
    "random_1m": _simple("random_1m.img", MiB, data=[(0, rand_bytes(MiB, 1))]),
    "random_3m": _simple("random_3m.img", 3 * MiB, data=[(0, rand_bytes(3 * MiB, 2))]),
    "random_10000": _simple("random_10000.img", 10000,
                            data=[(0, rand_bytes(10000, 3))]),
    "random_1m_plus_512": _simple("random_1m512.img", MiB + 512,
                                  data=[(0, rand_bytes(MiB + 512, 4))]),
    "random_1m_plus_1": _simple("random_1m1.img", MiB + 1,
                                data=[(0, rand_bytes(MiB + 1, 5))]),
    "random_1m_minus_1": _simple("random_1m_1.img", MiB - 1,
                                 data=[(0, rand_bytes(MiB - 1, 6))]),
    "random_1_byte": _simple("one.img", 1, data=[(0, b"\x5a")]),
    "random_511": _simple("r511.img", 511, data=[(0, rand_bytes(511, 7))]),
    "random_513": _simple("r513.img", 513, data=[(0, rand_bytes(513, 8))]),
    "random_4097": _simple("r4097.img", 4097, data=[(0, rand_bytes(4097, 9))]),
    # sparse images with data at odd offsets
    "sparse_odd": _simple(
        "sparse_odd.img", MiB + 1,
        data=[(4096 * 3 + 100, rand_bytes(5000, 10)),
              (200000 + 7, b"\x01"),
              (MiB, b"\x02")]),
    "sparse_hole_at_start": _simple(
        "hole_start.img", 2 * MiB, data=[(MiB + 1234, rand_bytes(4096, 11))]),
    "sparse_data_at_end_only": _simple(
        "data_end.img", MiB, data=[(MiB - 1, b"\xff")]),
    "sparse_alternating_4k": _simple(
        "alternating.img", 512 * KiB,
        data=[(i * 8192, rand_bytes(4096, 100 + i)) for i in range(64)]),
    "sparse_tail_hole_odd": _simple(
        "tail_hole.img", 3 * MiB + 777, data=[(0, rand_bytes(70000, 12))]),
    "sparse_10000_data_at_9000": _simple(
        "s10000.img", 10000, data=[(9000, b"abc")]),
    # explicitly written (allocated) zeros
    "zeros_written_1m": _simple("zeros.img", MiB, zeros=[(0, MiB)]),
    "zeros_written_odd": _simple("zeros_odd.img", 10000, zeros=[(0, 10000)]),
    "mixed_data_zero_hole": _simple(
        "mixed.img", MiB + 512,
        data=[(0, rand_bytes(64 * KiB, 13)), (256 * KiB, rand_bytes(4099, 14))],
        zeros=[(64 * KiB, 64 * KiB), (600 * KiB + 5, 3000)]),
    # preallocated, never written (unwritten extents)
    "fallocated_middle": _simple(
        "falloc.img", 2 * MiB, data=[(0, rand_bytes(4096, 15))],
        fallocs=[(64 * KiB, 512 * KiB)]),
    # beyond 4 GiB offsets (sparse, costs no disk space)
    "sparse_5g": _simple(
        "sparse_5g.img", 5 * GiB,
        data=[(3 * GiB + 4096, rand_bytes(8192, 16)), (5 * GiB - 10, b"end")]),
    # awkward file names
    "name_with_space_quote_utf8": _simple(
        'we ird "q" \\ \u00e9.img', 8192, data=[(4096, b"x" * 10)]),
    "name_with_tab": _simple("tab\there.img", 4096, data=[(0, b"t")]),
}

# Image paths given in other spellings (relative with ./, sub directory,
# absolute).  Value: (image key, function(dir, relpath) -> argument)
PATH_SPELLINGS = {
    "dot_slash": ("sparse_odd", lambda d, p: "./" + p),
    "absolute": ("sparse_odd", lambda d, p: os.path.join(d, p)),
    "double_slash": ("random_10000", lambda d, p: "." + "//" + p),
}

VARIANTS = {
    # name: (argv before the image, kind)
    "info_json": (["info", "--output=json"], "json"),
    "info_json_fraw": (["info", "--output=json", "-f", "raw"], "json"),
    "info_human": (["info"], "text"),
    "info_human_fraw": (["info", "-f", "raw"], "text"),
    "map_json": (["map", "--output=json"], "json"),
    "map_json_fraw": (["map", "-f", "raw", "--output=json"], "json"),
    "map_human": (["map"], "text"),
    "map_human_fraw": (["map", "-f", "raw"], "text"),
}


class InfoMapTest(InteropTestCase):
    """info/map on a shared, read-only catalogue of images."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="vblk-interop-infomap-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.paths = {}
        cls.sizes = {}
        for key, builder in IMAGES.items():
            rel = builder(cls.dir)
            cls.paths[key] = rel
            cls.sizes[key] = os.path.getsize(os.path.join(cls.dir, rel))

    def _check(self, key, argv_prefix, kind, arg=None):
        rel = self.paths[key]
        full = os.path.join(self.dir, rel)
        arg = rel if arg is None else arg
        before = file_state(full)
        v, q = both(*(argv_prefix + [arg]), cwd=self.dir)
        after = file_state(full)
        self.assertUnchanged(before, after, "(image %s modified)" % rel)

        # The oracle must succeed; so must vblk.
        self.assertEqual(q.rc, 0, "qemu-img failed unexpectedly: %r" % q)
        self.assertEqual(v.rc, 0, "vblk failed: %r" % v)
        self.assertSameStderr(v, q)
        if kind == "json":
            try:
                vj = json.loads(v.stdout)
            except ValueError as exc:
                self.fail("vblk printed invalid JSON (%s): %r" % (exc, v.stdout))
            qj = json.loads(q.stdout)
            self.assertEqual(vj, qj, "parsed JSON differs")
        # Byte-exact output (layout, key order, escaping, number format).
        self.assertSameStdout(v, q)
        return v, q

    def _concrete_checks(self, key, variant, v):
        """Properties that hold independently of the oracle."""
        size = self.sizes[key]
        vsize = round_up(size, 512)
        if variant.startswith("info_json"):
            j = json.loads(v.stdout)
            self.assertEqual(j["virtual-size"], vsize)
            self.assertEqual(j["format"], "raw")
            self.assertIs(j["dirty-flag"], False)
        elif variant.startswith("info_human"):
            lines = v.stdout.splitlines()
            self.assertEqual(lines[1], "file format: raw")
            self.assertTrue(lines[2].startswith("virtual size: "), lines)
            self.assertTrue(lines[2].endswith("(%d bytes)" % vsize), lines)
        elif variant.startswith("map_json"):
            j = json.loads(v.stdout)
            self.assertIsInstance(j, list)
            pos = 0
            for ent in j:
                self.assertEqual(ent["start"], pos)
                pos += ent["length"]
            self.assertEqual(pos, vsize)
        elif variant.startswith("map_human"):
            self.assertEqual(v.stdout.splitlines()[0], MAP_HUMAN_HEADER)

    # explicit --output spellings -------------------------------------------
    def test_output_human_explicit(self):
        for cmd in ("info", "map"):
            for spelling in (["--output=human"], ["--output", "human"],
                             ["--output=json", "--output=human"]):
                with self.subTest(cmd=cmd, spelling=spelling):
                    v, q = self._check("sparse_odd", [cmd] + spelling, "text")
                    self.assertFalse(v.stdout.lstrip().startswith(("{", "[")))

    def test_output_json_space_separated(self):
        for cmd in ("info", "map"):
            with self.subTest(cmd=cmd):
                self._check("mixed_data_zero_hole", [cmd, "--output", "json"], "json")

    def test_options_after_filename(self):
        rel = self.paths["sparse_odd"]
        for argv in (["info", rel, "--output=json"], ["map", rel, "-f", "raw"],
                     ["map", rel, "--output=json", "-f", "raw"]):
            with self.subTest(argv=argv):
                v, q = both(*argv, cwd=self.dir)
                self.assertEqual(q.rc, 0, q)
                self.assertSameResult(v, q)

    def test_zero_length_map_json_literal(self):
        # qemu-img reports one non-present 0-length extent for an empty image.
        v, q = self._check("zero_length", ["map", "--output=json"], "json")
        self.assertEqual(json.loads(v.stdout), [
            {"start": 0, "length": 0, "depth": 0, "present": False,
             "zero": False, "data": False}])

    def test_zero_length_map_human_header_only(self):
        v, q = self._check("zero_length", ["map"], "text")
        self.assertEqual(v.stdout, MAP_HUMAN_HEADER + "\n")

    def test_info_json_keys_in_order(self):
        v, q = self._check("random_10000", ["info", "--output=json"], "json")
        keys = list(json.loads(v.stdout).keys())
        self.assertEqual(keys, ["virtual-size", "filename", "format",
                                "actual-size", "dirty-flag"])

    def test_odd_size_rounds_virtual_size_to_512(self):
        v, q = self._check("random_10000", ["info", "--output=json"], "json")
        self.assertEqual(json.loads(v.stdout)["virtual-size"], 10240)
        v, q = self._check("random_1m_plus_1", ["map", "--output=json"], "json")
        j = json.loads(v.stdout)
        self.assertEqual(j[-1]["start"] + j[-1]["length"], MiB + 512)


def _make_variant_test(key, variant):
    argv_prefix, kind = VARIANTS[variant]

    def test(self):
        v, q = self._check(key, list(argv_prefix), kind)
        self._concrete_checks(key, variant, v)
    test.__doc__ = "%s on image %s" % (" ".join(argv_prefix), key)
    return test


def _make_spelling_test(spelling, variant):
    key, fn = PATH_SPELLINGS[spelling]
    argv_prefix, kind = VARIANTS[variant]

    def test(self):
        arg = fn(self.dir, self.paths[key])
        self._check(key, list(argv_prefix), kind, arg=arg)
    return test


for _key in IMAGES:
    for _variant in VARIANTS:
        setattr(InfoMapTest, "test_%s__%s" % (_variant, _key),
                _make_variant_test(_key, _variant))
for _sp in PATH_SPELLINGS:
    for _variant in VARIANTS:
        setattr(InfoMapTest, "test_%s__path_%s" % (_variant, _sp),
                _make_spelling_test(_sp, _variant))


# ---------------------------------------------------------------------------
# create
# ---------------------------------------------------------------------------

CREATE_SIZES = [
    # (size argument, expected byte size printed in "Formatting")
    ("0", 0), ("1", 1), ("511", 511), ("512", 512), ("513", 513),
    ("10000", 10000), ("1048575", MiB - 1), ("1048577", MiB + 1),
    ("1k", KiB), ("1K", KiB), ("64k", 64 * KiB), ("1M", MiB),
    ("1.5M", 3 * MiB // 2), ("2M", 2 * MiB), ("1.5k", 1536), ("1G", GiB),
    ("1T", 1024 * GiB), ("0x100", 256), ("100b", 100), ("100B", 100),
    ("010", 10), ("+5", 5), ("5.", 5), (" 5", 5), ("1.0000001k", 1024),
    ("0.5k", 512),
]

PREALLOC_SIZES = ["0", "1", "10000", "1M", "1048577", "3M"]


class CreateTest(InteropTestCase):
    """create -f raw: stdout, exit code and the resulting file."""

    def _create_both(self, args, name="c.img", setup=None):
        """Run `create ARGS` in two fresh identical directories."""
        dv = make_tempdir(self)
        dq = make_tempdir(self)
        if setup is not None:
            setup(dv)
            setup(dq)
        v = vblk("create", *args, cwd=dv)
        q = qemu("create", *args, cwd=dq)
        return v, q, dv, dq

    def _compare_images(self, dv, dq, name="c.img", contents=True):
        pv, pq = os.path.join(dv, name), os.path.join(dq, name)
        self.assertEqual(os.path.exists(pv), os.path.exists(pq),
                         "existence of %s differs" % name)
        if not os.path.exists(pq):
            return
        self.assertEqual(os.path.getsize(pv), os.path.getsize(pq), "file size differs")
        if contents:
            sv = file_state(pv, with_mtime=False)
            sq = file_state(pq, with_mtime=False)
            self.assertEqual(sv[2], sq[2], "file content differs")
        # Allocation as qemu-img (the oracle) sees it, for both files.
        arg = "./" + name  # names may start with '-'
        for argv in (["map", "--output=json", "-f", "raw", arg],
                     ["info", "--output=json", "-f", "raw", arg]):
            rv = qemu(*argv, cwd=dv)
            rq = qemu(*argv, cwd=dq)
            self.assertEqual(rq.rc, 0, rq)
            self.assertEqual(rv.rc, 0, rv)
            self.assertEqual(json.loads(rv.stdout), json.loads(rq.stdout),
                             "allocation of created file differs (%s)" % argv[0])

    def _check_create(self, args, expect_line=None, setup=None):
        v, q, dv, dq = self._create_both(args, setup=setup)
        self.assertSameResult(v, q)
        self.assertEqual(q.rc, 0, q)
        if expect_line is not None:
            self.assertEqual(v.stdout, expect_line + "\n")
        self._compare_images(dv, dq)
        return v, q, dv, dq

    def test_sizes(self):
        for arg, nbytes in CREATE_SIZES:
            with self.subTest(size=arg):
                self._check_create(
                    ["-f", "raw", "c.img", arg],
                    "Formatting 'c.img', fmt=raw size=%d" % nbytes)

    def test_file_size_rounded_up_to_512(self):
        # qemu-img rounds the raw file up to a multiple of 512 bytes but
        # prints the requested size.
        for arg, expect in (("10000", 10240), ("1", 512), ("1048577", MiB + 512)):
            with self.subTest(size=arg):
                v, q, dv, dq = self._check_create(["-f", "raw", "c.img", arg])
                self.assertEqual(os.path.getsize(os.path.join(dv, "c.img")), expect)

    def test_preallocation(self):
        for mode in ("off", "falloc", "full"):
            for size in PREALLOC_SIZES:
                with self.subTest(preallocation=mode, size=size):
                    v, q, dv, dq = self._check_create(
                        ["-f", "raw", "-o", "preallocation=" + mode, "c.img", size])
                    self.assertTrue(v.stdout.startswith("Formatting 'c.img', fmt=raw size="))
                    self.assertTrue(v.stdout.endswith(" preallocation=%s\n" % mode), v.stdout)

    def test_preallocation_full_is_allocated(self):
        v, q, dv, dq = self._check_create(
            ["-f", "raw", "-o", "preallocation=full", "c.img", "2M"])
        st = os.stat(os.path.join(dv, "c.img"))
        self.assertGreaterEqual(st.st_blocks * 512, 2 * MiB)

    def test_option_order_in_formatting_line(self):
        # The Formatting line lists options in qemu's fixed order, not in
        # the order given.
        for opts in (["-o", "extent_size_hint=1M,nocow=on,preallocation=off"],
                     ["-o", "preallocation=falloc", "-o", "nocow=off"],
                     ["-o", "nocow=on,preallocation=full"],
                     ["-o", "preallocation=off,nocow=on"]):
            with self.subTest(opts=opts):
                self._check_create(["-f", "raw"] + opts + ["c.img", "1M"])

    def test_size_via_o_option(self):
        for args in (["-f", "raw", "-o", "size=2M", "c.img"],
                     ["-f", "raw", "-o", "size=1k,size=2k", "c.img"],
                     ["-f", "raw", "-o", "size=10000,preallocation=full", "c.img"]):
            with self.subTest(args=args):
                self._check_create(args)

    def test_options_after_positionals(self):
        self._check_create(["-f", "raw", "c.img", "1M", "-o", "preallocation=full"],
                           "Formatting 'c.img', fmt=raw size=1048576 preallocation=full")

    def test_default_format_is_raw(self):
        self._check_create(["c.img", "1M"], "Formatting 'c.img', fmt=raw size=1048576")

    def test_quiet(self):
        v, q, dv, dq = self._check_create(["-q", "-f", "raw", "c.img", "1M"])
        self.assertEqual(v.stdout, "")

    def test_dash_dash_filename(self):
        v, q, dv, dq = self._create_both(["-f", "raw", "--", "-d.img", "64k"])
        self.assertSameResult(v, q)
        self.assertEqual(q.rc, 0, q)
        self._compare_images(dv, dq, name="-d.img")

    def test_overwrite_existing_file(self):
        def setup(d):
            make_image(os.path.join(d, "c.img"), 3 * MiB,
                       data=[(0, rand_bytes(3 * MiB, 42))])
        for extra in ([], ["-o", "preallocation=full"], ["-o", "preallocation=falloc"]):
            with self.subTest(extra=extra):
                self._check_create(["-f", "raw"] + extra + ["c.img", "1M"], setup=setup)

    def test_created_file_mode_and_content(self):
        v, q, dv, dq = self._check_create(["-f", "raw", "c.img", "64k"])
        with open(os.path.join(dv, "c.img"), "rb") as f:
            self.assertEqual(f.read(), b"\0" * (64 * KiB))
        self.assertEqual(file_state(os.path.join(dv, "c.img"))[3],
                         file_state(os.path.join(dq, "c.img"))[3], "file mode differs")

    def test_absolute_path(self):
        dv = make_tempdir(self)
        dq = make_tempdir(self)
        v = vblk("create", "-f", "raw", os.path.join(dv, "c.img"), "1M")
        q = qemu("create", "-f", "raw", os.path.join(dq, "c.img"), "1M")
        self.assertEqual(q.rc, 0, q)
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(v.stdout.replace(dv, "<DIR>"), q.stdout.replace(dq, "<DIR>"))
        self.assertEqual(v.stdout, "Formatting '%s', fmt=raw size=1048576\n"
                         % os.path.join(dv, "c.img"))
        self._compare_images(dv, dq)

    def test_create_then_info_map_roundtrip(self):
        # A vblk-created image must look the same to vblk and qemu-img.
        d = make_tempdir(self)
        for i, size in enumerate(("0", "10000", "1M", "1T")):
            name = "rt%d.img" % i
            r = vblk("create", "-f", "raw", name, size, cwd=d)
            self.assertEqual(r.rc, 0, r)
            for argv in (["info", "--output=json", name], ["info", name],
                         ["map", "--output=json", name], ["map", name]):
                with self.subTest(size=size, argv=argv):
                    v, q = both(*argv, cwd=d)
                    self.assertEqual(q.rc, 0, q)
                    self.assertSameResult(v, q)


class MapThroughFilterTest(InteropTestCase):
    """iotest 204: `map` of a filter (blkdebug) over a qcow2 image
    with a backing chain looks through the filter, as QEMU's
    bdrv_skip_filters: the backing file's extents are listed (depth 1)."""

    def test_filters_over_backing_chain(self):
        d = self.tmp
        base, top = os.path.join(d, "t.qcow2.base"), os.path.join(d, "t.qcow2")
        qio = shutil.which("qemu-io")
        if not qio:
            self.skipTest("needs qemu-io")
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", "-o", "cluster_size=1M", base, "128M").rc, 0)
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", "-o", "cluster_size=1M", "-b", base, "-F", "qcow2",
                              top).rc, 0)
        import subprocess
        for img, ops in ((base, ["write -P 11 0 128M"]),
                         (top, ["write -P 22 0 110M", "write -z 32M 32M", "discard 80000001 30M"])):
            argv = [qio, "-f", "qcow2"]
            for op in ops:
                argv += ["-c", op]
            r = subprocess.run(argv + [img], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r)
        nested = "image.driver=qcow2,image.file.driver=file,image.file.filename=" + top
        # (throttle would need --object throttle-group, which vblk's CLI
        # does not create yet; nested blkdebug stands for a filter chain.)
        specs = [
            ["--image-opts", "driver=blkdebug,%s,align=4k" % nested],
            ["--image-opts", "driver=blkdebug,%s" % nested],
            ["--image-opts", "driver=blkdebug,image.driver=blkdebug,image.image.driver=qcow2,"
             "image.image.file.driver=file,image.image.file.filename=" + top],
        ]
        for spec in specs:
            for out in ("human", "json"):
                with self.subTest(spec=spec, out=out):
                    before = file_state(top)
                    v, q = both("map", "--output=" + out, *spec, cwd=d)
                    self.assertEqual(q.rc, 0, q)
                    self.assertIn("t.qcow2.base" if out == "human" else '"depth": 1', q.stdout)
                    self.assertSameResult(v, q)
                    self.assertUnchanged(before, file_state(top))


if __name__ == "__main__":
    unittest.main()
