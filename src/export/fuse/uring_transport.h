// FUSE over io_uring (Linux 6.14, protocol 7.42; not in every system's
// linux/fuse.h, hence our own names): the FUSE export's second transport,
// chosen with the export option io-uring=on (QEMU 10.2's name) and the
// kernel's fuse.enable_uring=Y.
//
// After FUSE_INIT the daemon registers ring entries (a header and a payload
// buffer each) on one queue per possible CPU with IORING_OP_URING_CMD on
// /dev/fuse; once every queue has one, the kernel sends requests (those of a
// task on CPU n to queue n) as completions of those commands, and a reply
// is committed with the fetch of the next request, in one command. Forgets
// and interrupts still come on /dev/fuse. The kernel copies a request's
// data in and out by task work on the thread that submits the commands:
// the loop thread, through a ring of its own (SQE128 for the commands'
// 80-byte area) whose completions ring an eventfd the loop reads.
#pragma once

#include <liburing.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "fuse/request_buffer.h"
#include "vblk/buffer.h"
#include "vblk/loop.h"
#include "vblk/net.h"
#include "vblk/sync.h"

namespace vblk::fuse {

// FUSE_INIT's flag (flags2 bit 9) offering and accepting the transport.
constexpr uint64_t kFuseOverIoUring = 1ull << 41;

struct UringEntInOut {
  uint64_t flags;
  uint64_t commit_id;  // to echo in the commit
  uint32_t payload_sz;
  uint32_t padding;
  uint64_t reserved;
};
struct UringReqHeader {
  uint8_t in_out[128];  // fuse_in_header, then fuse_out_header
  uint8_t op_in[128];   // the opcode's own struct (the request's first argument)
  UringEntInOut ent;
};
static_assert(sizeof(UringReqHeader) == 288);

// A ring entry: the kernel writes a request into hdr and the payload
// (buf from kDataOffset, so node reads land aligned), we the reply.
struct RingEnt {
  UringReqHeader hdr{};
  AlignedBuffer buf{kBufSize};
  iovec iov[2]{};
  uint16_t qid = 0;
  bool replied = false;
};

// Whether this kernel lets a daemon use the transport; the error says why not.
Status uring_transport_available();

class UringTransport {
 public:
  using Serve = std::function<void(RingEnt&)>;

  explicit UringTransport(Loop& loop) : loop_(loop) {}
  ~UringTransport() { close(); }
  UringTransport(const UringTransport&) = delete;
  UringTransport& operator=(const UringTransport&) = delete;

  // The ring, its eventfd and `entries` ring entries spread over the
  // kernel's queues (at least one per queue).
  Status setup(unsigned entries);

  // Once FUSE_INIT's reply accepted the transport: registers every entry
  // on `fuse_fd` and hands each request that arrives to `serve`, which must
  // end with commit(). `tasks` counts the reader and pending submits; the
  // reader ends when every entry's command has failed (the connection
  // ended, or it refused the ring).
  void start(int fuse_fd, Serve serve, WaitGroup& tasks);

  // The reply of a request that came through the ring: header and payload
  // into the entry, committed along with the fetch of the next request.
  void commit(RingEnt& e, uint64_t unique, int error, const void* p, size_t len, const void* p2, size_t len2);

  // Cancels what is still registered (the unmount waits for the entries).
  void close();

 private:
  void queue_cmd(RingEnt& e, uint32_t op, uint64_t commit_id);
  Task<void> flush_later();
  Task<void> reader(Serve serve);

  Loop& loop_;
  io_uring ring_{};
  bool ready_ = false;          // ring_ set up
  bool batching_ = false;       // queue_cmd leaves the submit to the caller
  bool flush_pending_ = false;  // a flush_later() is on its way
  int fuse_fd_ = -1;
  Fd efd_;
  WaitGroup* tasks_ = nullptr;
  std::vector<std::unique_ptr<RingEnt>> ents_;
  size_t live_ents_ = 0;  // entries whose command has not failed
};

}  // namespace vblk::fuse
