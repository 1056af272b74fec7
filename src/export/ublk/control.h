// The ublk control device (/dev/ublk-control): adding, configuring,
// starting, stopping and deleting a device. Each command is an
// IORING_OP_URING_CMD on a 128-byte SQE and may block for long (START_DEV
// adds the disk, whose partition scan reads from the device; STOP_DEV waits
// for the requests in flight; DEL_DEV for the char device to be released),
// so the export runs them on the loop's thread pool while the loop goes on
// serving the device's queues.
#pragma once

#include <cstdint>
#include <string>

#include "ublk/ublk_abi.h"
#include "vblk/result.h"

namespace vblk::ublk {

class Control {
 public:
  // Opens /dev/ublk-control; the error says when the driver is missing.
  static Result<Control> open();

  Control(Control&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Control& operator=(Control&&) = delete;
  ~Control();

  // Synchronous commands; each returns the driver's result (>= 0) or an
  // error with its errno. Thread-safe: each uses a ring of its own.
  Status add_dev(DevInfo& info) const;
  Status set_params(uint32_t dev_id, Params& p) const;
  Status start_dev(uint32_t dev_id, int32_t pid) const;
  Status stop_dev(uint32_t dev_id) const;
  Status del_dev(uint32_t dev_id) const;
  Status get_dev_info(uint32_t dev_id, DevInfo& info) const;
  Status start_user_recovery(uint32_t dev_id) const;
  Status end_user_recovery(uint32_t dev_id, int32_t pid) const;

 private:
  explicit Control(int fd) : fd_(fd) {}
  Status command(uint32_t op, uint32_t dev_id, void* buf, uint16_t len, uint64_t data0, const char* what) const;

  int fd_ = -1;
};

}  // namespace vblk::ublk
