#!/usr/bin/env python3
"""One incremental backup, timed in phases, for profiling (not a benchmark
table): the setup of bench_incremental.py (a 4 GiB qcow2 source, a share of
it dirtied through the NBD export, caches dropped, a blockdev-create'd
overlay), then the transaction and BLOCK_JOB_COMPLETED, printing
transaction / job / fsync seconds and the daemon's CPU time.
  --perf records the daemon during the backup into $PERFDIR/perf.data (default /tmp)
  (PERFARGS="-e io_uring:io_uring_submit_req -e io_uring:io_uring_complete"
  for the request trace); QSD names another qemu-storage-daemon (a wrapper).
Run vblk and QEMU alternately, several times: the machine is shared.
  python3 bench/probe_incremental.py --env vblk
  python3 bench/probe_incremental.py --env qemu-io_uring
"""
import os, sys, subprocess, time, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_incremental as B
import bench_img as bi
from qmp_driver import Daemon
import argparse
ap = argparse.ArgumentParser()
ap.add_argument("--env", default="vblk")
ap.add_argument("--size", default="4G")
ap.add_argument("--pct", type=int, default=1)
ap.add_argument("--perf", action="store_true")
ap.add_argument("--xperf", default=None)
ap.add_argument("--nodrop", action="store_true")
ap.add_argument("--settle", type=float, default=0, help="seconds to wait before the transaction")
ap.add_argument("--vblk", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "vblk"))
a = ap.parse_args()
size = bi.parse_size(a.size)
d = "/var/tmp/incprof"; os.makedirs(d, exist_ok=True)
kind, file_opts = B.ENVS[a.env]
argv0 = [os.environ.get("QSD","qemu-storage-daemon")] if kind == "qemu" else [a.vblk, "serve"]
src, full, tgt = (os.path.join(d, n) for n in ("src.qcow2", "full.qcow2", "tgt.qcow2"))
for p in (src, full, tgt): bi.rm(p)
for p in (src, full):
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=65536", p, str(size)], check=True)
dm = Daemon(argv0, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
q = dm.qmp
dirty = (size * a.pct // 100) // B.BLOCK * B.BLOCK
try:
    q.ok("blockdev-add", {"driver": "qcow2", "node-name": "disk", "file": dict({"driver": "file", "filename": src}, **file_opts)})
    q.ok("block-dirty-bitmap-add", {"node": "disk", "name": "c1", "persistent": True})
    sock = os.path.join(d, "nbd.sock")
    q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
    q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "disk", "name": "disk", "writable": True})
    subprocess.run(["fio", "--name=dirty", "--ioengine=nbd", "--uri=nbd+unix:///disk?socket=" + sock,
         "--rw=randwrite", "--bs=64k", "--iodepth=16", "--io_size=%d" % dirty, "--randseed=%d" % (a.pct + 14),
         "--end_fsync=1", "--output-format=json"], check=True, capture_output=True)
    q.ok("block-export-del", id="e0")
    bi.fsync_path(src)
    if not a.nodrop: bi.drop_cache(src)
    B.create(q, "cf", {"driver": "file", "filename": tgt, "size": 0}, 60)
    q.ok("blockdev-add", dict({"driver": "file", "node-name": "tgt-f", "filename": tgt}, **file_opts))
    B.create(q, "cq", {"driver": "qcow2", "file": "tgt-f", "size": size, "backing-file": full, "backing-fmt": "qcow2"}, 60)
    q.ok("blockdev-add", {"driver": "qcow2", "node-name": "tgt", "file": "tgt-f", "backing": None})
    q.events.clear()
    seen = []
    class Recorded(list):
        def append(self, x):
            seen.append(x)
            super().append(x)
    q.events = Recorded()
    perf = None
    if a.perf:
        perf = subprocess.Popen(["perf", "record"] + (os.environ["PERFARGS"].split() if os.environ.get("PERFARGS") else ["-F", "4999", "-g"]) + ["-o", os.path.join(os.environ.get("PERFDIR", "/tmp"), "perf.data"), "-p", str(dm.proc.pid)], stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    if a.settle: time.sleep(a.settle)
    bk = {"job-id": "b", "device": "disk", "target": "tgt", "sync": "bitmap", "bitmap": "c1", "bitmap-mode": "never"}
    if a.xperf: bk["x-perf"] = json.loads(a.xperf)
    def cpu():
        f=open("/proc/%d/stat"%dm.proc.pid).read().rsplit(")",1)[1].split()
        return (int(f[11])+int(f[12]))/os.sysconf("SC_CLK_TCK")
    c0=cpu()
    w0 = time.time()
    t0 = time.monotonic()
    q.ok("transaction", actions=[
        {"type": "block-dirty-bitmap-add", "data": {"node": "disk", "name": "c2", "persistent": True}},
        {"type": "block-dirty-bitmap-disable", "data": {"node": "disk", "name": "c1"}},
        {"type": "blockdev-backup", "data": bk}])
    t1 = time.monotonic()
    e = B.wait_job_event(q, 60)
    t2 = time.monotonic()
    bi.fsync_path(tgt)
    t3 = time.monotonic()
    print("cpu %.3f" % (cpu()-c0))
    if perf: perf.send_signal(2); perf.wait()
    print("%s: txn %.3f job %.3f fsync %.3f total %.3f" % (a.env, t1-t0, t2-t1, t3-t2, t3-t0))
    if os.environ.get("PROBE_EVENTS"):
        for ev in seen:
            ts = ev.get("timestamp", {})
            print("  %+.3f %s %s" % (ts.get("seconds", 0) + ts.get("microseconds", 0) / 1e6 - w0, ev["event"], ev.get("data", {}).get("status", "")))
finally:
    dm.quit()
