#!/usr/bin/env python3
"""Interop: `vblk serve` and its QMP monitor, beside qemu-storage-daemon.

Every scenario runs twice with the same arguments: once against
qemu-storage-daemon (QEMU 7.2) and once against `vblk serve`, on images
created the same way at the same paths. What each scenario observes (reply
lines, error classes and descriptions, event names and data, exit codes,
stderr, data read through NBD exports) must be the same for both daemons.
Where the two daemons cannot agree by nature (the version in the greeting,
names QEMU generates for implicit nodes), the scenario normalises that one
field and says so.

Only the Python standard library is used.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import (MiB, InteropTestCase, VBLK, norm_qemu_err, norm_vblk_err, qemu, rand_bytes, run,
                    end_process)  # noqa: E402
import qmp_driver  # noqa: E402  (common.py puts bench/ on the path)

QSD = shutil.which("qemu-storage-daemon")
QEMU_IO = shutil.which("qemu-io")
NBDINFO = shutil.which("nbdinfo")

QSD_CMD = [QSD] if QSD else None
VBLK_CMD = [VBLK, "serve"]


def QMP(path):
    """A connection that stops after the greeting: the tests negotiate
    themselves (or test what happens when they do not)."""
    return qmp_driver.QMP(path, negotiate=False)


class Daemon:
    """A running daemon (qemu-storage-daemon or vblk serve)."""

    def __init__(self, cmd, args, sock=None, tc=None):
        self.argv = list(cmd) + list(args)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.sock = sock
        if sock:
            self.wait_socket(sock)

    def wait_socket(self, path, timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            if os.path.exists(path):
                return
            if self.proc.poll() is not None:
                raise AssertionError("%s exited early: rc=%s stderr=%r" %
                                     (self.argv, self.proc.returncode, self.proc.stderr.read()))
            time.sleep(0.02)
        raise AssertionError("%s did not create %s" % (self.argv, path))

    def qmp(self):
        return QMP(self.sock)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        return end_process(self.proc, self.argv, sig, timeout)[0]

    def wait(self, timeout=30):
        return end_process(self.proc, self.argv, None, timeout)[0]


def norm_names(obj):
    """Generated node names differ (#block092 vs #block000): one spelling."""
    if isinstance(obj, dict):
        return {k: norm_names(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [norm_names(v) for v in obj]
    if isinstance(obj, str):
        return re.sub(r"#block\d+", "#block", obj)
    return obj


@unittest.skipUnless(QSD, "qemu-storage-daemon is not installed")
class QmpTest(InteropTestCase):

    def setUp(self):
        super().setUp()
        self.mon = os.path.join(self.tmp, "qmp.sock")
        self.nbd = os.path.join(self.tmp, "nbd.sock")
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
            for f in (d.proc.stdout, d.proc.stderr):
                if f and not f.closed:
                    f.close()
        super().tearDown()

    def start(self, cmd, extra=(), monitor=True):
        args = []
        if monitor:
            args += ["--chardev", "socket,path=%s,server=on,wait=off,id=mon0" % self.mon, "--monitor", "chardev=mon0"]
        d = Daemon(cmd, args + list(extra), self.mon if monitor else None)
        self.daemons.append(d)
        return d

    def images(self):
        """The same images at the same paths for each daemon's run."""
        raw = os.path.join(self.tmp, "a.raw")
        with open(raw, "wb") as f:
            f.write(rand_bytes(1 * MiB, "qmp-raw"))
        qc = os.path.join(self.tmp, "b.qcow2")
        if os.path.exists(qc):
            os.unlink(qc)
        r = qemu("create", "-q", "-f", "qcow2", qc, "1M")
        self.assertEqual(r.rc, 0, r)
        r = run([QEMU_IO, "-f", "qcow2", "-c", "write -P 0x5a 64k 64k", qc])
        self.assertEqual(r.rc, 0, r)
        return raw, qc

    def both(self, scenario):
        """Runs scenario(cmd) for both daemons; returns (qemu, vblk)."""
        q = scenario(QSD_CMD)
        for p in (self.mon, self.nbd):
            if os.path.exists(p):
                os.unlink(p)
        v = scenario(VBLK_CMD)
        return q, v

    def assertBoth(self, scenario, msg=""):
        q, v = self.both(scenario)
        self.assertEqual(v, q, "vblk serve differs from qemu-storage-daemon %s" % msg)
        return q

    # ------------------------------------------------------------------
    def test_greeting_and_negotiation(self):
        def scenario(cmd):
            d = self.start(cmd)
            c = d.qmp()
            g = c.greeting
            shape = (list(g), list(g["QMP"]), sorted(g["QMP"]["version"]),
                     sorted(g["QMP"]["version"]["qemu"]), g["QMP"]["capabilities"],
                     all(isinstance(x, int) for x in g["QMP"]["version"]["qemu"].values()),
                     isinstance(g["QMP"]["version"]["package"], str))
            out = [shape, c.greeting_line.endswith("}\r\n")]
            out.append(c.raw('{"execute":"query-version","id":7}'))
            out.append(c.raw('{"execute":"blockdev-del","arguments":{"node-name":"x"}}'))
            out.append(c.raw('{"execute":"qmp_capabilities","arguments":{"enable":["foo"]},"id":"a"}'))
            out.append(c.raw('{"execute":"qmp_capabilities","id":{"x":[1,2]}}'))
            out.append(c.raw('{"execute":"qmp_capabilities"}'))
            v = c.cmd("query-version", req_id=3)
            out.append((sorted(v), sorted(v["return"]), v["id"]))
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_unknown_command_and_malformed_json(self):
        inputs = [
            '{"execute":"nope","id":1}', 'garbage', '{"execute": }', '{"a" 1}', '{1: 2}', '[1 2]',
            '{"a":1 "b":2}', '{"a":1, "a":2}', '@', 'Abc', '01', '"\\ud800"', '"\\u00e9"', '123', '[]',
            '{"arguments":{}}', '{"execute":5}', '{"execute":"query-version","foo":1}',
            '{"execute":"query-version","arguments":[]}', '{"execute":"query-version","control":{}}',
            '{"exec-oob":"query-version"}', '{"execute":"query-version","exec-oob":"x"}',
            "{'execute':'blockdev-del','arguments':{'node-name':'nope'},'id':'sq'}",
            '{"execute":"blockdev-del","arguments":{"node-name":"a\\u00e9\\n\\"\\\\/\\ud83d\\ude00"},"id":1.5}',
            '{"execute":"blockdev-del","arguments":{"node-name":"n"},"id":[true,false,null,-1,18446744073709551615]}',
        ]

        def scenario(cmd):
            d = self.start(cmd)
            c = d.qmp().negotiate()
            out = [c.raw(i) for i in inputs]
            # Two messages in one write, and one message split over writes.
            c.send_raw('{"execute":"nbd-server-stop","id":1}{"execute":"nbd-server-stop","id":2}\n')
            out += [c.reply_line(), c.reply_line()]
            c.send_raw('{"execute":"nbd-server-')
            time.sleep(0.1)
            c.send_raw('stop"}')
            out.append(c.reply_line())
            # A stray character inside a message: the error, then recovery.
            c.send_raw('{"execute": @}\n{"execute":"nbd-server-stop"}\n')
            out += [c.reply_line(), c.reply_line(), c.reply_line()]
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_argument_errors(self):
        cmds = [
            ("blockdev-del", None), ("blockdev-del", {}), ("blockdev-del", {"node-name": 1}),
            ("blockdev-del", {"node-name": None}), ("blockdev-del", {"node-name": "x", "bogus": 1}),
            ("query-named-block-nodes", {"flat": "yes"}), ("query-version", {"x": 1}),
            ("query-block-exports", {"a": []}),
            ("blockdev-add", {}), ("blockdev-add", {"driver": 5}), ("blockdev-add", {"driver": "null-co"}),
            ("blockdev-add", {"driver": "bogus", "node-name": "x"}),
            ("blockdev-add", {"driver": "null-co", "node-name": "x", "read-zeroes": "yes"}),
            ("blockdev-add", {"driver": "null-co", "node-name": "x", "size": "1M"}),
            ("blockdev-add", {"driver": "null-co", "node-name": "x", "bogus": 1}),
            ("blockdev-add", {"driver": "file", "node-name": "x"}),
            ("blockdev-add", {"driver": "file", "node-name": "x", "filename": "/nonexistent/vblk"}),
            ("block-export-add", {"id": "e", "node-name": "n"}),
            ("block-export-add", {"type": "vhost", "id": "e", "node-name": "n"}),
            ("block-export-add", {"type": "nbd", "node-name": "n"}),
            ("block-export-add", {"type": "nbd", "id": "e", "node-name": "n", "writable": "on"}),
            ("block-export-add", {"type": "nbd", "id": "e", "node-name": "n", "extra": 1}),
            ("block-export-del", {}), ("block-export-del", {"id": "e", "mode": "soft"}),
            ("nbd-server-start", {}), ("nbd-server-start", {"addr": {"type": "unix"}}),
            ("nbd-server-start", {"addr": {"type": "unix", "data": {}}}),
            ("nbd-server-start", {"addr": {"type": "pipe", "data": {}}}),
            ("nbd-server-start", {"addr": {"type": "unix", "data": {"path": 5}}}),
            ("nbd-server-start", {"addr": {"type": "unix", "data": {"path": "/x", "q": 1}}}),
            ("nbd-server-start", {"addr": {"type": "inet", "data": {"host": "127.0.0.1"}}}),
            ("nbd-server-start", {"addr": {"type": "unix", "data": {"path": "p"}}, "max-connections": "2"}),
            ("nbd-server-stop", None), ("quit", {"now": True}),
        ]

        def scenario(cmd):
            d = self.start(cmd)
            c = d.qmp().negotiate()
            out = []
            for name, args in cmds:
                req = {"execute": name, "id": name}
                if args is not None:
                    req["arguments"] = args
                out.append(c.raw(json.dumps(req)))
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_blockdev_add_del(self):
        raw, qc = os.path.join(self.tmp, "a.raw"), os.path.join(self.tmp, "b.qcow2")

        def scenario(cmd):
            self.images()
            d = self.start(cmd)
            c = d.qmp().negotiate()
            out = []
            steps = [
                ("blockdev-add", {"driver": "file", "node-name": "f0", "filename": raw}),
                ("blockdev-add", {"driver": "raw", "node-name": "r0", "file": "f0"}),
                ("blockdev-add", {"driver": "raw", "node-name": "r0", "file": "f0"}),
                ("blockdev-add", {"driver": "null-co", "node-name": "f0"}),
                ("blockdev-add", {"driver": "qcow2", "node-name": "q0",
                                  "file": {"driver": "file", "filename": qc}}),
                ("blockdev-add", {"driver": "null-co", "node-name": "n0", "size": 4 * MiB}),
                ("blockdev-add", {"driver": "raw", "node-name": "r1", "file": "nope"}),
                ("query-named-block-nodes", None),
                ("query-named-block-nodes", {"flat": True}),
                ("blockdev-del", {"node-name": "f0"}),
                ("blockdev-del", {"node-name": "nope"}),
                ("blockdev-del", {"node-name": "r0"}),
                ("blockdev-del", {"node-name": "r0"}),
                ("blockdev-del", {"node-name": "f0"}),
                ("blockdev-del", {"node-name": "q0"}),
                ("query-named-block-nodes", None),
                ("blockdev-del", {"node-name": "n0"}),
                ("query-named-block-nodes", None),
            ]
            for name, args in steps:
                out.append(norm_names(c.cmd(name, args)))
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)
        r = qemu("check", qc)
        self.assertEqual(r.rc, 0, r)

    def test_query_named_block_nodes_raw_lines(self):
        """The reply line itself, byte for byte (key order included)."""
        raw, qc = os.path.join(self.tmp, "a.raw"), os.path.join(self.tmp, "b.qcow2")

        def scenario(cmd):
            self.images()
            d = self.start(cmd, ["--blockdev", "driver=file,node-name=f0,filename=%s" % raw,
                                 "--blockdev", "driver=raw,node-name=r0,file=f0",
                                 "--blockdev", json.dumps({"driver": "qcow2", "node-name": "q0", "file": {
                                     "driver": "file", "filename": qc, "node-name": "qf"}}),
                                 "--blockdev", "driver=null-co,node-name=n0,read-zeroes=on"])
            c = d.qmp().negotiate()
            line = c.raw('{"execute":"query-named-block-nodes","id":"q"}')
            c.close()
            self.assertEqual(d.stop(), 0)
            return line
        self.assertBoth(scenario)

    def test_query_named_block_nodes_chain(self):
        """Backing chains (implicit nodes, depth, backing-image), cache and
        detect-zeroes settings, read-only, a blkdebug filter: whole lines."""
        base, top, top2 = (os.path.join(self.tmp, n) for n in ("base.raw", "top.qcow2", "top2.qcow2"))

        def scenario(cmd):
            for p in (top, top2):
                if os.path.exists(p):
                    os.unlink(p)
            with open(base, "wb") as f:
                f.truncate(MiB)
            self.assertEqual(qemu("create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", top).rc, 0)
            self.assertEqual(qemu("create", "-q", "-f", "qcow2", "-b", "top.qcow2", "-F", "qcow2", top2).rc, 0)
            d = self.start(cmd)
            c = d.qmp().negotiate()
            cmds = [
                {"execute": "blockdev-add", "arguments": {"driver": "qcow2", "node-name": "t", "file": {
                    "driver": "file", "filename": top2}}},
                {"execute": "query-named-block-nodes"},
                {"execute": "query-named-block-nodes", "arguments": {"flat": True}},
                {"execute": "blockdev-add", "arguments": {
                    "driver": "raw", "node-name": "r", "read-only": True, "detect-zeroes": "on",
                    "cache": {"direct": True, "no-flush": False}, "file": {"driver": "file", "filename": base}}},
                {"execute": "blockdev-add", "arguments": {"driver": "raw", "node-name": "bd", "file": {
                    "driver": "blkdebug", "image": {"driver": "file", "filename": base}}}},
                {"execute": "query-named-block-nodes", "arguments": {"flat": True}},
                {"execute": "blockdev-del", "arguments": {"node-name": "t"}},
                {"execute": "query-named-block-nodes"},
            ]
            out = [re.sub(r"#block\d+", "#block", c.raw(json.dumps(x))) for x in cmds]
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_nbd_client_node(self):
        """blockdev-add of the nbd driver against qemu-nbd."""
        img = os.path.join(self.tmp, "n.raw")
        with open(img, "wb") as f:
            f.write(rand_bytes(MiB, "nbd-node"))
        qn_sock = os.path.join(self.tmp, "qn.sock")
        qn = subprocess.Popen(["qemu-nbd", "-e", "4", "-t", "-f", "raw", "-x", "ex", "-k", qn_sock, img],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(qn.wait)
        self.addCleanup(qn.kill)
        Daemon.wait_socket(type("P", (), {"proc": qn, "argv": ["qemu-nbd"]})(), qn_sock)

        def scenario(cmd):
            d = self.start(cmd)
            c = d.qmp().negotiate()
            cmds = [
                {"execute": "blockdev-add", "arguments": {"driver": "nbd", "node-name": "n", "export": "ex",
                                                          "server": {"type": "unix", "path": qn_sock}}},
                {"execute": "blockdev-add", "arguments": {"driver": "raw", "node-name": "r", "file": "n"}},
                {"execute": "query-named-block-nodes"},
                {"execute": "blockdev-add", "arguments": {"driver": "nbd", "node-name": "n3", "export": "nope",
                                                          "server": {"type": "unix", "path": qn_sock}}},
                {"execute": "blockdev-del", "arguments": {"node-name": "n"}},
                {"execute": "blockdev-del", "arguments": {"node-name": "r"}},
                {"execute": "blockdev-del", "arguments": {"node-name": "n"}},
            ]
            out = [re.sub(r"#block\d+", "#block", c.raw(json.dumps(x))) for x in cmds]
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_nbd_export_read_write(self):
        raw, qc = os.path.join(self.tmp, "a.raw"), os.path.join(self.tmp, "b.qcow2")

        def scenario(cmd):
            self.images()
            d = self.start(cmd)
            c = d.qmp().negotiate()
            out = []
            add = lambda *a: out.append(c.cmd(*a))  # noqa: E731
            add("block-export-add", {"type": "nbd", "id": "e0", "node-name": "r0"})
            add("blockdev-add", {"driver": "raw", "node-name": "r0",
                                 "file": {"driver": "file", "filename": raw}})
            add("blockdev-add", {"driver": "qcow2", "node-name": "q0",
                                 "file": {"driver": "file", "filename": qc}})
            add("block-export-add", {"type": "nbd", "id": "e0", "node-name": "r0"})
            add("nbd-server-start", {"addr": {"type": "unix", "data": {"path": self.nbd}}})
            add("nbd-server-start", {"addr": {"type": "unix", "data": {"path": self.nbd}}})
            add("block-export-add", {"type": "nbd", "id": "e0", "node-name": "zz"})
            add("block-export-add", {"type": "nbd", "id": "e0", "node-name": "r0", "name": "raw",
                                     "description": "the raw one"})
            add("block-export-add", {"type": "nbd", "id": "e0", "node-name": "q0"})
            add("block-export-add", {"type": "nbd", "id": "e1", "node-name": "q0", "name": "raw"})
            add("block-export-add", {"type": "nbd", "id": "1e", "node-name": "q0"})
            add("block-export-add", {"type": "nbd", "id": "e1", "node-name": "q0", "writable": True})
            add("query-block-exports")
            add("blockdev-del", {"node-name": "r0"})
            # Read both exports and compare with the images.
            uri_raw = "nbd+unix:///raw?socket=%s" % self.nbd
            uri_q = "nbd+unix:///q0?socket=%s" % self.nbd
            # -U: qemu-storage-daemon holds QEMU's image locks.
            r = qemu("compare", "-U", "-f", "raw", "-F", "raw", raw, uri_raw)
            out.append(("compare raw", r.rc, r.stdout))
            r = qemu("compare", "-U", "-f", "qcow2", "-F", "raw", qc, uri_q)
            out.append(("compare qcow2", r.rc, r.stdout))
            if NBDINFO:
                r = run([NBDINFO, "--size", uri_raw])
                out.append(("nbdinfo size", r.rc, r.stdout))
                r = run([NBDINFO, "--json", "--list", "nbd+unix://?socket=%s" % self.nbd])
                info = json.loads(r.stdout) if r.rc == 0 else r.stderr
                exports = sorted((e["export-name"], e.get("description"), e["is_read_only"], e["export-size"])
                                 for e in info["exports"])
                out.append(("nbdinfo list", exports))
            # The writable export writes through to the qcow2 image.
            r = run([QEMU_IO, "-f", "raw", "-c", "write -P 0xa7 128k 4k", uri_q])
            out.append(("write", r.rc))
            r = run([QEMU_IO, "-f", "raw", "-c", "write -P 0xa7 0 512", uri_raw])
            out.append(("write ro", r.rc, "failed" in r.stderr or "denied" in r.stderr or "read-only" in r.stderr))
            add("block-export-del", {"id": "zz"})
            add("block-export-del", {"id": "e0"})
            ev = c.event("BLOCK_EXPORT_DELETED")
            out.append((sorted(ev), ev["data"], sorted(ev["timestamp"])))
            add("query-block-exports")
            add("block-export-del", {"id": "e0"})
            add("nbd-server-stop")
            ev = c.event("BLOCK_EXPORT_DELETED")
            out.append(ev["data"])
            add("nbd-server-stop")
            add("query-block-exports")
            add("quit")
            c.close()
            out.append(("rc", d.wait()))
            r = run([QEMU_IO, "-f", "qcow2", "-c", "read -P 0xa7 128k 4k", qc])
            out.append(("written", r.rc))
            r = qemu("check", qc)
            out.append(("check", r.rc))
            out.append(("sockets left", os.path.exists(self.mon), os.path.exists(self.nbd)))
            return out
        self.assertBoth(scenario)

    def test_export_in_use(self):
        """An export with a client connected: mode=safe refuses to delete it,
        mode=hard ends the client and frees the node."""
        raw = os.path.join(self.tmp, "a.raw")

        def scenario(cmd):
            self.images()
            d = self.start(cmd, ["--blockdev", "driver=file,node-name=f0,filename=%s" % raw,
                                 "--nbd-server", "addr.type=unix,addr.path=%s" % self.nbd,
                                 "--export", "type=nbd,id=e0,node-name=f0,name=x"])
            c = d.qmp().negotiate()
            out = [c.cmd("blockdev-del", {"node-name": "f0"})]
            cl = subprocess.Popen([QEMU_IO, "-r", "-f", "raw", "nbd+unix:///x?socket=%s" % self.nbd],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            cl.stdin.write(b"read -P 0 0 512\n")
            cl.stdin.flush()
            out.append(b"read 512/512" in cl.stdout.readline())
            out.append(c.cmd("block-export-del", {"id": "e0"}))
            out.append(c.cmd("blockdev-del", {"node-name": "f0"}))
            out.append(c.cmd("block-export-del", {"id": "e0", "mode": "hard"}))
            # The export goes once its client is cut off, which the daemon
            # does in the background: until BLOCK_EXPORT_DELETED,
            # query-block-exports may still list it as shutting-down.
            out.append(c.event("BLOCK_EXPORT_DELETED")["data"])
            out.append(c.cmd("query-block-exports"))
            out.append(c.cmd("blockdev-del", {"node-name": "f0"}))
            out.append(c.cmd("query-named-block-nodes"))
            try:
                o, e = cl.communicate(b"read 0 512\nquit\n", timeout=30)
            except BrokenPipeError:
                o, e = cl.stdout.read(), cl.stderr.read()
                cl.wait(30)
            out.append(b"read failed" in o + e)
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_events_reach_every_monitor(self):
        mon2 = os.path.join(self.tmp, "qmp2.sock")

        def scenario(cmd):
            d = self.start(cmd, ["--chardev", "socket,path=%s,server=on,wait=off,id=mon1" % mon2,
                                 "--monitor", "chardev=mon1",
                                 "--blockdev", "driver=null-co,node-name=n0",
                                 "--nbd-server", "addr.type=unix,addr.path=%s" % self.nbd,
                                 "--export", "type=nbd,id=e0,node-name=n0"])
            a = d.qmp().negotiate()
            b = QMP(mon2).negotiate()
            # A second client of the same monitor waits for the first to go.
            late = socket.socket(socket.AF_UNIX)
            late.connect(self.mon)
            late.settimeout(0.5)
            try:
                early = late.recv(100)
            except socket.timeout:
                early = b""
            out = [early]
            out.append(b.cmd("block-export-del", {"id": "e0"}))
            ea, eb = a.event("BLOCK_EXPORT_DELETED"), b.event("BLOCK_EXPORT_DELETED")
            out.append((ea["event"], ea["data"], eb["event"], eb["data"]))
            a.close()
            late.settimeout(20)
            out.append(late.recv(10).startswith(b'{"QMP":'))
            late.close()
            b.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_blkdebug_read_error(self):
        raw = os.path.join(self.tmp, "a.raw")

        def scenario(cmd):
            self.images()
            dbg = {"driver": "raw", "node-name": "dbg", "file": {
                "driver": "blkdebug", "image": {"driver": "file", "filename": raw},
                "inject-error": [{"event": "read_aio", "errno": 5, "sector": 8},
                                 {"event": "write_aio", "errno": 28, "sector": 16, "once": True}]}}
            d = self.start(cmd, ["--blockdev", json.dumps(dbg),
                                 "--nbd-server", "addr.type=unix,addr.path=%s" % self.nbd,
                                 "--export", "type=nbd,id=e0,node-name=dbg,name=dbg,writable=on"])
            uri = "nbd+unix:///dbg?socket=%s" % self.nbd
            out = []
            for c in ("read 0 4k", "read 4k 512", "read 3584 1k", "read 8k 4k", "write 8k 512",
                      "write 8k 512", "read 4k 512"):
                r = run([QEMU_IO, "-f", "raw", "-c", c, uri])
                out.append((c, r.rc, [l for l in r.stdout.splitlines() + r.stderr.splitlines()
                                      if "failed" in l or "error" in l.lower()]))
            q = d.qmp().negotiate()
            out.append(norm_names(q.cmd("query-named-block-nodes", {"flat": True})["return"][0]["drv"]))
            out.append(q.cmd("blockdev-add", {"driver": "blkdebug", "node-name": "b2", "image": "dbg",
                                              "inject-error": [{"event": "nope"}]}))
            out.append(q.cmd("blockdev-add", {"driver": "blkdebug", "node-name": "b2", "image": "dbg",
                                              "inject-error": [{"errno": 5}]}))
            q.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_throttle_group(self):
        """throttle-group objects (--object and object-add) and the throttle
        filter: QEMU's validation, in-use refusal, and writes held to the rate."""
        raw = os.path.join(self.tmp, "a.raw")

        def scenario(cmd):
            self.images()
            d = self.start(cmd, ["--object", "throttle-group,id=tg0,x-bps-write=524288",
                                 "--blockdev", "driver=file,node-name=f0,filename=%s" % raw,
                                 "--blockdev", "driver=throttle,node-name=t0,throttle-group=tg0,file=f0",
                                 "--nbd-server", "addr.type=unix,addr.path=%s" % self.nbd,
                                 "--export", "type=nbd,id=e0,node-name=t0,name=x,writable=on"])
            c = d.qmp().negotiate()
            tg = {"qom-type": "throttle-group"}
            out = [c.cmd("object-add", a) for a in (
                dict(tg), {"id": "x"}, dict(tg, id="a", foo=1), dict(tg, id="a", limits={"foo": 1}),
                dict(tg, id="a", limits={"bps-total": "x"}), dict(tg, id="a", limits=5),
                dict(tg, id="a", **{"x-bps-total": -5}), dict(tg, id="a", **{"x-bps-total": "5"}),
                dict(tg, id="a", limits={"iops-size": 4096}), dict(tg, id="a", limits={"bps-total-max-length": 2}),
                dict(tg, id="a", limits={"bps-total": 10, "bps-total-max": 5}),
                dict(tg, id="a", limits={"bps-total": 100, "bps-read": 5}),
                dict(tg, id="a", limits={"iops-total": -1}), dict(tg, id="1bad"),
                {"qom-type": "nosuch", "id": "a"}, dict(tg, id="tg0"),
                dict(tg, id="tg1", limits={"iops-total": 100, "iops-total-max": 200}),
                {"qom-type": "iothread", "id": "io0"}, {"qom-type": "iothread", "id": "tg1"})]
            out.append(c.cmd("object-del", {"id": "tg0"}))
            out.append(c.cmd("object-del", {"id": "nosuch"}))
            for args in ({"driver": "throttle", "node-name": "t1", "throttle-group": "nosuch", "file": "f0"},
                         {"driver": "throttle", "node-name": "t1", "file": "f0"},
                         {"driver": "throttle", "node-name": "t1", "throttle-group": 5, "file": "f0"},
                         {"driver": "throttle", "node-name": "t1", "throttle-group": "tg1",
                          "file": {"driver": "null-co"}}):
                out.append(c.cmd("blockdev-add", args))
            out.append(c.cmd("object-del", {"id": "tg1"}))
            out.append(c.cmd("blockdev-del", {"node-name": "t1"}))
            out.append(c.cmd("object-del", {"id": "tg1"}))
            out.append(c.cmd("object-del", {"id": "io0"}))
            out.append(c.cmd("query-named-block-nodes"))
            # 1 MiB in four requests at 512 KiB/s: the last goes once the
            # bucket has drained to a tenth of the rate, after about 1.4 s.
            uri = "nbd+unix:///x?socket=%s" % self.nbd
            t0 = time.monotonic()
            r = run([QEMU_IO, "-f", "raw"] + sum((["-c", "write -P 0x3c %dk 256k" % (i * 256)] for i in range(4)), [])
                    + [uri])
            took = time.monotonic() - t0
            out.append(("write", r.rc, took >= 1.2, took < 20))
            r = run([QEMU_IO, "-f", "raw", "-c", "read -P 0x3c 0 1M", uri])
            out.append(("read back", r.rc))
            c.close()
            self.assertEqual(d.stop(), 0)
            return out
        self.assertBoth(scenario)

    def test_command_line_errors(self):
        raw = os.path.join(self.tmp, "a.raw")
        cases = [
            ["--object", "foo,id=x"],
            ["--blockdev", "driver=bogus"],
            ["--monitor", "chardev=nope"],
            ["--export", "type=nbd,id=e,node-name=zz"],
            ["--blockdev", "driver=null-co,node-name=n", "--export", "type=nbd,id=e,node-name=n"],
            ["--nbd-server", "addr.type=unix"],
            ["--bogus"],
            ["foo"],
            ["--blockdev", "driver=file,node-name=f,filename=/nonexistent/vblk"],
            ["--blockdev", "driver=file,node-name=f,filename=%s" % raw,
             "--blockdev", "driver=file,node-name=f,filename=%s" % raw],
            ["--export", "type=nbd,node-name=n"],
            ["--blockdev", '{"driver":"null-co","node-name":"x"'],
            ["--blockdev", "driver=null-co,node-name=x,read-zeroes=maybe"],
            ["--chardev", "socket,path=%s,server=on,wait=off,id=m" % os.path.join(self.tmp, "c1"),
             "--chardev", "socket,path=%s,server=on,wait=off,id=m" % os.path.join(self.tmp, "c2")],
            ["-x"], ["-T"], ["--blockdev"],
            # An export's iothread must exist (every type; checked after
            # the node and its read-only state).
            ["--object", "iothread,id=io0", "--blockdev", "driver=null-co,node-name=n", "--nbd-server",
             "addr.type=unix,addr.path=%s" % os.path.join(self.tmp, "io.sock"),
             "--export", "type=nbd,id=e,node-name=n,iothread=io1"],
            ["--blockdev", "driver=null-co,node-name=n,read-only=on", "--export",
             "type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path=%s,iothread=io1,writable=on"
             % os.path.join(self.tmp, "vu.sock")],
            ["--blockdev", "driver=null-co,node-name=n", "--export",
             "type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path=%s,iothread=io1"
             % os.path.join(self.tmp, "vu.sock")],
        ]
        self.images()
        for args in cases:
            q = run(QSD_CMD + args, timeout=30)
            v = run(VBLK_CMD + args, timeout=30)
            self.assertEqual(v.rc, q.rc, (args, v, q))
            # getopt's messages name argv[0] as given (a path for qsd).
            qerr = re.sub(r"(?m)^\S*qemu-storage-daemon: ", "DAEMON: ", q.stderr)
            verr = re.sub(r"(?m)^\S*%s: " % re.escape(os.path.basename(VBLK)), "DAEMON: ", v.stderr)
            self.assertEqual(verr, qerr, args)

    def test_same_command_line_pidfile_signal(self):
        raw = os.path.join(self.tmp, "a.raw")
        pid = os.path.join(self.tmp, "pid")

        def scenario(cmd):
            self.images()
            d = self.start(cmd, ["--blockdev", "driver=file,node-name=f0,filename=%s" % raw,
                                 "--blockdev", "driver=raw,node-name=r0,file=f0",
                                 "--nbd-server", "addr.type=unix,addr.path=%s,max-connections=4" % self.nbd,
                                 "--export", "type=nbd,id=e0,node-name=r0,name=disk,writable=on",
                                 "--object", "iothread,id=io0",
                                 "--pidfile", pid])
            d.wait_socket(pid)
            time.sleep(0.2)
            with open(pid) as f:
                written = int(f.read().strip())
            r = qemu("compare", "-f", "raw", "-F", "raw", raw, "nbd+unix:///disk?socket=%s" % self.nbd)
            out = [written == d.proc.pid, r.rc]
            out.append(d.stop(signal.SIGINT))
            out.append((os.path.exists(pid), os.path.exists(self.mon)))
            return out
        self.assertBoth(scenario)

    def test_daemonize(self):
        pid = os.path.join(self.tmp, "pid")

        def scenario(cmd):
            args = ["--chardev", "socket,path=%s,server=on,wait=off,id=m" % self.mon, "--monitor", "chardev=m",
                    "--blockdev", "driver=null-co,node-name=n0", "--daemonize", "--pidfile", pid]
            r = run(cmd + args, timeout=30)
            out = [r.rc, r.stdout, os.path.exists(self.mon)]
            with open(pid) as f:
                p = int(f.read().strip())
            c = QMP(self.mon).negotiate()
            out.append(norm_names(c.cmd("query-named-block-nodes")["return"][0]["node-name"]))
            out.append(c.cmd("quit"))
            c.close()
            end = time.time() + 20
            while time.time() < end:
                try:
                    os.kill(p, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            out.append(os.path.exists(pid))
            return out
        self.assertBoth(scenario)

    def test_mlock(self):
        """vblk's --mlock (qsd has none): the serving process's memory is
        locked as it is touched and it serves; without the privilege or the
        limit to lock, it fails at once with the limit in the message."""
        raw, _ = self.images()
        d = self.start(VBLK_CMD, ["--mlock", "--blockdev", "driver=file,node-name=f0,filename=%s" % raw,
                                  "--nbd-server", "addr.type=unix,addr.path=%s" % self.nbd,
                                  "--export", "type=nbd,id=e0,node-name=f0,writable=on"])
        d.wait_socket(self.nbd)
        with open("/proc/%d/maps" % d.proc.pid) as f:
            if "libasan" in f.read():
                # ASan intercepts mlockall and makes it a no-op.
                self.skipTest("mlockall does nothing under AddressSanitizer")
        uri = "nbd+unix:///f0?socket=%s" % self.nbd
        r = run([QEMU_IO, "-f", "raw", "-c", "write -P 0x6d 0 512k", "-c", "read -P 0x6d 0 512k", uri])
        self.assertEqual(r.rc, 0, r)
        with open("/proc/%d/status" % d.proc.pid) as f:
            locked = int(re.search(r"VmLck:\s+(\d+) kB", f.read()).group(1))
        self.assertGreater(locked, 0)
        self.assertEqual(d.stop(), 0)
        # Without CAP_IPC_LOCK and a 64 KiB limit: a clear error, exit 1,
        # nothing served (the monitor socket is never created).
        if os.path.exists(self.mon):
            os.unlink(self.mon)
        r = run(["prlimit", "--memlock=65536:65536", "setpriv", "--bounding-set", "-ipc_lock"] + VBLK_CMD +
                ["--mlock", "--chardev", "socket,path=%s,server=on,wait=off,id=m" % self.mon, "--monitor",
                 "chardev=m", "--blockdev", "driver=file,node-name=f0,filename=%s" % raw])
        self.assertEqual(r.rc, 1, r)
        self.assertIn("--mlock: cannot lock memory", r.stderr)
        self.assertIn("RLIMIT_MEMLOCK is 65536 bytes", r.stderr)
        self.assertFalse(os.path.exists(self.mon))


if __name__ == "__main__":
    unittest.main()
