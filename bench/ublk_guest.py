"""A TCG guest whose kernel has the ublk driver, with vblk inside it: for
tests of a ublk export (the host's kernel may have no ublk_drv).

Debian 12's own kernel (6.1) builds no ublk. bookworm-backports' 6.12
has CONFIG_BLK_DEV_UBLK=m but oopses when a ublk daemon is killed with
requests being queued (io_fallback_tw: a NULL dereference in the dying
daemon's io_uring task work, 1 kill in 5 with a writer running, with and
without IORING_SETUP_DEFER_TASKRUN on the daemon's ring); so the guest runs
the newest kernel of KERNEL_SUITE (trixie-backports: 7.3 in December 2026,
signed with a key bookworm's debian-archive-keyring holds), or
$VBLK_UBLK_SUITE's. `build_ublk_guest(vblk)` fetches that kernel's packages
(linux-image-*, and the linux-binary-* and linux-modules-* it is split into
since 6.16) with `apt-get download` from a private apt configuration (its
own sources list, lists and cache under $VBLK_GUEST_DIR/ublk/apt: the
system's apt configuration is left as it is; the archive's address is the
one the system's sources use), takes vmlinuz and the modules this guest
loads (MODULES and what their `depends=` name,
in dependency order; the package's modules are .ko.xz, decompressed here,
since busybox insmod takes plain .ko), and writes a cpio "newc" initramfs
with busybox (busybox-static), mke2fs / e2fsck (e2fsprogs) and stress-ng
with their `ldd` closures, taken from the host, whose e2fsprogs and
stress-ng scripts/deps.sh installs (stress-ng when installed; stress_ng=False
leaves it out: it and its libraries are 31 of the base's 45 MiB, with no
boot time measurable). That base archive is cached, keyed by the package versions; vblk
changes on every build, so it goes into a second archive appended to the
first (the kernel unpacks concatenated newc archives one after the other):
a new vblk costs a copy of the base, not a new kernel or base. vblk is
stripped of its debug information (strip --strip-debug; its symbol table
stays) unless strip=False, and carries its own `ldd` closure, the dynamic
loader at the path the binary names.

The guest's /init mounts /proc, /sys, /dev (devtmpfs) and a tmpfs on /mnt,
insmods the modules (loop, virtio-blk, ublk_drv, crc32c and ext4 with their
dependencies), checks that /dev/ublk-control exists, prints GUEST-UP and
runs a shell on the serial console. PATH is /sbin:/bin; vblk is /bin/vblk.

`UblkGuest(workdir, vblk, disks=[...])` boots it: guest_vm.Guest's console
and QMP (sh(), expect(), quit(), ...) with this kernel and initramfs, each
disk a virtio-blk device (/dev/vda, /dev/vdb, ... in order), attached raw by
default: a qcow2 file on the host is the same bytes on /dev/vdX, for vblk in
the guest to open (`vblk info /dev/vda`) or to copy into the tmpfs
(`copy_in()`); `copy_out()` and `read_back()` bring a file from the guest
back to the host through such a disk.

Measured on a busy two-core machine (load 6): the first build 20 s (a 106
MB package), then 1.5-3 s for a new vblk; initramfs 59 MiB with the
optimised vblk, 164 MiB with the ASan build (its .data and relocations);
GUEST-UP 12-19 s after QEMU starts (21 s with the ASan vblk), with 628 and
840 MiB of RAM.

Python 3 standard library only.
"""
import contextlib
import fcntl
import glob
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import tempfile
import time

import guest_vm
import qmp_driver
from guest_vm import GuestUnavailable

UBLK_CACHE = os.path.join(guest_vm.CACHE, "ublk")

# What /init insmods, before the modules these depend on (added from each
# module's depends=, loaded first). crc32c_generic is ext4's and jbd2's
# softdep ("pre: crypto-crc32c": metadata_csum, mke2fs's default, needs
# the crc32c hash when the file system is mounted); there is no modprobe
# in the guest to follow a softdep. virtio, virtio_ring and virtio_pci are
# built in (=y) in this kernel.
# vduse and virtio_vdpa (with vdpa under them) serve the VDUSE export: a
# device vblk creates, `vdpa dev add` attaches, and virtio_vdpa binds as
# /dev/vdX.
MODULES = ("loop", "virtio_blk", "ublk_drv", "crc32c_generic", "ext4", "vduse", "virtio_vdpa")
# Loaded where the kernel has them: 6.15 and later compute ext4's crc32c
# with the library, and name no crc32c_generic.
OPTIONAL_MODULES = ("crc32c_generic", "vduse", "virtio_vdpa")

