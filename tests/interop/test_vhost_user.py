#!/usr/bin/env python3
"""Interop: vhost-user-blk back ends driven by vblk-vhost-client.

The client (tests/tools/vhost_user/, $VBLK_VHOST_CLIENT) is the host side of
a vhost-user-blk device, QEMU's role: it negotiates over the unix socket,
hands the back end memfd guest memory and split virtqueues, and issues
virtio-blk requests. Each scenario runs against every back end in DAEMONS
(now qemu-storage-daemon 7.2; `vblk` goes there when vblk serves
vhost-user-blk). Data is checked against the image file read on the host.

What qemu-storage-daemon 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18) answers,
export type=vhost-user-blk,writable=on,num-queues=2 on a raw file node:

  GET_FEATURES 0x175007e46: BLK_SIZE_MAX(1) BLK_SEG_MAX(2) BLK_BLK_SIZE(6)
    BLK_FLUSH(9) BLK_TOPOLOGY(10) BLK_CONFIG_WCE(11) BLK_MQ(12)
    BLK_DISCARD(13) BLK_WRITE_ZEROES(14) NOTIFY_ON_EMPTY(24) LOG_ALL(26)
    RING_INDIRECT_DESC(28) RING_EVENT_IDX(29) PROTOCOL_FEATURES(30)
    VERSION_1(32); BLK_RO(5) added when writable=off (0x175007e66).
    Not offered: GEOMETRY, RING_PACKED, IN_ORDER, ACCESS_PLATFORM,
    SECURE_ERASE, LIFETIME.
  GET_PROTOCOL_FEATURES 0x8f2b: MQ(0) LOG_SHMFD(1) REPLY_ACK(3)
    BACKEND_REQ(5) PAGEFAULT(8) CONFIG(9) BACKEND_SEND_FD(10)
    HOST_NOTIFIER(11) CONFIGURE_MEM_SLOTS(15). NOT INFLIGHT_SHMFD (12): a
    front end cannot hand qsd 7.2 an inflight area, so after a back-end
    crash the front end resubmits what was outstanding itself.
  GET_QUEUE_NUM: num-queues (1 by default).
  GET_CONFIG (60 bytes): capacity = size/512, size_max 0, seg_max 126,
    geometry 0/0/0, blk_size 512 (logical-block-size), physical_block_exp
    0, alignment_offset 0, min_io_size 1, opt_io_size 1, wce 0,
    num_queues = num-queues, max_discard_sectors 32768, max_discard_seg 1,
    discard_sector_alignment 1, max_write_zeroes_sectors 32768,
    max_write_zeroes_seg 1, write_zeroes_may_unmap 0.
  SET_CONFIG of wce (offset 32, 1 byte, flags 0): accepted (REPLY_ACK 0);
    GET_CONFIG then shows wce 1.
  Every message with need_reply is acked with u64 0 - even one it does not
    know (type 99: "vu_panic: Unhandled request", ack 0, then disconnect).
  Requests: OUT/IN/FLUSH/DISCARD/WRITE_ZEROES -> OK; GET_ID -> OK with
    "vhost_user_blk" (used len 21); an unknown type (99) -> UNSUPP; a read
    or write past the end, or not a multiple of 512 bytes -> IOERR; on a
    read-only export OUT/DISCARD/WRITE_ZEROES -> IOERR, FLUSH -> OK. The
    used length is data + 1 for reads even when the status is IOERR;
    1 for writes. WRITE_ZEROES' unmap flag is ignored.
  Malformed input (hostile kinds; qsd's log line in quotes). "disconnect"
  means vu_panic: qsd closes the connection, stays up, and accepts the next
  client on the same export:
    desc-addr-out-of-range   disconnect  "virtio: invalid address for buffers"
    desc-len-past-region     disconnect  (same)
    desc-loop                disconnect  "Looped descriptor"
    next-out-of-range        disconnect  "Desc next is 135"
    head-out-of-range        disconnect  "Guest says index 131 is available"
    indirect-out-of-range    disconnect  "Invalid indirect buffer table"
    indirect-nested          no reply, request dropped ("virtio-blk request
                             missing headers"), connection kept
    indirect-bad-len         disconnect  "Invalid size for indirect buffer table"
    queue-size-zero          SET_VRING_NUM 0 acked; the first request:
                             disconnect "Virtqueue size exceeded"
    avail-idx-jump           disconnect  (qsd 7.2 says "Virtqueue size
                             exceeded" here, not the "Guest moved used
                             index" check)
    read-into-readonly       reply OK, used len 1 (reads 0 bytes: the
                             readable data buffer is ignored)
    write-from-writable      reply OK, used len 4097 (writes 0 bytes)
    header-too-short         no reply, dropped ("outhdr too short"), kept
    no-writable-status       no reply, dropped ("missing headers"), kept
    zero-length-desc         disconnect  "zero sized buffers are not allowed"
    writable-before-readable disconnect  "Incorrect order for descriptors"
    msg-unknown-request      ack 0, then disconnect
    msg-oversize             disconnect  "too big message request"
    msg-bad-vring-index      ack 0, then disconnect "Invalid queue index: 200"
    msg-mem-table-no-fd      ack 0, then disconnect "region mmap error"
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import MiB, VBLK, InteropTestCase, make_image, make_tempdir, rand_bytes, read_range, shm_dir  # noqa: E402

QSD = shutil.which("qemu-storage-daemon")


def _find_client():
    env = os.environ.get("VBLK_VHOST_CLIENT")
    if env:
        return env
    for cand in (os.path.join(os.path.dirname(VBLK), "tests", "vblk-vhost-client"),
                 os.path.join(os.path.dirname(VBLK), "vblk-vhost-client")):
        if os.access(cand, os.X_OK):
            return cand
    return None


CLIENT = _find_client()

# ---------------------------------------------------------------------------
# The pattern the client writes (vhost_user_client.h fill_pattern): byte at
# absolute offset o is byte o % 8 of splitmix64(seed ^ (o // 8)), LE.
# ---------------------------------------------------------------------------

_M = (1 << 64) - 1


def _splitmix64(x):
    x = (x + 0x9e3779b97f4a7c15) & _M
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & _M
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & _M
    return x ^ (x >> 31)


def pattern(seed, offset, length):
    first, last = offset // 8, (offset + length + 7) // 8
    b = b"".join(_splitmix64(seed ^ w).to_bytes(8, "little") for w in range(first, last))
    skip = offset - first * 8
    return b[skip:skip + length]


def fnv1a64(data):
    h = 0xcbf29ce484222325
    for c in data:
        h = ((h ^ c) * 0x100000001b3) & _M
    return "%016x" % h


# ---------------------------------------------------------------------------
# Back ends. Each factory takes (workdir, exports, throttle_bps) where
# exports is a list of {"image", "writable", "num_queues"}, and returns an
# object with .socks (one unix socket per export, in order), .pid,
# .alive(), .stop(), .kill(), .restart() and .log_text(). `expect` holds
# what the scenarios check beyond the protocol's rules (qsd's observed
# answers; a back end without an entry is checked against the rules only).
# ---------------------------------------------------------------------------

class QsdBackend:
    name = "qemu-storage-daemon"
    available = QSD is not None
    command = [QSD] if QSD else []
    env = {}
    expect = {
        "features": 0x175007e46,
        "protocol_features": 0x8f2b,
        "config": {"size_max": 0, "seg_max": 126, "blk_size": 512, "min_io_size": 1, "opt_io_size": 1,
                   "wce": 0, "max_discard_sectors": 32768, "max_discard_seg": 1,
                   "discard_sector_alignment": 1, "max_write_zeroes_sectors": 32768,
                   "max_write_zeroes_seg": 1, "write_zeroes_may_unmap": 0},
        "getid": "vhost_user_blk",
        "hostile": {
            "desc-addr-out-of-range": "disconnect", "desc-len-past-region": "disconnect",
            "desc-loop": "disconnect", "next-out-of-range": "disconnect",
            "head-out-of-range": "disconnect", "indirect-out-of-range": "disconnect",
            "indirect-nested": "no_reply", "indirect-bad-len": "disconnect",
            "queue-size-zero": "disconnect", "avail-idx-jump": "disconnect",
            "read-into-readonly": "reply:OK", "write-from-writable": "reply:OK",
            "header-too-short": "no_reply", "no-writable-status": "no_reply",
            "zero-length-desc": "disconnect", "writable-before-readable": "disconnect",
            "msg-unknown-request": "reply", "msg-oversize": "disconnect",
            "msg-bad-vring-index": "reply", "msg-mem-table-no-fd": "reply",
        },
    }

    def __init__(self, workdir, exports, throttle_bps=None, file_opts=""):
        self.workdir = workdir
        self.exports = exports
        self.socks = [os.path.join(workdir, "vhost%d.sock" % i) for i in range(len(exports))]
        self.argv = list(self.command)
        if throttle_bps:
            self.argv += ["--object", "throttle-group,id=tg0,x-bps-total=%d" % throttle_bps]
        for i, e in enumerate(exports):
            self.argv += ["--blockdev", "driver=file,filename=%s,node-name=f%d%s" % (e["image"], i, file_opts)]
            top = "r%d" % i if throttle_bps else "d%d" % i
            self.argv += ["--blockdev", "driver=raw,file=f%d,node-name=%s" % (i, top)]
            if throttle_bps:
                self.argv += ["--blockdev", "driver=throttle,throttle-group=tg0,file=%s,node-name=d%d" % (top, i)]
            self.argv += ["--export", "type=vhost-user-blk,id=e%d,node-name=d%d,addr.type=unix,addr.path=%s,"
                          "writable=%s,num-queues=%d" % (i, i, self.socks[i], "on" if e.get("writable", True)
                                                         else "off", e.get("num_queues", 2))]
        self.log = os.path.join(workdir, "qsd.log")
        self.proc = None
        self.start()

    def start(self):
        for s in self.socks:
            if os.path.exists(s):
                os.unlink(s)
        self.logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.logf, stderr=self.logf,
                                     env=dict(os.environ, **self.env))
        self.pid = self.proc.pid
        end = time.time() + 10
        while not all(os.path.exists(s) for s in self.socks):
            if self.proc.poll() is not None or time.time() > end:
                raise AssertionError("%s did not start: %s" % (self.name, self.log_text()))
            time.sleep(0.02)

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.logf.close()

    def restart(self):
        self.start()

    def stop(self):
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.logf.closed:
            self.logf.close()
        return self.proc.returncode

    def log_text(self):
        with open(self.log, "rb") as f:
            return f.read().decode("utf-8", "replace")


class VblkBackend(QsdBackend):
    """`vblk serve` with the same command line. Where it answers otherwise
    than qemu-storage-daemon 7.2, on purpose:
      - wce is 1: the export caches writes unless writethrough=on, and says
        so, so a guest sends flushes (qsd 7.2 says 0 and caches anyway: a
        guest's fsync never reaches the image); write_zeroes_may_unmap is 1
        and the unmap flag is honoured (qsd ignores it);
      - features: no SIZE_MAX (qsd offers it with size_max 0), no
        NOTIFY_ON_EMPTY or LOG_ALL (no migration dirty log); protocol
        features: MQ, REPLY_ACK, CONFIG and INFLIGHT_SHMFD (qsd 7.2 lacks
        the last, so requests in flight when it dies are lost to QEMU);
      - a malformed request the device cannot answer (header too short, no
        writable status byte, a nested indirect table) ends the connection
        as every other ring error does, where qsd drops the request and
        leaves the driver waiting for it forever;
      - a zero-length descriptor is not an error (the virtio spec allows
        it; qsd disconnects): a read with a zero-length data buffer
        completes OK with no data;
      - SET_VRING_NUM 0 is refused at once (REPLY_ACK 1, disconnect), not
        at the first request; a need_reply message that fails is acked 1,
        not 0, before the disconnect."""
    name = "vblk"
    available = os.access(VBLK, os.X_OK) and os.path.basename(VBLK) == "vblk"
    command = [VBLK, "serve"]
    expect = {
        "features": 0x170007e44,
        "protocol_features": 0x1209,
        "config": {"size_max": 0, "seg_max": 126, "blk_size": 512, "min_io_size": 1, "opt_io_size": 1,
                   "wce": 1, "max_discard_sectors": 32768, "max_discard_seg": 1,
                   "discard_sector_alignment": 1, "max_write_zeroes_sectors": 32768,
                   "max_write_zeroes_seg": 1, "write_zeroes_may_unmap": 1},
        "getid": "vhost_user_blk",
        "hostile": {
            "desc-addr-out-of-range": "disconnect", "desc-len-past-region": "disconnect",
            "desc-loop": "disconnect", "next-out-of-range": "disconnect",
            "head-out-of-range": "disconnect", "indirect-out-of-range": "disconnect",
            "indirect-nested": "disconnect", "indirect-bad-len": "disconnect",
            "queue-size-zero": "refused", "avail-idx-jump": "disconnect",
            "read-into-readonly": "reply:OK", "write-from-writable": "reply:OK",
            "header-too-short": "disconnect", "no-writable-status": "disconnect",
            "zero-length-desc": "reply:OK", "writable-before-readable": "disconnect",
            "msg-unknown-request": "reply", "msg-oversize": "disconnect",
            "msg-bad-vring-index": "reply", "msg-mem-table-no-fd": "reply",
        },
    }


class VblkNoUringBackend(VblkBackend):
    """vblk without io_uring: the socket, kick and call descriptors wait in
    the epoll fallback instead of the ring."""
    name = "vblk-no-io-uring"
    env = {"VBLK_NO_IO_URING": "1"}


# The back ends the scenarios run against.
DAEMONS = {
    "qemu-storage-daemon": QsdBackend,
    "vblk": VblkBackend,
    "vblk-no-io-uring": VblkNoUringBackend,
}


def client(*args, timeout=120, stdin=None):
    """Runs vblk-vhost-client; returns (exit code, parsed JSON, stderr)."""
    p = subprocess.run([CLIENT] + [str(a) for a in args], input=stdin, capture_output=True, timeout=timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        raise AssertionError("client printed no JSON: rc=%d stdout=%r stderr=%r" % (p.returncode, p.stdout, p.stderr))
    return p.returncode, doc, p.stderr.decode("utf-8", "replace")


class VhostUserScenarios:
    """Mixed into one TestCase per back end (backend = its DAEMONS entry)."""

    backend = None
    SIZE = 64 * MiB

    def setUp(self):
        super().setUp()
        if not CLIENT:
            self.skipTest("vblk-vhost-client not built (VBLK_VHOST_CLIENT)")
        if not self.backend.available:
            self.skipTest("%s not installed" % self.backend.name)
        # Images on tmpfs when there is one; sockets beside them.
        self.dir = make_tempdir(self, base=shm_dir(), prefix="vblk-vhost-")

    def start(self, exports=None, **kw):
        if exports is None:
            img = make_image(os.path.join(self.dir, "disk0.raw"), self.SIZE)
            exports = [{"image": img, "writable": True, "num_queues": 2}]
        d = self.backend(self.dir, exports, **kw)
        self.addCleanup(d.stop)
        return d

    def io(self, sock, *script, opts=(), expect_rc=None):
        rc, doc, err = client("io", sock, *opts, *script)
        self.assertNotIn("error", doc, err)
        if expect_rc is not None:
            self.assertEqual(rc, expect_rc, doc)
        return doc

    # -- negotiation and config -------------------------------------------

    def test_negotiation(self):
        d = self.start()
        rc, info, err = client("info", d.socks[0])
        self.assertEqual(rc, 0, err)
        names = set(info["feature_names"])
        for f in ("VERSION_1", "PROTOCOL_FEATURES", "BLK_FLUSH", "BLK_DISCARD", "BLK_WRITE_ZEROES",
                  "BLK_BLK_SIZE", "BLK_SEG_MAX", "BLK_CONFIG_WCE", "BLK_MQ", "RING_EVENT_IDX",
                  "RING_INDIRECT_DESC"):
            self.assertIn(f, names)
        self.assertNotIn("BLK_RO", names)
        pnames = set(info["protocol_feature_names"])
        for f in ("MQ", "CONFIG", "REPLY_ACK"):
            self.assertIn(f, pnames)
        self.assertEqual(info["queue_num"], 2)
        exp = self.backend.expect
        if "features" in exp:
            self.assertEqual(int(info["features"], 16), exp["features"])
            self.assertEqual(int(info["protocol_features"], 16), exp["protocol_features"])
        # Without REPLY_ACK, EVENT_IDX and INDIRECT the same session works.
        doc = self.io(d.socks[0], "write 0 4k 7", "read 0 4k expect 7",
                      opts=("--reply-ack", "off", "--event-idx", "off", "--indirect", "off"), expect_rc=0)
        acked = doc["protocol_feature_names_acked"]
        self.assertEqual([f for f in acked if f != "INFLIGHT_SHMFD"], ["MQ", "CONFIG"])
        self.assertFalse(doc["event_idx"])
        self.assertFalse(doc["indirect"])

    def test_config(self):
        d = self.start()
        _, info, _ = client("info", d.socks[0])
        c = info["config"]
        self.assertEqual(c["capacity"], self.SIZE // 512)
        self.assertEqual(c["num_queues"], 2)
        self.assertGreaterEqual(c["blk_size"], 512)
        self.assertGreater(c["seg_max"], 0)
        self.assertGreater(c["max_discard_sectors"], 0)
        self.assertGreater(c["max_write_zeroes_sectors"], 0)
        for k, v in self.backend.expect.get("config", {}).items():
            self.assertEqual(c[k], v, k)
        # wce is writable through SET_CONFIG and reads back.
        doc = self.io(d.socks[0], "wce 1", "config", "wce 0")
        self.assertEqual(doc["results"][0]["ack"], 0)
        self.assertEqual(doc["results"][0]["wce"], 1)
        self.assertEqual(doc["results"][1]["config"]["wce"], 1)
        self.assertEqual(doc["results"][2]["wce"], 0)

    # -- requests ------------------------------------------------------------

    def test_every_request_type(self):
        d = self.start()
        img = d.exports[0]["image"]
        host = rand_bytes(64 * 1024, "vhost-host")
        with open(img, "r+b") as f:
            f.seek(32 * MiB)
            f.write(host)
        save = os.path.join(self.dir, "read.bin")
        doc = self.io(d.socks[0],
                      "write 0 1M rand:11", "write 2M 4k 0xab", "wait",
                      "read 0 1M expect rand:11", "read 32M 64k save %s" % save,
                      "flush", "getid", "discard 2M 4k", "zero 1M 64k", "zero 1536k 4k unmap", "wait",
                      "read 1M 64k expect 0", "raw 99", "raw 99 in 4k", expect_rc=1)
        st = {r["cmd"]: r.get("status") for r in doc["results"] if "status" in r}
        for cmd, s in st.items():
            if cmd.startswith("raw"):
                self.assertEqual(s, "UNSUPP", cmd)
            else:
                self.assertEqual(s, "OK", cmd)
        res = {r["cmd"]: r for r in doc["results"]}
        self.assertTrue(res["read 0 1M expect rand:11"]["match"])
        self.assertTrue(res["read 1M 64k expect 0"]["match"])
        self.assertEqual(res["read 0 1M expect rand:11"]["used_len"], MiB + 1)
        with open(save, "rb") as f:
            self.assertEqual(f.read(), host)
        if "getid" in self.backend.expect:
            self.assertEqual(res["getid"]["id"], self.backend.expect["getid"])
        # What the back end wrote is in the image.
        self.assertEqual(read_range(img, 0, MiB), pattern(11, 0, MiB))
        self.assertEqual(read_range(img, MiB, 64 * 1024), bytes(64 * 1024))

    def test_errors(self):
        d = self.start()
        end = self.SIZE
        doc = self.io(d.socks[0], "read %d 4k" % end, "read %d 8k" % (end - 4096), "write %d 4k 1" % end,
                      "write 0 1000 1", "read 0 1000", "discard %d 4k" % end, "zero %d 4k" % end,
                      "raw 99", "raw 10 in 512", expect_rc=1)
        st = [r["status"] for r in doc["results"]]
        self.assertEqual(st[:7], ["IOERR"] * 7)
        self.assertEqual(st[7:], ["UNSUPP"] * 2)

    def test_read_only(self):
        img = make_image(os.path.join(self.dir, "ro.raw"), 8 * MiB, data=[(0, b"\x5a" * 4096)])
        d = self.start([{"image": img, "writable": False, "num_queues": 1}])
        _, info, _ = client("info", d.socks[0])
        self.assertIn("BLK_RO", info["feature_names"])
        self.assertEqual(info["queue_num"], 1)
        doc = self.io(d.socks[0], "write 0 4k 1", "discard 0 4k", "zero 0 4k", "flush", "read 0 4k expect 0x5a")
        self.assertEqual([r["status"] for r in doc["results"]], ["IOERR", "IOERR", "IOERR", "OK", "OK"])
        self.assertTrue(doc["results"][4]["match"])
        self.assertEqual(read_range(img, 0, 4096), b"\x5a" * 4096)

    def test_ring_options(self):
        """EVENT_IDX and INDIRECT_DESC on and off, two queues, many in flight,
        buffers split over three memory regions."""
        d = self.start()
        seed = 100
        for ev in ("on", "off"):
            for ind in ("on", "off"):
                with self.subTest(event_idx=ev, indirect=ind):
                    seed += 1
                    rc, doc, err = client("verify", d.socks[0], "--event-idx", ev, "--indirect", ind,
                                          "--queues", 2, "--qd", 24, "--size", "4M", "--bs", "64k",
                                          "--max-seg", "16k", "--mem-regions", 3, "--seed", seed)
                    self.assertEqual(rc, 0, (doc, err))
                    self.assertEqual(doc["event_idx"], ev == "on")
                    self.assertEqual(doc["indirect"], ind == "on")
                    self.assertEqual(doc["bytes_read"], 4 * MiB)
                    self.assertEqual(read_range(d.exports[0]["image"], 3 * MiB, 4096), pattern(seed, 3 * MiB, 4096))

    def test_ring_wrap(self):
        """More than 65536 requests on an 8-entry queue: the 16-bit avail and
        used indices wrap twice."""
        d = self.start()
        rc, doc, err = client("verify", d.socks[0], "--queue-size", 8, "--qd", 8, "--size", "35000k",
                              "--bs", 512, "--seed", 77, "--event-idx", "on")
        self.assertEqual(rc, 0, (doc, err))
        self.assertEqual(doc["bytes_written"], 35000 * 1024)
        img = d.exports[0]["image"]
        for off in (0, 512 * 65535, 512 * 65536, 35000 * 1024 - 512):
            self.assertEqual(read_range(img, off, 512), pattern(77, off, 512), off)

    def test_two_queues(self):
        d = self.start()
        script = ["@0 write 0 64k rand:5", "@1 write 64k 64k rand:5", "wait",
                  "@1 read 0 128k expect rand:5", "@0 read 0 128k expect rand:5", "stop"]
        doc = self.io(d.socks[0], *script, opts=("--queues", 2, "--qd", 4))
        r = doc["results"]
        self.assertEqual([x.get("queue") for x in r[:5]], [0, 1, None, 1, 0])
        self.assertTrue(r[3]["match"] and r[4]["match"])
        # GET_VRING_BASE: each queue consumed two requests.
        self.assertEqual(r[5]["vring_bases"], [2, 2])
        # More queues than GET_QUEUE_NUM / num_queues: the client refuses.
        rc, doc, _ = client("io", d.socks[0], "--queues", 3, "flush")
        self.assertEqual(rc, 3)
        self.assertIn("queues", doc["error"])

    def test_host_data(self):
        """Data written on the host reads back through the back end, and the
        other way round, split into 4 KiB descriptors over 8 regions."""
        d = self.start()
        img = d.exports[0]["image"]
        data = rand_bytes(256 * 1024, "host-data")
        with open(img, "r+b") as f:
            f.seek(5 * MiB)
            f.write(data)
        doc = self.io(d.socks[0], "read 5M 256k", "write 9M 256k rand:3", opts=("--mem-regions", 8,
                                                                                 "--max-seg", "4k"))
        self.assertEqual(doc["results"][0]["fnv1a64"], fnv1a64(data))
        self.assertEqual(read_range(img, 9 * MiB, 256 * 1024), pattern(3, 9 * MiB, 256 * 1024))

    # -- reconnection ----------------------------------------------------------

    def test_reconnect_after_kill(self):
        """The back end is killed with requests in flight and started again;
        the client reconnects, the outstanding requests complete, and the
        data verifies (through the back end and in the image)."""
        img = make_image(os.path.join(self.dir, "disk0.raw"), self.SIZE)
        d = self.start([{"image": img, "writable": True, "num_queues": 2}], throttle_bps=16 * MiB)
        p = subprocess.Popen([CLIENT, "verify", d.socks[0], "--queues", "2", "--qd", "16", "--size", "16M",
                              "--bs", "64k", "--seed", "21", "--reconnect", "20"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # Kill once the first writes have landed (the rest are in flight,
        # held by the throttle), however slow the machine is.
        end = time.time() + 30
        while read_range(img, 0, 65536) == bytes(65536):
            self.assertLess(time.time(), end, "no write reached the image")
            time.sleep(0.02)
        self.assertIsNone(p.poll())
        d.kill()
        time.sleep(0.3)
        d.restart()
        out, err = p.communicate(timeout=120)
        doc = json.loads(out)
        self.assertEqual(p.returncode, 0, (doc, err, d.log_text()))
        self.assertEqual(doc["reconnects"], 1)
        self.assertGreater(doc["resubmitted"], 0)
        self.assertEqual(doc["mismatches"], 0)
        self.assertEqual(read_range(img, 0, 16 * MiB), pattern(21, 0, 16 * MiB))

    # -- hostile input ------------------------------------------------------------

    def test_hostile(self):
        """Each malformed ring or message against export 0 of a daemon with
        two exports: the daemon stays up, export 0 serves a new client, and
        export 1 keeps working."""
        img0 = make_image(os.path.join(self.dir, "h0.raw"), 8 * MiB)
        img1 = make_image(os.path.join(self.dir, "h1.raw"), 8 * MiB)
        d = self.start([{"image": img0, "writable": True, "num_queues": 1},
                        {"image": img1, "writable": True, "num_queues": 1}])
        _, kinds, _ = client("hostile", d.socks[0], "list")
        expect = self.backend.expect.get("hostile", {})
        seen = {}
        for i, k in enumerate(kinds):
            kind = k["kind"]
            with self.subTest(kind=kind):
                rc, r, err = client("hostile", d.socks[0], kind, "--timeout", 1.5)
                self.assertEqual(rc, 0, err)
                outcome = r["outcome"] + (":" + r["status"] if r["outcome"] == "reply" and "status" in r else "")
                seen[kind] = outcome
                self.assertTrue(d.alive(), "%s: the daemon died: %s" % (kind, d.log_text()[-2000:]))
                self.assertTrue(r["recovered"], r)
                if kind in expect:
                    self.assertEqual(outcome, expect[kind], r)
                else:
                    self.assertNotIn(outcome, ("reply:unwritten",), r)
                doc = self.io(d.socks[1], "write %d 4k %d" % (i * 4096, i + 1),
                              "read %d 4k expect %d" % (i * 4096, i + 1), expect_rc=0)
                self.assertTrue(doc["results"][1]["match"])
        sys.stderr.write("\n%s hostile outcomes: %s\n" % (self.backend.name, json.dumps(seen)))


class VblkStallWatchBackend(VblkBackend):
    """vblk with a one-second stall watch (60 s by default)."""
    env = {"VBLK_VHOST_STALL_SECONDS": "1"}


class TestVhostUserStallWatch(InteropTestCase):
    """vblk's stall watch (qemu-storage-daemon has none): a queue with work
    outstanding that stops moving is reported once, with both sides' ring
    indices and whose move it is, and again when it moves; an idle queue
    is never reported."""

    def setUp(self):
        super().setUp()
        if not CLIENT:
            self.skipTest("vblk-vhost-client not built (VBLK_VHOST_CLIENT)")
        if not VblkBackend.available:
            self.skipTest("vblk not built")
        self.dir = make_tempdir(self, base=shm_dir(), prefix="vblk-vhost-stall-")

    def start(self, **kw):
        img = make_image(os.path.join(self.dir, "disk0.raw"), 16 * MiB)
        log = os.path.join(self.dir, "qsd.log")
        since = os.path.getsize(log) if os.path.exists(log) else 0
        d = VblkStallWatchBackend(self.dir, [{"image": img, "writable": True, "num_queues": 1}], **kw)
        d.since = since  # daemons in one test share the log
        self.addCleanup(d.stop)
        return d

    def reports(self, d):
        return [line for line in d.log_text()[d.since:].splitlines() if "vhost-user-blk " in line]

    def run_client(self, d, *script, opts=()):
        rc, doc, err = client("io", d.socks[0], "--qd", 4, *opts, *script)
        self.assertEqual(rc, 0, (doc, err, d.log_text()))
        return doc

    def test_idle_is_not_a_stall(self):
        d = self.start()
        self.run_client(d, "write 0 64k 0x11", "wait", "sleep 2500")
        self.assertEqual(self.reports(d), [])

    def test_kick_not_sent(self):
        # Made available without a kick: the daemon's side, not popped.
        d = self.start()
        self.run_client(d, "write 0 4k 0x11", "publish", "sleep 2500", "wait", "sleep 1000")
        r = self.reports(d)
        self.assertEqual(len(r), 2, r)
        self.assertIn("queue 0 stalled for", r[0])
        self.assertIn("1 request(s) available and not popped", r[0])
        self.assertIn("avail idx 1, popped 0, used idx 0", r[0])
        self.assertIn("queue 0 moving again after", r[1])

    def test_interrupt_not_consumed(self):
        # Completed and signalled; the driver does not look for 2.5 s: with
        # EVENT_IDX its used_event shows it has not consumed the completion.
        d = self.start()
        self.run_client(d, "write 0 4k 0x11", "kick", "sleep 2500", "wait", "write 4k 4k 0x12", "wait",
                        "sleep 1000", opts=("--event-idx", "on"))
        r = self.reports(d)
        self.assertEqual(len(r), 2, r)
        self.assertIn("every request completed and signalled", r[0])
        self.assertIn("consumed completions only up to 0 of 1", r[0])
        self.assertIn("last interrupt at used idx 1", r[0])
        self.assertIn("moving again", r[1])
        # Without EVENT_IDX the daemon cannot see the driver consume: that
        # queue looks idle, and nothing is said.
        d.stop()
        d2 = self.start()
        self.run_client(d2, "write 0 4k 0x11", "kick", "sleep 2500", "wait", opts=("--event-idx", "off"))
        self.assertEqual(self.reports(d2), [])

    def test_request_held_by_the_node(self):
        # A node throttled to 4 KiB/s: the first 32 KiB write goes out of
        # the burst allowance, the second is held about 8 s: popped, not
        # completed.
        d = self.start(throttle_bps=4096)
        doc = self.run_client(d, "write 0 32k 0x11", "wait", "write 32k 32k 0x12", "wait", "sleep 1000",
                              opts=("--timeout", 60))
        self.assertEqual([x.get("status") for x in doc["results"] if "status" in x], ["OK", "OK"])
        r = self.reports(d)
        self.assertEqual(len(r), 2, r)
        self.assertIn("1 request(s) popped and not completed", r[0])
        self.assertIn("avail idx 2, popped 2, used idx 1", r[0])
        self.assertIn("moving again", r[1])


def _make_cases():
    for name, cls in DAEMONS.items():
        tc = type("TestVhostUser_" + name.replace("-", "_"), (VhostUserScenarios, InteropTestCase),
                  {"backend": cls})
        globals()[tc.__name__] = tc


_make_cases()

if __name__ == "__main__":
    unittest.main()
