// The COW buffer: block-copy claims, the CowBuffer store (memory, spill,
// age order) and copy-before-write with a buffer over fake nodes whose target
// is slow or fails.
#include "vblk/cow_buffer.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_disk.h"
#include "vblk/copy_before_write.h"

using namespace vblk;
using vblk::MemNode;
using vblk::testing::fill_pattern;
using vblk::testing::run_until;

// Named, not anonymous: the unity build puts several test files in one
// translation unit, and their helpers share names.
namespace cow_buffer_test {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;

// Files in a directory other than . and ..
int entries_in(const std::string& dir) {
  int n = 0;
  DIR* d = opendir(dir.c_str());
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") ++n;
  closedir(d);
  return n;
}

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/vblk-cowtest-XXXXXX";
    path = mkdtemp(t);
  }
  ~TempDir() { rmdir(path.c_str()); }
};

TEST(BlockCopyClaimTest, ClaimTakesDirtyClustersAndEndClaimKeepsOrGivesBack) {
  Loop loop;
  MemNode src(loop, vblk::testing::disk_options(1 * MiB)), dst(loop, vblk::testing::disk_options(1 * MiB));
  BlockCopyOptions o;
  o.cluster_size = 64 * KiB;
  BlockCopyState bcs(src, dst, o);
  bcs.bitmap().set_all();
  bcs.bitmap().reset(128 * KiB, 64 * KiB);                      // cluster 2 already copied
  EXPECT_EQ(bcs.dirty_bytes(100 * KiB, 100 * KiB), 128 * KiB);  // clusters 1 and 3
  auto c = bcs.claim(100 * KiB, 100 * KiB);
  ASSERT_EQ(c->ranges().size(), 2u);
  EXPECT_EQ(c->ranges()[0].offset, 64 * KiB);
  EXPECT_EQ(c->ranges()[1].offset, 192 * KiB);
  EXPECT_EQ(bcs.bitmap().count(), 1 * MiB - 192 * KiB);
  EXPECT_EQ(bcs.in_flight_bytes(), 128 * KiB);
  const uint64_t total = bcs.progress_total();
  bcs.end_claim(std::move(c), true);
  // Kept: clean, not in flight, still owed until the claimer reports it.
  EXPECT_EQ(bcs.in_flight_bytes(), 0u);
  EXPECT_EQ(bcs.progress_total(), total);
  bcs.add_done(128 * KiB);
  EXPECT_EQ(bcs.progress_done(), 128 * KiB);
  auto c2 = bcs.claim(0, 64 * KiB);
  bcs.end_claim(std::move(c2), false);
  EXPECT_TRUE(bcs.bitmap().get(0));  // given back
}

TEST(BlockCopyClaimTest, AClaimWaitsForATaskAndACallWaitsForAClaim) {
  Loop loop;
  MemNode src(loop, vblk::testing::disk_options(1 * MiB)), dst(loop, vblk::testing::disk_options(1 * MiB));
  src.options().latency_ns = 20'000'000;
  dst.options().latency_ns = 20'000'000;
  BlockCopyOptions o;
  o.cluster_size = 64 * KiB;
  BlockCopyState bcs(src, dst, o);
  bcs.bitmap().set_all();
  auto call = bcs.copy_async(0, 64 * KiB, true);
  bool idle = false;
  auto waiter = [](BlockCopyState& b, bool& flag) -> Task<void> {
    co_await b.wait_idle(0, 64 * KiB);
    flag = true;
  };
  spawn_detached(waiter(bcs, idle));
  run_until(loop, [&] { return idle; });
  EXPECT_TRUE(call->finished());  // the claimer waited for the task
  // Now a claim is in flight: a call over it waits until it ends.
  bcs.bitmap().set(0, 64 * KiB);
  auto c = bcs.claim(0, 64 * KiB);
  auto call2 = bcs.copy_async(0, 64 * KiB, true);
  const uint64_t until = Loop::now_ns() + 50'000'000;
  auto nap = [](Loop& l) -> Task<void> { co_await l.sleep(std::chrono::milliseconds(60)); };
  spawn_detached(nap(loop));
  loop.run_until([&] { return Loop::now_ns() > until; });
  EXPECT_FALSE(call2->finished());
  bcs.end_claim(std::move(c), true);
  run_until(loop, [&] { return call2->finished(); });
  EXPECT_TRUE(call2->succeeded());
  EXPECT_EQ(dst.count('w', 0, 64 * KiB), 1);  // the claimed cluster was not copied again
}

