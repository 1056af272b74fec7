"""A real Linux guest for tests and benches: Debian's kernel and a busybox
initramfs, booted by qemu-system-x86_64 under TCG in a few seconds.

Nothing is downloaded from outside Debian: `build_guest()` fetches the
packages with `apt-get download` (the kernel that linux-image-amd64 depends
on, and busybox-static), takes vmlinuz and busybox out of them, and writes
the initramfs itself (cpio "newc", no compression). The result is cached in
$VBLK_GUEST_DIR (default /var/tmp/vblk-guest), keyed by the package versions.

The guest's /init mounts /proc, /sys, /dev and a tmpfs on /mnt, prints
GUEST-UP and runs a shell on the serial console. `build_guest(virtio=True)`
gives a second initramfs that also carries Debian's virtio PCI and
virtio-blk modules and loads them first, so a virtio-blk or
vhost-user-blk-pci disk is /dev/vda (the kernel has them as modules only).
`build_guest(fio=True)` adds the host's /usr/bin/fio to that one, with
every shared object ldd says it loads (build_fio_initramfs()).
`Guest` drives it: QMP on a unix socket, the serial console on another; `sh()` runs a shell command and
returns what it printed. `fill_ram()` writes a known pattern into the tmpfs
(guest RAM: no swap) and returns its digest; `ram_digest()` asks again, so a
guest restored from a snapshot or an incoming migration proves its RAM came
back bit-exact.

Python 3 standard library only.
"""
import functools
import glob
import hashlib
import os
import re
import select
import shutil
import socket
import subprocess
import tempfile
import time

import qmp_driver

QEMU_SYSTEM = shutil.which("qemu-system-x86_64")
CACHE = os.environ.get("VBLK_GUEST_DIR", "/var/tmp/vblk-guest")

INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs -o size=95% tmpfs /mnt
echo 0 > /proc/sys/kernel/printk
echo GUEST-UP
exec setsid cttyhack sh
"""

# The virtio PCI transport and virtio-blk, modules in Debian's kernel, in
# load order (no depmod in the initramfs: insmod one after the other). Only
# the "virtio" initramfs carries them; it loads them before GUEST-UP, so a
# virtio-blk or vhost-user-blk-pci disk is /dev/vda once the guest is up.
VIRTIO_MODULES = ("drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko",
                  "drivers/virtio/virtio_pci_legacy_dev.ko", "drivers/virtio/virtio_pci_modern_dev.ko",
                  "drivers/virtio/virtio_pci.ko", "drivers/block/virtio_blk.ko")

# The virtio initramfs's console shell is not PID 1 but PID 1's child: a process orphaned in the
# guest (a writer left running in the background) is reparented to PID 1,
# and when it exits while an interactive busybox sh as PID 1 reads the
# console, that sh takes the interrupted read for the end of input and
# exits: "Attempted to kill init", the guest panics. PID 1 here is the
# script's own sh, which reaps orphans as it waits.
INIT_VIRTIO = INIT.replace("echo GUEST-UP", "for m in $(cat /lib/modules/order); do insmod /lib/modules/$m; done\n"
                           "echo GUEST-UP").replace("exec setsid cttyhack sh", "setsid cttyhack sh\npoweroff -f")


class GuestUnavailable(Exception):
    """The kernel or busybox package cannot be fetched here (no apt, no
    network): tests skip with this message."""


def _run(argv, cwd=None):
    r = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if r.returncode != 0:
        raise GuestUnavailable("%s: %s" % (" ".join(argv), r.stderr.decode(errors="replace").strip()[-400:]))
    return r.stdout.decode()


@functools.lru_cache(maxsize=None)
def _kernel_package():
    # Asked once per process: apt-cache takes 0.75 s, and a test asks
    # build_guest() for its guest two or three times.
    out = _run(["apt-cache", "depends", "linux-image-amd64"])
    m = re.search(r"Depends: (linux-image-\S+-amd64)", out)
    if not m:
        raise GuestUnavailable("apt-cache knows no linux-image-amd64 (run apt-get update)")
    return m.group(1)


def _cpio_newc(entries):
    """An uncompressed cpio archive in the kernel's "newc" format.
    entries: (name, mode, data) with mode including the file type bits."""
    out = bytearray()
    ino = 1

    def put(name, mode, data):
        nonlocal ino
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join("%08X" % v for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out.extend(hdr.encode() + nb)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))
        ino += 1

    for name, mode, data in entries:
        put(name, mode, data)
    put("TRAILER!!!", 0, b"")
    return bytes(out)


def _fio_files():
    """(path in the guest, file on the host) for the host's fio and exactly
    the shared objects it loads as ldd resolves them, the dynamic loader
    included, each at the path ldd names (the guest's loader searches
    /lib/x86_64-linux-gnu without an ld.so.cache, and librados and librbd
    find libceph-common by their RUNPATH)."""
    fio = shutil.which("fio")
    if not fio:
        raise GuestUnavailable("fio is not installed on the host")
    out = _run(["ldd", fio])
    if "not found" in out:
        raise GuestUnavailable("ldd %s: %s" % (fio, out))
    files = {"usr/bin/fio": os.path.realpath(fio)}
    for line in out.splitlines():
        m = re.match(r"\s*(?:\S+ => )?(/\S+) \(0x", line)  # linux-vdso has no path
        if m:
            files[m.group(1).lstrip("/")] = os.path.realpath(m.group(1))
    return sorted(files.items())


def build_fio_initramfs(kpkg_dir, base):
    """The virtio initramfs `base` followed by a second cpio archive with
    fio and its libraries (the kernel unpacks concatenated archives in
    turn): /usr/bin/fio in the guest. Debian's fio links 64 libraries
    (librbd, libceph-common, glusterfs, ICU's 31 MB of data...), 84 MB
    uncompressed, so only the guests that run fio carry it. Cached in
    kpkg_dir, keyed by the files' paths, sizes and times (an upgraded fio
    or library makes a new one).

    In the initramfs rather than on a second, read-only disk (an ext2 image
    made by mke2fs -d): measured under TCG on a busy two-core machine, the
    kernel unpacks the 84 MB in 0.5-2.4 s (0.04-0.3 s without fio) and
    the boot to the shell took as long as without fio within the noise
    (13-26 s against 16-31 s over four boots each); the disk costs about as
    much (0.9 s to insmod ext4 and its four modules and mount, and fio's
    first start reads its libraries from the disk: 1.8-3.6 s against
    1.1-2.0 s), and needs those modules, a disk more beside the ones under
    test, and links from /lib64, /lib/x86_64-linux-gnu and /usr into the
    mount. What the initramfs costs is RAM: the guest keeps the 84 MB
    unpacked, and the kernel caps the rootfs it unpacks into at half the
    RAM it sees then: with 256 MiB the unpacking stops at 58 MB ("Initramfs
    unpacking failed: write error"); give the guest 512 MiB."""
    files = _fio_files()
    h = hashlib.sha256()
    for guest_path, host_path in [("", base)] + files:
        st = os.stat(host_path)
        h.update(("%s %s %d %d\n" % (guest_path, host_path, st.st_size, st.st_mtime_ns)).encode())
    path = os.path.join(kpkg_dir, "initramfs-virtio-fio-%s.cpio" % h.hexdigest()[:16])
    if os.path.exists(path):
        return path
    dirs = sorted({"/".join(p.split("/")[:i]) for p, _ in files for i in range(1, p.count("/") + 1)},
                  key=lambda d: (d.count("/"), d))
    entries = [(d, 0o040755, b"") for d in dirs]
    for guest_path, host_path in files:
        with open(host_path, "rb") as f:
            entries.append((guest_path, 0o100755, f.read()))
    with open(base, "rb") as f:
        data = f.read() + _cpio_newc(entries)
    fd, tmp = tempfile.mkstemp(dir=kpkg_dir, prefix=".fio-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    # Atomic: another test may be booting the same file right now.
    os.rename(tmp, path)
    for old in glob.glob(os.path.join(kpkg_dir, "initramfs-virtio-fio-*.cpio")):
        if old != path:  # an older fio's
            os.unlink(old)
    return path


def build_guest(virtio=False, fio=False):
    """(vmlinuz path, initramfs path), built once and cached. virtio: the
    initramfs that loads the virtio-blk modules (VIRTIO_MODULES) at boot;
    fio: that one with the host's fio in /usr/bin (build_fio_initramfs)."""
    if not QEMU_SYSTEM:
        raise GuestUnavailable("qemu-system-x86_64 is not installed")
    kpkg = _kernel_package()
    key = os.path.join(CACHE, kpkg)
    kernel = os.path.join(key, "vmlinuz")
    initrd = os.path.join(key, "initramfs-virtio.cpio" if virtio or fio else "initramfs.cpio")
    if os.path.exists(kernel) and os.path.exists(initrd):
        return kernel, build_fio_initramfs(key, initrd) if fio else initrd
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as work:
        # apt drops to user _apt, which cannot write here: let it download
        # as root rather than print a warning for each file.
        _run(["apt-get", "download", "-o", "APT::Sandbox::User=root", kpkg, "busybox-static"], cwd=work)
        debs = {d: os.path.join(work, d) for d in os.listdir(work) if d.endswith(".deb")}
        kdeb = [p for d, p in debs.items() if d.startswith(kpkg + "_")]
        bdeb = [p for d, p in debs.items() if d.startswith("busybox-static_")]
        if not kdeb or not bdeb:
            raise GuestUnavailable("apt-get download gave %s" % sorted(debs))
        for deb in (kdeb[0], bdeb[0]):
            _run(["dpkg-deb", "-x", deb, os.path.join(work, "root")])
        vmlinuz = glob.glob(os.path.join(work, "root", "boot", "vmlinuz-*"))
        busybox = os.path.join(work, "root", "bin", "busybox")
        if not vmlinuz or not os.path.exists(busybox):
            raise GuestUnavailable("no vmlinuz or busybox in the packages")
        with open(busybox, "rb") as f:
            bb = f.read()
        dirs = [(d, 0o040755, b"") for d in ("bin", "dev", "proc", "sys", "mnt", "tmp")]
        cpio = _cpio_newc(dirs + [("bin/busybox", 0o100755, bb), ("init", 0o100755, INIT.encode())])
        files = {"initramfs.cpio": cpio}
        mods = glob.glob(os.path.join(work, "root", "lib", "modules", "*", "kernel"))
        if mods and all(os.path.exists(os.path.join(mods[0], m)) for m in VIRTIO_MODULES):
            mod_entries = [("lib", 0o040755, b""), ("lib/modules", 0o040755, b"")]
            for m in VIRTIO_MODULES:
                with open(os.path.join(mods[0], m), "rb") as f:
                    mod_entries.append(("lib/modules/" + os.path.basename(m), 0o100644, f.read()))
            order = "".join(os.path.basename(m) + "\n" for m in VIRTIO_MODULES).encode()
            mod_entries.append(("lib/modules/order", 0o100644, order))
            files["initramfs-virtio.cpio"] = _cpio_newc(dirs + mod_entries + [
                ("bin/busybox", 0o100755, bb), ("init", 0o100755, INIT_VIRTIO.encode())])
        new = tempfile.mkdtemp(dir=CACHE, prefix=kpkg + ".new")
        shutil.copy(vmlinuz[0], os.path.join(new, "vmlinuz"))
        for name, data in files.items():
            with open(os.path.join(new, name), "wb") as f:
                f.write(data)
        os.chmod(new, 0o755)
        shutil.rmtree(key, ignore_errors=True)
        os.rename(new, key)
    if not os.path.exists(initrd):
        raise GuestUnavailable("the kernel package has no %s" % ", ".join(VIRTIO_MODULES))
    if fio:
        return kernel, build_fio_initramfs(key, initrd)
    return kernel, initrd


class Guest:
    """One qemu-system-x86_64 process running the test guest.

    disk: a qcow2 attached as a virtio-blk device (savevm needs a writable
    image that takes snapshots), or drive: -blockdev options of the disk
    instead (an NBD export: "driver=nbd,server.type=unix,..."); or disk_args:
    the QEMU arguments of the disk and its device instead of both (a
    vhost-user-blk-pci device); extra: more QEMU arguments (-incoming,
    -loadvm, -S). virtio: boot the initramfs that loads the virtio-blk
    modules, so the guest sees its disk as /dev/vda; fio: that initramfs with
    /usr/bin/fio. The serial console and QMP are unix sockets in workdir."""

    def __init__(self, workdir, disk, mem_mib=256, extra=(), name="g", cache="writeback", drive=None,
                 disk_args=None, virtio=False, fio=False):
        self.kernel, self.initrd = build_guest(virtio=virtio, fio=fio)
        self.workdir = workdir
        self.serial_path = os.path.join(workdir, name + ".serial")
        self.qmp_path = os.path.join(workdir, name + ".qmp")
        for p in (self.serial_path, self.qmp_path):
            if os.path.exists(p):
                os.unlink(p)
        cache_opts = {"writeback": "", "none": ",cache.direct=on"}[cache]
        if disk_args is not None:
            disk_args = list(disk_args)
        elif drive:
            disk_args = ["-blockdev", drive + ",node-name=d0", "-device", "virtio-blk,drive=d0"]
        else:
            disk_args = ["-blockdev", "driver=file,node-name=f0,filename=%s%s" % (disk, cache_opts),
                         "-blockdev", "driver=qcow2,node-name=d0,file=f0", "-device", "virtio-blk,drive=d0"]
        self.argv = [QEMU_SYSTEM, "-nodefaults", "-display", "none", "-accel", "tcg", "-m", str(mem_mib),
                     "-kernel", self.kernel, "-initrd", self.initrd,
                     "-append", "console=ttyS0 quiet panic=-1 rdinit=/init",
                     "-no-reboot",
                     "-chardev", "socket,id=ser,path=%s,server=on,wait=off" % self.serial_path,
                     "-serial", "chardev:ser",
                     "-chardev", "socket,id=mon,path=%s,server=on,wait=off" % self.qmp_path,
                     "-mon", "chardev=mon,mode=control",
                     ] + disk_args + list(extra)
        self.log = open(os.path.join(workdir, name + ".log"), "wb")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        try:
            self.qmp = qmp_driver.QMP(self.qmp_path, timeout=30)
            self.serial = qmp_driver.connect_unix(self.serial_path, timeout=30)
        except Exception:
            self.kill()
            raise
        self.out = b""
        self.seq = 0

    # --- the serial console -------------------------------------------------
    def expect(self, pattern, timeout=60.0):
        """Waits for `pattern` (a regex over bytes) in the console output;
        returns the match and what came before it, and drops both."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while True:
            m = rx.search(self.out)
            if m:
                before = self.out[:m.start()]
                self.out = self.out[m.end():]
                return m, before
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise TimeoutError("guest console: no %r in %.0f s; last output %r; log %s" % (
                    pattern, timeout, self.out[-400:], self.log_tail()))
            r, _, _ = select.select([self.serial], [], [], min(left, 0.5))
            if r:
                chunk = self.serial.recv(65536)
                if not chunk:
                    raise TimeoutError("guest console closed; log %s" % self.log_tail())
                self.out += chunk

    def sh(self, command, timeout=120.0):
        """Runs a shell command in the guest and returns its output. The end
        marker is computed by the guest shell, so the console's echo of the
        command line cannot match it."""
        self.seq += 1
        n = self.seq
        self.serial.sendall(("%s; echo END-$((%d+1))-$?\n" % (command, n * 2)).encode())
        # The marker alone: a pattern that also matched the output before it
        # ("((?:.|\n)*?)END-...") made every search quadratic in the output
        # so far, and the console delivers long output a few bytes per
        # read: 7 KB of output took 10 s of the host's CPU.
        m, before = self.expect(rb"END-%d-(\d+)\r?\n" % (n * 2 + 1), timeout)
        return int(m.group(1)), before.decode(errors="replace").replace("\r", "")

    def boot(self, timeout=120.0):
        self.expect(rb"GUEST-UP", timeout)
        # Once sh answers, the console stops echoing (so output is only output).
        rc, _ = self.sh("stty -echo; PS1=", timeout)
        self.out = b""
        return rc == 0

    def fill_ram(self, mib, seed_mib=8):
        """Fills `mib` MiB of guest RAM (a tmpfs file) with random data: a
        random block of seed_mib MiB repeated (urandom under TCG is slow; the
        migration stream still carries every page, only zero pages are
        skipped). Returns the file's md5 as the guest computed it."""
        rc, out = self.sh("dd if=/dev/urandom of=/mnt/seed bs=1M count=%d 2>/dev/null && "
                          "i=0; while [ $i -lt %d ]; do cat /mnt/seed; i=$((i+1)); done > /mnt/fill && "
                          "rm /mnt/seed && md5sum /mnt/fill" % (seed_mib, mib // seed_mib), timeout=600)
        if rc != 0:
            raise RuntimeError("fill failed: %s" % out)
        return out.split()[0]

    def ram_digest(self):
        rc, out = self.sh("md5sum /mnt/fill", timeout=600)
        if rc != 0:
            raise RuntimeError("md5sum failed: %s" % out)
        return out.split()[0]

    # --- QMP ------------------------------------------------------------------
    def hmp(self, line, timeout=600.0):
        return self.qmp.ok("human-monitor-command", {"command-line": line}, timeout=timeout)

    def status(self):
        return self.qmp.ok("query-status")["status"]

    def wait_migration(self, timeout=600.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.qmp.ok("query-migrate").get("status")
            if st in ("completed", "failed", "cancelled"):
                return st
            time.sleep(0.05)
        raise TimeoutError("migration did not finish")

    def log_tail(self, n=1500):
        try:
            with open(self.log.name, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def quit(self):
        try:
            self.qmp.cmd("quit", timeout=30)
            self.proc.wait(timeout=30)
        except Exception:
            pass
        self.kill()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for s in ("serial", "qmp"):
            obj = getattr(self, s, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass
        self.log.close()
