// The NBD client: one connection to an export, negotiated with fixed
// newstyle (GO, falling back to EXPORT_NAME for old servers), structured
// replies and base:allocation when the server offers them. Requests are
// multiplexed: any number in flight, each waiting for its own reply, which
// one reader coroutine routes by cookie straight into the caller's buffer.
//
// Ownership: shared between its user and its reader coroutine; close()
// disconnects politely and waits for the reader, and destroying a Client
// that was not closed only shuts the socket down. One loop.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "vblk/net.h"
#include "vblk/sync.h"

namespace vblk::nbd {

struct Address {
  std::string unix_path;  // set: unix socket; else host/port
  std::string host;
  uint16_t port = 10809;
};

struct Extent {
  uint32_t length;
  uint32_t flags;  // kStateHole | kStateZero
};

class Client : public std::enable_shared_from_this<Client> {
 public:
  struct Options {
    bool structured = true;  // ask for structured replies (and base:allocation)
  };
  static Task<Result<std::shared_ptr<Client>>> connect(Loop& loop, Address addr, std::string export_name, Options opts);
  ~Client();

  uint64_t size() const { return size_; }
  uint16_t flags() const { return flags_; }
  bool structured() const { return structured_; }
  bool has_block_status() const { return base_allocation_; }
  uint32_t min_block() const { return min_block_; }
  uint32_t max_block() const { return max_block_; }

  Task<Status> read(uint64_t offset, std::span<uint8_t> buf);
  Task<Status> write(uint64_t offset, std::span<const uint8_t> buf, bool fua);
  Task<Status> write_zeroes(uint64_t offset, uint32_t bytes, uint16_t cmd_flags);
  Task<Status> trim(uint64_t offset, uint32_t bytes);
  Task<Status> flush();
  // base:allocation extents from offset, covering at most `bytes`.
  Task<Result<std::vector<Extent>>> block_status(uint64_t offset, uint32_t bytes);
  // Sends NBD_CMD_DISC once requests have finished and waits for the reader.
  Task<void> close();

 private:
  struct Pending;
  Client(Loop& loop, Fd fd) : loop_(loop), fd_(std::move(fd)), send_lock_(loop), reader_done_(loop) {}
  Task<Status> handshake(const std::string& export_name, Options opts);
  Task<Status> request(Pending& p, uint16_t type, uint16_t flags, uint64_t offset, uint32_t length,
                       std::span<const uint8_t> payload = {});
  static Task<void> reader(std::shared_ptr<Client> self);
  Task<Status> read_reply();
  void fail_all(const Error& e);

  Loop& loop_;
  Fd fd_;
  CoMutex send_lock_;
  CoEvent reader_done_;
  uint64_t next_cookie_ = 1;
  std::unordered_map<uint64_t, Pending*> pending_;
  Status dead_;  // set once the connection failed: later requests fail at once
  bool closing_ = false;
  uint64_t size_ = 0;
  uint16_t flags_ = 0;
  bool structured_ = false;
  bool base_allocation_ = false;
  uint32_t meta_id_ = 0;
  uint32_t min_block_ = 1, max_block_ = 32u << 20;
};

// Parses nbd://host[:port]/export, nbd+tcp://..., nbd+unix:///export?socket=PATH.
// Returns false if `uri` is not an NBD URI at all; sets *err if it is but
// malformed.
bool parse_nbd_uri(const std::string& uri, Address& addr, std::string& export_name, std::string* err);

}  // namespace vblk::nbd
