// The process plumbing shared by the long-running commands (`vblk nbd`,
// `vblk serve`): going to the background once ready, stop signals, pid
// files. Both follow their QEMU counterparts: the parent of --fork /
// --daemonize exits only when the child serves (status 0) or has failed
// (the child's status).
#pragma once

#include <signal.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>

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
// the blocked set for StopSignalThread.
sigset_t block_stop_signals();

// The first stop signal runs `stop` on the loop. A thread of its own takes
// it in sigwait, so the loop only ever sees a posted call. Declare it after
// the loop: the destructor wakes the thread if no signal came and joins it,
// so the thread never posts to (or signals the eventfd of) a loop that is
// gone, and its last write to the loop happens before the loop closes.
class StopSignalThread {
 public:
  StopSignalThread(Loop& loop, sigset_t set, std::function<void()> stop);
  ~StopSignalThread() { join(); }
  // Wakes the thread if no signal came, and joins it (once).
  void join();
  StopSignalThread(const StopSignalThread&) = delete;
  StopSignalThread& operator=(const StopSignalThread&) = delete;

 private:
  std::atomic<bool> ending_{false};
  std::thread thread_;
};

// Writes "<pid>\n" to path; false (errno set) when it cannot.
bool write_pid_file(const std::string& path);

}  // namespace vblk::cli
