"""A throwaway Ceph cluster for the RBD tests and benches.

One monitor on 127.0.0.1 (a free port below the ephemeral range), N OSDs on
the memstore object store (RAM only, nothing on disk but their small state
files), one replicated pool initialised for RBD. By default no cephx (any
`user` name is accepted, so the driver's `user`/`conf` options can still be
exercised); with cephx=True every connection authenticates with cephx: the
daemons and the admin tools read keys from the cluster's keyrings, and a
second user, client.vblk (caps: profile rbd), has a known key
(`user_key`) kept out of every conf, so a client reaches the cluster only
through `client_conf` (mon address and auth settings, no keyring) plus that
key, e.g. QEMU's key-secret. No manager: I/O does not need one, and leaving
it out saves seconds.

The clients' op timeouts are short (rados_osd_op_timeout,
rados_mon_op_timeout), so a stopped cluster fails a request instead of
hanging it. Daemons run in the foreground under Popen: stop() ends them by
PID (SIGKILL, wait) and removes the directory; pause()/resume() (SIGSTOP /
SIGCONT) freeze the whole cluster without losing the OSDs' memory.

Use:
    with CephCluster(osds=1) as c:
        c.conf, c.pool ...
or by hand: python3 tests/interop/ceph_cluster.py [--osds N] (prints the
conf path and waits for Ctrl-C).
"""

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Optional

BINARIES = ("ceph-mon", "ceph-osd", "ceph", "rbd", "monmaptool", "ceph-authtool")


def missing_binaries() -> List[str]:
    return [b for b in BINARIES if not shutil.which(b)]


def skip_reason() -> Optional[str]:
    """None when a cluster can be started, else why not (for skipTest)."""
    m = missing_binaries()
    if m:
        return ("Ceph is not installed (missing %s; scripts/deps.sh installs "
                "ceph-mon ceph-osd)" % ", ".join(m))
    return None


def _free_port(lo: int = 20000, hi: int = 30000) -> int:
    """A port nobody listens on, below the ephemeral range (32768+)."""
    start = lo + (os.getpid() * 7919) % (hi - lo)
    for i in range(hi - lo):
        p = lo + (start - lo + i) % (hi - lo)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
            return p
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free port for the Ceph monitor")


