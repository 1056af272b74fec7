#!/usr/bin/env python3
"""Interop: block-export-add type=vhost-user-blk over QMP, side by side with
qemu-storage-daemon 7.2: the same commands get the same errors, the export
lists, and block-export-del refuses while a front end is attached (mode
safe) and disconnects it (mode hard), with BLOCK_EXPORT_DELETED.

The front end is vblk-vhost-client (tests/tools/vhost_user/)."""

import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

import unittest  # noqa: E402

from common import BothDaemons, InteropTestCase, MiB, make_image, storage_daemons  # noqa: E402
from test_vhost_user import CLIENT, client  # noqa: E402


def add_nodes(qmp, d):
    img = make_image(os.path.join(d, "disk.raw"), 16 * MiB)
    qmp.ok("blockdev-add", {"driver": "file", "filename": img, "node-name": "f0"})
    qmp.ok("blockdev-add", {"driver": "raw", "file": "f0", "node-name": "d0"})
    qmp.ok("blockdev-add", {"driver": "file", "filename": img, "node-name": "f1", "read-only": True,
                            "locking": "off"})
    return img


def export_args(d, **kw):
    a = {"type": "vhost-user-blk", "id": "e0", "node-name": "d0",
         "addr": {"type": "unix", "path": os.path.join(d, "vhost.sock")}}
    a.update(kw)
    return a


def error(r):
    return r.get("error", {}).get("desc", "OK" if "return" in r else repr(r))


class VhostUserQmpTest(BothDaemons, InteropTestCase):
    def setUp(self):
        super().setUp()
        if len(storage_daemons()) < 2:
            self.skipTest("needs qemu-storage-daemon and vblk serve")
        if not CLIENT:
            self.skipTest("vblk-vhost-client not built")

    def test_errors_match(self):
        def scenario(qmp, d):
            add_nodes(qmp, d)
            sock = os.path.join(d, "vhost.sock")
            cases = [
                {"type": "vhost-user-blk", "id": "e0", "node-name": "d0"},
                export_args(d, addr={"type": "inet", "host": "127.0.0.1", "port": "0"}),
                export_args(d, **{"logical-block-size": 1000}),
                export_args(d, **{"logical-block-size": 256}),
                export_args(d, **{"logical-block-size": 4 * MiB}),
                export_args(d, **{"num-queues": 0}),
                export_args(d, **{"num-queues": 70000}),
                export_args(d, name="x"),
                export_args(d, **{"node-name": "nope"}),
                export_args(d, **{"node-name": "f1", "writable": True}),
                export_args(d, addr={"type": "unix"}),
                export_args(d, id="1bad"),
            ]
            seen = [error(qmp.cmd("block-export-add", c)) for c in cases]
            # Nothing was left listening by the failures.
            seen.append(os.path.exists(sock))
            seen.append(qmp.ok("query-block-exports"))
            qmp.ok("block-export-add", export_args(d, writable=True, **{"num-queues": 2}))
            seen.append(error(qmp.cmd("block-export-add", export_args(d, addr={"type": "unix", "path": sock + "2"}))))
            return seen

        seen = self.each_daemon(scenario)
        self.assertSame(seen)

    def test_lifecycle(self):
        def scenario(qmp, d):
            img = add_nodes(qmp, d)
            sock = os.path.join(d, "vhost.sock")
            qmp.ok("block-export-add", export_args(d, writable=True, **{"num-queues": 2}))
            obs = {"listed": qmp.ok("query-block-exports"), "sock": os.path.exists(sock)}
            # A front end writes through it; the data is in the image.
            rc, doc, err = client("io", sock, "write 1M 64k 0x3c", "read 1M 64k expect 0x3c")
            obs["io"] = (rc, [r["status"] for r in doc["results"]])
            with open(img, "rb") as f:
                f.seek(MiB)
                obs["in_image"] = f.read(65536) == b"\x3c" * 65536
            # The node is in use: blockdev-del refuses.
            obs["blockdev-del"] = error(qmp.cmd("blockdev-del", {"node-name": "d0"}))
            # A front end that stays connected.
            p = subprocess.Popen([CLIENT, "bench", sock, "--rw", "randread", "--bs", "4k", "--qd", "4",
                                  "--seconds", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                time.sleep(1.5)
                obs["client_up"] = p.poll() is None
                obs["del_safe"] = error(qmp.cmd("block-export-del", {"id": "e0"}))
                obs["del_hard"] = error(qmp.cmd("block-export-del", {"id": "e0", "mode": "hard"}))
                obs["event"] = qmp.event("BLOCK_EXPORT_DELETED", timeout=30)["data"]
                # The front end was disconnected.
                p.wait(30)
                obs["client_ended"] = True
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            obs["after"] = qmp.ok("query-block-exports")
            obs["del_again"] = error(qmp.cmd("block-export-del", {"id": "e0"}))
            obs["blockdev-del_after"] = error(qmp.cmd("blockdev-del", {"node-name": "d0"}))
            # The id can be used again.
            obs["re-add"] = error(qmp.cmd("block-export-add", export_args(d, **{"node-name": "f0"})))
            return obs

        seen = self.each_daemon(scenario)
        for name, obs in seen.items():
            self.assertEqual(obs["io"], (0, ["OK", "OK"]), name)
            self.assertTrue(obs["in_image"], name)
            self.assertTrue(obs["client_up"], name)
            self.assertTrue(obs["client_ended"], name)
        # A deliberate difference: qemu-storage-daemon 7.2 removes a
        # vhost-user-blk export in mode "safe" with its front end attached
        # (the VM loses its disk), although QAPI documents "safe" as "remove
        # the export if there are no connections"; vblk refuses, as it does
        # for NBD, and mode "hard" disconnects.
        q = seen.pop("qemu-storage-daemon")
        self.assertEqual((q.pop("del_safe"), q.pop("del_hard")), ("OK", "Export 'e0' is not found"))
        v = seen.pop("vblk serve")
        self.assertEqual((v.pop("del_safe"), v.pop("del_hard")), ("export 'e0' still in use", "OK"))
        self.assertEqual(v, q)


if __name__ == "__main__":
    unittest.main()
