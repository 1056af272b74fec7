#include "server_process.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

namespace vblk::cli {

int Background::fork_and_wait(const std::function<void(const std::string&)>& fail) {
  if (::pipe(pipe_) < 0) fail(std::string("Failed to create pipe: ") + std::strerror(errno));
  pid_t pid = ::fork();
  if (pid < 0) fail(std::string("Failed to fork: ") + std::strerror(errno));
  if (pid > 0) {
    ::close(pipe_[1]);
    char ok = 0;
    ssize_t n = ::read(pipe_[0], &ok, 1);
    if (n == 1 && ok == 1) return 0;
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) ? WEXITSTATUS(status) : 1;
  }
  ::close(pipe_[0]);
  pipe_[0] = -1;
  ::setsid();
  return -1;
}

void Background::ready() {
  if (pipe_[1] < 0) return;
  char ok = 1;
  [[maybe_unused]] ssize_t n = ::write(pipe_[1], &ok, 1);
  ::close(pipe_[1]);
  pipe_[1] = -1;
  int devnull = ::open("/dev/null", O_RDWR);
  if (devnull >= 0) {
    ::dup2(devnull, 0);
    ::dup2(devnull, 1);
    ::dup2(devnull, 2);
    ::close(devnull);
  }
}

sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  return set;
}

StopSignalThread::StopSignalThread(Loop& loop, sigset_t set, std::function<void()> stop) {
  // Until the signal comes the loop is fed from here: held, it waits for
  // it even when nothing else is left to serve.
  loop.hold();
  thread_ = std::thread([this, &loop, set, stop = std::move(stop)] {
    int sig = 0;
    sigwait(&set, &sig);
    if (ending_.load()) return;  // the destructor's wakeup, not a signal
    loop.post_threadsafe([&loop, stop] {
      loop.release();
      stop();
    });
  });
}

void StopSignalThread::join() {
  if (!thread_.joinable()) return;
  ending_.store(true);
  // A stop signal sent to the thread itself ends its sigwait (the set is
  // blocked in every thread, so none is delivered anywhere else); one that
  // came first has already ended it, and the thread has finished posting.
  pthread_kill(thread_.native_handle(), SIGTERM);
  thread_.join();
}

bool write_pid_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  bool ok = std::fprintf(f, "%d\n", static_cast<int>(::getpid())) >= 0;
  int saved = errno;
  if (std::fclose(f) != 0) return false;
  errno = saved;
  return ok;
}

}  // namespace vblk::cli
