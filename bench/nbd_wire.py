"""The NBD wire protocol at the byte level, for the tests and tools that
must speak it by hand (doc/proto.md of the NBD project): clients that hang
up mid-request, flood a server, or play a server that misbehaves. Normal
clients are nbdinfo, qemu-io and libnbd; this is for what they will not do.
"""

import socket
import struct

NBDMAGIC = 0x4E42444D41474943       # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054       # "IHAVEOPT"
OPT_REPLY_MAGIC = 0x3E889045565A9
REQ_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

OPT_GO = 7
REP_ACK, REP_INFO = 1, 3
REP_FLAG_ERROR = 0x80000000
INFO_EXPORT = 0

CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH = 0, 1, 2, 3
FLAG_FUA = 1
TFLAG_SEND_FUA = 8

REQUEST = ">IHHQQI"   # magic, flags, type, cookie, offset, length
SIMPLE_REPLY = ">IIQ"  # magic, error, cookie


def recv_exact(s, n):
    """n bytes from s; ConnectionError if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def go(s, name=b""):
    """The fixed-newstyle handshake up to NBD_OPT_GO (no zeroes, simple
    replies). Returns (size, transmission flags); ConnectionError if GO is
    refused."""
    magic, opt_magic, _flags = struct.unpack(">QQH", recv_exact(s, 18))
    if (magic, opt_magic) != (NBDMAGIC, IHAVEOPT):
        raise ConnectionError("not an NBD server: %x %x" % (magic, opt_magic))
    s.sendall(struct.pack(">I", 3))  # fixed newstyle, no zeroes
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
    size = flags = None
    while True:
        rmagic, _opt, rtype, rlen = struct.unpack(">QIII", recv_exact(s, 20))
        if rmagic != OPT_REPLY_MAGIC:
            raise ConnectionError("bad option reply magic %x" % rmagic)
        payload = recv_exact(s, rlen)
        if rtype == REP_ACK:
            return size, flags
        if rtype & REP_FLAG_ERROR:
            raise ConnectionError("GO refused: %r" % payload)
        if rtype == REP_INFO and struct.unpack(">H", payload[:2])[0] == INFO_EXPORT:
            size, flags = struct.unpack(">QH", payload[2:12])


def connect_unix(path, name=b"", timeout=60):
    """A unix socket to path, through GO for export `name`."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(path)
    go(s, name)
    return s


def request(cmd, cookie, offset=0, length=0, flags=0):
    """A request header (a write's payload follows it)."""
    return struct.pack(REQUEST, REQ_MAGIC, flags, cmd, cookie, offset, length)