TEST(CowBufferTest, MemoryThenSpillThenFull) {
  Loop loop;
  TempDir dir;
  CowBufferOptions o{128 * KiB, dir.path, 128 * KiB};
  auto b = CowBuffer::create(loop, 64 * KiB, o);
  ASSERT_TRUE(b.ok()) << b.error().what();
  CowBuffer& buf = **b;
  EXPECT_EQ(entries_in(dir.path), 0);  // the spill file has no name
  std::vector<CowBuffer::Slot> slots;
  ASSERT_TRUE(buf.reserve(4, slots));
  EXPECT_EQ(slots[0].spill, -1);
  EXPECT_EQ(slots[1].spill, -1);
  EXPECT_GE(slots[2].spill, 0);
  EXPECT_GE(slots[3].spill, 0);
  std::vector<CowBuffer::Slot> more;
  EXPECT_FALSE(buf.reserve(1, more));
  for (int i = 0; i < 4; ++i) {
    std::memset(slots[i].mem, 0x10 + i, 64 * KiB);
    Status st = loop.run(buf.commit_slot(slots[i], 64 * KiB));
    ASSERT_TRUE(st.ok()) << st.error().what();
    buf.insert(uint64_t(i) * MiB, 64 * KiB, slots[i]);
  }
  auto s = buf.stats();
  EXPECT_EQ(s.used, 128 * KiB);
  EXPECT_EQ(s.spilled, 128 * KiB);
  // Oldest first, and spilled data reads back.
  for (int i = 0; i < 4; ++i) {
    CowBuffer::Entry* e = buf.next_to_drain();
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->offset, uint64_t(i) * MiB);
    std::vector<uint8_t> data(64 * KiB);
    auto st = loop.run(buf.read_old(e->offset, data));
    ASSERT_TRUE(st && st->ok());
    EXPECT_EQ(data[0], 0x10 + i);
    EXPECT_EQ(data[64 * KiB - 1], 0x10 + i);
    buf.remove(e->offset);
  }
  EXPECT_TRUE(buf.empty());
  EXPECT_EQ(buf.stats().spilled_peak, 128 * KiB);
  EXPECT_TRUE(buf.reserve(4, more));  // everything given back
  for (auto& sl : more) buf.unreserve(sl);
}

TEST(CowBufferTest, ReadOldServesMemoryAndSpilledEntriesAndKeepsASlotWhileRead) {
  Loop loop;
  TempDir dir;
  auto b = CowBuffer::create(loop, 64 * KiB, {64 * KiB, dir.path, 64 * KiB});
  ASSERT_TRUE(b.ok());
  CowBuffer& buf = **b;
  std::vector<CowBuffer::Slot> slots;
  ASSERT_TRUE(buf.reserve(2, slots));
  for (int i = 0; i < 2; ++i) {
    for (uint64_t k = 0; k < 64 * KiB; ++k) slots[i].mem[k] = static_cast<uint8_t>(i * 100 + k / 512);
    ASSERT_TRUE(loop.run(buf.commit_slot(slots[i], 64 * KiB)).ok());
    buf.insert(uint64_t(i) * 64 * KiB, 64 * KiB, slots[i]);
  }
  std::vector<uint8_t> got(1024);
  auto r = loop.run(buf.read_old(0 + 4096, got));  // memory
  ASSERT_TRUE(r && r->ok());
  EXPECT_EQ(got[0], 4096 / 512);
  // The spilled entry is drained (removed) while its read is in flight: the
  // read still returns the old data, and the slot is reused only after it.
  auto reader = [](CowBuffer& bb, std::vector<uint8_t>& out, std::optional<Status>& res) -> Task<void> {
    res = co_await bb.read_old(64 * KiB + 8192, out);
  };
  std::optional<Status> res;
  spawn_detached(reader(buf, got, res));
  buf.remove(64 * KiB);
  std::vector<CowBuffer::Slot> again;
  EXPECT_FALSE(buf.reserve(1, again));  // the slot is still held by the reader
  run_until(loop, [&] { return res.has_value(); });
  ASSERT_TRUE(res->ok());
  EXPECT_EQ(got[0], 100 + 8192 / 512);
  EXPECT_TRUE(buf.reserve(1, again));
  for (auto& sl : again) buf.unreserve(sl);
  EXPECT_FALSE(loop.run(buf.read_old(5 * MiB, got)).has_value());
}

