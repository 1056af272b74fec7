#!/usr/bin/env bash
# Installs what vblk needs to build and test on Debian 12, skipping what is
# already there. Uses sudo when not root.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config python3 clang-format  # clang-format: ctest lint.format
      liburing-dev zlib1g-dev libzstd-dev libdeflate-dev libssl-dev nlohmann-json3-dev libfmt-dev
      libgtest-dev libgmock-dev libbenchmark-dev
      qemu-utils qemu-system-common qemu-system-x86 libnbd-bin nbdkit fio  # qemu-system-x86: test_vmstate saves and restores a VM
      stress-ng e2fsprogs  # test_fuse_export: file system load (fsstress is not in Debian 12), mkfs.ext4/e2fsck
      ceph-mon ceph-osd librbd-dev librados-dev qemu-block-extra cryptsetup-bin  # Ceph RBD: the driver, QEMU's rbd, a test cluster, LUKS images for its encryption
      clang libclang-rt-14-dev llvm)  # clang + libFuzzer runtime + llvm-symbolizer: scripts/fuzz.sh
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "vblk: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
