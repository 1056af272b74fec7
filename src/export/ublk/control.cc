#include "ublk/control.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace vblk::ublk {

Result<Control> Control::open() {
  int fd = ::open("/dev/ublk-control", O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    return Error(e, std::string("Failed to open /dev/ublk-control: ") + std::strerror(e) +
                        (e == ENOENT ? " (is the ublk_drv module loaded?)" : ""));
  }
  return Control(fd);
}

Control::~Control() {
  if (fd_ >= 0) ::close(fd_);
}

Status Control::command(uint32_t op, uint32_t dev_id, void* buf, uint16_t len, uint64_t data0, const char* what) const {
  io_uring ring;
  io_uring_params p{};
  p.flags = IORING_SETUP_SQE128;
  if (int r = io_uring_queue_init_params(2, &ring, &p); r < 0)
    return Error(-r, std::string("ublk ") + what + ": io_uring: " + std::strerror(-r));
  io_uring_sqe* sqe = io_uring_get_sqe(&ring);
  std::memset(sqe, 0, 2 * sizeof *sqe);
  sqe->opcode = IORING_OP_URING_CMD;
  sqe->fd = fd_;
  sqe->cmd_op = op;
  CtrlCmd c{};
  c.dev_id = dev_id;
  c.queue_id = 0xffff;
  c.addr = reinterpret_cast<uint64_t>(buf);
  c.len = len;
  c.data[0] = data0;
  std::memcpy(sqe->cmd, &c, sizeof c);
  int res = io_uring_submit_and_wait(&ring, 1);
  io_uring_cqe* cqe = nullptr;
  if (res >= 0) res = io_uring_wait_cqe(&ring, &cqe);
  if (res >= 0) {
    res = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
  }
  io_uring_queue_exit(&ring);
  if (res < 0) return Error(-res, std::string("ublk ") + what + " failed: " + std::strerror(-res));
  return {};
}

Status Control::add_dev(DevInfo& info) const {
  return command(kCmdAddDev, info.dev_id, &info, sizeof info, 0, "ADD_DEV");
}

Status Control::set_params(uint32_t dev_id, Params& p) const {
  return command(kCmdSetParams, dev_id, &p, sizeof p, 0, "SET_PARAMS");
}

Status Control::start_dev(uint32_t dev_id, int32_t pid) const {
  return command(kCmdStartDev, dev_id, nullptr, 0, static_cast<uint64_t>(pid), "START_DEV");
}

Status Control::stop_dev(uint32_t dev_id) const { return command(kCmdStopDev, dev_id, nullptr, 0, 0, "STOP_DEV"); }

Status Control::del_dev(uint32_t dev_id) const { return command(kCmdDelDev, dev_id, nullptr, 0, 0, "DEL_DEV"); }

Status Control::get_dev_info(uint32_t dev_id, DevInfo& info) const {
  return command(kCmdGetDevInfo, dev_id, &info, sizeof info, 0, "GET_DEV_INFO");
}

Status Control::start_user_recovery(uint32_t dev_id) const {
  return command(kCmdStartUserRecovery, dev_id, nullptr, 0, 0, "START_USER_RECOVERY");
}

Status Control::end_user_recovery(uint32_t dev_id, int32_t pid) const {
  return command(kCmdEndUserRecovery, dev_id, nullptr, 0, static_cast<uint64_t>(pid), "END_USER_RECOVERY");
}

}  // namespace vblk::ublk
