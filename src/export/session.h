// One client connection on the server: what negotiation agreed, and the two
// phases that use it (src/export/handshake.cc, src/export/transmission.cc).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "vblk/nbd_protocol.h"
#include "vblk/nbd_server.h"

namespace vblk::nbd {

struct Session {
  Server& server;
  Loop& loop;
  int fd;
  std::shared_ptr<const Export> exp;  // chosen by EXPORT_NAME or GO
  bool no_zeroes = false;             // client flag: skip the 124 padding bytes
  bool structured = false;            // NBD_OPT_STRUCTURED_REPLY agreed
  bool base_allocation = false;       // "base:allocation" selected by SET_META_CONTEXT
  // "qemu:dirty-bitmap:NAME" contexts selected: indices into exp->bitmaps;
  // context id kFirstBitmapId + index.
  std::vector<uint32_t> bitmap_contexts;
  static constexpr uint32_t kBaseAllocationId = 1;
  static constexpr uint32_t kFirstBitmapId = 2;
};

// Runs option haggling. Returns true when the client chose an export and
// transmission begins; false when the connection should close (abort, error,
// unknown export on EXPORT_NAME, or the client went away).
Task<bool> negotiate(Session& s);
// Serves requests until the client disconnects or the server stops.
Task<void> transmit(Session& s);

uint16_t transmission_flags(const Session& s);

}  // namespace vblk::nbd
