#!/usr/bin/env python3
"""Block status that costs nothing, and zeros in backup (issue 16, part 1):
vblk against QEMU 7.2's tools, side by side, in one run.

Rows (each vblk row runs interleaved with its QEMU anchor, order rotating):
  convert    1 GiB raw, every byte 0xff -> new raw: `vblk convert` against
             `qemu-img convert`, on tmpfs (/dev/shm) and on ext4 (/var/tmp).
  backup     the same source, blockdev-backup sync=full to a new raw in
             `vblk serve` against qemu-storage-daemon, same QMP commands.
             Time: job command -> BLOCK_JOB_COMPLETED + fsync of the target.
  Each tool runs in every configuration listed in CONFIGS for the file
  system; the table names the best one per tool (the anchor's fastest).
  lseeks     `strace -f -c -e trace=lseek` of one more run of each tool,
             separate from the timed runs (strace slows syscalls down).
  iops       guest 4 KiB random writes (fio, ioengine=nbd, iodepth 16) to
             the backup source exported over NBD by the same daemon, idle
             and while a full backup of it runs (tmpfs); the ratio
             busy/idle per daemon; vblk also with its COW buffer
             (x-perf cow-buffer-size, --iops-cow-buffer).
  map        a 1 TiB qcow2 with 1 % data (1 MiB written every 100 MiB by
             qemu-io): `vblk map` against `qemu-img map`, and `nbdinfo
             --map` against `vblk nbd` and `qemu-nbd` serving it.
  zeros      1 GiB raw where every other MiB is allocated zeroes (the rest
             0xff): allocated bytes of a backup target (blockdev-backup to a
             new raw, detect-zeroes off|unmap on the target node; and `vblk
             backup` with its defaults) against `qemu-img convert`'s.

Output: tables on stdout (bench/results/bench_bstatus.txt keeps one run with
its command line) and --json. Python 3 standard library only.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_img as bi  # noqa: E402
from qmp_driver import Daemon, QMPError  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30

# File-node options tried per file system (QEMU's possible best ones; vblk
# takes the same).
CONFIGS = {
    "tmpfs": [{"aio": "threads"}, {"aio": "io_uring"}],
    "ext4": [{"aio": "threads"}, {"aio": "io_uring"}, {"cache": {"direct": True}, "aio": "native"}],
}
# qemu-img convert / vblk convert command-line options per file system.
CONVERT_OPTS = {
    "tmpfs": [[], ["-m", "16", "-W"]],
    "ext4": [[], ["-t", "none", "-T", "none", "-m", "16", "-W"]],
}


def fill(path, size, zero_every_other=False):
    """0xff everywhere, or with every other MiB allocated zeroes."""
    ff, zz = b"\xff" * MIB, bytes(MIB)
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        for i, off in enumerate(range(0, size, MIB)):
            os.pwrite(fd, zz if zero_every_other and i % 2 else ff, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def cfg_name(c):
    return ",".join(f"{k}={v}" if not isinstance(v, dict) else f"{k}.direct={v['direct']}" for k, v in c.items())


def strace_argv(out):
    return ["strace", "-f", "-c", "-e", "trace=lseek", "-o", out]


def lseek_count(path):
    with open(path) as f:
        for line in f:
            p = line.split()
            if p and p[-1] == "lseek":
                return int(p[3])
    return 0


def allocated(path):
    return os.stat(path).st_blocks * 512


def run_backup(daemon0, src, dst, cfg, d, target_extra=None, strace=None, timeout=600):
    """One blockdev-backup sync=full src -> new raw dst; returns seconds."""
    bi.rm(dst)
    subprocess.run(["qemu-img", "create", "-q", "-f", "raw", dst, str(os.path.getsize(src))], check=True)
    argv0 = (strace_argv(strace) if strace else []) + daemon0
    dm = Daemon(argv0, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
    try:
        dm.qmp.ok("blockdev-add", dict({"driver": "file", "filename": src, "node-name": "source"}, **cfg))
        tgt = dict({"driver": "file", "filename": dst, "node-name": "target"}, **cfg)
        tgt.update(target_extra or {})
        dm.qmp.ok("blockdev-add", tgt)
        t0 = time.monotonic()
        dm.qmp.ok("blockdev-backup", {"job-id": "j", "device": "source", "target": "target", "sync": "full"})
        ev, t1 = dm.qmp.next_event({"BLOCK_JOB_COMPLETED"}, timeout)
        if "error" in ev.get("data", {}):
            raise QMPError(ev["data"]["error"])
        bi.fsync_path(dst)
        t = time.monotonic() - t0
        dm.quit()
        dm = None
        return t
    finally:
        if dm is not None:
            dm.kill()


def run_convert(tool, src, dst, opts, strace=None):
    bi.rm(dst)
    argv = (strace_argv(strace) if strace else []) + [tool, "convert", "-f", "raw", "-O", "raw"] + opts + [src, dst]
    t0 = time.monotonic()
    subprocess.run(argv, check=True)
    bi.fsync_path(dst)
    return time.monotonic() - t0


def rows_speed(title, results, anchor):
    """results: {tool: {config: [seconds]}} -> table, best config per tool."""
    rows = [["tool", "config", "time (s)", "MiB/s", "lseeks"]]
    best = {}
    for tool, per in results.items():
        for c, ts in per["t"].items():
            m, sd = bi.mean_sd(ts)
            rows.append([tool, c, bi.fmt_pm(m, sd, 3), f"{1024 / m:.0f}", str(per["lseeks"].get(c, ""))])
            if tool not in best or m < best[tool][1]:
                best[tool] = (c, m)
    print(f"\n## {title}")
    print(bi.render_table(rows))
    line = []
    for tool, (c, m) in best.items():
        if tool != anchor and anchor in best:
            line.append(f"{tool} best ({c}) {best[anchor][1] / m:.2f}x {anchor} best ({best[anchor][0]})")
    print("; ".join(line), flush=True)
    return best


def bench_copy(args, fsname, root, vblk):
    d = tempfile.mkdtemp(prefix="vblk-bstatus-", dir=root)
    try:
        src = os.path.join(d, "src.raw")
        fill(src, args.size)
        out = {}
        # backup
        res = {"qemu-storage-daemon": {"t": {}, "lseeks": {}}, "vblk serve": {"t": {}, "lseeks": {}}}
        daemons = {"qemu-storage-daemon": ["qemu-storage-daemon"], "vblk serve": [vblk, "serve"]}
        for r in range(args.runs):
            order = list(daemons) if r % 2 == 0 else list(daemons)[::-1]
            for cfg in CONFIGS[fsname]:
                for name in order:
                    bi.drop_cache(src)
                    t = run_backup(daemons[name], src, os.path.join(d, "dst.raw"), cfg, d)
                    res[name]["t"].setdefault(cfg_name(cfg), []).append(t)
                    print(f"{fsname} backup {name} {cfg_name(cfg)} {t:.3f}", file=sys.stderr, flush=True)
        for cfg in CONFIGS[fsname]:
            for name in daemons:
                st = os.path.join(d, "strace.txt")
                run_backup(daemons[name], src, os.path.join(d, "dst.raw"), cfg, d, strace=st)
                res[name]["lseeks"][cfg_name(cfg)] = lseek_count(st)
        out["backup"] = {"results": res,
                         "best": rows_speed(f"full backup of {args.size >> 20} MiB raw on {fsname}", res,
                                            "qemu-storage-daemon")}
        # convert
        res = {"qemu-img": {"t": {}, "lseeks": {}}, "vblk": {"t": {}, "lseeks": {}}}
        tools = {"qemu-img": "qemu-img", "vblk": vblk}
        for r in range(args.runs):
            order = list(tools) if r % 2 == 0 else list(tools)[::-1]
            for opts in CONVERT_OPTS[fsname]:
                for name in order:
                    bi.drop_cache(src)
                    t = run_convert(tools[name], src, os.path.join(d, "dst.raw"), opts)
                    res[name]["t"].setdefault(" ".join(opts) or "defaults", []).append(t)
                    print(f"{fsname} convert {name} {opts} {t:.3f}", file=sys.stderr, flush=True)
        for opts in CONVERT_OPTS[fsname]:
            for name in tools:
                st = os.path.join(d, "strace.txt")
                run_convert(tools[name], src, os.path.join(d, "dst.raw"), opts, strace=st)
                res[name]["lseeks"][" ".join(opts) or "defaults"] = lseek_count(st)
        out["convert"] = {"results": res,
                          "best": rows_speed(f"convert of {args.size >> 20} MiB raw on {fsname}", res, "qemu-img")}
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def wait_sock(path, proc, timeout=30):
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.args}")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return
        except OSError:
            if time.monotonic() > end:
                raise SystemExit(f"no server on {path}")
            time.sleep(0.05)
        finally:
            s.close()


def timed(argv, out=subprocess.DEVNULL):
    t0 = time.monotonic()
    p = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, check=False)
    if p.returncode:
        raise SystemExit(f"{argv} failed: {p.stderr.decode()[-500:]}")
    return time.monotonic() - t0


def make_big(path, size=1 << 40, step=100 * MIB, chunk=MIB):
    """1 TiB qcow2, `chunk` of data every `step` (1 %), written by qemu-io."""
    if os.path.exists(path) and os.path.exists(path + ".done"):
        return
    bi.rm(path)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", path, str(size)], check=True)
    cmds = "".join(f"write -q -P 0x5a {o} {chunk}\n" for o in range(0, size, step)) + "quit\n"
    subprocess.run(["qemu-io", "-f", "qcow2", path], input=cmds.encode(), stdout=subprocess.DEVNULL, check=True)
    open(path + ".done", "w").close()


def row_map(args, vblk):
    big = os.path.join(args.big_dir, "big-1T-1pct.qcow2")
    print("creating the 1 TiB qcow2 (1 MiB every 100 MiB) ...", file=sys.stderr, flush=True)
    make_big(big)
    out = {}
    rows = [["map", "tool", "time (s)", "extents"]]
    # local
    res = {"qemu-img map": [], "vblk map": []}
    outs = {}
    for r in range(args.runs):
        for name, tool in ([("qemu-img map", "qemu-img"), ("vblk map", vblk)][::1 if r % 2 == 0 else -1]):
            f = os.path.join(args.big_dir, "map.json")
            with open(f, "w") as fo:
                res[name].append(timed([tool, "map", "--output=json", "-f", "qcow2", big], fo))
            outs[name] = json.load(open(f))
    same_local = outs["qemu-img map"] == outs["vblk map"]
    for name, ts in res.items():
        m, sd = bi.mean_sd(ts)
        rows.append(["local", name, bi.fmt_pm(m, sd, 3), str(len(outs[name]))])
    out["local"] = {"seconds": res, "same_output": same_local}
    # over NBD
    sock = os.path.join(args.big_dir, "nbd.sock")
    servers = {"qemu-nbd": ["qemu-nbd", "-f", "qcow2", "-r", "-t", "-k", sock, big],
               "vblk nbd": [vblk, "nbd", "-f", "qcow2", "-r", "-t", "-k", sock, big]}
    res = {k: [] for k in servers}
    outs = {}
    for r in range(args.runs):
        for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
            bi.rm(sock)
            proc = subprocess.Popen(servers[name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_sock(sock, proc)
                f = os.path.join(args.big_dir, "nbdmap.txt")
                with open(f, "w") as fo:
                    res[name].append(timed(["nbdinfo", "--map", f"nbd+unix:///?socket={sock}"], fo))
                outs[name] = open(f).read()
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
    same_nbd = outs["qemu-nbd"] == outs["vblk nbd"]
    for name, ts in res.items():
        m, sd = bi.mean_sd(ts)
        rows.append(["nbdinfo --map", name, bi.fmt_pm(m, sd, 3), str(len(outs[name].splitlines()))])
    out["nbd"] = {"seconds": res, "same_output": same_nbd}
    print("\n## extent map of a 1 TiB qcow2 with 1 % data (1 MiB every 100 MiB), ext4")
    print(bi.render_table(rows))
    print(f"same extents: local {same_local}, nbdinfo {same_nbd}", flush=True)
    return out


def row_zeros(args, vblk):
    d = tempfile.mkdtemp(prefix="vblk-bstatus-", dir="/var/tmp")
    try:
        src = os.path.join(d, "src.raw")
        fill(src, args.size, zero_every_other=True)
        rows = [["tool", "setting", "allocated (MiB)", "same content"]]
        out = {}

        def record(tool, setting, dst):
            ok = subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "raw", src, dst]).returncode == 0
            a = allocated(dst) / MIB
            rows.append([tool, setting, f"{a:.0f}", "yes" if ok else "NO"])
            out[f"{tool} {setting}"] = {"allocated_mib": a, "identical": ok}

        dst = os.path.join(d, "dst.raw")
        run_convert("qemu-img", src, dst, [])
        record("qemu-img convert", "defaults", dst)
        run_convert(vblk, src, dst, [])
        record("vblk convert", "defaults", dst)
        bi.rm(dst)
        subprocess.run([vblk, "backup", "-f", "raw", "-O", "raw", "-q", src, dst], check=True)
        record("vblk backup", "defaults", dst)
        daemons = {"qemu-storage-daemon": ["qemu-storage-daemon"], "vblk serve": [vblk, "serve"]}
        for mode in ("off", "on", "unmap"):
            extra = {"detect-zeroes": mode}
            if mode == "unmap":
                extra["discard"] = "unmap"
            for name, argv0 in daemons.items():
                run_backup(argv0, src, dst, {}, d, target_extra=extra)
                record(f"blockdev-backup ({name})", f"detect-zeroes={mode}", dst)
        print(f"\n## {args.size >> 20} MiB raw, every other MiB allocated zeroes -> new raw target (ext4)")
        print(bi.render_table(rows), flush=True)
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def row_iops(args, vblk):
    """fio 4 KiB random writes through the daemon's NBD export of the
    backup source: idle, then while a full backup runs."""
    d = tempfile.mkdtemp(prefix="vblk-bstatus-", dir="/dev/shm")
    try:
        src, dst = os.path.join(d, "src.raw"), os.path.join(d, "dst.raw")
        size = 2 * args.size
        fill(src, size)
        daemons = {"qemu-storage-daemon": ["qemu-storage-daemon"], "vblk serve": [vblk, "serve"],
                   "vblk serve, COW buffer": [vblk, "serve"]}
        # vblk's COW buffer (x-perf cow-buffer-size, QEMU has none): a guest
        # write's old data goes to memory and the target is written later.
        job_extra = {"vblk serve, COW buffer": {"x-perf": {"cow-buffer-size": args.iops_cow_buffer}}}
        daemons = {k: v for k, v in daemons.items() if re.search(args.iops_daemons, k)}
        res = {n: {"idle": [], "backup": [], "backup_s": []} for n in daemons}
        sock = os.path.join(d, "nbd.sock")
        fio = ["fio", "--name=guest", "--ioengine=nbd", f"--uri=nbd+unix:///source?socket={sock}",
               "--rw=randwrite", "--bs=4k", "--iodepth=16", f"--size={args.fio_size}", "--runtime=3", "--time_based",
               "--output-format=json"]

        def iops(text):
            # fio's nbd engine prints a line before the JSON
            return json.loads(text[text.index("{"):])["jobs"][0]["write"]["iops"]
        for r in range(args.runs):
            for name in (list(daemons) if r % 2 == 0 else list(daemons)[::-1]):
                bi.rm(dst)
                subprocess.run(["qemu-img", "create", "-q", "-f", "raw", dst, str(size)], check=True)
                dm = Daemon(daemons[name], os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
                try:
                    dm.qmp.ok("blockdev-add", {"driver": "file", "filename": src, "node-name": "source",
                                               "aio": "threads"})
                    dm.qmp.ok("blockdev-add", {"driver": "file", "filename": dst, "node-name": "target",
                                               "aio": "threads"})
                    dm.qmp.ok("nbd-server-start", {"addr": {"type": "unix", "data": {"path": sock}}})
                    dm.qmp.ok("block-export-add", {"type": "nbd", "id": "e", "node-name": "source",
                                                   "writable": True})
                    p = subprocess.run(fio, capture_output=True, text=True, check=True)
                    res[name]["idle"].append(iops(p.stdout))
                    fp = subprocess.Popen(fio, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    time.sleep(0.3)
                    t0 = time.monotonic()
                    dm.qmp.ok("blockdev-backup", dict({"job-id": "j", "device": "source", "target": "target",
                                                       "sync": "full"}, **args.iops_backup_args,
                                                      **job_extra.get(name, {})))
                    ev, t1 = dm.qmp.next_event({"BLOCK_JOB_COMPLETED"}, 600)
                    res[name]["backup_s"].append(t1 - t0)
                    o, _ = fp.communicate()
                    res[name]["backup"].append(iops(o))
                    dm.quit()
                    dm = None
                finally:
                    if dm is not None:
                        dm.kill()
                print(f"iops {name} idle {res[name]['idle'][-1]:.0f} during backup {res[name]['backup'][-1]:.0f} "
                      f"(backup {res[name]['backup_s'][-1]:.2f} s)", file=sys.stderr, flush=True)
        rows = [["daemon", "idle IOPS", "IOPS during backup", "% of idle", "backup (s)"]]
        for name, v in res.items():
            mi, si = bi.mean_sd(v["idle"])
            mb, sb = bi.mean_sd(v["backup"])
            mt, st = bi.mean_sd(v["backup_s"])
            rows.append([name, bi.fmt_pm(mi, si, 0), bi.fmt_pm(mb, sb, 0), f"{100 * mb / mi:.0f}",
                         bi.fmt_pm(mt, st, 2)])
        print(f"\n## guest 4 KiB random writes (fio nbd engine, QD16, 3 s, over the first {args.fio_size >> 20} MiB) "
              f"to a {size >> 30} GiB raw on tmpfs, "
              f"idle and during a full backup of it (started 0.3 s into the fio run)")
        print(bi.render_table(rows), flush=True)
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


EXTRA_ROWS = {"iops": row_iops, "map": row_map, "zeros": row_zeros}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vblk", default=os.path.join(bi.REPO_ROOT, "build", "vblk"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=bi.parse_size, default=GIB)
    ap.add_argument("--only", default="copy,iops,map,zeros", help="comma-separated rows")
    ap.add_argument("--fs", default="tmpfs,ext4")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fio-size", type=bi.parse_size, default=256 * MIB,
                    help="the guest's working set for the iops row (from offset 0)")
    ap.add_argument("--iops-backup-args", type=json.loads, default={},
                    help="extra blockdev-backup arguments for the iops row (JSON), e.g. x-perf")
    ap.add_argument("--iops-daemons", default=".", help="regex of the daemons in the iops row")
    ap.add_argument("--iops-cow-buffer", type=bi.parse_size, default=256 * MIB,
                    help="the COW buffer of the 'vblk serve, COW buffer' daemon in the iops row")
    ap.add_argument("--big-dir", default="/var/tmp", help="where the 1 TiB qcow2 is made (kept between runs)")
    args = ap.parse_args()
    vblk = bi.resolve_tool(args.vblk, "vblk")
    only = set(args.only.split(","))
    meta = bi.run_meta(vblk, {"qsd_version": ["qemu-storage-daemon", "--version"],
                              "qemu_img_version": ["qemu-img", "--version"]}, runs=args.runs, size=args.size)
    print(f"# command:  {meta['command']}")
    print(f"# date:     {meta['date']}; kernel {meta['kernel']}; cpu {meta['cpu']}")
    print(f"# tools:    {meta['vblk_version']}; {meta['qsd_version']}; {meta['qemu_img_version']}")
    print(f"# load:     {meta['loadavg_start']} at start; runs {args.runs}, interleaved", flush=True)
    results = {}
    roots = {"tmpfs": "/dev/shm", "ext4": "/var/tmp"}
    if "copy" in only:
        for fsname in args.fs.split(","):
            results[f"copy-{fsname}"] = bench_copy(args, fsname, roots[fsname], vblk)
            bi.write_json(args.json, meta, results)
    extra = globals().get("EXTRA_ROWS", {})
    for row, fn in extra.items():
        if row in only:
            results[row] = fn(args, vblk)
            bi.write_json(args.json, meta, results)
    meta["loadavg_end"] = bi.loadavg()
    print(f"# load {meta['loadavg_end']} at end")
    bi.write_json(args.json, meta, results)


if __name__ == "__main__":
    main()
