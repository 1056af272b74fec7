"""Shared harness of the test_qmp_* graph tests (blockdev-create, snapshots,
drive-backup, transaction): one scenario runs against qemu-storage-daemon
and `vblk serve` in turn, in the same directory at the same paths, so replies
and events (paths included) must be equal. Between the daemons the work
directory is emptied; what a scenario wants compared afterwards (images,
qemu-img info) it returns as part of its observation.

Normalised, because they cannot agree: event timestamps (dropped),
generated node names (#blockNNN -> #block), snapshot dates and clocks.

Only the Python standard library is used.
"""

import json
import os
import re
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import InteropTestCase, storage_daemons  # noqa: E402
from qmp_driver import Daemon  # noqa: E402  (common.py puts bench/ on the path)

QSD = shutil.which("qemu-storage-daemon")
QEMU_IMG = shutil.which("qemu-img")
QEMU_IO = shutil.which("qemu-io")
DAEMONS = storage_daemons()


def norm(obj):
    """Generated node names compare equal."""
    return json.loads(re.sub(r"#block\d+", "#block", json.dumps(obj)))


def graph(q):
    """query-named-block-nodes (flat) without what depends on allocation
    (actual-size) or is a guess for file nodes (their virtual-size)."""
    out = []
    for n in q.ok("query-named-block-nodes", flat=True):
        n["image"].pop("actual-size", None)
        if n["drv"] == "file":
            n["image"].pop("virtual-size", None)
        out.append(n)
    return out


def qnode(name, path, **extra):
    """A qcow2 node over a file node, for blockdev-add."""
    n = {"driver": "qcow2", "node-name": name, "file": {"driver": "file", "filename": path}}
    n.update(extra)
    return n


def bitmaps(q, node):
    """The named dirty bitmaps of `node` as query-named-block-nodes has them."""
    for n in q.ok("query-named-block-nodes", flat=True):
        if n["node-name"] == node:
            return [b for b in n.get("dirty-bitmaps", []) if "name" in b]
    return None


def tx(*actions, **props):
    """transaction arguments from (type, data) pairs and properties."""
    a = {"actions": [{"type": t, "data": d} for t, d in actions]}
    if props:
        a["properties"] = props
    return a


def data_bytes(extents):
    """Bytes of data (not holes, not zero) in qemu-img map / nbdinfo extents."""
    return sum(e["length"] for e in extents if e.get("data", True) and not e.get("zero", False))


def create_job(c, job, options):
    """blockdev-create as a job, waited for and dismissed (events recorded)."""
    c("blockdev-create", **{"job-id": job, "options": options})
    c.wait_job(job)
    c("job-dismiss", id=job)
    c.ev()


class QsdTimingFlake(Exception):
    """qemu-storage-daemon's PBKDF timing failed ("Unable to get accurate CPU
    usage"), as it does now and then on a busy machine: the run is done
    again (run_retrying_flakes)."""


def create_luks_job(c, job, options):
    """blockdev-create of a LUKS volume (luks, or qcow2 with encrypt) as a
    job, waited for and dismissed; the reply of the command (an error
    reply: no job). Raises QsdTimingFlake on qemu-storage-daemon's
    timing failure."""
    r = c("blockdev-create", **{"job-id": job, "options": options})
    if "error" in r:
        return r
    c.wait_job(job)
    if "Unable to get accurate CPU usage" in json.dumps(c("query-jobs")):
        raise QsdTimingFlake()
    c("job-dismiss", id=job)
    c.ev()
    return r


def comparable_luks_nodes(nodes, luks_info):
    """query-named-block-nodes of a new LUKS volume without what is random
    or timed in it (actual size, uuid, PBKDF2 iterations); luks_info(node)
    is the node's QCryptoBlockInfoLUKS."""
    for n in nodes:
        n["image"].pop("actual-size", None)
        data = luks_info(n)
        data.pop("uuid"), data.pop("master-key-iters")
        for sl in data["slots"]:
            sl.pop("iters", None)
    return nodes


