"""Shared helpers for the vblk <-> qemu-img black-box interop tests.

Every test runs the binary under test ($VBLK) and the reference
``qemu-img`` (QEMU 7.2; override with $QEMU_IMG) on identical inputs and
compares the observable results (exit code, stdout, stderr, files).

Sanity check for the suite itself: ``VBLK=$(which qemu-img)`` must make
every test pass.

Only the Python 3 standard library is used.
"""

import hashlib
import os
import random
import re
import shutil
import stat
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

# One QMP connect helper for tests, benches and the demo (bench/qmp_driver.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from qmp_driver import connect_unix  # noqa: E402,F401


def _require_binary(env_name: str, fallback: Optional[str]) -> str:
    value = os.environ.get(env_name) or fallback
    if not value:
        sys.stderr.write(
            "interop tests: environment variable %s is not set\n" % env_name)
        sys.exit(2)
    path = value if os.sep in value else shutil.which(value)
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        sys.stderr.write(
            "interop tests: %s=%r is not an executable file\n" % (env_name, value))
        sys.exit(2)
    return os.path.abspath(path)


#: The binary under test.
VBLK = _require_binary("VBLK", None)
#: The reference implementation.
QEMU_IMG = _require_binary("QEMU_IMG", shutil.which("qemu-img"))

VBLK_NAME = os.path.basename(VBLK)
QEMU_NAME = os.path.basename(QEMU_IMG)

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# A fixed, C locale so strerror() texts etc. are comparable and stable.
_BASE_ENV = dict(os.environ)
for _k in list(_BASE_ENV):
    if _k.startswith("LC_") or _k in ("LANG", "LANGUAGE"):
        del _BASE_ENV[_k]
_BASE_ENV["LC_ALL"] = "C"
_BASE_ENV["LANG"] = "C"
# Keep qemu from picking up tracing / module settings from the caller.
for _k in ("QEMU_MODULE_DIR",):
    _BASE_ENV.pop(_k, None)


class Result:
    """Outcome of one process run."""

    def __init__(self, argv: Sequence[str], rc: int, out_bytes: bytes,
                 err_bytes: bytes):
        self.argv = list(argv)
        self.rc = rc
        self.out_bytes = out_bytes
        self.err_bytes = err_bytes
        self.stdout = out_bytes.decode("utf-8", "surrogateescape")
        self.stderr = err_bytes.decode("utf-8", "surrogateescape")

    def __repr__(self) -> str:
        return ("Result(argv=%r, rc=%d,\n  stdout=%r,\n  stderr=%r)"
                % (self.argv, self.rc, self.stdout, self.stderr))


