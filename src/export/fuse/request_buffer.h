// The FUSE export's request sizes, shared by its two transports (/dev/fuse
// and io_uring): the largest read or write the kernel sends in one request,
// and the buffer that holds one (headers first, data from kDataOffset so
// that node I/O gets aligned memory).
#pragma once

#include <cstddef>
#include <cstdint>

namespace vblk::fuse {

constexpr uint32_t kMaxWrite = 1u << 20;
constexpr size_t kDataOffset = 4096;
constexpr size_t kBufSize = kDataOffset + kMaxWrite;

}  // namespace vblk::fuse