# The archive suite whose kernel the guest boots.
KERNEL_SUITE = os.environ.get("VBLK_UBLK_SUITE", "trixie-backports")

# Host tools in the base archive, with their ldd closures: (path on the host,
# path in the guest). mkfs.ext4 is a link to mke2fs there and here.
E2FS_TOOLS = (("/sbin/mke2fs", "sbin/mke2fs"), ("/sbin/e2fsck", "sbin/e2fsck"))
STRESS_NG = ("/usr/bin/stress-ng", "bin/stress-ng")
# iproute2's vdpa, which attaches a VDUSE device to the vDPA bus.
VDPA = ("/sbin/vdpa", "sbin/vdpa")

INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs -o size=95% tmpfs /mnt
echo 0 > /proc/sys/kernel/printk
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m.ko || echo "INSMOD-FAILED $m"; done
[ -c /dev/ublk-control ] || echo "NO-UBLK-CONTROL"
echo GUEST-UP
setsid cttyhack sh
poweroff -f
"""
# PID 1 stays the script's sh (not exec'd into the console shell), as in
# guest_vm.INIT_VIRTIO: it reaps orphans, and a process orphaned in the guest
# (a ublk server left running in the background) does not end the console.

# Bump when what goes into the base archive changes in a way its key does
# not show.
LAYOUT = "1"


def _apt_dir():
    return os.path.join(UBLK_CACHE, "apt")


def _os_release():
    vals = {}
    try:
        with open("/etc/os-release") as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                vals[k] = v.strip('"')
    except OSError:
        pass
    return vals


def _debian_mirror(codename):
    """The archive address the system's apt sources use for `codename`
    (deb822 .sources or one-line lists), else deb.debian.org."""
    files = glob.glob("/etc/apt/sources.list.d/*.sources") + glob.glob("/etc/apt/sources.list.d/*.list")
    files.append("/etc/apt/sources.list")
    for path in files:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        if path.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
                if "deb" in fields.get("Types", "").split() and codename in fields.get("Suites", "").split():
                    uris = fields.get("URIs", "").split()
                    if uris:
                        return uris[0]
        else:
            for line in text.splitlines():
                m = re.match(r"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
                if m and m.group(2) == codename:
                    return m.group(1)
    return "http://deb.debian.org/debian"


def _apt_argv(tool):
    """apt-get / apt-cache reading only the private backports configuration."""
    d = _apt_dir()
    return [tool, "-o", "Dir::Etc::sourcelist=" + os.path.join(d, "sources.list"), "-o", "Dir::Etc::sourceparts=-",
            "-o", "Dir::State::Lists=" + os.path.join(d, "lists"), "-o", "Dir::Cache=" + os.path.join(d, "cache"),
            "-o", "Dir::State::status=/dev/null", "-o", "APT::Sandbox::User=root"]


def _backports_lists(max_age=86400.0):
    """Fresh package lists of KERNEL_SUITE in the private apt directory:
    updated when older than max_age seconds; when the update fails, older
    lists still serve (the kernel they name may be cached)."""
    codename = _os_release().get("VERSION_CODENAME") or "bookworm"
    d = _apt_dir()
    lists = os.path.join(d, "lists")
    for sub in ("lists/partial", "cache/archives/partial"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    line = "deb [signed-by=%s] %s %s main\n" % (keyring, _debian_mirror(codename), KERNEL_SUITE)
    src = os.path.join(d, "sources.list")
    old = None
    if os.path.exists(src):
        with open(src) as f:
            old = f.read()
    have = glob.glob(os.path.join(lists, "*_Packages*"))
    stamp = os.path.join(d, "updated")
    fresh = have and old == line and os.path.exists(stamp) and time.time() - os.path.getmtime(stamp) < max_age
    if fresh:
        return
    with open(src, "w") as f:
        f.write(line)
    r = subprocess.run(_apt_argv("apt-get") + ["-q", "update"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if r.returncode == 0 and glob.glob(os.path.join(lists, "*_Packages*")):
        with open(stamp, "w"):
            pass
    elif not have:
        raise GuestUnavailable("apt-get update of %s: %s" % (
            KERNEL_SUITE, r.stdout.decode(errors="replace").strip()[-400:]))


def _pkg_version(argv_prefix, pkg):
    out = guest_vm._run(argv_prefix + ["show", "--no-all-versions", pkg])
    m = re.search(r"^Version: (\S+)", out, re.M)
    if not m:
        raise GuestUnavailable("apt-cache shows no version of %s" % pkg)
    return m.group(1)


def kernel_package():
    """(package, version) of the guest's kernel: $VBLK_UBLK_KERNEL_PKG, or
    what KERNEL_SUITE's linux-image-amd64 depends on (linux-image-7.3.*-amd64
    in trixie-backports)."""
    _backports_lists()
    cache = _apt_argv("apt-cache")
    pkg = os.environ.get("VBLK_UBLK_KERNEL_PKG")
    if not pkg:
        out = guest_vm._run(cache + ["depends", "linux-image-amd64"])
        m = re.search(r"Depends: (linux-image-\S+-amd64)", out)
        if not m:
            raise GuestUnavailable("%s has no linux-image-amd64" % KERNEL_SUITE)
        pkg = m.group(1)
    return pkg, _pkg_version(cache, pkg)


def _host_version(pkg):
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL)
    return r.stdout.decode().strip() if r.returncode == 0 else ""


def _ldd_closure(path):
    """{path the loader looks for: the host file's real path} for a dynamic
    executable, the loader included (at the path the binary names)."""
    r = subprocess.run(["ldd", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = r.stdout.decode(errors="replace")
    if "not a dynamic executable" in out:
        return {}
    if r.returncode != 0 or "not found" in out:
        raise GuestUnavailable("ldd %s: %s" % (path, out.strip()[-400:]))
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(?:\S+ => )?(/\S+) \(0x", line)
        if m:
            libs[m.group(1)] = os.path.realpath(m.group(1))
    return libs


class _Tree:
    """Files for a newc archive: parent directories first, each once."""

    def __init__(self, dirs=()):
        self.entries = []
        self.dirs = set()
        for d in dirs:
            self.mkdir(d)

    def mkdir(self, d):
        d = d.strip("/")
        if not d or d in self.dirs:
            return
        self.mkdir(os.path.dirname(d))
        self.dirs.add(d)
        self.entries.append((d, 0o040755, b""))

    def add(self, path, data, mode=0o100755):
        path = path.strip("/")
        self.mkdir(os.path.dirname(path))
        self.entries.append((path, mode, data))

    def add_file(self, host_path, path, mode=0o100755):
        with open(host_path, "rb") as f:
            self.add(path, f.read(), mode)

    def link(self, path, target):
        self.add(path, target.encode(), 0o120777)

    def add_closure(self, host_exe):
        for want, real in _ldd_closure(host_exe).items():
            self.add_file(real, want)

    def size(self):
        return sum(len(d) for _, _, d in self.entries)


def _module_index(kernel_dir):
    index = {}
    for p in glob.glob(os.path.join(kernel_dir, "**", "*.ko*"), recursive=True):
        index[os.path.basename(p).split(".ko")[0].replace("-", "_")] = p
    return index


def _module_data(path):
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".xz"):
        data = lzma.decompress(data)
    elif path.endswith(".zst") or path.endswith(".gz"):
        raise GuestUnavailable("cannot decompress %s" % path)
    return data


def _modules_in_order(kernel_dir, wanted):
    """[(name, .ko bytes)] of `wanted` and their dependencies (modinfo
    depends=, what depmod writes to modules.dep; the package ships no
    modules.dep), each after what it depends on."""
    index = _module_index(kernel_dir)
    order, seen = [], set()

    def visit(name):
        name = name.replace("-", "_")
        if name in seen:
            return
        seen.add(name)
        if name not in index:
            raise GuestUnavailable("the kernel package has no module %s" % name)
        data = _module_data(index[name])
        m = re.search(rb"\0depends=([^\0]*)\0", data)
        for dep in (m.group(1).decode().split(",") if m else ()):
            if dep:
                visit(dep)
        order.append((name, data))

    for name in wanted:
        visit(name)
    return order


def _kernel_parts(kpkg, kver):
    """The packages a kernel is split into: linux-image-X itself and, since
    Debian's 6.16, the linux-binary-X (vmlinuz) and linux-modules-X it
    depends on, at the same version."""
    out = guest_vm._run(_apt_argv("apt-cache") + ["depends", "%s=%s" % (kpkg, kver)])
    parts = sorted(set(re.findall(r"Depends: (linux-(?:binary|modules)-\S+)", out)))
    return [kpkg] + parts


def _kernel_config(root):
    cfg = glob.glob(os.path.join(root, "boot", "config-*")) + glob.glob(os.path.join(root, "usr/lib/modules/*/config"))
    if not cfg:
        return {}
    with open(cfg[0]) as f:
        return dict(re.findall(r"^(CONFIG_\w+)=(\S+)$", f.read(), re.M))


@contextlib.contextmanager
def _cache_lock():
    """Tests that build or prune the cache at the same time (ctest -j) take
    turns: one apt-get update of the private lists at a time, one build of
    a base, no base removed under another's feet."""
    os.makedirs(UBLK_CACHE, exist_ok=True)
    with open(os.path.join(UBLK_CACHE, "lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def build_base(stress_ng=True):
    """(directory, vmlinuz path, base initramfs path) of the cached kernel,
    modules and tools; built once per key. Raises GuestUnavailable when the
    packages cannot be fetched."""
    if not guest_vm.QEMU_SYSTEM:
        raise GuestUnavailable("qemu-system-x86_64 is not installed")
    with _cache_lock():
        return _build_base(stress_ng)


def _build_base(stress_ng):
    kpkg, kver = kernel_package()
    bb_ver = _pkg_version(["apt-cache"], "busybox-static")
    for host, _ in E2FS_TOOLS:
        if not os.path.exists(host):
            raise GuestUnavailable("%s is not installed (scripts/deps.sh)" % host)
    stress_ng = stress_ng and os.path.exists(STRESS_NG[0])
    tools = list(E2FS_TOOLS) + ([STRESS_NG] if stress_ng else []) + ([VDPA] if os.path.exists(VDPA[0]) else [])
    key = "|".join([LAYOUT, kpkg, kver, bb_ver, INIT, ",".join(MODULES)] + [
        "%s=%s" % (p, _host_version(p)) for p in ("libc6", "e2fsprogs", "iproute2", "stress-ng" if stress_ng else "")])
    name = "%s_%s-%s" % (kpkg, kver, hashlib.sha1(key.encode()).hexdigest()[:12])
    base_dir = os.path.join(UBLK_CACHE, name)
    kernel = os.path.join(base_dir, "vmlinuz")
    base = os.path.join(base_dir, "base.cpio")
    if os.path.exists(kernel) and os.path.exists(base):
        os.utime(base_dir)
        return base_dir, kernel, base
    os.makedirs(UBLK_CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=UBLK_CACHE) as work:
        guest_vm._run(_apt_argv("apt-get") + ["-q", "download"] + ["%s=%s" % (p, kver) for p in _kernel_parts(kpkg, kver)],
                      cwd=work)
        guest_vm._run(["apt-get", "download", "-o", "APT::Sandbox::User=root", "busybox-static"], cwd=work)
        debs = [os.path.join(work, d) for d in os.listdir(work) if d.endswith(".deb")]
        kdebs = [d for d in debs if re.match(r"linux-(image|binary|modules)-", os.path.basename(d))]
        kdeb = [d for d in kdebs if os.path.basename(d).startswith(kpkg + "_")]
        bdeb = [d for d in debs if os.path.basename(d).startswith("busybox-static_")]
        if not kdeb or not bdeb:
            raise GuestUnavailable("apt-get download gave %s" % sorted(map(os.path.basename, debs)))
        root = os.path.join(work, "root")
        for deb in kdebs + [bdeb[0]]:
            guest_vm._run(["dpkg-deb", "-x", deb, root])
        vmlinuz = glob.glob(os.path.join(root, "boot", "vmlinuz-*")) + glob.glob(
            os.path.join(root, "usr", "lib", "modules", "*", "vmlinuz"))
        kdirs = glob.glob(os.path.join(root, "lib", "modules", "*", "kernel")) + glob.glob(
            os.path.join(root, "usr", "lib", "modules", "*", "kernel"))
        busybox = os.path.join(root, "bin", "busybox")
        if not vmlinuz or not kdirs or not os.path.exists(busybox):
            raise GuestUnavailable("no vmlinuz, modules or busybox in the packages")
        # Packages without a config file: the modules they carry say it.
        config = _kernel_config(root)
        have = _module_index(kdirs[0])
        ublk = config.get("CONFIG_BLK_DEV_UBLK", "m" if "ublk_drv" in have else None)
        if ublk not in ("m", "y"):
            raise GuestUnavailable("%s has no CONFIG_BLK_DEV_UBLK" % kpkg)
        wanted = [m for m in MODULES if (m != "ublk_drv" or ublk == "m") and (m not in OPTIONAL_MODULES or m in have)]
        mods = _modules_in_order(kdirs[0], wanted)

        tree = _Tree(["dev", "proc", "sys", "mnt", "tmp", "run", "var/tmp", "root"])
        tree.add_file(busybox, "bin/busybox")
        tree.add("init", INIT.encode())
        for name_, data in mods:
            tree.add("lib/modules/%s.ko" % name_, data, 0o100644)
        tree.add("lib/modules/order", "".join(n + "\n" for n, _ in mods).encode(), 0o100644)
        for host, path in tools:
            tree.add_file(host, path)
            tree.add_closure(host)
        tree.link("sbin/mkfs.ext4", "mke2fs")
        tree.link("sbin/fsck.ext4", "e2fsck")
        if os.path.exists("/etc/mke2fs.conf"):
            tree.add_file("/etc/mke2fs.conf", "etc/mke2fs.conf", 0o100644)
        tree.link("etc/mtab", "/proc/self/mounts")
        tree.add("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o100644)
        tree.add("etc/group", b"root:x:0:\n", 0o100644)

        new = tempfile.mkdtemp(dir=UBLK_CACHE, prefix=name + ".new")
        shutil.copy(vmlinuz[0], os.path.join(new, "vmlinuz"))
        with open(os.path.join(new, "base.cpio"), "wb") as f:
            f.write(guest_vm._cpio_newc(tree.entries))
        with open(os.path.join(new, "modules"), "w") as f:
            f.write("".join(n + "\n" for n, _ in mods))
        os.chmod(new, 0o755)
        shutil.rmtree(base_dir, ignore_errors=True)
        os.rename(new, base_dir)
    # Bases of another kernel, or unused for a week (an earlier busybox or
    # layout), are not used again.
    for old in glob.glob(os.path.join(UBLK_CACHE, "linux-image-*")):
        if old == base_dir or ".new" in os.path.basename(old):
            continue
        if not os.path.basename(old).startswith("%s_%s-" % (kpkg, kver)) or \
                time.time() - os.path.getmtime(old) > 7 * 86400:
            shutil.rmtree(old, ignore_errors=True)
    return base_dir, kernel, base


def _vblk_archive(vblk, strip):
    """The second archive: /bin/vblk and its ldd closure."""
    tree = _Tree()
    exe = vblk
    with tempfile.TemporaryDirectory() as tmp:
        if strip and shutil.which("strip"):
            exe = os.path.join(tmp, "vblk")
            guest_vm._run(["strip", "--strip-debug", "-o", exe, vblk])
        tree.add_file(exe, "bin/vblk")
    tree.add_closure(vblk)
    return guest_vm._cpio_newc(tree.entries)


def _fio_archive():
    """A third archive, for benches only: the host's fio at /usr/bin/fio
    with the shared objects it loads (guest_vm._fio_files(): 64 libraries,
    84 MB with Debian 12's fio), so the tests' initramfs stays as it is."""
    tree = _Tree()
    for guest_path, host_path in guest_vm._fio_files():
        tree.add_file(host_path, guest_path)
    return guest_vm._cpio_newc(tree.entries)


def _fio_key():
    h = hashlib.sha1()
    for guest_path, host_path in guest_vm._fio_files():
        st = os.stat(host_path)
        h.update(("%s %s %d %d\n" % (guest_path, host_path, st.st_size, st.st_mtime_ns)).encode())
    return h.hexdigest()


def build_ublk_guest(vblk, strip=True, stress_ng=True, keep=4, fio=False):
    """(vmlinuz path, initramfs path) of the ublk guest with `vblk` (a path
    to the binary) in it. The initramfs is the cached base archive followed
    by vblk's archive; one is cached per vblk build (its path, size and
    mtime), the `keep` newest kept. strip: strip vblk's debug information
    (symbolize a guest's backtrace with the binary on the host). stress_ng:
    put stress-ng in when the host has it. fio: a third archive with the
    host's fio (/usr/bin/fio in the guest; _fio_archive()), cached apart
    (initramfs-fio-vblk-*, the two newest kept) and off by default: the
    tests' guests do without its 84 MB."""
    base_dir, kernel, base = build_base(stress_ng=stress_ng)
    vblk = os.path.realpath(vblk)
    st = os.stat(vblk)
    key = "%s|%d|%d|%d|%s" % (vblk, st.st_size, st.st_mtime_ns, st.st_ino, strip)
    prefix = "initramfs-vblk-"
    if fio:
        key += "|fio " + _fio_key()
        prefix, keep = "initramfs-fio-vblk-", 2
    initrd = os.path.join(base_dir, "%s%s.cpio" % (prefix, hashlib.sha1(key.encode()).hexdigest()[:16]))
    if os.path.exists(initrd):
        os.utime(initrd)
        return kernel, initrd
    with _cache_lock():
        return kernel, _vblk_initrd(base, initrd, vblk, strip, keep, fio, prefix)


def _vblk_initrd(base, initrd, vblk, strip, keep, fio=False, prefix="initramfs-vblk-"):
    if os.path.exists(initrd):
        return initrd
    base_dir = os.path.dirname(base)
    fd, tmp = tempfile.mkstemp(dir=base_dir, prefix=".initramfs-")
    try:
        with os.fdopen(fd, "wb") as out, open(base, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
            out.write(_vblk_archive(vblk, strip))
            if fio:
                out.write(_fio_archive())
        os.chmod(tmp, 0o644)
        os.rename(tmp, initrd)
    except BaseException:
        os.unlink(tmp)
        raise
    olds = sorted(glob.glob(os.path.join(base_dir, prefix + "*.cpio")), key=os.path.getmtime, reverse=True)
    for old in olds[keep:]:
        try:
            os.unlink(old)
        except OSError:
            pass
    return initrd


def default_mem_mib(initrd):
    """Guest RAM for an initramfs: the archive and its unpacked files both
    sit in RAM while it unpacks, then the files stay (rootfs), and 512 MiB
    are left for the tmpfs and what runs."""
    return 512 + 2 * (os.path.getsize(initrd) >> 20)


class UblkGuest(guest_vm.Guest):
    """The ublk guest under qemu-system-x86_64 (TCG), vblk inside.

    vblk: path of the vblk binary to put in the guest (/bin/vblk there).
    disks: host files, each a virtio-blk disk (/dev/vda, /dev/vdb, ...), or
    (path, format) pairs; format "raw" (the default: the guest sees the
    file's bytes, a qcow2 file included) or "qcow2" (the guest sees the
    image's contents). mem_mib: default_mem_mib() when None. smp: vCPUs.
    extra: more QEMU arguments. strip, stress_ng, fio: as build_ublk_guest().
    Console and QMP as guest_vm.Guest: boot() first, then sh(command) ->
    (exit code, output with stderr) or check(command) -> output; quit().
    Each disk's serial is vblk<i> (/sys/block/vdX/serial)."""

    def __init__(self, workdir, vblk, disks=(), mem_mib=None, smp=2, extra=(), name="u", strip=True,
                 stress_ng=True, cache="writeback", fio=False):
        self.kernel, self.initrd = build_ublk_guest(vblk, strip=strip, stress_ng=stress_ng, fio=fio)
        self.mem_mib = mem_mib or default_mem_mib(self.initrd)
        self.workdir = workdir
        self.serial_path = os.path.join(workdir, name + ".serial")
        self.qmp_path = os.path.join(workdir, name + ".qmp")
        for p in (self.serial_path, self.qmp_path):
            if os.path.exists(p):
                os.unlink(p)
        cache_opts = {"writeback": "", "none": ",cache.direct=on"}[cache]
        disk_args = []
        for i, d in enumerate(disks):
            path, fmt = (d, "raw") if isinstance(d, str) else d
            disk_args += ["-blockdev", "driver=file,node-name=f%d,filename=%s%s" % (i, path, cache_opts),
                          "-blockdev", "driver=%s,node-name=d%d,file=f%d" % (fmt, i, i),
                          "-device", "virtio-blk-pci,drive=d%d,serial=vblk%d" % (i, i)]
        self.argv = [guest_vm.QEMU_SYSTEM, "-nodefaults", "-display", "none", "-accel", "tcg",
                     "-m", str(self.mem_mib), "-smp", str(smp),
                     "-kernel", self.kernel, "-initrd", self.initrd,
                     "-append", "console=ttyS0 quiet panic=-1 rdinit=/init",
                     "-no-reboot",
                     "-chardev", "socket,id=ser,path=%s,server=on,wait=off" % self.serial_path,
                     "-serial", "chardev:ser",
                     "-chardev", "socket,id=mon,path=%s,server=on,wait=off" % self.qmp_path,
                     "-mon", "chardev=mon,mode=control",
                     ] + disk_args + list(extra)
        self.log = open(os.path.join(workdir, name + ".log"), "wb")
        self.started = time.monotonic()
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
        self.boot_seconds = None
        self.boot_messages = ""

    def boot(self, timeout=300.0):
        """Waits for GUEST-UP (raises TimeoutError), then quiets the console.
        boot_seconds: from QEMU's start to GUEST-UP; boot_messages: what
        /init printed before it (INSMOD-FAILED <module>, NO-UBLK-CONTROL)."""
        _, before = self.expect(rb"GUEST-UP", timeout)
        self.boot_seconds = time.monotonic() - self.started
        self.boot_messages = before.decode(errors="replace").replace("\r", "")
        # Once sh answers, the console stops echoing (so output is only output).
        rc, _ = self.sh("stty -echo; PS1=", timeout)
        self.out = b""
        return rc == 0

    def check(self, command, timeout=120.0):
        """sh() that raises unless the command exits 0; returns its output."""
        rc, out = self.sh(command, timeout)
        if rc != 0:
            raise AssertionError("guest: %r exited %d: %s" % (command, rc, out[-2000:]))
        return out

    def copy_in(self, dev, path, nbytes, timeout=300.0):
        """Copies the first nbytes of disk `dev` (/dev/vda: a host file
        attached raw, e.g. a qcow2 image; nbytes its size on the host) to
        `path` in the guest (the tmpfs: /mnt/...)."""
        self.check("head -c %d %s > %s" % (nbytes, dev, path), timeout)

    def copy_out(self, path, dev, timeout=300.0):
        """Writes guest file `path` to the start of disk `dev` (attached raw,
        at least as large), syncs it, and returns its size: read_back() it
        on the host after quit()."""
        out = self.check("cat %s > %s && sync && stat -c %%s %s" % (path, dev, path), timeout)
        return int(out.split()[-1])


def carrier_disk(path, size):
    """A host file of `size` bytes (sparse) to attach raw and copy_out() to;
    an existing file (an image to carry in) is grown to `size`, never
    shrunk: qcow2 ignores what follows its last cluster."""
    with open(path, "ab") as f:
        if f.tell() < size:
            f.truncate(size)
    return path


def read_back(disk, size, dest):
    """The first `size` bytes of a carrier disk, as a host file `dest`."""
    with open(disk, "rb") as f, open(dest, "wb") as out:
        left = size
        while left:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                raise AssertionError("%s ends before %d bytes" % (disk, size))
            out.write(chunk)
            left -= len(chunk)
    return dest