def vblk_has_serve() -> bool:
    """Whether the vblk under test has the `serve` daemon."""
    try:
        r = subprocess.run([VBLK, "serve", "--help"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def storage_daemons() -> list:
    """[(name, argv)] of qemu-storage-daemon and `vblk serve`, those present:
    the daemons a QMP scenario runs against side by side."""
    out = []
    qsd = shutil.which("qemu-storage-daemon")
    if qsd:
        out.append(("qemu-storage-daemon", [qsd]))
    if vblk_has_serve():
        out.append(("vblk serve", [VBLK, "serve"]))
    return out


class BothDaemons:
    """Mixin for an InteropTestCase whose scenarios run against
    qemu-storage-daemon and `vblk serve` in turn, with the same input, and
    compare what each observed. `chdir_to_workdir`: the scenario (and the
    daemon) run in the daemon's work directory, for relative file names as
    images record them."""

    chdir_to_workdir = False

    def each_daemon(self, scenario):
        """Runs scenario(qmp, workdir) for each daemon; returns {name: observation}."""
        from qmp_driver import Daemon
        seen = {}
        for name, cmd in storage_daemons():
            with self.subTest(daemon=name):
                d = self.subdir(name.replace(" ", "_"))
                cwd = os.getcwd()
                if self.chdir_to_workdir:
                    os.chdir(d)
                try:
                    dm = Daemon(cmd, os.path.join(d, "qmp.sock"), os.path.join(d, "daemon.log"))
                    try:
                        seen[name] = scenario(dm.qmp, d)
                    finally:
                        dm.quit()
                finally:
                    os.chdir(cwd)
        return seen

    def assertSame(self, seen):
        vals = list(seen.values())
        for name, v in seen.items():
            self.assertEqual(v, vals[0], "%s differs from %s" % (name, list(seen)[0]))


def run(argv: Sequence[str], cwd: Optional[str] = None, timeout: float = 60,
        stdin_data: Optional[bytes] = None) -> Result:
    """Run argv, capturing stdout, stderr and the exit code."""
    argv = [os.fspath(a) for a in argv]
    try:
        proc = subprocess.run(argv, cwd=cwd, env=_BASE_ENV,
                              input=stdin_data if stdin_data is not None else b"",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("command timed out after %ss: %r" % (timeout, argv)) from exc
    return Result(argv, proc.returncode, proc.stdout, proc.stderr)


def vblk(*args, cwd: Optional[str] = None, timeout: float = 60) -> Result:
    return run([VBLK] + [os.fspath(a) for a in args], cwd=cwd, timeout=timeout)


def qemu(*args, cwd: Optional[str] = None, timeout: float = 60) -> Result:
    return run([QEMU_IMG] + [os.fspath(a) for a in args], cwd=cwd, timeout=timeout)


def both(*args, cwd: Optional[str] = None, cwd_q: Optional[str] = None,
         timeout: float = 60) -> Tuple[Result, Result]:
    """Run the same arguments through vblk (in cwd) and qemu-img (in cwd_q,
    default: the same cwd).  vblk runs first."""
    v = vblk(*args, cwd=cwd, timeout=timeout)
    q = qemu(*args, cwd=cwd_q if cwd_q is not None else cwd, timeout=timeout)
    return v, q


def normalise_progname(text: str, progname: str) -> str:
    """Rewrite program-name mentions in error output to 'qemu-img'.

    qemu-img prefixes error_report() lines with "qemu-img: " and prints
    "Try 'qemu-img --help' for more information"; vblk uses its own name.
    Only those two well-defined positions are rewritten."""
    if progname == "qemu-img":
        return text
    esc = re.escape(progname)
    text = re.sub(r"(?m)^" + esc + r": ", "qemu-img: ", text)
    text = re.sub(r"'" + esc + r" --help'", "'qemu-img --help'", text)
    return text


def norm_vblk_err(text: str) -> str:
    return normalise_progname(text, VBLK_NAME)


def norm_qemu_err(text: str) -> str:
    return normalise_progname(text, QEMU_NAME)


# ---------------------------------------------------------------------------
# Image construction helpers (pure Python file I/O)
# ---------------------------------------------------------------------------

def rand_bytes(n: int, seed: Union[int, str] = 0) -> bytes:
    """Deterministic pseudo-random bytes (so format probing is stable)."""
    rng = random.Random(seed)
    return rng.randbytes(n)


def make_image(path: str, size: int,
               data: Iterable[Tuple[int, bytes]] = (),
               zeros: Iterable[Tuple[int, int]] = (),
               fallocs: Iterable[Tuple[int, int]] = ()) -> str:
    """Create a raw image file.

    size   -- final file size; everything not written stays a hole
              (os.truncate creates the sparse file).
    data   -- (offset, bytes) written with os.pwrite.
    zeros  -- (offset, length) regions explicitly written with zero bytes,
              i.e. allocated on disk but reading as zero.
    fallocs-- (offset, length) regions reserved via posix_fallocate
              (unwritten extents).
    The file is created with exactly `size` bytes (zero/data writes that end
    beyond `size` are truncated back)."""
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        os.ftruncate(fd, size)
        for off, length in fallocs:
            os.posix_fallocate(fd, off, length)
        for off, length in zeros:
            chunk = b"\0" * min(length, MiB)
            done = 0
            while done < length:
                n = min(len(chunk), length - done)
                os.pwrite(fd, chunk[:n], off + done)
                done += n
        for off, buf in data:
            os.pwrite(fd, buf, off)
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def fill_file(path: str, size: int, byte: int) -> str:
    """Create a fully allocated file of `size` bytes all equal to `byte`."""
    return make_image(path, size, data=[(0, bytes([byte]) * size)] if size else [])


def read_range(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


# ---------------------------------------------------------------------------
# File-system state snapshots
# ---------------------------------------------------------------------------

_HASH_LIMIT = 256 * MiB


def file_state(path: str, with_mtime: bool = True):
    """(kind, size, sha256, mtime_ns) of a path; sha256 is skipped for huge
    (sparse) files."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return ("symlink", os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return ("dir",)
    if not stat.S_ISREG(st.st_mode):
        return ("other", stat.S_IFMT(st.st_mode))
    digest = None
    if st.st_size <= _HASH_LIMIT:
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(MiB), b""):
                    h.update(block)
            digest = h.hexdigest()
        except PermissionError:
            digest = "<unreadable>"
    state = ("file", st.st_size, digest, stat.S_IMODE(st.st_mode))
    if with_mtime:
        state += (st.st_mtime_ns,)
    return state


def tree_state(root: str, with_mtime: bool = True) -> Dict[str, tuple]:
    """Snapshot of every entry under root (relative path -> file_state)."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            snap[os.path.relpath(full, root)] = file_state(full, with_mtime)
    return snap


# ---------------------------------------------------------------------------
# Temporary directories and a test-case base class
# ---------------------------------------------------------------------------

def make_tempdir(testcase: Optional[unittest.TestCase] = None,
                 base: Optional[str] = None, prefix: str = "vblk-interop-") -> str:
    """Create a temp dir; registered for cleanup on `testcase` if given."""
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    if testcase is not None:
        testcase.addCleanup(shutil.rmtree, path, True)
    return path


def shm_dir() -> Optional[str]:
    """A tmpfs directory if one is available."""
    for cand in ("/dev/shm",):
        if os.path.isdir(cand) and os.access(cand, os.W_OK):
            return cand
    return None


def end_process(proc, argv, sig=None, timeout=30):
    """Sends `sig` (None: nothing, just wait) to a Popen started with piped
    stdout/stderr, waits for it to exit (killing it and failing the test if
    it does not), and returns (exit code, stderr text)."""
    if sig is not None and proc.poll() is None:
        proc.send_signal(sig)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("%s did not exit%s" % (argv, " on %s" % sig if sig is not None else ""))
    err = proc.stderr.read().decode("utf-8", "replace")
    proc.stdout.close()
    proc.stderr.close()
    return rc, err


def lock_bytes(path):
    """The byte offsets of the OFD locks anybody holds on `path`'s inode
    (QEMU's and vblk's image locks: 100+i needed, 200+i not shared)."""
    ino = os.stat(path).st_ino
    held = set()
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 8 or parts[1] != "OFDLCK":
                continue
            if int(parts[5].split(":")[2]) != ino:
                continue
            start = int(parts[6])
            last = start if parts[7] == "EOF" else int(parts[7])
            held.update(range(start, last + 1))
    return sorted(held)


def wait_unlocked(path, timeout=30):
    """Waits until nobody holds an image lock on `path`. A process killed
    with SIGKILL keeps its locks a little after wait() returns: its io_uring
    requests still in flight hold the open file until the kernel has
    cancelled them."""
    end = time.monotonic() + timeout
    while lock_bytes(path):
        if time.monotonic() > end:
            raise AssertionError("%s still locked after %ss: %r" % (path, timeout, lock_bytes(path)))
        time.sleep(0.01)


def wait_for_socket(path, proc, timeout=10):
    """Waits until a server process accepts connections on a unix socket."""
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(path):
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                s.close()
                return
            except OSError:
                pass
        if proc.poll() is not None:
            raise AssertionError("server exited early: rc=%s stderr=%r" %
                                 (proc.returncode, proc.stderr.read()))
        time.sleep(0.02)
    raise AssertionError("server did not listen on %s" % path)


class InteropTestCase(unittest.TestCase):
    """Base class with temp dirs and result-comparison assertions."""

    maxDiff = None

    def setUp(self):
        super().setUp()
        self.tmp = make_tempdir(self)

    def subdir(self, name: str) -> str:
        path = os.path.join(self.tmp, name)
        os.makedirs(path, exist_ok=True)
        return path

    # -- comparisons -------------------------------------------------------
    def assertSameRc(self, v: Result, q: Result, msg: str = ""):
        self.assertEqual(v.rc, q.rc,
                         "exit code differs %s\nvblk: %r\nqemu: %r" % (msg, v, q))

    def assertSameStdout(self, v: Result, q: Result, msg: str = ""):
        self.assertEqual(v.stdout, q.stdout,
                         "stdout differs %s\nvblk: %r\nqemu: %r" % (msg, v, q))

    def assertSameStderr(self, v: Result, q: Result, msg: str = ""):
        self.assertEqual(norm_vblk_err(v.stderr), norm_qemu_err(q.stderr),
                         "stderr differs (after program-name normalisation) %s"
                         "\nvblk: %r\nqemu: %r" % (msg, v, q))

    def assertSameResult(self, v: Result, q: Result, msg: str = "",
                         stdout: bool = True, stderr: bool = True):
        self.assertSameRc(v, q, msg)
        if stdout:
            self.assertSameStdout(v, q, msg)
        if stderr:
            self.assertSameStderr(v, q, msg)

    def assertUnchanged(self, before, after, msg: str = ""):
        self.assertEqual(before, after, "file system changed %s" % msg)


_FORMATS_CACHE: Dict[str, bool] = {}


def vblk_has_format(fmt: str) -> bool:
    """True if the binary under test lists `fmt` in its --help "Supported
    formats:" line (qemu-img does, so these cases always run against it).
    Used to hold back cases for a driver that has not landed yet."""
    if fmt not in _FORMATS_CACHE:
        out = run([VBLK, "--help"]).stdout
        line = next((l for l in out.splitlines() if l.startswith("Supported formats:")), "")
        _FORMATS_CACHE[fmt] = fmt in line.split()
    return _FORMATS_CACHE[fmt]


def skip_unless_formats(testcase: unittest.TestCase, argv: Sequence[str]) -> None:
    """Skips the current (sub)test if argv names a format vblk lacks."""
    for i, a in enumerate(argv[:-1]):
        if a in ("-f", "-F", "-O") and not vblk_has_format(argv[i + 1]):
            if argv[i + 1] in ("qcow2",):
                testcase.skipTest("vblk has no %s driver yet" % argv[i + 1])


def semi_compressible(n, seed):
    """Deterministic data mixing incompressible 4k blocks, text-like
    (compressible) blocks and zero blocks."""
    rng = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"qcow2", b"cluster", b"\n",
             b"refcount", b"L2", b"  "]
    out = bytearray()
    while len(out) < n:
        kind = rng.randrange(4)
        if kind == 0:
            out += rng.randbytes(4096)
        elif kind == 1:
            out += bytes(4096)
        else:
            blk = bytearray()
            while len(blk) < 4096:
                blk += rng.choice(words)
            out += blk[:4096]
    return bytes(out[:n])
