#!/usr/bin/env python3
"""Interop: dirty bitmaps over NBD (meta context qemu:dirty-bitmap:NAME), the
way incremental-backup tools read them: `vblk nbd -B` beside `qemu-nbd -B`,
and block-export-add `bitmaps` on `vblk serve` beside qemu-storage-daemon.

A qcow2 image gets a persistent bitmap (qemu-img bitmap --add) and writes
through qemu-io; the servers export it and the clients — nbdinfo --map and
--list, qemu-img map with x-dirty-bitmap — must see the same dirty extents,
the same contexts and the same errors from both.
"""

import json
import os
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unittest  # noqa: E402

from common import InteropTestCase, VBLK, qemu, run, wait_for_socket  # noqa: E402
from qmp_driver import Daemon  # noqa: E402  (bench/, on the path through common)

QEMU_NBD = shutil.which("qemu-nbd")
QEMU_IO = shutil.which("qemu-io")
QSD = shutil.which("qemu-storage-daemon")
NBDINFO = shutil.which("nbdinfo")


@unittest.skipUnless(QEMU_NBD and QEMU_IO and NBDINFO and QSD, "needs qemu-nbd, qemu-io, nbdinfo, qemu-storage-daemon")
class NbdBitmapTest(InteropTestCase):

    def image(self):
        """4 MiB qcow2 with bitmap b0 (dirty: 64k@64k, 1M+4k, 640k@3M) and a
        disabled, clean bitmap b1."""
        img = os.path.join(self.tmp, "b.qcow2")
        if os.path.exists(img):
            os.unlink(img)
        self.assertEqual(qemu("create", "-q", "-f", "qcow2", img, "4M").rc, 0)
        self.assertEqual(qemu("bitmap", "--add", img, "b0").rc, 0)
        self.assertEqual(qemu("bitmap", "--add", "--disable", img, "b1").rc, 0)
        r = run([QEMU_IO, "-f", "qcow2", "-c", "write 64k 64k", "-c", "write 1M 4k", "-c", "write 3M 640k", img])
        self.assertEqual(r.rc, 0, r)
        return img

    def clients(self, uri, sock):
        out = []
        for ctx in ("qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"):
            r = run([NBDINFO, "--map=" + ctx, uri])
            out.append((ctx, r.rc, r.stdout))
        r = run([NBDINFO, "--list", "--json", uri.split("/")[0] + "//" + "/?" + uri.split("?")[1]])
        out.append([e.get("contexts") for e in json.loads(r.stdout)["exports"]] if r.rc == 0 else r.stderr)
        opts = "driver=nbd,server.type=unix,server.path=%s,x-dirty-bitmap=qemu:dirty-bitmap:b0" % sock
        if "/x?" in uri:
            opts += ",export=x"
        r = run(["qemu-img", "map", "--output=json", "--image-opts", opts])
        out.append((r.rc, r.stdout))
        return out

    def test_qemu_nbd_bitmap_option(self):
        sock = os.path.join(self.tmp, "n.sock")
        uri = "nbd+unix:///?socket=%s" % sock

        def serve(argv0, args):
            """Runs a server; returns what its clients see."""
            if os.path.exists(sock):
                os.unlink(sock)
            p = subprocess.Popen(argv0 + args + ["-k", sock, "-t", os.path.join(self.tmp, "b.qcow2")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                wait_for_socket(sock, p)
                return self.clients(uri, sock)
            finally:
                if p.poll() is None:
                    p.terminate()
                    p.wait(30)
                p.stdout.close()
                p.stderr.close()

        def refused(argv0, args):
            r = run(argv0 + args + ["-k", sock, os.path.join(self.tmp, "b.qcow2")])
            return ("refused", r.rc, r.stderr.strip().split(": ", 1)[-1])

        def scenario(argv0):
            self.image()
            return [refused(argv0, ["-f", "qcow2", "-r", "-B", "nosuch"]),
                    serve(argv0, ["-f", "qcow2", "-r", "-B", "b0"]),
                    serve(argv0, ["-f", "qcow2", "-B", "b0", "-B", "b1"])]

        q = scenario([QEMU_NBD])
        v = scenario([VBLK, "nbd"])
        self.assertEqual(v, q)
        # Not vacuous: the dirty extents are what qemu-io wrote.
        self.assertIn("1048576       65536    1  dirty", q[1][0][2])

    def test_block_export_add_bitmaps(self):
        sock = os.path.join(self.tmp, "e.sock")

        def scenario(argv0):
            img = self.image()
            d = Daemon(argv0 + ["--blockdev", "driver=file,node-name=f0,filename=%s" % img,
                                "--blockdev", "driver=qcow2,node-name=q0,file=f0",
                                "--nbd-server", "addr.type=unix,addr.path=%s" % sock],
                       os.path.join(self.tmp, "qmp.sock"), os.path.join(self.tmp, "d.log"))
            q = d.qmp
            base = {"type": "nbd", "node-name": "q0"}
            out = [q.cmd("block-export-add", dict(base, id="e1", name="x", bitmaps=bm)) for bm in (
                ["nosuch"], ["b0"], [{"node": "f0", "name": "b0"}], [{"node": "zz", "name": "b0"}])]
            out.append(q.cmd("block-export-add", dict(base, id="e1", name="x", writable=True, bitmaps=["b0", "b1"])))
            out.append(q.cmd("block-export-add", dict(base, id="e2", name="y", bitmaps=["b0"])))
            out.append([(b["name"], b["busy"], b["recording"]) for b in
                        q.ok("query-named-block-nodes")[0]["dirty-bitmaps"]])
            out.append(q.cmd("block-dirty-bitmap-remove", {"node": "q0", "name": "b0"}))
            out += self.clients("nbd+unix:///x?socket=%s" % sock, sock)
            out.append(q.cmd("block-export-del", {"id": "e1"}))
            q.event("BLOCK_EXPORT_DELETED")
            out.append([(b["name"], b["busy"]) for b in q.ok("query-named-block-nodes")[0]["dirty-bitmaps"]])
            out.append(q.cmd("block-dirty-bitmap-remove", {"node": "q0", "name": "b1"}))
            d.quit()
            return out

        q = scenario([QSD])
        v = scenario([VBLK, "serve"])
        self.assertEqual(v, q)


if __name__ == "__main__":
    unittest.main()
