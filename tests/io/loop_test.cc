// Event loop, Task and socket tests, run over both backends (io_uring and the
// thread-pool/epoll fallback) so the fallback is proven, not assumed.
#include "vblk/loop.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "vblk/buffer.h"
#include "vblk/net.h"
#include "vblk/sync.h"

using namespace vblk;
using namespace std::chrono_literals;

namespace {

class LoopTest : public ::testing::TestWithParam<bool> {
 protected:
  Loop::Options opts() {
    Loop::Options o;
    o.allow_io_uring = GetParam();
    return o;
  }
};

std::string temp_file(size_t size) {
  char tmpl[] = "/tmp/vblk-loop-XXXXXX";
  int fd = mkstemp(tmpl);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  close(fd);
  return tmpl;
}

Task<int> add_one(int v) { co_return v + 1; }
Task<int> chain(int depth) {
  int v = 0;
  for (int i = 0; i < depth; ++i) v = co_await add_one(v);
  co_return v;
}
Task<int> thrower() {
  throw std::runtime_error("boom");
  co_return 0;
}

}  // namespace

TEST_P(LoopTest, TasksChainWithoutStackGrowth) {
  Loop loop(opts());
  // 200k synchronous completions in a row: symmetric transfer must not recurse.
  EXPECT_EQ(loop.run(chain(200000)), 200000);
}

TEST_P(LoopTest, ExceptionsReachTheAwaiter) {
  Loop loop(opts());
  auto t = []() -> Task<std::string> {
    try {
      co_await thrower();
    } catch (const std::runtime_error& e) {
      co_return std::string(e.what());
    }
    co_return std::string("none");
  };
  EXPECT_EQ(loop.run(t()), "boom");
}

TEST_P(LoopTest, SleepWaitsAtLeastItsTime) {
  Loop loop(opts());
  auto t = [](Loop& l) -> Task<uint64_t> {
    uint64_t start = Loop::now_ns();
    bool full = co_await l.sleep(20ms);
    EXPECT_TRUE(full);
    co_return Loop::now_ns() - start;
  };
  EXPECT_GE(loop.run(t(loop)), 20'000'000u);
}

