#!/usr/bin/env python3
"""Interop: `transaction` and drive-backup in vblk serve beside
qemu-storage-daemon 7.2 — the same replies (errors included), the same job
events per job, the same bitmaps, images and rollbacks:

- all or nothing: a bitmap added, cleared or disabled in a transaction that
  fails later is back as it was; an overlay is not installed; an internal
  snapshot is deleted again; a backup job is cancelled before it starts;
- completion-mode grouped: only backups may take part; the jobs finish
  together, and when one fails the other is cancelled;
- drive-backup: the target created (or opened with mode=existing) and
  filled, QEMU's errors;
- the libvirt-style chain: one transaction starts a full backup and adds a
  new persistent checkpoint bitmap; after writes through the NBD export an
  incremental one (bitmap-add of the next checkpoint + blockdev-backup
  sync=bitmap of the previous one) goes into a blockdev-create'd qcow2
  overlay whose backing file is the full backup. The restored point
  (qemu-img convert of the chain's top) equals the source at that moment
  and is no more allocated than the source was.
"""

import json
import os
import subprocess
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_common import (DAEMONS, QEMU_IO, GraphTestCase, bitmaps, compare, data_bytes, export_point,  # noqa: E402
                          graph, img, img_info, new_qcow2, qnode, tx)

MiB = 1 << 20


