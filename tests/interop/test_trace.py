#!/usr/bin/env python3
"""Interop: trace categories (include/io/vblk/trace.h) and the driver list.

vblk's trace categories switch on at start (`--trace PATTERN` before the
command as qemu-img takes it, `vblk nbd -T`, `vblk serve --trace`,
VBLK_TRACE=a,b) and at run time (QMP trace-event-set-state). Each line is
QEMU's log format, PID@SECONDS.MICROSECONDS:category message. Option
errors and unmatched patterns are worded and exit as qemu-img's are. The
"Supported formats" line of --help comes from the driver registry.
"""

import os
import re
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import VBLK, InteropTestCase, norm_qemu_err, norm_vblk_err, qemu, vblk, wait_for_socket  # noqa: E402
import qmp_driver  # noqa: E402  (common.py puts bench/ on the path)

LINE = re.compile(r"^(\d+)@(\d+)\.(\d{6}):([a-z0-9]+) (.*)$")
CATEGORIES = ["io", "block", "qcow2", "copy", "job", "nbd", "qmp"]


def run_env(argv, env_extra, timeout=60):
    env = dict(os.environ, LC_ALL="C", **env_extra)
    return subprocess.run([os.fspath(a) for a in argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout, text=True)


def trace_lines(stderr):
    """(pid, category, message) of every trace line in stderr."""
    out = []
    for line in stderr.splitlines():
        m = LINE.match(line)
        if m:
            out.append((int(m.group(1)), m.group(4), m.group(5)))
    return out


class TraceCliTest(InteropTestCase):
    def test_help_lists_every_registered_driver(self):
        r = vblk("--help")
        self.assertEqual(r.rc, 0, r)
        line = next(l for l in r.stdout.splitlines() if l.startswith("Supported formats:"))
        names = line.split()[2:]
        self.assertEqual(names, sorted(names))
        # The block layer's own drivers and those the copy layer registers.
        for d in ("blkdebug", "copy-before-write", "file", "host_device", "luks", "nbd", "null-co", "qcow2", "raw",
                  "rbd", "snapshot-access", "throttle"):
            self.assertIn(d, names)
        self.assertIn("--trace", r.stdout)

    def test_env_switches_categories_on_and_lines_are_qemu_log_format(self):
        img = os.path.join(self.tmp, "a.qcow2")
        r = vblk("create", "-q", "-f", "qcow2", img, "1M")
        self.assertEqual(r.rc, 0, r)
        quiet = run_env([VBLK, "io", "-c", "write 0 64k", img], {})
        self.assertEqual(quiet.returncode, 0, quiet)
        self.assertEqual(trace_lines(quiet.stderr), [], "trace is off by default")
        t = run_env([VBLK, "io", "-c", "write 128k 64k", img], {"VBLK_TRACE": "qcow2,block"})
        self.assertEqual(t.returncode, 0, t)
        lines = trace_lines(t.stderr)
        self.assertTrue(lines, t.stderr)
        self.assertEqual({c for _, c, _ in lines} - {"qcow2", "block"}, set(), lines)
        # The new data cluster, at a host offset past the metadata.
        allocs = [m for _, c, m in lines if c == "qcow2" and " alloc " in m]
        self.assertTrue(allocs, lines)
        self.assertTrue(any(m.startswith("open node") and "driver qcow2" in m for _, c, m in lines if c == "block"))
        self.assertEqual({p for p, _, _ in lines}, {lines[0][0]})
        # Nothing of the qcow2 category leaks into another image's quiet run.
        self.assertEqual(vblk("check", img).rc, 0)
        self.assertEqual(qemu("check", img).rc, 0)

    def test_option_before_the_command(self):
        img = os.path.join(self.tmp, "b.qcow2")
        self.assertEqual(vblk("create", "-q", "-f", "qcow2", img, "1M").rc, 0)
        for i, argv in enumerate((["--trace", "qcow2"], ["-T", "q*"], ["--trace=enable=qcow2"])):
            # A new cluster each time: qcow2 traces allocations.
            r = vblk(*argv, "io", "-c", "write %dk 4k" % (64 * i), img)
            self.assertEqual(r.rc, 0, r)
            self.assertTrue(any(c == "qcow2" for _, c, _ in trace_lines(r.stderr)), (argv, r))

    def test_unmatched_pattern_warns_and_bad_option_fails_as_qemu_img(self):
        img = os.path.join(self.tmp, "c.raw")
        with open(img, "wb") as f:
            f.truncate(1 << 20)
        v, q = vblk("--trace", "nosuch", "info", img), qemu("--trace", "nosuch", "info", img)
        self.assertEqual((v.rc, q.rc), (0, 0))
        want = "qemu-img: warning: trace event 'nosuch' does not exist"
        self.assertIn(want, norm_qemu_err(q.stderr))
        self.assertIn(want, norm_vblk_err(v.stderr))
        v, q = vblk("--trace", "bogus=1", "info", img), qemu("--trace", "bogus=1", "info", img)
        self.assertSameRc(v, q)
        self.assertEqual(v.rc, 1)
        self.assertSameStderr(v, q)
        r = run_env([VBLK, "info", img], {"VBLK_TRACE": "qcow2,nosuch"})
        self.assertEqual(r.returncode, 1, r)
        self.assertIn("no trace category 'nosuch'", r.stderr)
        self.assertNotIn("--help", r.stderr)  # an environment variable is no usage error
        self.assertEqual(r.stdout, "")


class TraceServeTest(InteropTestCase):
    def start_serve(self, *extra):
        sock = os.path.join(self.tmp, "qmp.sock")
        err = open(os.path.join(self.tmp, "serve.err"), "w+")
        argv = [VBLK, "serve", "--chardev", "socket,path=%s,server=on,wait=off,id=m" % sock, "--monitor", "chardev=m",
                *extra]
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)

        def stop():
            p.terminate()
            self.assertEqual(p.wait(30), 0)
            err.close()

        self.addCleanup(stop)
        wait_for_socket(sock, p)
        q = qmp_driver.QMP(sock)
        self.addCleanup(q.close)
        return p, q, err

    def read_lines(self, err, category, pred, timeout=20):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            err.seek(0)
            found = [m for _, c, m in trace_lines(err.read()) if c == category and pred(m)]
            if found:
                return found
            time.sleep(0.05)
        err.seek(0)
        self.fail("no %s trace line within %ss:\n%s" % (category, timeout, err.read()))

    def test_qmp_switches_categories_at_run_time(self):
        _, q, err = self.start_serve()
        states = q.ok("trace-event-get-state", {"name": "*"})
        self.assertEqual([s["name"] for s in states], CATEGORIES)
        self.assertTrue(all(s["state"] == "disabled" and s["vcpu"] is False for s in states), states)
        self.assertEqual(q.ok("trace-event-get-state", {"name": "nosuch"}), [])
        r = q.cmd("trace-event-set-state", {"name": "nosuch", "enable": True})
        self.assertEqual(r["error"], {"class": "GenericError", "desc": 'unknown event "nosuch"'})
        self.assertEqual(q.cmd("trace-event-set-state", {"name": "job"})["error"]["desc"],
                         "Parameter 'enable' is missing")

        q.ok("trace-event-set-state", {"name": "j*", "enable": True})
        q.ok("trace-event-set-state", {"name": "qmp", "enable": True})
        self.assertEqual([s["name"] for s in q.ok("trace-event-get-state", {"name": "*"}) if s["state"] == "enabled"],
                         ["job", "qmp"])
        img = os.path.join(self.tmp, "new.raw")
        q.ok("blockdev-create", {"job-id": "c0", "options": {"driver": "file", "filename": img, "size": 1 << 20}})
        q.event("JOB_STATUS_CHANGE")
        lines = self.read_lines(err, "job", lambda m: m.startswith("job 'c0' ") and m.endswith("-> concluded"))
        self.assertTrue(lines)
        self.read_lines(err, "qmp", lambda m: m.startswith("command blockdev-create"))

        q.ok("trace-event-set-state", {"name": "*", "enable": False})
        err.seek(0, os.SEEK_END)
        before = err.tell()
        q.ok("query-version")
        q.ok("query-jobs")
        time.sleep(0.2)
        err.seek(before)
        self.assertEqual(trace_lines(err.read()), [], "categories switched off print nothing")

    def test_serve_trace_option(self):
        _, q, err = self.start_serve("--trace", "qmp")
        q.ok("query-version")
        self.read_lines(err, "qmp", lambda m: m == "command query-version: ok")
        states = {s["name"]: s["state"] for s in q.ok("trace-event-get-state", {"name": "*"})}
        self.assertEqual(states["qmp"], "enabled")
        self.assertEqual(states["nbd"], "disabled")


if __name__ == "__main__":
    unittest.main()