TEST_P(LoopTest, SleepingCoroutineCanBeCancelled) {
  Loop loop(opts());
  std::stop_source src;
  bool result = true;
  uint64_t woke_after = 0;
  auto sleeper = [](Loop& l, std::stop_token tok, bool& res, uint64_t& after) -> Task<void> {
    uint64_t start = Loop::now_ns();
    res = co_await l.sleep(10s, tok);
    after = Loop::now_ns() - start;
  };
  auto canceller = [](Loop& l, std::stop_source& s) -> Task<void> {
    co_await l.sleep(5ms);
    s.request_stop();
  };
  auto both = [&]() -> Task<void> {
    WaitGroup wg(loop);
    wg.add(2);
    auto wrap = [](Task<void> t, WaitGroup& w) -> Task<void> {
      co_await std::move(t);
      w.done();
    };
    spawn_detached(wrap(sleeper(loop, src.get_token(), result, woke_after), wg));
    spawn_detached(wrap(canceller(loop, src), wg));
    co_await wg.wait();
  };
  loop.run(both());
  EXPECT_FALSE(result);
  EXPECT_LT(woke_after, 2'000'000'000u);
}

TEST_P(LoopTest, AlreadyCancelledSleepReturnsAtOnce) {
  Loop loop(opts());
  std::stop_source src;
  src.request_stop();
  auto t = [](Loop& l, std::stop_token tok) -> Task<bool> { co_return co_await l.sleep(10s, tok); };
  EXPECT_FALSE(loop.run(t(loop, src.get_token())));
}

TEST_P(LoopTest, ThousandsOfConcurrentReads) {
  Loop loop(opts());
  const size_t kBlocks = 4096;
  std::string path = temp_file(0);
  int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  // Block i holds the value i in every 4-byte word.
  std::vector<uint32_t> block(1024);
  for (uint32_t i = 0; i < kBlocks; ++i) {
    std::fill(block.begin(), block.end(), i);
    ASSERT_EQ(pwrite(fd, block.data(), 4096, static_cast<off_t>(i) * 4096), 4096);
  }
  size_t good = 0;
  auto one = [](Loop& l, int f, uint32_t i, size_t& ok, WaitGroup& wg) -> Task<void> {
    AlignedBuffer buf(4096);
    long r = co_await l.pread(f, buf.data(), 4096, uint64_t(i) * 4096);
    auto* w = reinterpret_cast<uint32_t*>(buf.data());
    if (r == 4096 && w[0] == i && w[1023] == i) ++ok;
    wg.done();
  };
  auto all = [&]() -> Task<void> {
    WaitGroup wg(loop);
    wg.add(kBlocks);
    for (uint32_t i = 0; i < kBlocks; ++i) spawn_detached(one(loop, fd, i, good, wg));
    EXPECT_GT(loop.pending_io(), 0u);
    co_await wg.wait();
  };
  loop.run(all());
  EXPECT_EQ(good, kBlocks);
  EXPECT_EQ(loop.pending_io(), 0u);
  close(fd);
  unlink(path.c_str());
}

TEST_P(LoopTest, WriteFsyncFallocateReportErrno) {
  Loop loop(opts());
  std::string path = temp_file(1 << 20);
  int fd = open(path.c_str(), O_RDWR);
  auto t = [](Loop& l, int f) -> Task<void> {
    AlignedBuffer b(4096);
    std::memset(b.data(), 0xab, 4096);
    EXPECT_EQ(co_await l.pwrite(f, b.data(), 4096, 8192), 4096);
    EXPECT_EQ(co_await l.fsync(f, true), 0);
    EXPECT_EQ(co_await l.fallocate(f, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 8192, 4096), 0);
    EXPECT_EQ(co_await l.pread(f, b.data(), 4096, 8192), 4096);
    EXPECT_EQ(b.data()[0], 0);
    // A bad fd comes back as -EBADF, not a crash or an exception.
    EXPECT_EQ(co_await l.pread(-1, b.data(), 4096, 0), -EBADF);
  };
  loop.run(t(loop, fd));
  close(fd);
  unlink(path.c_str());
}

TEST_P(LoopTest, RunBlockingRunsOffTheLoopThread) {
  Loop loop(opts());
  auto t = [](Loop& l) -> Task<long> {
    auto self = std::this_thread::get_id();
    std::function<long()> fn = [self] { return std::this_thread::get_id() != self ? 42L : -1L; };
    co_return co_await l.run_blocking(fn);
  };
  EXPECT_EQ(loop.run(t(loop)), 42);
}

TEST_P(LoopTest, PostThreadsafeWakesTheLoop) {
  Loop loop(opts());
  std::atomic<bool> ran{false};
  bool seen = false;
  std::thread th([&] {
    std::this_thread::sleep_for(10ms);
    loop.post_threadsafe([&] { seen = true; });
    ran = true;
  });
  auto t = [](Loop& l, bool& s) -> Task<void> {
    // Keep a timer armed so the loop is not considered stalled while waiting.
    while (!s) co_await l.sleep(50ms);
  };
  loop.run(t(loop, seen));
  th.join();
  EXPECT_TRUE(seen);
}

TEST_P(LoopTest, SemaphoreCapsConcurrency) {
  Loop loop(opts());
  CoSemaphore sem(loop, 3);
  int active = 0, peak = 0, finished = 0;
  auto worker = [](Loop& l, CoSemaphore& s, int& a, int& p, int& f) -> Task<void> {
    co_await s.acquire();
    ++a;
    p = std::max(p, a);
    co_await l.sleep(1ms);
    --a;
    s.release();
    ++f;
  };
  auto all = [&]() -> Task<void> {
    for (int i = 0; i < 20; ++i) spawn_detached(worker(loop, sem, active, peak, finished));
    while (finished < 20) co_await loop.sleep(1ms);
  };
  loop.run(all());
  EXPECT_EQ(peak, 3);
  EXPECT_EQ(finished, 20);
}

TEST_P(LoopTest, MutexSerialisesCriticalSections) {
  Loop loop(opts());
  CoMutex mu(loop);
  std::vector<int> order;
  int finished = 0;
  auto worker = [](Loop& l, CoMutex& m, std::vector<int>& o, int id, int& f) -> Task<void> {
    auto g = co_await m.scoped();
    o.push_back(id);
    co_await l.sleep(1ms);  // hold across a suspension
    o.push_back(id);
    ++f;
  };
  auto all = [&]() -> Task<void> {
    for (int i = 0; i < 5; ++i) spawn_detached(worker(loop, mu, order, i, finished));
    while (finished < 5) co_await loop.sleep(1ms);
  };
  loop.run(all());
  ASSERT_EQ(order.size(), 10u);
  for (size_t i = 0; i < order.size(); i += 2) EXPECT_EQ(order[i], order[i + 1]);
  EXPECT_FALSE(mu.locked());
}

TEST_P(LoopTest, QueueDeliversInOrderAndCloses) {
  Loop loop(opts());
  CoQueue<int> q(loop, 2);
  std::vector<int> got;
  auto producer = [](CoQueue<int>& qq) -> Task<void> {
    for (int i = 0; i < 10; ++i) EXPECT_TRUE(co_await qq.push(i));
    qq.close();
  };
  auto consumer = [](CoQueue<int>& qq, std::vector<int>& g) -> Task<void> {
    while (auto v = co_await qq.pop()) g.push_back(*v);
  };
  auto all = [&]() -> Task<void> {
    spawn_detached(producer(q));
    co_await consumer(q, got);
  };
  loop.run(all());
  EXPECT_EQ(got, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST_P(LoopTest, UnixAndTcpSocketsEcho) {
  Loop loop(opts());
  std::string path = "/tmp/vblk-loop-test-" + std::to_string(getpid()) + (GetParam() ? "u" : "t") + ".sock";
  auto server = [](Loop& l, int lfd) -> Task<void> {
    auto c = co_await accept_socket(l, lfd);
    EXPECT_TRUE(c.ok());
    std::vector<uint8_t> buf(1 << 20);
    EXPECT_TRUE((co_await recv_exact(l, c->get(), buf)).ok());
    EXPECT_TRUE((co_await send_all(l, c->get(), buf)).ok());
  };
  auto client = [](Loop& l, Result<Fd> conn) -> Task<bool> {
    EXPECT_TRUE(conn.ok());
    if (!conn) co_return false;
    std::vector<uint8_t> out(1 << 20), in(1 << 20);
    for (size_t i = 0; i < out.size(); ++i) out[i] = uint8_t(i * 7);
    auto sr = co_await send_all(l, conn->get(), out);
    EXPECT_TRUE(sr.ok()) << (sr.ok() ? "" : sr.error().what());
    EXPECT_TRUE((co_await recv_exact(l, conn->get(), in)).ok());
    // The peer closed: the next receive reports end of stream as an error value.
    uint8_t extra;
    auto eof = co_await recv_exact(l, conn->get(), {&extra, 1});
    EXPECT_FALSE(eof.ok());
    co_return in == out;
  };
  auto run_pair = [&](Result<Fd> listener, bool unix_sock) -> Task<bool> {
    EXPECT_TRUE(listener.ok());
    int lfd = listener->get();
    spawn_detached(server(loop, lfd));
    // (No co_await inside ?: — GCC 12 mishandles temporaries there.)
    if (unix_sock) co_return co_await client(loop, co_await connect_unix(loop, path));
    co_return co_await client(loop, co_await connect_tcp(loop, "127.0.0.1", *local_port(lfd)));
  };
  EXPECT_TRUE(loop.run(run_pair(listen_unix(loop, path), true)));
  EXPECT_TRUE(loop.run(run_pair(listen_tcp(loop, "127.0.0.1", 0), false)));
  unlink(path.c_str());
}

// Far more sockets waiting on silent peers than the ring takes in (ring_entries
// 8: 16 bounded requests and 256 peer waits) must not stop file I/O, other sockets
// or a new connection; and each idle receive still completes once its peer
// speaks or goes away.
TEST_P(LoopTest, IdleSocketsDoNotStopOtherIo) {
  Loop::Options o = opts();
  o.ring_entries = 8;
  Loop loop(o);
  constexpr int kIdle = 400;
  std::vector<int> peers;    // the silent ends
  std::vector<int> waiting;  // the loop's ends, each with a pending receive
  for (int i = 0; i < kIdle; ++i) {
    int sv[2];
    int type = SOCK_STREAM | SOCK_CLOEXEC | (GetParam() ? 0 : SOCK_NONBLOCK);
    ASSERT_EQ(socketpair(AF_UNIX, type, 0, sv), 0);
    waiting.push_back(sv[0]);
    peers.push_back(sv[1]);
  }
  int got = 0;
  WaitGroup idle(loop);
  auto idle_recv = [](Loop& l, int fd, int& n, WaitGroup& wg) -> Task<void> {
    char c;
    long r = co_await l.recv(fd, &c, 1);
    if (r == 1 && c == 'x') ++n;
    wg.done();
  };
  idle.add(kIdle);
  for (int fd : waiting) spawn_detached(idle_recv(loop, fd, got, idle));
  std::string path = temp_file(1 << 20);
  int ffd = open(path.c_str(), O_RDWR);
  ASSERT_GE(ffd, 0);
  std::string sock = "/tmp/vblk-loop-idle-" + std::to_string(getpid()) + (GetParam() ? "u" : "t") + ".sock";
  auto busy = [&]() -> Task<bool> {
    // File I/O in parallel, more requests than the whole CQ.
    WaitGroup wg(loop);
    int ok = 0;
    auto one = [](Loop& l, int f, uint64_t off, int& n, WaitGroup& w) -> Task<void> {
      AlignedBuffer b(4096);
      if (co_await l.pread(f, b.data(), 4096, off) == 4096) ++n;
      w.done();
    };
    wg.add(64);
    for (int i = 0; i < 64; ++i) spawn_detached(one(loop, ffd, uint64_t(i) * 4096, ok, wg));
    co_await wg.wait();
    if (ok != 64) co_return false;
    // A new connection and an exchange on it.
    auto listener = listen_unix(loop, sock);
    if (!listener) co_return false;
    auto server = [](Loop& l, int lfd) -> Task<void> {
      auto c = co_await accept_socket(l, lfd);
      if (!c) co_return;
      uint8_t b[4];
      if (co_await recv_exact(l, c->get(), b)) (void)co_await send_all(l, c->get(), b);
    };
    spawn_detached(server(loop, listener->get()));
    auto c = co_await connect_unix(loop, sock);
    if (!c) co_return false;
    uint8_t out[4] = {1, 2, 3, 4}, in[4] = {};
    if (!co_await send_all(loop, c->get(), out)) co_return false;
    if (!co_await recv_exact(loop, c->get(), in)) co_return false;
    co_return std::equal(in, in + 4, out);
  };
  EXPECT_TRUE(loop.run(busy()));
  // Now the silent peers speak (half) or go away (the rest).
  for (int i = 0; i < kIdle; ++i) {
    if (i % 2 == 0) {
      ASSERT_EQ(write(peers[i], "x", 1), 1);
    } else {
      close(peers[i]);
      peers[i] = -1;
    }
  }
  loop.run([](WaitGroup& wg) -> Task<void> { co_await wg.wait(); }(idle));
  EXPECT_EQ(got, kIdle / 2);
  EXPECT_EQ(loop.pending_io(), 0u);
  for (int fd : peers)
    if (fd >= 0) close(fd);
  for (int fd : waiting) close(fd);
  close(ffd);
  unlink(path.c_str());
  unlink(sock.c_str());
}

TEST_P(LoopTest, ConnectToNothingFailsCleanly) {
  Loop loop(opts());
  auto t = [](Loop& l) -> Task<int> {
    auto c = co_await connect_unix(l, "/nonexistent/vblk.sock");
    co_return c.ok() ? 0 : c.error().code;
  };
  EXPECT_EQ(loop.run(t(loop)), ENOENT);
}

INSTANTIATE_TEST_SUITE_P(Backends, LoopTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "io_uring" : "threads"; });

TEST(BufferTest, ZeroDetection) {
  std::vector<uint8_t> b(100000, 0);
  EXPECT_TRUE(buffer_is_zero(b));
  for (size_t pos : {0ul, 15ul, 16ul, 17ul, 4095ul, 99999ul}) {
    b[pos] = 1;
    EXPECT_FALSE(buffer_is_zero(b)) << pos;
    b[pos] = 0;
  }
  EXPECT_TRUE(buffer_is_zero(std::span<const uint8_t>()));
}
