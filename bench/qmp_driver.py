"""A minimal QMP client and a storage-daemon launcher for the bench scripts.

The same code drives `qemu-storage-daemon` and `vblk serve`: both get the
same command line (a unix-socket chardev as QMP monitor), the same greeting /
qmp_capabilities handshake and the same commands, so a difference in the
numbers is the daemon's, not the driver's.

QMP framing: one JSON object per line in both directions. Replies and events
interleave on the socket, so events that arrive while a command waits for its
reply are kept aside for `event()`.

Python 3 standard library only.
"""
import json
import os
import select
import signal
import socket
import subprocess
import time


class QMPError(Exception):
    """A command answered with {"error": ...}, or the daemon went away."""


def connect_unix(path, timeout=20.0):
    """A connected AF_UNIX socket. A server's socket file appears at bind(), a
    moment before listen(): until then connect() is refused, so retry."""
    end = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return s
        except (ConnectionRefusedError, FileNotFoundError):
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.02)


class QMP:
    """One QMP connection. `negotiate=False` stops after the greeting (for
    tests of the handshake itself); `greeting` / `greeting_line` keep it as
    parsed and as sent (with its line end)."""

    def __init__(self, path, timeout=20.0, negotiate=True):
        self.sock = connect_unix(path, timeout)
        self.buf = b""
        self.events = []
        self.greeting_line = self.read_line(timeout)
        self.greeting = json.loads(self.greeting_line)
        if "QMP" not in self.greeting:
            raise QMPError(f"no QMP greeting on {path}: {self.greeting_line!r}")
        if negotiate:
            self.negotiate()

    def negotiate(self):
        self.ok("qmp_capabilities")
        return self

    def _line(self, timeout):
        """The next line with its end, or None when nothing came within
        timeout seconds."""
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            chunk = self.sock.recv(65536)
            if not chunk:
                raise QMPError("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode() + "\n"

    def read_line(self, timeout=120.0):
        line = self._line(timeout)
        if line is None:
            raise QMPError(f"nothing from the daemon within {timeout} s")
        return line

    def send_raw(self, text):
        self.sock.sendall(text.encode() if isinstance(text, str) else text)

    def reply_line(self, timeout=120.0):
        """The next reply line, unparsed; events meanwhile are queued."""
        end = time.monotonic() + timeout
        while True:
            line = self.read_line(max(0.0, end - time.monotonic()))
            obj = json.loads(line)
            if "event" in obj:
                self.events.append(obj)
                continue
            if "QMP" in obj:
                # qemu-storage-daemon 7.2 sometimes greets a client that
                # connected while it was starting twice; a reply never has
                # this member.
                continue
            return line

    def raw(self, text, timeout=120.0):
        """Sends text (a line end is added) and returns the next reply line."""
        self.send_raw(text if text.endswith("\n") else text + "\n")
        return self.reply_line(timeout)

    def send(self, name, args=None, req_id=None):
        req = {"execute": name}
        if args is not None:
            req["arguments"] = args
        if req_id is not None:
            req["id"] = req_id
        self.send_raw(json.dumps(req) + "\n")

    def reply(self, name, timeout=120.0):
        """The reply to the command sent last; events meanwhile are queued."""
        try:
            return json.loads(self.reply_line(timeout))
        except QMPError as e:
            raise QMPError(f"no reply to {name}: {e}") from None

    def cmd(self, name, args=None, *, timeout=120.0, req_id=None, **kw):
        """Runs a command; its arguments as a dict, or as keywords
        (`cmd("block-job-pause", device="j")`), or both."""
        if kw:
            args = dict(args or {}, **kw)
        self.send(name, args, req_id)
        return self.reply(name, timeout)

    def ok(self, name, args=None, *, timeout=120.0, **kw):
        """Runs a command that must succeed; returns its "return" value."""
        r = self.cmd(name, args, timeout=timeout, **kw)
        if "return" not in r:
            err = r.get("error", {})
            raise QMPError(f"{name}: {err.get('class', '?')}: {err.get('desc', r)}")
        return r["return"]

    def _read_event(self, end, waiting_for):
        line = self._line(max(0.0, end - time.monotonic()))
        if line is None:
            return None
        obj = json.loads(line)
        if "event" not in obj:
            raise QMPError(f"unexpected reply while waiting for {waiting_for}: {obj}")
        return obj

    def event(self, name, timeout=60.0):
        """The first queued or arriving `name` event; other events stay queued."""
        end = time.monotonic() + timeout
        while True:
            for e in self.events:
                if e["event"] == name:
                    self.events.remove(e)
                    return e
            obj = self._read_event(end, name)
            if obj is None:
                raise QMPError(f"no {name} event within {timeout} s; got "
                               f"{[e['event'] for e in self.events]}")
            self.events.append(obj)

    def next_event(self, names, timeout):
        """The first queued or arriving event whose name is in `names`;
        others are dropped. Returns (event, time.monotonic() at arrival)."""
        end = time.monotonic() + timeout
        while True:
            while self.events:
                e = self.events.pop(0)
                if e["event"] in names:
                    return e, time.monotonic()
            obj = self._read_event(end, "/".join(sorted(names)))
            if obj is None:
                raise QMPError(f"no {'/'.join(sorted(names))} event within {timeout} s")
            if obj["event"] in names:
                return obj, time.monotonic()

    def drain_events(self, wait=0.05):
        """Queues the events that arrive within `wait` seconds; returns the queue."""
        while True:
            obj = self._read_event(time.monotonic() + wait, "events")
            if obj is None:
                return self.events
            self.events.append(obj)

    def close(self):
        self.sock.close()


class Daemon:
    """One storage daemon process with one QMP monitor on a unix socket.

    `argv0` is ["qemu-storage-daemon"] or ["path/to/vblk", "serve"]; the rest
    of the command line is the same for both. stderr goes to `log` (a file),
    so a chatty daemon cannot block on a full pipe."""

    def __init__(self, argv0, sock, log):
        self.sock_path = sock
        self.log_path = log
        if os.path.exists(sock):
            os.unlink(sock)
        self.argv = list(argv0) + ["--chardev", f"socket,path={sock},server=on,wait=off,id=m0",
                                   "--monitor", "chardev=m0"]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        end = time.monotonic() + 30
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise QMPError(f"{self.argv[0]} did not start: {self.log_tail()}")
            time.sleep(0.01)
        try:
            self.qmp = QMP(sock)
        except BaseException:
            self.kill()  # not left running when the handshake fails
            raise

    def log_tail(self, n=2000):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:].strip()
        except OSError:
            return ""

    def quit(self, timeout=120.0):
        """`quit`, then waits for the exit. Returns the seconds it took."""
        t0 = time.monotonic()
        try:
            self.qmp.cmd("quit", timeout=timeout)
        except (OSError, QMPError):
            pass  # the daemon may close the socket before its reply arrives
        self.qmp.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise QMPError(f"{self.argv[0]} did not exit after quit")
        return time.monotonic() - t0

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
