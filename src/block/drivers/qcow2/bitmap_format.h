// The on-disk limits and bits of qcow2's bitmaps extension (QEMU's
// docs/interop/qcow2.txt, "Bitmaps extension"; the BME_* names of
// block/qcow2-bitmap.c), shared by the bitmap code and check.
#pragma once

#include <cstdint>

namespace vblk::qcow2 {

constexpr uint32_t kBmeInUse = 1u << 0;
constexpr uint32_t kBmeAuto = 1u << 1;
constexpr uint32_t kBmeReservedFlags = ~(kBmeInUse | kBmeAuto);  // QEMU's BME_RESERVED_FLAGS
constexpr uint64_t kBmeMaxTableSize = 0x8000000;
constexpr uint64_t kBmeMaxPhysSize = 0x20000000;
constexpr unsigned kBmeMinGranularityBits = 9;
constexpr unsigned kBmeMaxGranularityBits = 31;
constexpr uint64_t kBmeMaxNameSize = 1023;
// A bitmap table entry: the data cluster's offset, reserved bits, and the
// "all ones" flag of an entry without a cluster.
constexpr uint64_t kBmeOffsetMask = 0x00fffffffffffe00ull;
constexpr uint64_t kBmeReservedMask = 0xff000000000001feull;
constexpr uint64_t kBmeAllOnes = 1;
constexpr uint32_t kMaxBitmaps = 65535;
constexpr uint64_t kMaxBitmapDirectorySize = 1024ull * kMaxBitmaps;
constexpr uint64_t kBitmapDirEntrySize = 24;  // the fixed part of a directory entry
constexpr uint8_t kDirtyTrackingBitmap = 1;

}  // namespace vblk::qcow2
