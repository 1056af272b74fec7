// What a vhost-user back end asks of the virtio device it serves (only
// virtio-blk today): its feature bits, its configuration space and the
// handling of one request. The back end (backend.h) owns the socket, the
// memory table and the rings; the device never sees them.
#pragma once

#include <cstdint>
#include <span>

#include "vblk/task.h"
#include "vhost_user/virtqueue.h"

namespace vblk::vhost {

class Device {
 public:
  virtual ~Device() = default;
  // Device-specific virtio feature bits (the ring and vhost-user bits are
  // the back end's).
  virtual uint64_t features() const = 0;
  virtual uint16_t num_queues() const = 0;
  // GET_CONFIG: false if the range is not inside the configuration space.
  virtual bool get_config(uint32_t offset, std::span<uint8_t> out) = 0;
  // SET_CONFIG from the driver (virtio-blk: the wce byte); unknown writes
  // are ignored, as the spec lets a device do.
  virtual void set_config(uint32_t offset, std::span<const uint8_t> in) = 0;
  // Serves one request; returns the bytes written into its writable
  // buffers, or an error when the request is malformed beyond a status
  // (no room for one): the back end then stops the device.
  virtual Task<Result<uint32_t>> handle(Chain& c) = 0;
};

}  // namespace vblk::vhost
