// libFuzzer target: the input is a VM state as QEMU's migration writes it,
// checked by MigrationStreamCheck (src/block/migration_stream.cc) as savevm
// checks a stream it receives: fed in pieces, then finished. Byte 0 picks
// the piece size (1 to 255 bytes, or 0: all at once), so that every parser
// state is also entered with a record split across feeds. A refusal is
// fine; a crash, a sanitizer report, a leak, or memory beyond the checker's
// stated bounds is a bug.
#include <cstdint>
#include <span>

#include "vblk/migration_stream.h"

using namespace vblk;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = data[0] ? data[0] : SIZE_MAX;
  std::span<const uint8_t> s(data + 1, size - 1);
  MigrationStreamCheck c;
  if (s.size() >= 4) (void)MigrationStreamCheck::has_magic(s.first(4));
  for (size_t pos = 0; pos < s.size();) {
    const size_t n = std::min(piece, s.size() - pos);
    if (!c.feed(s.subspan(pos, n))) return 0;  // refused: stays refused
    pos += n;
  }
  (void)c.finish();
  (void)c.offset();
  return 0;
}
