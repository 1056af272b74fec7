#!/usr/bin/env python3
"""Interop: `rebase` and `commit`, vblk beside qemu-img 7.2.

Every case builds the same qcow2 chain twice (base <- mid <- top, plus a
stand-alone nb.qcow2 and a short one), with relative backing names, in two
directories, runs qemu-img in one and vblk in the other with the same
arguments, and asserts:
  - the same exit code, stdout and stderr (program name normalised);
  - every image reads the same as QEMU's result (`qemu-img compare` across
    the directories: each chain reads its own files), and each layer
    allocates the same ranges as QEMU's (`qemu-img map` of the layer alone);
  - `qemu-img check` clean, and `qemu-img info`'s backing fields equal.

Hostile cases: a typo in -b, no -b, -u with a backing file that does not
exist, -F missing (vblk refuses before writing anything; QEMU copies first
and refuses at the header), a raw image, and images held by another process
(qemu-io, `vblk io`, `vblk nbd`): refused with QEMU's lock message and the
image unchanged byte for byte.

Sanity check for the suite itself: ``VBLK=$(which qemu-img)`` passes every
test but the -c one (7.2 has no rebase -c) and the ones that hold vblk's
own refusal before writing to account (they say so).
"""

import json
import os
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (VBLK, QEMU_IMG, InteropTestCase, file_state, lock_bytes,  # noqa: E402
                    norm_qemu_err, norm_vblk_err, run)

QEMU_IO = shutil.which("qemu-io")
IDENTICAL = "Images are identical.\n"
IS_QEMU = os.path.basename(VBLK) == "qemu-img"


def qemu_io(d, img, *cmds):
    argv = [QEMU_IO, "-f", "qcow2"]
    for c in cmds:
        argv += ["-c", c]
    r = run(argv + [img], cwd=d)
    assert r.rc == 0 and "error" not in r.stdout.lower(), r


def img(d, *args):
    r = run([QEMU_IMG] + list(args), cwd=d)
    assert r.rc == 0, r
    return r


