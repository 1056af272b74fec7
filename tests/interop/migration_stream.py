"""Real QEMU migration streams for the VM-state tests.

qemu-system-x86_64 (-accel tcg, no disk, never run: -S) migrates to
``exec:cat > FILE``; ``-device loader`` puts `random_mib` MiB of random
bytes into its RAM first, so the stream carries that many MiB of real
pages besides the zero pages and device sections (QEMU writes whole
streams of ~random_mib + 0.5 MiB in ~1.5 s). Streams are cached per
process by their parameters.
"""

import os
import random
import shutil
import subprocess
import tempfile

QEMU_SYSTEM = shutil.which("qemu-system-x86_64")
_cache = {}


def qemu_migration_stream(mem_mib=64, random_mib=6, seed=1):
    key = (mem_mib, random_mib, seed)
    if key in _cache:
        return _cache[key]
    if not QEMU_SYSTEM:
        raise RuntimeError("qemu-system-x86_64 not installed")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "stream")
        argv = [QEMU_SYSTEM, "-nodefaults", "-display", "none", "-accel", "tcg", "-m", str(mem_mib), "-S",
                "-monitor", "stdio"]
        if random_mib:
            blob = os.path.join(d, "ram")
            with open(blob, "wb") as f:
                f.write(random.Random(seed).randbytes(random_mib << 20))
            argv += ["-device", "loader,file=%s,addr=0x1000000" % blob]
        p = subprocess.run(argv, input=('migrate "exec:cat > %s"\nquit\n' % out).encode(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        if p.returncode != 0 or not os.path.exists(out):
            raise RuntimeError("qemu-system-x86_64 wrote no stream: %r" % p.stderr[-500:])
        with open(out, "rb") as f:
            data = f.read()
    assert data[:4] == b"QEVM", data[:16]
    _cache[key] = data
    return data
