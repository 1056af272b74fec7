// The block layer's drivers, in probe order (QEMU probes formats in its
// driver list's order and takes the best score). Adding a driver is its
// folder plus one line here: the folder defines `const DriverInfo
// <id>_driver` in vblk::drivers (open.h), and open.cc's registry lists it.
// No include guard: read once per expansion of VBLK_DRIVER.
VBLK_DRIVER(blkdebug)
VBLK_DRIVER(file)
VBLK_DRIVER(host_device)
VBLK_DRIVER(nbd)
VBLK_DRIVER(luks)
VBLK_DRIVER(null_co)
VBLK_DRIVER(qcow2)
VBLK_DRIVER(raw)
VBLK_DRIVER(rbd)
VBLK_DRIVER(throttle)