class TransactionTest(GraphTestCase):

    def io(self, target, *cmds, fmt="raw"):
        argv = [QEMU_IO, "-f", fmt]
        for c in cmds:
            argv += ["-c", c]
        argv.append(target)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r)
        self.assertNotIn("error", r.stdout + r.stderr, r)

    def src_image(self, path, size="8M"):
        img("create", "-q", "-f", "qcow2", path, size)
        self.io(path, "write -P 1 0 2M", "write -P 2 4M 1M", fmt="qcow2")

    def test_rollback_and_errors(self):
        P = self.path

        def prepare():
            self.src_image(P("src.qcow2"))
            for t in ("t1", "t2"):
                img("create", "-q", "-f", "qcow2", P(t + ".qcow2"), "8M")
            img("create", "-q", "-f", "qcow2", P("small.qcow2"), "4M")

        def run(q, c, out):
            c("blockdev-add", **qnode("src", P("src.qcow2")))
            c("blockdev-add", **qnode("t1", P("t1.qcow2")))
            c("blockdev-add", **qnode("small", P("small.qcow2")))
            c("block-dirty-bitmap-add", node="src", name="keep", granularity=65536)
            # Schema errors: nothing runs.
            c("transaction")
            c("transaction", actions={})
            c("transaction", actions=[5])
            c("transaction", actions=[{"type": "abort"}])
            c("transaction", actions=[{"data": {}}])
            c("transaction", actions=[{"type": "foo", "data": {}}])
            c("transaction", actions=[{"type": "abort", "data": {"x": 1}}])
            c("transaction", actions=[{"type": "abort", "data": {}, "x": 1}])
            c("transaction", **tx(("block-dirty-bitmap-add", {"node": "src", "name": "n"}),
                                  ("block-dirty-bitmap-add", {"node": "src"})))
            c("transaction", actions=[], properties={"completion-mode": "all"})
            c("transaction", actions=[])
            # Rollbacks.
            c("transaction", **tx(("abort", {})))
            c("transaction", **tx(("block-dirty-bitmap-add", {"node": "src", "name": "b1"}), ("abort", {})))
            c("transaction", **tx(("block-dirty-bitmap-add", {"node": "src", "name": "b1"}),
                                  ("block-dirty-bitmap-add", {"node": "src", "name": "b1"})))
            c("transaction", **tx(("block-dirty-bitmap-add", {"node": "src", "name": "b1", "persistent": True}),
                                  ("blockdev-backup", {"job-id": "j", "device": "src", "target": "small",
                                                       "sync": "full"})))
            out.append(bitmaps(q, "src"))
            # Mark `keep`, then clear + disable it in a transaction that aborts.
            c("x-debug-block-dirty-bitmap-sha256", node="src", name="keep")
            c("nbd-server-start", addr={"type": "unix", "data": {"path": os.path.join(self.tmp, "nbd.sock")}})
            c("block-export-add", type="nbd", id="e", name="exp", writable=True, **{"node-name": "src"})
            self.io("nbd+unix:///exp?socket=%s" % os.path.join(self.tmp, "nbd.sock"), "write -P 5 1M 128k")
            c("x-debug-block-dirty-bitmap-sha256", node="src", name="keep")
            c("transaction", **tx(("block-dirty-bitmap-clear", {"node": "src", "name": "keep"}),
                                  ("block-dirty-bitmap-disable", {"node": "src", "name": "keep"}),
                                  ("block-dirty-bitmap-add", {"node": "src", "name": "m"}),
                                  ("block-dirty-bitmap-merge", {"node": "src", "target": "m", "bitmaps": ["keep"]}),
                                  ("block-dirty-bitmap-remove", {"node": "src", "name": "keep"}),
                                  ("abort", {})))
            out.append(bitmaps(q, "src"))
            c("x-debug-block-dirty-bitmap-sha256", node="src", name="keep")
            # A transaction that works: the same actions without abort.
            c("transaction", **tx(("block-dirty-bitmap-add", {"node": "src", "name": "m"}),
                                  ("block-dirty-bitmap-merge", {"node": "src", "target": "m", "bitmaps": ["keep"]}),
                                  ("block-dirty-bitmap-clear", {"node": "src", "name": "keep"}),
                                  ("block-dirty-bitmap-disable", {"node": "src", "name": "keep"})))
            out.append(bitmaps(q, "src"))
            c("transaction", **tx(("block-dirty-bitmap-enable", {"node": "src", "name": "keep"}),
                                  ("block-dirty-bitmap-remove", {"node": "src", "name": "m"})))
            out.append(bitmaps(q, "src"))
            c("transaction", **tx(("block-dirty-bitmap-remove", {"node": "src", "name": "nope"})))
            # Internal snapshot and external overlay rolled back.
            c("transaction", **tx(("blockdev-snapshot-internal-sync", {"device": "t1", "name": "s"}), ("abort", {})))
            c("transaction", **tx(("blockdev-snapshot-sync", {"node-name": "t1", "snapshot-file": P("ov.qcow2"),
                                                              "snapshot-node-name": "ov"}),
                                  ("abort", {})))
            out.append(graph(q))
            c("blockdev-del", **{"node-name": "t1"})
            # A backup job made in a failed transaction never starts.
            c("blockdev-add", **qnode("t2", P("t2.qcow2")))
            c("transaction", **tx(("blockdev-backup", {"job-id": "j", "device": "src", "target": "t2",
                                                       "sync": "full"}),
                                  ("abort", {})))
            c.ev(0.3)
            c("query-jobs")
            # Grouped mode takes backups and abort only.
            c("transaction", properties={"completion-mode": "grouped"},
              **tx(("block-dirty-bitmap-add", {"node": "src", "name": "g"})))
            c("transaction", properties={"completion-mode": "grouped"}, **tx(("abort", {})))
            c("transaction", properties={"completion-mode": "individual"},
              **tx(("block-dirty-bitmap-add", {"node": "src", "name": "g"})))
            out.append(bitmaps(q, "src"))

        self.both(run, prepare)
        for i in range(len(DAEMONS)):
            r = img("snapshot", "-l", "-U", self.kept(i, "t1.qcow2"))
            self.assertEqual(r.stdout.strip(), "", DAEMONS[i][0])

    def test_grouped(self):
        P = self.path

        def prepare():
            for s in ("a", "b"):
                self.src_image(P(s + ".qcow2"))
                img("create", "-q", "-f", "qcow2", P(s + "t.qcow2"), "8M")

        def bad(name, path):
            return {"driver": "qcow2", "node-name": name,
                    "file": {"driver": "blkdebug",
                             "inject-error": [{"event": "write_aio", "errno": 5}],
                             "image": {"driver": "file", "filename": path}}}

        def run(q, c, out):
            for s in ("a", "b"):
                c("blockdev-add", **qnode(s, P(s + ".qcow2")))
                c("blockdev-add", **qnode(s + "t", P(s + "t.qcow2")))
            c("transaction", properties={"completion-mode": "grouped"},
              **tx(("blockdev-backup", {"job-id": "ja", "device": "a", "target": "at", "sync": "full"}),
                   ("blockdev-backup", {"job-id": "jb", "device": "b", "target": "bt", "sync": "full"})))
            evs = c.wait_jobs(["ja", "jb"], "null")
            # Grouped: no job concludes before both are pending.
            st = [(e["data"]["id"], e["data"]["status"]) for e in evs if e["event"] == "JOB_STATUS_CHANGE"]
            first_concluded = min(i for i, s in enumerate(st) if s[1] == "concluded")
            self.assertEqual({s[0] for s in st[:first_concluded] if s[1] == "pending"}, {"ja", "jb"})
            c("blockdev-del", **{"node-name": "bt"})
            img("create", "-q", "-f", "qcow2", P("bt.qcow2"), "8M")
            c("blockdev-add", **bad("bt", P("bt.qcow2")))
            c("blockdev-del", **{"node-name": "at"})
            img("create", "-q", "-f", "qcow2", P("at.qcow2"), "8M")
            c("blockdev-add", **qnode("at", P("at.qcow2")))
            # jb fails: ja is cancelled with it.
            c("transaction", properties={"completion-mode": "grouped"},
              **tx(("blockdev-backup", {"job-id": "ja", "device": "a", "target": "at", "sync": "full",
                                        "speed": 1 << 20}),
                   ("blockdev-backup", {"job-id": "jb", "device": "b", "target": "bt", "sync": "full"})))
            c.wait_jobs(["ja", "jb"], "null")
            # Individual: jb's failure leaves ja alone.
            c("transaction",
              **tx(("blockdev-backup", {"job-id": "ja", "device": "a", "target": "at", "sync": "full"}),
                   ("blockdev-backup", {"job-id": "jb", "device": "b", "target": "bt", "sync": "full"})))
            c.wait_jobs(["ja", "jb"], "null")

        self.both(run, prepare)
        for i in range(len(DAEMONS)):
            self.assertEqual(compare(self.kept(i, "a.qcow2"), self.kept(i, "at.qcow2"))[0], 0)

    def test_drive_backup(self):
        P = self.path

        def prepare():
            self.src_image(P("src.qcow2"))
            img("create", "-q", "-f", "raw", P("exist.raw"), "8M")

        def run(q, c, out):
            c("blockdev-add", **qnode("src", P("src.qcow2")))
            c("drive-backup", device="src", target=P("d1.qcow2"), sync="full")
            c("drive-backup", device="nope", target=P("d1.qcow2"), sync="full", **{"job-id": "d"})
            c("drive-backup", device="src", target=P("nodir/d1.qcow2"), sync="full", **{"job-id": "d"})
            c("drive-backup", device="src", target=P("d1.qcow2"), sync="full", format="vdi2", **{"job-id": "d"})
            c("drive-backup", device="src", target=P("d1.qcow2"), sync="full", mode="x", **{"job-id": "d"})
            c("drive-backup", device="src", target=P("missing.qcow2"), sync="full", mode="existing",
              **{"job-id": "d"})
            c("drive-backup", device="src", target=P("d1.qcow2"), sync="full", **{"job-id": "d"})
            c.wait_job("d", "null")
            c("drive-backup", device="src", target=P("d2.raw"), sync="full", format="raw", **{"job-id": "d"})
            c.wait_job("d", "null")
            c("drive-backup", device="src", target=P("exist.raw"), sync="full", mode="existing",
              **{"job-id": "d", "auto-dismiss": False})
            c.wait_job("d", "concluded")
            c("query-jobs")
            c("job-dismiss", id="d")
            c.ev()
            # sync=none: the target is created over the source and reads
            # through it; the job runs until it is cancelled.
            c("drive-backup", device="src", target=P("none.qcow2"), sync="none", format="qcow2", **{"job-id": "n"})
            c.wait_job("n", "running")
            c("block-job-cancel", device="n")
            c.wait_job("n", "null")
            out.append(graph(q))
            return {f: img_info(P(f)) for f in ("d1.qcow2", "d2.raw", "none.qcow2")}

        self.both(run, prepare)
        for i in range(len(DAEMONS)):
            for f in ("d1.qcow2", "d2.raw", "exist.raw"):
                self.assertEqual(compare(self.kept(i, "src.qcow2"), self.kept(i, f))[0], 0, f)
            self.assertEqual(img("check", "-U", self.kept(i, "d1.qcow2"), check=False).returncode, 0)

    def test_mixed_and_manual_finalize(self):
        P = self.path

        def prepare():
            img("create", "-q", "-f", "qcow2", P("base.qcow2"), "8M")
            self.io(P("base.qcow2"), "write -P 3 0 4M", fmt="qcow2")
            img("create", "-q", "-f", "qcow2", "-b", P("base.qcow2"), "-F", "qcow2", P("src.qcow2"))
            self.io(P("src.qcow2"), "write -P 4 1M 1M", fmt="qcow2")
            for t in ("t1", "t2"):
                img("create", "-q", "-f", "qcow2", P(t + ".qcow2"), "8M")
            self.src_image(P("o.qcow2"))

        def run(q, c, out):
            c("blockdev-add", **qnode("src", P("src.qcow2")))
            c("blockdev-add", **qnode("o", P("o.qcow2")))
            c("blockdev-add", **qnode("t1", P("t1.qcow2")))
            c("blockdev-add", **qnode("t2", P("t2.qcow2")))
            c("block-dirty-bitmap-add", node="src", name="p", persistent=True)
            # Grouped, finalized by hand: one job-finalize finalizes both.
            c("transaction", properties={"completion-mode": "grouped"},
              **tx(("blockdev-backup", {"job-id": "j1", "device": "o", "target": "t1", "sync": "full",
                                        "auto-finalize": False}),
                   ("drive-backup", {"job-id": "j2", "device": "src", "target": P("top.qcow2"), "sync": "top",
                                     "auto-finalize": False})))
            c.wait_jobs(["j1", "j2"], "pending")
            c("query-jobs")
            c("job-finalize", id="j2")
            c.wait_jobs(["j1", "j2"], "null")
            # An internal snapshot and a bitmap in one transaction; then the
            # node gets an overlay, its persistent bitmap stored as it goes
            # read-only.
            c("transaction", **tx(("blockdev-snapshot-internal-sync", {"device": "t2", "name": "s1"}),
                                  ("block-dirty-bitmap-add", {"node": "src", "name": "q"}),
                                  ("block-dirty-bitmap-disable", {"node": "src", "name": "p"})))
            out.append(bitmaps(q, "src"))
            c("transaction", **tx(("blockdev-snapshot-sync", {"node-name": "t2", "snapshot-file": P("ov.qcow2"),
                                                              "snapshot-node-name": "ov"}),
                                  ("block-dirty-bitmap-remove", {"node": "src", "name": "q"})))
            c("blockdev-snapshot-sync", **{"node-name": "src", "snapshot-file": P("sov.qcow2"),
                                           "snapshot-node-name": "sov"})
            out.append([(n["node-name"], n["ro"]) for n in graph(q) if not n["node-name"].startswith("#")])
            return img_info(P("top.qcow2"))

        self.both(run, prepare)
        for i in range(len(DAEMONS)):
            self.assertEqual(compare(self.kept(i, "o.qcow2"), self.kept(i, "t1.qcow2"))[0], 0)
            # sync=top: the top layer only, over the source's backing file.
            self.assertEqual(compare(self.kept(i, "src.qcow2"), self.kept(i, "top.qcow2"))[0], 0)
            m = json.loads(img("map", "--output=json", "-U", self.kept(i, "top.qcow2")).stdout)
            self.assertEqual([(e["start"], e["length"]) for e in m if e["depth"] == 0 and e["data"]],
                             [(MiB, MiB)], DAEMONS[i][0])
            info = json.loads(img("info", "--output=json", "-U", self.kept(i, "src.qcow2")).stdout)
            self.assertEqual([b["name"] for b in info["format-specific"]["data"].get("bitmaps", [])], ["p"])
            r = img("snapshot", "-l", "-U", self.kept(i, "t2.qcow2"))
            self.assertIn("s1", r.stdout)

    def test_libvirt_chain(self):
        P = self.path
        sock = os.path.join(self.tmp, "nbd.sock")
        uri = "nbd+unix:///exp?socket=%s" % sock
        size = 16 * MiB

        def prepare():
            img("create", "-q", "-f", "qcow2", P("disk.qcow2"), str(size))
            self.io(P("disk.qcow2"), "write -P 1 0 3M", "write -z 3M 1M", "write -P 2 10M 1M", fmt="qcow2")

        def new_image(c, name, backing=None):
            new_qcow2(c, P(name + ".qcow2"), name, size, backing and P(backing + ".qcow2"))

        def snapshot_source(name):
            return export_point(uri, P(name + ".raw"))

        def run(q, c, out):
            c("blockdev-add", **qnode("disk", P("disk.qcow2")))
            c("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
            c("block-export-add", type="nbd", id="e", name="exp", writable=True, **{"node-name": "disk"})
            new_image(c, "full")
            alloc = [snapshot_source("pt0")]
            c("transaction", **tx(
                ("blockdev-backup", {"job-id": "b0", "device": "disk", "target": "full", "sync": "full"}),
                ("block-dirty-bitmap-add", {"node": "disk", "name": "c1", "persistent": True})))
            c.wait_job("b0", "null")
            prev = "full"
            for rnd in range(1, 3):
                self.io(uri, "write -P %d %dM 512k" % (10 + rnd, 2 * rnd), "write -z %dM 64k" % (6 + rnd),
                        "write -P %d %dM 1M" % (20 + rnd, 10 + rnd % 2))
                cur = "inc%d" % rnd
                new_image(c, cur, backing=prev)
                alloc.append(snapshot_source("pt%d" % rnd))
                c("transaction", **tx(
                    ("block-dirty-bitmap-add", {"node": "disk", "name": "c%d" % (rnd + 1), "persistent": True}),
                    ("block-dirty-bitmap-disable", {"node": "disk", "name": "c%d" % rnd}),
                    ("blockdev-backup", {"job-id": "b%d" % rnd, "device": "disk", "target": cur, "sync": "bitmap",
                                         "bitmap": "c%d" % rnd, "bitmap-mode": "never"})))
                # Writes after the point in time stay out of this backup.
                self.io(uri, "write -P 99 0 64k")
                c.wait_job("b%d" % rnd, "null")
                out.append(bitmaps(q, "disk"))
                prev = cur
            return alloc

        seen = self.both(run, prepare)
        alloc = [x[1] for x in seen[DAEMONS[0][0]] if x[0] == "result"][0]
        for i in range(len(DAEMONS)):
            for rnd, top in enumerate(("full", "inc1", "inc2")):
                restored = self.kept(i, "restored%d.qcow2" % rnd)
                img("convert", "-U", "-O", "qcow2", self.kept(i, top + ".qcow2"), restored)
                self.assertEqual(compare(self.kept(i, "pt%d.raw" % rnd), restored, "raw", "qcow2")[0], 0,
                                 (DAEMONS[i][0], top))
                m = json.loads(img("map", "--output=json", restored).stdout)
                self.assertLessEqual(data_bytes(m), alloc[rnd], (DAEMONS[i][0], top))
                self.assertEqual(img("check", "-U", self.kept(i, top + ".qcow2"), check=False).returncode, 0)


if __name__ == "__main__":
    unittest.main()
