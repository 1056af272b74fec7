// QAPI's SnapshotInfo as JSON, in the schema's field order: one builder for
// `vblk info --output=json` (ImageInfo.snapshots), query-named-block-nodes
// and blockdev-snapshot-delete-internal-sync's reply.
#pragma once

#include <nlohmann/json.hpp>

#include "vblk/image_format.h"

namespace vblk {

nlohmann::ordered_json snapshot_info_json(const SnapshotInfo& sn);

}  // namespace vblk
