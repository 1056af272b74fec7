#!/usr/bin/env python3
"""RBD benchmark: vblk's rbd driver against QEMU's (qemu-block-extra), one run.

A throwaway single-OSD Ceph cluster (tests/interop/ceph_cluster.py, memstore:
the OSD keeps objects in RAM, so the numbers are the clients' and the
messenger's, not a disk's) serves every row. Rows:

  backup    a --size (default 1 GiB) raw source, every byte data, backed up
            by blockdev-backup sync=full into a fresh RBD image (blockdev-add
            raw over driver=rbd): `vblk serve` vs qemu-storage-daemon, the
            same QMP. Time from the command to BLOCK_JOB_COMPLETED.
  convert   RBD image (the same data) -> local raw file: `vblk convert -O raw`
            vs `qemu-img convert -O raw`, same arguments.
  guest     fio (4 KiB random writes, iodepth 16, through the daemon's NBD
            export of the local source) while a backup to RBD runs; the RBD
            target behind a throttle node (--target-rate, default 64 MiB/s,
            so the backup outlasts the guest's --runtime). Environments:
            qemu-storage-daemon, vblk serve without, and with its COW buffer
            (x-perf.cow-buffer-size 256 MiB). Reported: guest write IOPS,
            and IOPS without any backup as the baseline.

--runs N repetitions, environments interleaved (the order rotating) on a
shared machine; mean ± stdev and the ratio vblk/QEMU per row. Every backup
target is checked once with qemu-img compare; the converted file too.

Output: a table on stdout, JSON with --json (bench/results/bench_rbd.*).
Python 3 standard library only.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))
from qmp_driver import Daemon  # noqa: E402
import ceph_cluster  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def fill(path, size):
    """Every byte data (no zero blocks: the whole image is copied)."""
    chunk = bytes((i * 37 + 11) & 0xff or 1 for i in range(MiB))
    with open(path, "wb") as f:
        for i in range(size // MiB):
            f.write(chunk[i % 251:] + chunk[:i % 251])


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rbd_file(c, image):
    return {"driver": "rbd", "pool": c.pool, "image": image, "conf": c.conf}


def daemon_argv(name, vblk):
    return [vblk, "serve"] if name.startswith("vblk") else ["qemu-storage-daemon"]


def backup_once(env, c, src, size, work, vblk, run, check):
    image = "bk-%s-%d" % (env, run)
    c.rbd("create", "--size", "%dM" % (size // MiB), "%s/%s" % (c.pool, image))
    drop_cache(src)
    d = Daemon(daemon_argv(env, vblk), os.path.join(work, "qmp.sock"), os.path.join(work, env + ".log"))
    try:
        q = d.qmp
        q.ok("blockdev-add", **{"driver": "raw", "node-name": "src",
                                "file": {"driver": "file", "filename": src, "cache": {"direct": True},
                                         "aio": "native"}})
        q.ok("blockdev-add", **{"driver": "raw", "node-name": "tgt", "file": rbd_file(c, image)})
        t0 = time.monotonic()
        q.ok("blockdev-backup", **{"job-id": "j", "device": "src", "target": "tgt", "sync": "full"})
        ev = q.event("BLOCK_JOB_COMPLETED", 900)
        dt = time.monotonic() - t0
        if "error" in ev["data"]:
            raise RuntimeError("%s: %s" % (env, ev["data"]["error"]))
        q.ok("blockdev-del", **{"node-name": "tgt"})
        d.quit()
    finally:
        d.kill()
    if check:
        r = subprocess.run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, c.spec(image)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("%s: target differs: %s" % (env, r.stdout + r.stderr))
    c.rbd("rm", "%s/%s" % (c.pool, image))
    return dt


def convert_once(env, c, image, src, work, vblk, check):
    out = os.path.join(work, "conv.raw")
    if os.path.exists(out):
        os.unlink(out)
    tool = [vblk] if env == "vblk" else ["qemu-img"]
    t0 = time.monotonic()
    r = subprocess.run(tool + ["convert", "-f", "raw", "-O", "raw", c.spec(image), out],
                       capture_output=True, text=True)
    if r.returncode == 0:
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    dt = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError("%s convert: %s" % (env, r.stderr))
    if check:
        r = subprocess.run(["cmp", "-s", src, out])
        if r.returncode != 0:
            raise RuntimeError("%s convert: output differs" % env)
    os.unlink(out)
    return dt


GUEST_ENVS = {"qemu": None, "vblk": None, "vblk-buf256M": {"cow-buffer-size": 256 * MiB}}


def fio(sock, runtime, outdir):
    argv = ["fio", "--output-format=json", "--name=guest", "--rw=randwrite", "--bs=4k", "--iodepth=16",
            "--time_based", "--runtime=%d" % runtime, "--norandommap", "--randrepeat=0", "--ioengine=nbd",
            "--uri=nbd+unix:///disk?socket=%s" % sock]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=runtime * 10 + 60)
    if r.returncode != 0:
        raise RuntimeError("fio: " + r.stderr[-1000:])
    w = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]["write"]
    return w["iops"]


def guest_once(env, c, src, size, work, vblk, run, args):
    image = "g-%s-%d" % (env, run)
    c.rbd("create", "--size", "%dM" % (size // MiB), "%s/%s" % (c.pool, image))
    sock = os.path.join(work, "nbd.sock")
    d = Daemon(daemon_argv(env, vblk), os.path.join(work, "qmp.sock"), os.path.join(work, env + "-g.log"))
    try:
        q = d.qmp
        q.ok("object-add", **{"qom-type": "throttle-group", "id": "slow",
                              "limits": {"bps-total": args.target_rate}})
        q.ok("blockdev-add", **{"driver": "raw", "node-name": "disk",
                                "file": {"driver": "file", "filename": src, "cache": {"direct": True},
                                         "aio": "native"}})
        q.ok("blockdev-add", **{"driver": "throttle", "throttle-group": "slow", "node-name": "tgt",
                                "file": {"driver": "raw", "file": rbd_file(c, image)}})
        q.ok("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        q.ok("block-export-add", {"type": "nbd", "id": "e0", "node-name": "disk", "name": "disk",
                                  "writable": True})
        baseline = fio(sock, args.runtime, work) if run == 0 and env == "qemu" else None
        bk = {"job-id": "j", "device": "disk", "target": "tgt", "sync": "full"}
        if GUEST_ENVS[env]:
            bk["x-perf"] = GUEST_ENVS[env]
        q.ok("blockdev-backup", **bk)
        iops = fio(sock, args.runtime, work)
        q.drain_events()
        running = any(j["device"] == "j" for j in q.ok("query-block-jobs"))
        if running:
            q.ok("block-job-cancel", device="j", force=True)
            q.event("BLOCK_JOB_CANCELLED", 120)
        else:
            print("  warning: %s: the backup ended before the guest did" % env, flush=True)
        d.quit()
    finally:
        d.kill()
    c.rbd("rm", "%s/%s" % (c.pool, image))
    return iops, baseline


def ms(xs):
    m = statistics.mean(xs)
    s = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return m, s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vblk", default=os.environ.get("VBLK", os.path.join(HERE, "..", "build", "vblk")))
    ap.add_argument("--size", type=int, default=GiB)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=10, help="fio seconds per guest run")
    ap.add_argument("--target-rate", type=int, default=64 * MiB)
    ap.add_argument("--rows", default="backup,convert,guest")
    ap.add_argument("--json")
    args = ap.parse_args()
    reason = ceph_cluster.skip_reason()
    if reason:
        sys.exit(reason)
    vblk = os.path.abspath(args.vblk)
    rows = args.rows.split(",")
    work = tempfile.mkdtemp(prefix="vblk-bench-rbd-", dir="/var/tmp")
    res = {"argv": sys.argv, "size": args.size, "runs": args.runs, "rows": {}}
    # Room for a source image, one backup target and a guest target at once.
    mem = (3 * args.size) // MiB + 512
    try:
        run_rows(args, vblk, rows, work, res, mem)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, res)


def run_rows(args, vblk, rows, work, res, mem):
    with ceph_cluster.CephCluster(osds=1, memstore_mib=mem) as c:
        src = os.path.join(work, "src.raw")
        fill(src, args.size)
        if "backup" in rows:
            t = {"qemu": [], "vblk": []}
            for run in range(args.runs):
                for env in (["qemu", "vblk"] if run % 2 == 0 else ["vblk", "qemu"]):
                    t[env].append(backup_once(env, c, src, args.size, work, vblk, run, run == 0))
                    print("backup %-5s run %d: %.2f s" % (env, run, t[env][-1]), flush=True)
            res["rows"]["backup"] = t
        if "convert" in rows:
            image = "conv-src"
            r = subprocess.run(["qemu-img", "convert", "-O", "raw", src, c.spec(image)], capture_output=True)
            assert r.returncode == 0, r
            t = {"qemu": [], "vblk": []}
            for run in range(args.runs):
                for env in (["qemu", "vblk"] if run % 2 == 0 else ["vblk", "qemu"]):
                    t[env].append(convert_once(env, c, image, src, work, vblk, run == 0))
                    print("convert %-5s run %d: %.2f s" % (env, run, t[env][-1]), flush=True)
            c.rbd("rm", "%s/%s" % (c.pool, image))
            res["rows"]["convert"] = t
        if "guest" in rows:
            t = {e: [] for e in GUEST_ENVS}
            envs = list(GUEST_ENVS)
            for run in range(args.runs):
                order = envs[run % len(envs):] + envs[:run % len(envs)]
                for env in order:
                    iops, base = guest_once(env, c, src, args.size, work, vblk, run, args)
                    t[env].append(iops)
                    if base is not None:
                        res["guest_baseline_iops"] = base
                        print("guest baseline (no backup): %.0f IOPS" % base, flush=True)
                    print("guest %-12s run %d: %.0f IOPS" % (env, run, iops), flush=True)
            res["rows"]["guest"] = t


def report(args, res):
    print()
    print("RBD bench: %s, %d run(s), size %d MiB; memstore OSD (RAM)" % (" ".join(sys.argv), args.runs,
                                                                      args.size // MiB))
    lines = []
    for row in ("backup", "convert"):
        if row not in res["rows"]:
            continue
        q = ms(res["rows"][row]["qemu"])
        v = ms(res["rows"][row]["vblk"])
        ratio = q[0] / v[0]
        lines.append("%-8s qemu %6.2f ± %.2f s   vblk %6.2f ± %.2f s   vblk %.2fx %s" % (
            row, q[0], q[1], v[0], v[1], ratio, "faster" if ratio >= 1 else "SLOWER (vblk loses this row)"))
        res[row + "_speedup"] = ratio
    if "guest" in res["rows"]:
        g = {e: ms(x) for e, x in res["rows"]["guest"].items()}
        base = res.get("guest_baseline_iops")
        if base:
            lines.append("guest    baseline (no backup) %.0f IOPS" % base)
        for e, (m, s) in g.items():
            lines.append("guest    %-13s %8.0f ± %.0f IOPS  (%.2fx qemu)" % (e, m, s, m / g["qemu"][0]))
            res["guest_" + e + "_vs_qemu"] = m / g["qemu"][0]
    print("\n".join(lines))
    res["summary"] = lines
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
