"""What the side-by-side daemon benchmarks (bench_fuse.py, bench_nbd_cpu.py,
bench_vhost_guest.py) share: a process's CPU time, their common options,
the random image they serve and the daemon started for a measurement."""
import os
import shutil
import signal
import subprocess
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """utime + stime of a process, all its threads, in seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def add_common_args(ap, size=1 << 30):
    ap.add_argument("--vblk", default=os.environ.get("VBLK", "build/vblk"))
    ap.add_argument("--qsd", default=shutil.which("qemu-storage-daemon"))
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--size", type=int, default=size)
    ap.add_argument("--reps", type=int, default=3)


def random_image(path, size):
    """A raw image of `size` bytes (whole MiB) of random data."""
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))


class Daemon:
    """A daemon started for one measurement: `ready()` says it serves
    (a socket exists, a mount is there); stop() is SIGTERM, then SIGKILL."""

    def __init__(self, argv, ready, env=None, timeout=20):
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))
        end = time.time() + timeout
        while not ready():
            if self.p.poll() is not None or time.time() > end:
                self.stop()
                raise RuntimeError("%s did not start" % argv[0])
            time.sleep(0.02)

    @property
    def pid(self):
        return self.p.pid

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