// The unlinked spill file this process holds in dir (-1 if none).
int spill_fd_in(const std::string& dir) {
  DIR* d = opendir("/proc/self/fd");
  int found = -1;
  while (dirent* e = readdir(d)) {
    char target[4096];
    std::string link = std::string("/proc/self/fd/") + e->d_name;
    ssize_t n = readlink(link.c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = 0;
    if (std::string(target).rfind(dir + "/", 0) == 0) found = std::atoi(e->d_name);
  }
  closedir(d);
  return found;
}

TEST(CowBufferTest, ACachedSpillPunchesOutWhatTheDrainTook) {
  Loop loop;
  TempDir dir;
  CowBufferOptions o{64 * KiB, dir.path, 256 * KiB, /*spill_direct=*/false};
  auto b = CowBuffer::create(loop, 64 * KiB, o);
  ASSERT_TRUE(b.ok()) << b.error().what();
  CowBuffer& buf = **b;
  const int fd = spill_fd_in(dir.path);
  ASSERT_GE(fd, 0) << "no unlinked spill file";
  EXPECT_FALSE(fcntl(fd, F_GETFL) & O_DIRECT) << "spill_direct=false still opened O_DIRECT";
  std::vector<CowBuffer::Slot> slots;
  ASSERT_TRUE(buf.reserve(4, slots));
  for (int i = 0; i < 4; ++i) {
    std::memset(slots[i].mem, 0x30 + i, 64 * KiB);
    ASSERT_TRUE(loop.run(buf.commit_slot(slots[i], 64 * KiB)).ok());
    buf.insert(uint64_t(i) * MiB, 64 * KiB, slots[i]);
  }
  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_GE(uint64_t(st.st_blocks) * 512, 3 * 64 * KiB) << "three spilled slots hold no blocks";
  for (int i = 0; i < 4; ++i) {
    CowBuffer::Entry* e = buf.next_to_drain();
    ASSERT_NE(e, nullptr);
    std::vector<uint8_t> data(64 * KiB);
    auto r = loop.run(buf.read_old(e->offset, data));
    ASSERT_TRUE(r && r->ok());
    EXPECT_EQ(data[100], 0x30 + i);
    buf.remove(e->offset);
  }
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(st.st_blocks, 0) << "drained slots were not punched out of the spill file";
}

TEST(CowBufferTest, BadSizesAndDirsAreRefused) {
  Loop loop;
  EXPECT_FALSE(CowBuffer::create(loop, 64 * KiB, {4 * KiB, "", 0}).ok());
  EXPECT_FALSE(CowBuffer::create(loop, 64 * KiB, {1 * MiB, "/nonexistent/dir", 1 * MiB}).ok());
}

struct CbwFixture {
  Loop loop;
  std::shared_ptr<MemNode> src = vblk::testing::test_disk(loop, 4 * MiB);
  std::shared_ptr<MemNode> dst = vblk::testing::test_disk(loop, 4 * MiB);
  std::vector<uint8_t> before;
  std::shared_ptr<CopyBeforeWrite> cbw;
  CbwFixture(uint64_t mem, uint64_t spill, const std::string& dir) {
    fill_pattern(*src, 3);
    before = src->data();
    dst->options().latency_ns = 30'000'000;  // a slow target
    CbwOptions o;
    o.copy.cluster_size = 64 * KiB;
    cbw = std::make_shared<CopyBeforeWrite>(loop, src, dst, o);
    if (mem) {
      Status st = cbw->enable_buffer({mem, dir, spill});
      EXPECT_TRUE(st.ok());
    }
  }
  // The filter's drain must be stopped before it goes (as the backup job
  // and close() do).
  ~CbwFixture() { loop.run(cbw->stop_buffer()); }
  // A guest write through the filter; returns its duration in ms.
  double guest_write(uint64_t off, uint64_t len, uint8_t v) {
    std::vector<uint8_t> data(len, v);
    uint64_t t0 = Loop::now_ns();
    Status st = loop.run(cbw->write(off, data));
    EXPECT_TRUE(st.ok());
    return (Loop::now_ns() - t0) / 1e6;
  }
  void drain_all() {
    run_until(loop, [&] { return cbw->buffer_empty(); });
  }
  bool target_has_old(uint64_t off, uint64_t len) {
    return std::equal(before.begin() + off, before.begin() + off + len, dst->data().begin() + off);
  }
};

TEST(CopyBeforeWriteBufferTest, GuestWritesDoNotWaitForTheTargetAndOldDataArrives) {
  CbwFixture f(1 * MiB, 0, "");
  double ms = f.guest_write(96 * KiB, 32 * KiB, 0xEE);
  EXPECT_LT(ms, 25.0);                                 // less than one target write
  EXPECT_FALSE(f.target_has_old(64 * KiB, 64 * KiB));  // its drain write is still on the way
  EXPECT_EQ(f.cbw->buffer_stats().used, 64 * KiB);
  f.drain_all();
  EXPECT_TRUE(f.target_has_old(64 * KiB, 64 * KiB));
  EXPECT_EQ(f.src->data()[96 * KiB], 0xEE);
  EXPECT_FALSE(f.cbw->bcs().bitmap().get(64 * KiB));
  EXPECT_EQ(f.cbw->bcs().progress_done(), 64 * KiB);
  // A second write there copies nothing more.
  f.guest_write(64 * KiB, 64 * KiB, 0x11);
  f.drain_all();
  EXPECT_EQ(f.dst->count('w', 64 * KiB, 64 * KiB), 1);
  EXPECT_TRUE(f.target_has_old(64 * KiB, 64 * KiB));
}

TEST(CopyBeforeWriteBufferTest, FullBufferAndSpillFallBackToSynchronousCopies) {
  TempDir dir;
  CbwFixture f(64 * KiB, 64 * KiB, dir.path);
  f.guest_write(0, 4 * KiB, 1);  // memory, then moved to the spill file
  run_until(f.loop, [&] { return f.cbw->buffer_stats().spilled == 64 * KiB && f.cbw->buffer_stats().used == 0; });
  f.guest_write(1 * MiB, 4 * KiB, 2);  // memory
  EXPECT_EQ(f.cbw->buffer_stats().used, 64 * KiB);
  EXPECT_EQ(f.cbw->buffer_stats().sync_copies, 0u);
  double ms = f.guest_write(2 * MiB, 4 * KiB, 3);  // full: waits for its copy
  EXPECT_GE(ms, 25.0);
  EXPECT_EQ(f.cbw->buffer_stats().sync_copies, 1u);
  f.drain_all();
  for (uint64_t off : {uint64_t{0}, 1 * MiB, 2 * MiB}) EXPECT_TRUE(f.target_has_old(off, 64 * KiB)) << off;
  EXPECT_EQ(entries_in(dir.path), 0);
}

TEST(CopyBeforeWriteBufferTest, AFailedDrainWriteKeepsTheDataUntilCleared) {
  CbwFixture f(1 * MiB, 0, "");
  f.dst->faults.push_back({'w', 0, 64 * KiB, EIO, true});
  f.guest_write(0, 64 * KiB, 0x55);
  run_until(f.loop, [&] { return !f.cbw->drain_error().ok(); });
  EXPECT_FALSE(f.cbw->buffer_empty());
  EXPECT_FALSE(f.cbw->bcs().bitmap().get(0));  // never re-read from the (overwritten) source
  f.cbw->clear_drain_error();
  f.drain_all();
  EXPECT_TRUE(f.target_has_old(0, 64 * KiB));
}

TEST(CopyBeforeWriteBufferTest, AFailedSourceReadGivesTheClustersBack) {
  CbwFixture f(1 * MiB, 0, "");
  f.src->faults.push_back({'r', 0, 64 * KiB, EIO, true});
  std::vector<uint8_t> data(4 * KiB, 9);
  Status st = f.loop.run(f.cbw->write(0, data));
  EXPECT_FALSE(st.ok());  // break-guest-write: the guest write fails
  EXPECT_TRUE(f.cbw->bcs().bitmap().get(0));
  EXPECT_TRUE(f.cbw->buffer_empty());
  EXPECT_EQ(f.src->data()[0], f.before[0]);
}

}  // namespace cow_buffer_test