def make_chain(d):
    """base (4M) <- mid <- top, nb.qcow2 (2M, some of base's data), and
    short.qcow2 (1M) beside them; data in every layer, zeroes in mid."""
    os.makedirs(d, exist_ok=True)
    img(d, "create", "-q", "-f", "qcow2", "base.qcow2", "4M")
    qemu_io(d, "base.qcow2", "write -P 1 0 3M", "write -P 5 3584k 512k")
    img(d, "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "mid.qcow2")
    qemu_io(d, "mid.qcow2", "write -P 2 1M 1M", "write -z 3M 64k")
    img(d, "create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", "top.qcow2")
    qemu_io(d, "top.qcow2", "write -P 3 0 64k", "write -P 4 2500k 7k")
    img(d, "create", "-q", "-f", "qcow2", "nb.qcow2", "2M")
    qemu_io(d, "nb.qcow2", "write -P 1 0 1M", "write -P 9 1M 512")
    img(d, "create", "-q", "-f", "qcow2", "short.qcow2", "1M")
    qemu_io(d, "short.qcow2", "write -P 2 0 1M")


def layer_map(d, name):
    """The layer's own allocation (its backing file left closed), offsets in
    the file left out."""
    spec = json.dumps({"driver": "qcow2", "file": {"driver": "file", "filename": name}, "backing": None})
    r = run([QEMU_IMG, "map", "--output=json", "json:" + spec], cwd=d)
    assert r.rc == 0, r
    return [{k: v for k, v in e.items() if k != "offset"} for e in json.loads(r.stdout)]


def backing_fields(d, name):
    r = run([QEMU_IMG, "info", "-U", "--output=json", name], cwd=d)
    assert r.rc == 0, r
    info = json.loads(r.stdout)
    return info.get("backing-filename"), info.get("backing-filename-format")


class ChainCase(InteropTestCase):
    """Runs one command in a QEMU directory and a vblk directory."""

    LAYERS = ("top.qcow2", "mid.qcow2", "base.qcow2", "nb.qcow2")

    def setUp(self):
        super().setUp()
        if not QEMU_IO:
            self.skipTest("needs qemu-io")
        self.q = os.path.join(self.tmp, "q")
        self.v = os.path.join(self.tmp, "v")
        make_chain(self.q)
        make_chain(self.v)

    def both(self, *args):
        v = run([VBLK] + list(args), cwd=self.v)
        q = run([QEMU_IMG] + list(args), cwd=self.q)
        return v, q

    def assertSameImages(self, layers=LAYERS):
        for name in layers:
            with self.subTest(image=name):
                r = run([QEMU_IMG, "compare", "-U", os.path.join(self.q, name), os.path.join(self.v, name)])
                self.assertEqual((r.rc, r.stdout), (0, IDENTICAL), r)
                self.assertEqual(layer_map(self.v, name), layer_map(self.q, name))
                self.assertEqual(backing_fields(self.v, name), backing_fields(self.q, name))
                c = run([QEMU_IMG, "check", name], cwd=self.v)
                self.assertEqual(c.rc, 0, c)

    def assertSameRun(self, *args, stdout=True):
        v, q = self.both(*args)
        self.assertSameRc(v, q)
        if stdout:
            self.assertSameStdout(v, q)
        self.assertSameStderr(v, q)
        return v, q

    def states(self, d):
        return {n: file_state(os.path.join(d, n), with_mtime=False) for n in self.LAYERS}


class RebaseTest(ChainCase):

    def test_safe_rebase_onto_another_image(self):
        v, q = self.assertSameRun("rebase", "-b", "nb.qcow2", "-F", "qcow2", "top.qcow2")
        self.assertEqual(v.rc, 0, v)
        self.assertSameImages()
        self.assertEqual(backing_fields(self.v, "top.qcow2"), ("nb.qcow2", "qcow2"))

    def test_safe_rebase_onto_a_node_of_the_old_chain(self):
        for target in ("base.qcow2", "mid.qcow2"):
            with self.subTest(target=target):
                make_chain(self.q)
                make_chain(self.v)
                v, _ = self.assertSameRun("rebase", "-b", target, "-F", "qcow2", "top.qcow2")
                self.assertEqual(v.rc, 0, v)
                self.assertSameImages()

    def test_safe_rebase_to_no_backing_copies_everything(self):
        v, _ = self.assertSameRun("rebase", "-b", "", "top.qcow2")
        self.assertEqual(v.rc, 0, v)
        self.assertSameImages()
        self.assertEqual(backing_fields(self.v, "top.qcow2"), (None, None))

    def test_safe_rebase_onto_a_shorter_image_and_as_raw(self):
        for args in (["-b", "short.qcow2", "-F", "qcow2"], ["-b", "nb.qcow2", "-F", "raw"]):
            with self.subTest(args=args):
                make_chain(self.q)
                make_chain(self.v)
                v, _ = self.assertSameRun("rebase", *args, "top.qcow2")
                self.assertEqual(v.rc, 0, v)
                self.assertSameImages()

    def test_relative_names_are_relative_to_the_image(self):
        # Run from the parent: -b names a file beside the image.
        v = run([VBLK, "rebase", "-b", "nb.qcow2", "-F", "qcow2", "v/top.qcow2"], cwd=self.tmp)
        q = run([QEMU_IMG, "rebase", "-b", "nb.qcow2", "-F", "qcow2", "q/top.qcow2"], cwd=self.tmp)
        self.assertEqual((v.rc, v.stdout), (q.rc, q.stdout))
        self.assertEqual(v.rc, 0, v)
        self.assertSameImages()

    def test_unsafe_changes_the_header_only(self):
        before = file_state(os.path.join(self.v, "top.qcow2"), with_mtime=False)
        v, _ = self.assertSameRun("rebase", "-u", "-b", "does-not-exist.qcow2", "-F", "qcow2", "top.qcow2")
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(backing_fields(self.v, "top.qcow2"), ("does-not-exist.qcow2", "qcow2"))
        self.assertEqual(layer_map(self.v, "top.qcow2"), layer_map(self.q, "top.qcow2"))
        self.assertNotEqual(file_state(os.path.join(self.v, "top.qcow2"), with_mtime=False), before)
        # And back, with the old chain gone from the header too.
        v, _ = self.assertSameRun("rebase", "-u", "-b", "", "top.qcow2")
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(backing_fields(self.v, "top.qcow2"), (None, None))

    def test_unsafe_with_image_opts_leaves_the_old_chain_closed(self):
        os.unlink(os.path.join(self.v, "mid.qcow2"))
        os.unlink(os.path.join(self.q, "mid.qcow2"))
        v, _ = self.assertSameRun("rebase", "--image-opts", "-u", "-b", "nb.qcow2", "-F", "qcow2",
                                  "driver=qcow2,file.filename=top.qcow2")
        self.assertEqual(v.rc, 0, v)
        self.assertEqual(backing_fields(self.v, "top.qcow2"), ("nb.qcow2", "qcow2"))

    def test_progress_and_quiet(self):
        v, _ = self.assertSameRun("rebase", "-p", "-b", "nb.qcow2", "-F", "qcow2", "top.qcow2")
        self.assertIn("(100.00/100%)", v.stdout)
        make_chain(self.q)
        make_chain(self.v)
        v, _ = self.assertSameRun("rebase", "-q", "-p", "-b", "nb.qcow2", "-F", "qcow2", "top.qcow2")
        self.assertEqual(v.stdout, "")
        self.assertSameImages()

    def test_errors_leave_the_image_unchanged(self):
        cases = [
            ["rebase", "-b", "nb-typo.qcow2", "-F", "qcow2", "top.qcow2"],
            ["rebase", "top.qcow2"],
            ["rebase", "-b", "nb.qcow2", "-F", "qcow2"],
            ["rebase", "-b", "nb.qcow2", "-F", "qcow2", "top.qcow2", "extra"],
            ["rebase", "-b", "nb.qcow2", "-F", "nosuchfmt", "top.qcow2"],
            ["rebase", "-b", "nb.qcow2", "-F", "qcow2", "-t", "bogus", "top.qcow2"],
            ["rebase", "-b", "nb.qcow2", "-F", "qcow2", "-T", "bogus", "top.qcow2"],
            ["rebase", "-b", "nb.qcow2", "-F", "qcow2", "missing.qcow2"],
            ["rebase", "-u", "-b", "nb.qcow2", "top.qcow2"],
            ["rebase", "-u", "-b", "nb.qcow2", "-F", "qcow2", "-f", "raw", "top.qcow2"],
        ]
        for args in cases:
            with self.subTest(args=args):
                before = self.states(self.v)
                v, _ = self.assertSameRun(*args)
                self.assertNotEqual(v.rc, 0, v)
                self.assertEqual(self.states(self.v), before)

    def test_missing_backing_format_refused_before_writing(self):
        # QEMU 7.2 copies the differing data first, then refuses the header
        # change; vblk refuses first. Same words, same exit code, and what
        # both images read is unchanged.
        before = self.states(self.v)
        v, q = self.assertSameRun("rebase", "-b", "nb.qcow2", "top.qcow2")
        self.assertEqual(v.rc, 1)
        self.assertIn("backing format must be specified", v.stderr)
        if not IS_QEMU:
            self.assertEqual(self.states(self.v), before)
        self.assertEqual(backing_fields(self.v, "top.qcow2"), ("mid.qcow2", "qcow2"))
        r = run([QEMU_IMG, "compare", "q/top.qcow2", "v/top.qcow2"], cwd=self.tmp)
        self.assertEqual(r.stdout, IDENTICAL, r)

    def test_write_error_midway_leaves_the_old_chain(self):
        # blkdebug fails every write to the image's file: the first data
        # copy fails; the image must still read as before, over its old
        # backing file, and check clean (QEMU: the same).
        opts = ("driver=qcow2,file.driver=blkdebug,file.image.driver=file,file.image.filename=top.qcow2,"
                "file.inject-error.0.event=write_aio,file.inject-error.0.errno=5")
        res = {}
        for d, prog in ((self.v, VBLK), (self.q, QEMU_IMG)):
            res[d] = run([prog, "rebase", "--image-opts", "-b", os.path.join(d, "nb.qcow2"), "-F", "qcow2", opts],
                         cwd=d)
        v, q = res[self.v], res[self.q]
        self.assertEqual((v.rc, v.stdout), (q.rc, q.stdout))
        self.assertEqual(v.rc, 1, v)
        self.assertEqual(norm_vblk_err(v.stderr).splitlines()[0], norm_qemu_err(q.stderr).splitlines()[0])
        orig = os.path.join(self.tmp, "o")
        make_chain(orig)
        for d in (self.v, self.q):
            r = run([QEMU_IMG, "compare", os.path.join(orig, "top.qcow2"), os.path.join(d, "top.qcow2")])
            self.assertEqual(r.stdout, IDENTICAL, r)
            self.assertEqual(backing_fields(d, "top.qcow2"), ("mid.qcow2", "qcow2"))
            self.assertEqual(run([QEMU_IMG, "check", "top.qcow2"], cwd=d).rc, 0)

    def test_killed_midway_reads_as_before(self):
        # A rebase to no backing file (copies everything) killed at several
        # points: whatever the moment, the image reads as it did (over the
        # old chain, or over none once the header changed) and check finds
        # no corruption (leaks are allowed: exit 0 or 3).
        if IS_QEMU:
            self.skipTest("vblk's crash order")
        d = os.path.join(self.tmp, "k")
        os.makedirs(d)
        img(d, "create", "-q", "-f", "qcow2", "base.qcow2", "96M")
        qemu_io(d, "base.qcow2", *["write -P %d %dM 3M" % (i + 1, i * 4) for i in range(24)])
        img(d, "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2")
        qemu_io(d, "top.qcow2", "write -P 99 5M 1M")
        shutil.copy(os.path.join(d, "top.qcow2"), os.path.join(d, "top.orig"))
        ref = os.path.join(d, "ref.raw")
        img(d, "convert", "-O", "raw", "top.qcow2", ref)
        outcomes = set()
        for delay in (0.02, 0.05, 0.1, 0.2, 0.4):
            with self.subTest(delay=delay):
                shutil.copy(os.path.join(d, "top.orig"), os.path.join(d, "top.qcow2"))
                p = subprocess.Popen([VBLK, "rebase", "-t", "writethrough", "-b", "", "top.qcow2"], cwd=d,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(delay)
                p.kill()
                p.wait()
                outcomes.add(backing_fields(d, "top.qcow2"))
                r = run([QEMU_IMG, "compare", "-F", "raw", "top.qcow2", ref], cwd=d)
                self.assertEqual(r.stdout, IDENTICAL, r)
                c = run([QEMU_IMG, "check", "top.qcow2"], cwd=d)
                self.assertIn(c.rc, (0, 3), c)
        self.assertTrue(outcomes <= {("base.qcow2", "qcow2"), (None, None)}, outcomes)

    def test_raw_image_cannot_record_a_backing_file(self):
        for d in (self.q, self.v):
            img(d, "create", "-q", "-f", "raw", "r.img", "1M")
        before = file_state(os.path.join(self.v, "r.img"), with_mtime=False)
        for args in (["-b", "nb.qcow2", "-F", "qcow2"], ["-b", ""], ["-u", "-b", "nb.qcow2", "-F", "qcow2"]):
            with self.subTest(args=args):
                v, _ = self.assertSameRun("rebase", "-f", "raw", *args, "r.img")
                self.assertEqual(v.rc, 1)
                self.assertEqual(file_state(os.path.join(self.v, "r.img"), with_mtime=False), before)

    def test_compressed_rebase(self):
        if IS_QEMU:
            self.skipTest("qemu-img 7.2 has no rebase -c")
        q = run([QEMU_IMG, "rebase", "-b", "", "top.qcow2"], cwd=self.q)
        self.assertEqual(q.rc, 0, q)
        v = run([VBLK, "rebase", "-c", "-b", "", "top.qcow2"], cwd=self.v)
        self.assertEqual((v.rc, v.stdout, v.stderr), (0, "", ""))
        r = run([QEMU_IMG, "compare", "q/top.qcow2", "v/top.qcow2"], cwd=self.tmp)
        self.assertEqual(r.stdout, IDENTICAL, r)
        c = run([QEMU_IMG, "check", "--output=json", "top.qcow2"], cwd=self.v)
        self.assertEqual(c.rc, 0, c)
        self.assertGreater(json.loads(c.stdout).get("compressed-clusters", 0), 0)


class Holder:
    """A process keeping an image open (QEMU's qemu-io, vblk io, vblk nbd)."""

    def __init__(self, tc, argv, path):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=os.path.dirname(path))
        end = time.monotonic() + 20
        while not lock_bytes(path):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError("holder did not lock %s: %r" % (path, argv))
            time.sleep(0.05)
        time.sleep(0.2)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()


class LockTest(ChainCase):

    def holders(self, name, rw):
        """(label, argv builder) for each kind of holder of `name`."""
        ro = [] if rw else ["-r"]
        kinds = [("qemu-io", lambda d: [QEMU_IO, "-f", "qcow2"] + ro + [name])]
        if not IS_QEMU:  # vblk's own holders
            kinds.append(("vblk io", lambda d: [VBLK, "io", "-f", "qcow2"] + ro + [name]))
            kinds.append(("vblk nbd", lambda d: [VBLK, "nbd", "-f", "qcow2", "-k", os.path.join(d, "h.sock")] + ro +
                          [name]))
        return kinds

    def held_run(self, holder_argv, held, args):
        """Runs args in both directories while `held` is open by the holder
        there; returns (vblk, qemu) results."""
        res = {}
        for d in (self.v, self.q):
            h = Holder(self, holder_argv(d), os.path.join(d, held))
            try:
                res[d] = run(([VBLK] if d == self.v else [QEMU_IMG]) + list(args), cwd=d)
            finally:
                h.stop()
        return res[self.v], res[self.q]

    def check_refused(self, held, rw, args):
        for label, argv in self.holders(held, rw):
            with self.subTest(holder=label, held=held, rw=rw, args=args):
                before = self.states(self.v)
                v, q = self.held_run(argv, held, args)
                self.assertSameRc(v, q)
                self.assertSameStderr(v, q)
                self.assertEqual(v.rc, 1, v)
                self.assertIn("lock", v.stderr)
                self.assertEqual(self.states(self.v), before)

    def test_rebase_of_an_image_in_use(self):
        self.check_refused("top.qcow2", True, ["rebase", "-b", "nb.qcow2", "-F", "qcow2", "top.qcow2"])
        self.check_refused("top.qcow2", False, ["rebase", "-u", "-b", "nb.qcow2", "-F", "qcow2", "top.qcow2"])

    def test_rebase_onto_a_backing_file_being_written(self):
        self.check_refused("nb.qcow2", True, ["rebase", "-b", "nb.qcow2", "-F", "qcow2", "top.qcow2"])

    def test_commit_into_a_base_in_use(self):
        self.check_refused("mid.qcow2", False, ["commit", "top.qcow2"])
        self.check_refused("mid.qcow2", True, ["commit", "top.qcow2"])
        self.check_refused("base.qcow2", False, ["commit", "-b", "base.qcow2", "top.qcow2"])

    def test_commit_past_an_intermediate_image_in_use(self):
        self.check_refused("mid.qcow2", True, ["commit", "-b", "base.qcow2", "top.qcow2"])


class CommitTest(ChainCase):

    def test_commit_into_the_backing_file_empties_the_image(self):
        v, _ = self.assertSameRun("commit", "top.qcow2")
        self.assertEqual((v.rc, v.stdout), (0, "Image committed.\n"))
        self.assertSameImages()
        self.assertFalse(any(e["data"] for e in layer_map(self.v, "top.qcow2")))

    def test_drop_keeps_the_image(self):
        v, _ = self.assertSameRun("commit", "-d", "top.qcow2")
        self.assertEqual(v.rc, 0, v)
        self.assertSameImages()
        self.assertTrue(any(e["data"] for e in layer_map(self.v, "top.qcow2")))

    def test_commit_down_to_a_base(self):
        for base in ("base.qcow2", "mid.qcow2"):
            with self.subTest(base=base):
                make_chain(self.q)
                make_chain(self.v)
                v, _ = self.assertSameRun("commit", "-b", base, "top.qcow2")
                self.assertEqual((v.rc, v.stdout), (0, "Image committed.\n"))
                self.assertSameImages()

    def test_progress_quiet_and_rate(self):
        v, _ = self.assertSameRun("commit", "-p", "-d", "top.qcow2", stdout=False)
        self.assertTrue(v.stdout.endswith("(100.00/100%)\r\nImage committed.\n"), v)
        make_chain(self.q)
        make_chain(self.v)
        v, _ = self.assertSameRun("commit", "-q", "-r", "64M", "top.qcow2")
        self.assertEqual((v.rc, v.stdout), (0, ""))
        self.assertSameImages()

    def test_commit_grows_a_shorter_base(self):
        for d in (self.q, self.v):
            img(d, "create", "-q", "-f", "qcow2", "-b", "short.qcow2", "-F", "qcow2", "long.qcow2", "3M")
            qemu_io(d, "long.qcow2", "write -P 7 2M 64k")
        v, _ = self.assertSameRun("commit", "long.qcow2")
        self.assertEqual((v.rc, v.stdout), (0, "Image committed.\n"))
        self.assertSameImages(("long.qcow2", "short.qcow2"))
        info = json.loads(run([QEMU_IMG, "info", "--output=json", "short.qcow2"], cwd=self.v).stdout)
        self.assertEqual(info["virtual-size"], 3 * 1024 * 1024)

    def test_image_opts(self):
        v, _ = self.assertSameRun("commit", "--image-opts", "driver=qcow2,file.filename=top.qcow2")
        self.assertEqual((v.rc, v.stdout), (0, "Image committed.\n"))
        self.assertSameImages()

    def test_errors_leave_the_chain_unchanged(self):
        for d in (self.q, self.v):
            img(d, "create", "-q", "-f", "qcow2", "alone.qcow2", "1M")
        cases = [
            ["commit", "-b", "nope.qcow2", "top.qcow2"],
            ["commit", "-b", "top.qcow2", "top.qcow2"],
            ["commit", "alone.qcow2"],
            ["commit"],
            ["commit", "top.qcow2", "extra"],
            ["commit", "-r", "lots", "top.qcow2"],
            ["commit", "-t", "bogus", "top.qcow2"],
            ["commit", "missing.qcow2"],
        ]
        for args in cases:
            with self.subTest(args=args):
                before = self.states(self.v)
                v, _ = self.assertSameRun(*args)
                self.assertNotEqual(v.rc, 0, v)
                self.assertEqual(self.states(self.v), before)

    def test_commit_with_a_missing_backing_file(self):
        for d in (self.q, self.v):
            os.unlink(os.path.join(d, "base.qcow2"))
        before = {n: file_state(os.path.join(self.v, n), with_mtime=False) for n in ("top.qcow2", "mid.qcow2")}
        v, _ = self.assertSameRun("commit", "top.qcow2")
        self.assertEqual(v.rc, 1)
        self.assertIn("No such file or directory", v.stderr)
        self.assertEqual({n: file_state(os.path.join(self.v, n), with_mtime=False) for n in before}, before)


if __name__ == "__main__":
    unittest.main()
