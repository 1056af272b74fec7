// Inflating one compressed qcow2 cluster: pure CPU work, safe on any thread
// (each thread keeps its own decompressor contexts), so the driver runs it
// on the loop's thread pool, one cluster per job, on every core at once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "vblk/result.h"

namespace vblk::qcow2 {

enum class InflateKind : uint8_t { Deflate, Zstd };

// Inflates `in` (the stored bytes: the stream, then padding to the sector)
// into exactly `out_len` bytes at `out`. EIO (as QEMU) when the data does
// not inflate to a whole cluster.
Status inflate_cluster(InflateKind kind, const uint8_t* in, size_t in_len, uint8_t* out, size_t out_len);

}  // namespace vblk::qcow2