def run_retrying_flakes(run, attempts=5):
    """run() again while qemu-storage-daemon's timing fails, up to attempts."""
    for attempt in range(attempts):
        try:
            return run()
        except QsdTimingFlake:
            if attempt == attempts - 1:
                raise


def new_qcow2(c, path, name, size, backing=None):
    """A backup target as libvirt makes one: a file and a qcow2 image on it
    by blockdev-create (the backing file `backing`, a path, in its header),
    opened without its backing chain."""
    create_job(c, "c-" + name, {"driver": "file", "filename": path, "size": 0})
    c("blockdev-add", driver="file", filename=path, **{"node-name": name + "-f"})
    opts = {"driver": "qcow2", "file": name + "-f", "size": size}
    if backing:
        opts.update({"backing-file": backing, "backing-fmt": "qcow2"})
    create_job(c, "q-" + name, opts)
    c("blockdev-add", driver="qcow2", file=name + "-f", backing=None, **{"node-name": name})


def export_point(uri, raw_path):
    """The content of an NBD export now, copied to `raw_path`, and its
    allocated bytes (NBD block status, holes excluded)."""
    img("convert", "-f", "raw", "-O", "raw", uri, raw_path)
    r = subprocess.run(["nbdinfo", "--map", "--json", uri], capture_output=True, text=True, check=True,
                       timeout=60)
    return data_bytes([{"length": e["length"], "data": e["type"] & 1 == 0} for e in json.loads(r.stdout)])


