// What the luks driver's files share (src/block/drivers/luks/): the header,
// algorithms, cipher and key slots, and the helpers of the node and create.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "block/drivers/luks/algorithms.h"
#include "block/drivers/luks/cipher.h"
#include "block/drivers/luks/header.h"
#include "block/drivers/luks/keyslot.h"

namespace vblk::luks {

// The passphrase in secret `id`, as QEMU's qcrypto_secret_lookup_as_utf8
// gives it: "No secret with id 'x'", "Data from secret x is not valid
// UTF-8"; it ends at the first NUL (QEMU passes it on as a C string).
Result<std::string> lookup_password(const std::string& id);

// QEMU's ImageInfoSpecific for luks: {"type": "luks", "data":
// QCryptoBlockInfoLUKS}.
nlohmann::ordered_json info_json(const Header& h, const Algorithms& a);

}  // namespace vblk::luks