class CephCluster:
    def __init__(self, osds: int = 1, pool_size: Optional[int] = None,
                 memstore_mib: int = 512, pool: str = "rbd",
                 op_timeout: int = 10, base_dir: Optional[str] = None,
                 cephx: bool = False):
        self.osds = osds
        self.cephx = cephx
        self.user = "vblk"      # client.vblk, cephx only
        self.user_key = ""      # its key (base64, as in a keyring)
        self.client_conf = ""   # mon host and auth only: no keyring
        self.pool_size = pool_size or min(osds, 3)
        self.memstore_mib = memstore_mib
        self.pool = pool
        self.op_timeout = op_timeout
        self.base_dir = base_dir
        self.dir = ""
        self.conf = ""
        self.port = 0
        self.procs: Dict[str, subprocess.Popen] = {}
        self.paused = False

    # ---- context manager
    def __enter__(self) -> "CephCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- helpers
    def env(self) -> Dict[str, str]:
        e = dict(os.environ)
        e["CEPH_CONF"] = self.conf
        return e

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=self.env(), timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(argv), p.returncode,
                                                       p.stderr.decode(errors="replace")))
        return p

    def ceph(self, *args: str, timeout: float = 60) -> str:
        return self.run("ceph", "-c", self.conf, *args, timeout=timeout).stdout.decode()

    def rbd(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("rbd", "-c", self.conf, *args, timeout=timeout, check=check)

    def spec(self, image: str, pool: Optional[str] = None) -> str:
        """QEMU's filename syntax for an image of this cluster."""
        return "rbd:%s/%s:conf=%s" % (pool or self.pool, image, self.conf)

    def _write_conf(self) -> None:
        d = self.dir
        auth = "cephx" if self.cephx else "none"
        # Client op timeouts, so a broken cluster fails instead of hanging; the
        # cluster's conf and the keyring-less client conf share them.
        client = f"""[client]
rados mon op timeout = {self.op_timeout}
rados osd op timeout = {self.op_timeout}
client mount timeout = {self.op_timeout}
log file = /dev/null
admin socket =
"""
        conf = f"""[global]
fsid = {self.fsid}
mon host = [v2:127.0.0.1:{self.port}]
ms bind msgr1 = false
auth cluster required = {auth}
auth service required = {auth}
auth client required = {auth}
auth supported = {auth}
run dir = {d}/run
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
log file = {d}/log/$name.log
keyring = {d}/keyring
mon data = {d}/$name
osd data = {d}/$name
osd objectstore = memstore
memstore device bytes = {self.memstore_mib << 20}
osd pool default size = {self.pool_size}
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool delete = true
# The monitor batches map changes for a second by default: every setup step
# (osd new, pool create, the OSD's boot) and every RBD snapshot (a pool snap
# id from the monitor) waited on it. 50 ms: the cluster is up in ~1 s, not 7.
paxos propose interval = 0.05
paxos min wait = 0.01
mon allow pool size one = true
mon warn on pool no redundancy = false
mon osd min down reporters = 1
osd heartbeat grace = 5
osd heartbeat interval = 1
osd fast fail on connection refused = true
mon osd down out interval = 0
osd op num threads per shard = 1
osd op num shards = 2
ms async op threads = 2
ms bind port min = 6800
ms bind port max = 7800
""" + client
        if self.cephx:
            # Each OSD's own key, given to `ceph osd new` and its mkfs.
            conf += f"[osd]\nkeyring = {d}/$name/keyring\n"
        with open(self.conf, "w") as f:
            f.write(conf)
        # What a client outside the cluster knows: where the monitor is and
        # how to authenticate, but no keyring (the key comes from elsewhere).
        with open(self.client_conf, "w") as f:
            f.write(f"""[global]
fsid = {self.fsid}
mon host = [v2:127.0.0.1:{self.port}]
ms bind msgr1 = false
auth client required = {auth}
keyring = {d}/no-such-keyring
""" + client)

    def gen_key(self) -> str:
        return self.run("ceph-authtool", "--gen-print-key").stdout.decode().strip()

    def _spawn(self, name: str, argv: List[str]) -> None:
        log = open(os.path.join(self.dir, "log", name + ".out"), "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env())
        log.close()

    # ---- life cycle
    def start(self) -> None:
        r = skip_reason()
        if r:
            raise RuntimeError(r)
        self.dir = tempfile.mkdtemp(prefix="vblk-ceph-", dir=self.base_dir)
        for sub in ("run", "log"):
            os.mkdir(os.path.join(self.dir, sub))
        self.conf = os.path.join(self.dir, "ceph.conf")
        self.client_conf = os.path.join(self.dir, "client.conf")
        self.fsid = str(uuid.uuid4())
        self.port = _free_port()
        self._write_conf()
        try:
            self._start_mon()
            for i in range(self.osds):
                self._start_osd(i)
            self._make_pool()
        except BaseException:
            self.stop()
            raise

    def _start_mon(self) -> None:
        d, c = self.dir, self.conf
        keyring = os.path.join(d, "keyring")
        monmap = os.path.join(d, "monmap")
        self.run("ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.",
                 "--cap", "mon", "allow *")
        if self.cephx:
            # The monitor's mkfs imports these users with their caps.
            self.user_key = self.gen_key()
            self.run("ceph-authtool", keyring, "--gen-key", "-n", "client.admin", "--cap", "mon", "allow *",
                     "--cap", "osd", "allow *", "--cap", "mgr", "allow *")
            self.run("ceph-authtool", keyring, "--add-key", self.user_key, "-n", "client." + self.user,
                     "--cap", "mon", "profile rbd", "--cap", "osd", "profile rbd")
        self.run("monmaptool", "--create", "--fsid", self.fsid,
                 "--addv", "a", "[v2:127.0.0.1:%d]" % self.port, monmap)
        self.run("ceph-mon", "-c", c, "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", keyring)
        self._spawn("mon.a", ["ceph-mon", "-c", c, "-f", "-i", "a"])

    def _start_osd(self, i: int) -> None:
        u = str(uuid.uuid4())
        os.mkdir(os.path.join(self.dir, "osd.%d" % i))
        if self.cephx:
            key = self.gen_key()
            secret = os.path.join(self.dir, "osd.%d" % i, "secret.json")
            with open(secret, "w") as f:
                f.write('{"cephx_secret": "%s"}' % key)
            osd_id = self.ceph("osd", "new", u, "-i", secret).strip()
            self.run("ceph-authtool", "--create-keyring", os.path.join(self.dir, "osd.%d" % i, "keyring"),
                     "-n", "osd.%d" % i, "--add-key", key)
        else:
            osd_id = self.ceph("osd", "new", u).strip()
        assert osd_id == str(i), (osd_id, i)
        self.run("ceph-osd", "-c", self.conf, "-i", str(i), "--mkfs", "--osd-uuid", u)
        self.start_osd(i)

    def start_osd(self, i: int) -> None:
        """(Re)starts OSD i (after kill_osd)."""
        self._spawn("osd.%d" % i, ["ceph-osd", "-c", self.conf, "-f", "-i", str(i)])

    def _make_pool(self) -> None:
        # Its size is the conf's `osd pool default size`.
        self.ceph("osd", "pool", "create", self.pool, "8", "8", "replicated")
        # Blocks until the pool's PGs are active, i.e. the OSDs are up.
        self.rbd("pool", "init", self.pool, timeout=120)

    def kill_osd(self, i: int) -> None:
        """SIGKILL one OSD (a crash) and tell the monitor it is down."""
        p = self.procs.pop("osd.%d" % i)
        p.kill()
        p.wait()
        # Faster than waiting for peers' heartbeats to time out.
        self.ceph("osd", "down", str(i), timeout=30)

    def pause(self) -> None:
        """Freezes every daemon (SIGSTOP): to clients the cluster is gone."""
        for p in self.procs.values():
            p.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        for p in self.procs.values():
            p.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        for name, p in list(self.procs.items()):
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        if self.dir and not os.environ.get("VBLK_KEEP_CEPH"):
            shutil.rmtree(self.dir, ignore_errors=True)


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description="Starts a throwaway Ceph cluster until Ctrl-C.")
    ap.add_argument("--osds", type=int, default=1)
    ap.add_argument("--pool-size", type=int, default=None)
    ap.add_argument("--memstore-mib", type=int, default=512)
    ap.add_argument("--pool", default="rbd")
    ap.add_argument("--cephx", action="store_true")
    a = ap.parse_args()
    # SIGTERM (and SIGINT, ignored in background jobs otherwise) end the
    # wait below, so the daemons are stopped and the directory removed.
    def _stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    t0 = time.time()
    with CephCluster(osds=a.osds, pool_size=a.pool_size, memstore_mib=a.memstore_mib, pool=a.pool,
                     cephx=a.cephx) as c:
        print("cluster up in %.1f s: conf=%s pool=%s (e.g. %s)" % (time.time() - t0, c.conf, c.pool,
                                                                 c.spec("img")), flush=True)
        if c.cephx:
            print("client conf=%s user=%s key=%s" % (c.client_conf, c.user, c.user_key), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())


class NeedsCluster:
    """TestCase mixin for tests on the module's cluster: skipped, saying why,
    where the Ceph daemons are missing; name(tag) gives image names unique
    within the test file."""
    _names = itertools.count(1)

    def setUp(self):
        super().setUp()
        reason = skip_reason()
        if reason:
            self.skipTest(reason)

    def name(self, tag):
        return "%s-%d" % (tag, next(NeedsCluster._names))