def img(*args, check=True):
    r = subprocess.run([QEMU_IMG] + list(args), capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError("qemu-img %s: %s" % (" ".join(args), r.stderr))
    return r


def img_info(path):
    """qemu-img info --output=json, without what depends on the file's
    allocation on the host (actual-size) or its directory."""
    r = img("info", "--output=json", "-U", path)
    info = json.loads(r.stdout)
    info.pop("actual-size", None)
    info.pop("dirty-flag", None)
    return info


def compare(a, b, fa=None, fb=None):
    args = ["compare", "-U"]
    if fa:
        args += ["-f", fa]
    if fb:
        args += ["-F", fb]
    r = img(*(args + [a, b]), check=False)
    return r.returncode, r.stdout.strip()


def strip_pauses(events):
    """Without QEMU's internal pause/resume pairs while it inserts a backup
    filter (JOB_STATUS_CHANGE paused then running of one job)."""
    out = []
    paused = set()
    for e in events:
        if e["event"] == "JOB_STATUS_CHANGE":
            jid, st = e["data"]["id"], e["data"]["status"]
            if st == "paused":
                paused.add(jid)
                continue
            if st == "running" and jid in paused:
                paused.discard(jid)
                continue
        out.append(e)
    return out


def by_job(events):
    """{job id: [statuses]} and the other events sorted: what two daemons
    agree on when jobs run side by side (their interleaving is timing)."""
    jobs = {}
    other = []
    for e in strip_pauses(events):
        if e["event"] == "JOB_STATUS_CHANGE":
            jobs.setdefault(e["data"]["id"], []).append(e["data"]["status"])
        else:
            # How far a failed or cancelled job got is timing.
            if e["event"] == "BLOCK_JOB_CANCELLED" or "error" in e.get("data", {}):
                e = dict(e, data=dict(e["data"], offset="any"))
            other.append(json.dumps(e, sort_keys=True))
    return {"jobs": jobs, "other": sorted(other)}


class Recorder:
    """c(command, **args): runs a command, appends (command, args, reply)
    to `out`; ev() appends the events that came meanwhile (timestamps
    dropped), waiting `wait` seconds for stragglers."""

    def __init__(self, qmp, out):
        self.qmp = qmp
        self.out = out

    def __call__(self, command, args=None, **kw):
        a = dict(args or {}, **kw)
        r = self.qmp.cmd(command, a)
        self.out.append((command, a, r))
        if os.environ.get("VBLK_GRAPH_DEBUG"):
            print(">", command, json.dumps(a)[:300], "\n<", json.dumps(r)[:600], file=sys.stderr)
        return r

    def ev(self, wait=0.1, until=None, timeout=30):
        """Events so far (and, with `until`, up to that event name)."""
        if until:
            e = self.qmp.event(until, timeout)
            self.qmp.events.append(e)
        evs = self.qmp.drain_events(wait)
        got = []
        for e in evs:
            e.pop("timestamp", None)
            got.append(e)
        self.qmp.events.clear()
        self.out.append(("events", strip_pauses(got)))
        return got

    def wait_job(self, job, status="concluded", timeout=60):
        """Waits for JOB_STATUS_CHANGE `status` of `job`; records the events."""
        got = []
        while True:
            e = self.qmp.event("JOB_STATUS_CHANGE", timeout)
            e.pop("timestamp", None)
            got.append(e)
            if e["data"]["id"] == job and e["data"]["status"] == status:
                break
        for e in self.qmp.drain_events(0.05):
            e.pop("timestamp", None)
            got.append(e)
        self.qmp.events.clear()
        self.out.append(("events", strip_pauses(got)))
        return got

    def wait_jobs(self, jobs, status="concluded", timeout=60):
        """Waits until every job in `jobs` reached `status` (or null);
        records the events grouped by job (by_job)."""
        got = []
        left = set(jobs)
        while left:
            e = self.qmp.event("JOB_STATUS_CHANGE", timeout)
            e.pop("timestamp", None)
            got.append(e)
            if e["data"]["status"] == status:
                left.discard(e["data"]["id"])
        for e in self.qmp.drain_events(0.1):
            e.pop("timestamp", None)
            got.append(e)
        self.qmp.events.clear()
        self.out.append(("events", by_job(got)))
        return got


class GraphTestCase(InteropTestCase):

    def setUp(self):
        super().setUp()
        if len(DAEMONS) < 2:
            self.skipTest("needs both qemu-storage-daemon and vblk serve")
        if os.environ.get("VBLK_GRAPH_KEEP"):  # debugging: keep the files
            import tempfile
            self.tmp = tempfile.mkdtemp(prefix="vblk-graph-")
            print("work directory:", self.tmp, file=sys.stderr)
        self.work = self.subdir("work")

    def path(self, name):
        return os.path.join(self.work, name)

    def clean_work(self):
        for f in os.listdir(self.work):
            p = os.path.join(self.work, f)
            if os.path.isdir(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)

    def both(self, scenario, prepare=None):
        """scenario(qmp, rec, out) per daemon in the same work directory;
        `prepare()` makes the inputs first. Asserts the observations equal
        and returns {daemon: observation}. The work directory of each run is
        kept as <daemon>/ for image comparisons."""
        seen = {}
        for name, argv in DAEMONS:
            self.clean_work()
            if prepare:
                prepare()
            sock = os.path.join(self.tmp, "qmp.sock")
            dm = Daemon(argv, sock, os.path.join(self.tmp, name.replace(" ", "_") + ".log"))
            out = []
            try:
                res = scenario(dm.qmp, Recorder(dm.qmp, out), out)
                if res is not None:
                    out.append(("result", res))
            finally:
                dm.quit()
            keep = os.path.join(self.tmp, name.replace(" ", "_"))
            if os.path.exists(keep):
                shutil.rmtree(keep)
            shutil.copytree(self.work, keep)
            seen[name] = norm(out)
        names = list(seen)
        a, b = seen[names[0]], seen[names[1]]
        for i, (x, y) in enumerate(zip(a, b)):
            self.assertEqual(y, x, "step %d: %s differs from %s" % (i, names[1], names[0]))
        self.assertEqual(len(b), len(a))
        return seen

    def kept(self, daemon_index, name):
        """A file the run of DAEMONS[daemon_index] left in its work directory."""
        return os.path.join(self.tmp, DAEMONS[daemon_index][0].replace(" ", "_"), name)
