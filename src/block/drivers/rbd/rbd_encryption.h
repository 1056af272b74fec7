// RBD image encryption as QEMU 7.2's rbd driver does it, through librbd's
// own LUKS support (rbd_encryption_format / rbd_encryption_load, librbd
// 16.2): `encrypt` {format: luks|luks2, key-secret} when opening, and
// `encrypt.format`, `encrypt.key-secret`, `encrypt.cipher-alg` when creating.
// The passphrase is the secret's bytes (util/secret_store.h), never printed.
// The options themselves (RbdEncryption) are parsed in rbd_location.h.
//
// Formatting runs LUKS' key derivation calibrated to about a second or more
// (librbd offers no knob), and so does every open with the key.
#pragma once

#include <rbd/librbd.h>

#include <optional>
#include <string>

#include "drivers/rbd/rbd_location.h"
#include "vblk/result.h"

namespace vblk::rbd {

// qemu_rbd_encryption_load: "encryption load fail: <strerror>".
Status load_encryption(rbd_image_t image, const RbdEncryption& enc);

// qemu_rbd_encryption_format: formats, then grows the image by the header so
// the usable size is the one asked for ("encryption format fail: ...").
Status format_encryption(rbd_image_t image, const RbdEncryption& enc);

// "luks" / "luks2" when the image starts with a LUKS header (as read through
// this handle: an image opened with its key reads decrypted, so nothing).
std::optional<std::string> probe_encryption_format(rbd_image_t image, uint64_t size);

}  // namespace vblk::rbd
