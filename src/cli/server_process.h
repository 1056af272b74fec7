// The process plumbing shared by the long-running commands (`vblk nbd`,
// `vblk serve`): going to the background once ready, stop signals, pid
// files. Both follow their QEMU counterparts: the parent of --fork /
// --daemonize exits only when the child serves (status 0) or has failed
// (the child's status).
#pragma once

#include <signal.h>

#include <functional>
#include <string>

#include "vblk/loop.h"

namespace vblk::cli {

// Forks; the parent waits for the child's verdict and returns the exit
// status it must exit with; the child (a new session) gets nullopt-like -1.
// `fail` reports a fork or pipe failure and does not return.
class Background {
 public:
  int fork_and_wait(const std::function<void(const std::string&)>& fail);
  // In the child: tells the parent it serves, and lets go of the caller's
  // terminal or pipes (stdio to /dev/null). A no-op without fork_and_wait.
  void ready();

 private:
  int pipe_[2] = {-1, -1};
};

// Blocks SIGTERM, SIGINT and SIGHUP in this thread (call before any thread
// starts, so every thread inherits the mask) and ignores SIGPIPE; returns
// the blocked set for on_stop_signal.
sigset_t block_stop_signals();

// The first stop signal runs `stop` on the loop. A detached thread takes it
// in sigwait, so the loop only ever sees a posted call.
void on_stop_signal(Loop& loop, sigset_t set, std::function<void()> stop);

// Writes "<pid>\n" to path; false (errno set) when it cannot.
bool write_pid_file(const std::string& path);

}  // namespace vblk::cli
