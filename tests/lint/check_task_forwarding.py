#!/usr/bin/env python3
"""A function that returns a Task without being a coroutine itself (no
co_await / co_return in its body) and passes the address of one of its
parameters or locals to the coroutine it returns hands that coroutine a
dangling pointer: Tasks start when awaited, after the function returned.
reply_u64 in the vhost-user back end did this and answered REPLY_ACK with
whatever the stack then held. Make such a function a coroutine
(`co_return co_await f(&v)`): its parameters then live in its frame."""
import glob
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
head = re.compile(r"^[ \t]*(?:static\s+|inline\s+)?Task<[^;{}]*?\)\s*(?:const\s*)?(?:override\s*)?\{", re.M)
address_of = re.compile(r"[(,]\s*&\s*[A-Za-z_]")
bad = []
files = []
for d in ("src", "include", "tests"):
    for ext in ("cc", "h"):
        files += glob.glob(os.path.join(root, d, "**", "*." + ext), recursive=True)
for f in sorted(files):
    s = open(f, encoding="utf-8", errors="replace").read()
    for m in head.finditer(s):
        i, depth = m.end(), 1
        while depth and i < len(s):
            depth += {"{": 1, "}": -1}.get(s[i], 0)
            i += 1
        body = s[m.end():i]
        if "co_" not in body and address_of.search(body):
            bad.append("%s:%d: %s" % (os.path.relpath(f, root), s.count("\n", 0, m.start()) + 1,
                                      " ".join(m.group(0).split())))
for b in bad:
    print(b)
sys.exit(1 if bad else 0)
