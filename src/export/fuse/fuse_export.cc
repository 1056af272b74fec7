// The FUSE export: the kernel's FUSE protocol (linux/fuse.h) spoken on
// /dev/fuse for a file system of one regular file, the root (node id 1).
#include "vblk/fuse_export.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>

#include "fuse/request_buffer.h"
#include "fuse/uring_transport.h"
#include "vblk/buffer.h"
#include "vblk/net.h"
#include "vblk/node_ref.h"
#include "vblk/sync.h"

namespace vblk::fuse {

namespace {

// Requests served at once: each has its own buffer (32 MiB in all at most),
// and as many ring entries with io-uring=on.
constexpr int kReaders = 32;
// How long the kernel may cache the file's attributes.
constexpr uint64_t kAttrValidSec = 1;

#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57
#endif

// The minor device number of the mount on `path` (the FUSE connection's
// name in fusectl), from /proc/self/mountinfo; 0 if not found.
unsigned mount_minor(const std::string& path) {
  char real[PATH_MAX];
  if (!::realpath(path.c_str(), real)) return 0;
  FILE* f = std::fopen("/proc/self/mountinfo", "re");
  if (!f) return 0;
  unsigned found = 0;
  char line[4096];
  while (std::fgets(line, sizeof line, f)) {
    unsigned id, parent, major, minor;
    char mnt[PATH_MAX];
    // "36 35 0:45 / /mnt/point rw,... - fuse.vblk vblk rw,..." (spaces in
    // paths are octal-escaped; such a mountpoint is simply not matched)
    if (std::sscanf(line, "%u %u %u:%u %*s %4095s", &id, &parent, &major, &minor, mnt) == 5 &&
        std::strcmp(mnt, real) == 0 && std::strstr(line, " - fuse.vblk "))
      found = minor;  // the last one: mounts stack
  }
  std::fclose(f);
  return found;
}

// Whom to answer: the request's id, and its ring entry if it came through
// io_uring (null: /dev/fuse).
struct Req {
  uint64_t unique;
  RingEnt* ent = nullptr;
};

class Export final : public FuseExport {
 public:
  Export(Loop& loop, Options o) : loop_(loop), opts_(std::move(o)), node_(opts_.node), readers_(loop) {
    created_ = std::time(nullptr);
    mtime_ = created_;
    mode_ = S_IFREG | S_IRUSR | (opts_.writable ? S_IWUSR : 0);
  }

  ~Export() override {
    if (ring_) ring_->close();  // first: the unmount may wait for the ring's entries
    if (mounted_) (void)::umount2(opts_.mountpoint.c_str(), MNT_DETACH);
  }

  Status start() {
    const uint32_t perm = kPermConsistentRead | (opts_.writable ? kPermWrite : 0u);
    VBLK_TRY(node_.set_perms(PermPair{perm, kPermAll}));
    VBLK_TRY(node_.set_perms(PermPair{perm, kPermAll & ~kPermResize}));
    if (opts_.io_uring) {
      VBLK_TRY(uring_transport_available());
      ring_ = std::make_unique<UringTransport>(loop_);
      VBLK_TRY(ring_->setup(kReaders));
    }
    VBLK_TRY(mount());
    // The loop serves a kernel client now: memory reclaim must not wait
    // on the I/O this thread is about to do (see docs/architecture.md).
    (void)::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0);
    for (int i = 0; i < kReaders; ++i) {
      readers_.add();
      spawn_detached(reader());
    }
    return {};
  }

  const char* type() const override { return "fuse"; }
  const Node* node() const override { return node_.get(); }
  // Files open on the mount (a loop device, a program) are its clients:
  // block-export-del in mode safe refuses then, as QAPI documents and
  // unlike qemu-storage-daemon 7.2, which aborts their I/O.
  bool in_use() const override { return open_files_ > 0; }

  Task<void> remove() override {
    if (ring_started_) {
      // Off the loop thread: the unmount waits for the ring entries to be
      // torn down, and one the kernel is handing a request to needs this
      // thread's task work to finish.
      std::function<long()> fn = [this] {
        unmount();
        return 0L;
      };
      (void)co_await loop_.run_blocking(fn);
    } else {
      unmount();
    }
    // Without users the unmount ends the connection and every reader sees
    // ENODEV. Files still open keep a lazily unmounted file system alive:
    // give them a moment, then abort the connection.
    for (int i = 0; i < 200 && readers_.count(); ++i) co_await loop_.sleep(std::chrono::milliseconds(5));
    if (readers_.count()) abort_connection();
    co_await readers_.wait();
    if (ring_) ring_->close();
    fd_.reset();
    node_.reset();
  }

 private:
  Status mount() {
    const char* mp = opts_.mountpoint.c_str();
    struct stat st {};
    if (::stat(mp, &st) < 0 && errno == ENOTCONN) {
      // A FUSE mount whose daemon died (kill -9): clear it and go on.
      (void)::umount2(mp, MNT_DETACH);
    }
    if (::stat(mp, &st) < 0) return Error(errno, "Failed to stat '" + opts_.mountpoint + "': " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return Error(EINVAL, "'" + opts_.mountpoint + "' is not a regular file");
    fd_ = Fd(::open("/dev/fuse", O_RDWR | O_CLOEXEC | O_NONBLOCK));
    if (!fd_.valid()) return Error(errno, std::string("Failed to open /dev/fuse: ") + std::strerror(errno));
    std::string data = "fd=" + std::to_string(fd_.get()) + ",rootmode=100000,user_id=" + std::to_string(::getuid()) +
                       ",group_id=" + std::to_string(::getgid()) +
                       ",default_permissions,max_read=" + std::to_string(kMaxWrite);
    unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOATIME;
    if (!opts_.writable) flags |= MS_RDONLY;
    int r = -1;
    if (opts_.allow_other != AllowOther::Off)
      r = ::mount("vblk", mp, "fuse.vblk", flags, (data + ",allow_other").c_str());
    if (r < 0 && opts_.allow_other != AllowOther::On) r = ::mount("vblk", mp, "fuse.vblk", flags, data.c_str());
    if (r < 0) return Error(errno, "Failed to mount FUSE session to export: " + std::string(std::strerror(errno)));
    mounted_ = true;
    // The connection's number (for an abort), from the mount table: a
    // stat here would wait for the INIT this thread has yet to answer.
    conn_id_ = mount_minor(opts_.mountpoint);
    return {};
  }

  void unmount() {
    if (!mounted_) return;
    mounted_ = false;
    if (::umount2(opts_.mountpoint.c_str(), 0) < 0) (void)::umount2(opts_.mountpoint.c_str(), MNT_DETACH);
  }

  // Ends the FUSE connection through fusectl (mounted privately for the
  // moment): requests of files still open fail, and the readers return.
  void abort_connection() {
    char dir[] = "/tmp/vblk-fusectl-XXXXXX";
    if (!::mkdtemp(dir)) return;
    if (::mount("fusectl", dir, "fusectl", 0, nullptr) == 0) {
      std::string path = std::string(dir) + "/" + std::to_string(conn_id_) + "/abort";
      int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd >= 0) {
        (void)!::write(fd, "1", 1);
        ::close(fd);
      }
      (void)::umount2(dir, MNT_DETACH);
    }
    ::rmdir(dir);
  }

  Task<void> serve_ent(RingEnt& e) {
    e.replied = false;
    const auto h = *reinterpret_cast<const fuse_in_header*>(e.hdr.in_out);
    const size_t n = std::min<size_t>(e.hdr.ent.payload_sz, kMaxWrite);
    co_await serve(Req{h.unique, &e}, h, std::span(e.hdr.op_in), e.buf.span().subspan(kDataOffset, n), e.buf);
    // The entry must go back to the kernel, answered or not.
    if (!e.replied) reply(Req{h.unique, &e}, ENOSYS);
  }

  // ---- requests

  Task<void> reader() {
    AlignedBuffer buf(kBufSize);
    while (true) {
      long n = co_await loop_.read_stream(fd_.get(), buf.data(), buf.size());
      if (n == -EAGAIN || n == -EINTR) continue;
      // A request the kernel gave up on before we read it.
      if (n == -ENOENT) continue;
      if (n < 0) break;  // ENODEV: unmounted
      if (static_cast<size_t>(n) < sizeof(fuse_in_header)) continue;
      auto req = std::span(buf.data(), static_cast<size_t>(n));
      const auto& h = *reinterpret_cast<const fuse_in_header*>(req.data());
      co_await serve(Req{h.unique}, h, req.subspan(sizeof(fuse_in_header)), {}, buf);
    }
    readers_.done();
  }

  void reply(Req u, int error, const void* p = nullptr, size_t len = 0, const void* p2 = nullptr, size_t len2 = 0) {
    if (u.ent) {
      ring_->commit(*u.ent, u.unique, error, p, len, p2, len2);
      return;
    }
    fuse_out_header h{};
    h.unique = u.unique;
    h.error = error ? -std::abs(error) : 0;
    iovec iov[3] = {{&h, sizeof h}, {const_cast<void*>(p), len}, {const_cast<void*>(p2), len2}};
    int n = 1;
    if (!error) {
      if (len) iov[n++] = {const_cast<void*>(p), len};
      if (len2) iov[n++] = {const_cast<void*>(p2), len2};
    }
    size_t total = 0;
    for (int i = 0; i < n; ++i) total += iov[i].iov_len;
    h.len = static_cast<uint32_t>(total);
    // ENOENT: the request was interrupted meanwhile; nothing to do.
    (void)::writev(fd_.get(), iov, n);
  }

  // The opcode's struct: `op` holds what follows the fuse_in_header (on
  // /dev/fuse) or the ring entry's op_in.
  template <class T>
  static const T* arg(std::span<uint8_t> op) {
    if (op.size() < sizeof(T)) return nullptr;
    return reinterpret_cast<const T*>(op.data());
  }

  fuse_attr attr() const {
    fuse_attr a{};
    a.ino = FUSE_ROOT_ID;
    a.size = node_->length();
    auto used = node_->allocated_size();
    a.blocks = used ? (*used + 511) / 512 : (a.size + 511) / 512;
    a.atime = a.ctime = static_cast<uint64_t>(created_);
    a.mtime = static_cast<uint64_t>(mtime_);
    a.mode = mode_;
    a.nlink = 1;
    a.uid = uid_;
    a.gid = gid_;
    a.blksize = 4096;
    return a;
  }

  void reply_attr(Req u) {
    fuse_attr_out o{};
    o.attr_valid = kAttrValidSec;
    o.attr = attr();
    reply(u, 0, &o, sizeof o);
  }

  // One request, from either transport: `op` as for arg(), `payload` the
  // data after the opcode's struct when it comes apart (io_uring; on
  // /dev/fuse it follows in `op`). Replies go where u says.
  Task<void> serve(Req u, const fuse_in_header& h, std::span<uint8_t> op, std::span<uint8_t> payload,
                   AlignedBuffer& buf) {
    if (h.nodeid != FUSE_ROOT_ID && h.opcode != FUSE_INIT && h.opcode != FUSE_INTERRUPT && h.opcode != FUSE_FORGET &&
        h.opcode != FUSE_BATCH_FORGET && h.opcode != FUSE_DESTROY) {
      reply(u, ENOENT);
      co_return;
    }
    switch (h.opcode) {
      case FUSE_INIT: init(u, arg<fuse_init_in>(op)); break;
      case FUSE_DESTROY: reply(u, 0); break;
      case FUSE_FORGET:
      case FUSE_BATCH_FORGET:
      case FUSE_INTERRUPT: break;  // no reply; requests run to completion
      case FUSE_GETATTR: reply_attr(u); break;
      case FUSE_SETATTR: co_await setattr(u, arg<fuse_setattr_in>(op)); break;
      case FUSE_OPEN: {
        const auto* in = arg<fuse_open_in>(op);
        if (!in) {
          reply(u, EINVAL);
          break;
        }
        if (!opts_.writable && (in->flags & O_ACCMODE) != O_RDONLY) {
          reply(u, EACCES);
          break;
        }
        fuse_open_out o{};
        // Concurrent O_DIRECT writes are safe here: each has its buffer.
        o.open_flags = FOPEN_PARALLEL_DIRECT_WRITES;
        ++open_files_;
        reply(u, 0, &o, sizeof o);
        break;
      }
      case FUSE_RELEASE:
        if (open_files_) --open_files_;
        reply(u, 0);
        break;
      case FUSE_READ: co_await read(u, arg<fuse_read_in>(op), buf); break;
      case FUSE_WRITE: co_await write(u, op, payload); break;
      case FUSE_FLUSH:
      case FUSE_FSYNC: {
        Status s = co_await node_->flush();
        reply(u, s ? 0 : s.error().code);
        break;
      }
      case FUSE_FALLOCATE: co_await fallocate(u, arg<fuse_fallocate_in>(op)); break;
      case FUSE_LSEEK: co_await lseek(u, arg<fuse_lseek_in>(op)); break;
      case FUSE_STATFS: {
        fuse_statfs_out o{};
        o.st.bsize = o.st.frsize = 512;
        o.st.namelen = 255;
        reply(u, 0, &o, sizeof o);
        break;
      }
      case FUSE_LOOKUP:
      case FUSE_OPENDIR:
      case FUSE_READDIR:
      case FUSE_READDIRPLUS:
      case FUSE_MKNOD:
      case FUSE_MKDIR:
      case FUSE_CREATE: reply(u, ENOTDIR); break;
      default: reply(u, ENOSYS); break;
    }
  }

  void init(Req u, const fuse_init_in* in) {
    if (!in || in->major != FUSE_KERNEL_VERSION) {
      // Tell the kernel our major version; it retries or gives up.
      fuse_init_out o{};
      o.major = FUSE_KERNEL_VERSION;
      o.minor = FUSE_KERNEL_MINOR_VERSION;
      reply(u, in ? 0 : EINVAL, &o, sizeof o);
      return;
    }
    fuse_init_out o{};
    o.major = FUSE_KERNEL_VERSION;
    o.minor = std::min<uint32_t>(in->minor, FUSE_KERNEL_MINOR_VERSION);
    o.max_readahead = in->max_readahead;
    const uint32_t wanted = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | FUSE_MAX_PAGES;
    o.flags = in->flags & wanted;
    o.max_background = 64;
    o.congestion_threshold = 48;
    o.max_write = kMaxWrite;
    o.time_gran = 1;
    o.max_pages = kMaxWrite / 4096;
    const bool uring =
        ring_ && (in->flags & FUSE_INIT_EXT) && ((static_cast<uint64_t>(in->flags2) << 32) & kFuseOverIoUring);
    if (uring) {
      o.flags |= FUSE_INIT_EXT;
      o.flags2 = static_cast<uint32_t>(kFuseOverIoUring >> 32);
    }
    reply(u, 0, &o, sizeof o);
    // The kernel takes the ring entries once the connection is
    // initialized, which the reply just did; until every queue has one,
    // new requests wait (a refused registration lets them go to /dev/fuse).
    if (uring) {
      ring_started_ = true;
      ring_->start(
          fd_.get(), [this](RingEnt& e) { spawn_detached(serve_ent(e)); }, readers_);
    }
  }

  Task<void> read(Req u, const fuse_read_in* in, AlignedBuffer& buf) {
    if (!in) {
      reply(u, EINVAL);
      co_return;
    }
    const uint64_t len = node_->length();
    uint64_t n = in->offset >= len ? 0 : std::min<uint64_t>({in->size, len - in->offset, kMaxWrite});
    if (n == 0) {
      reply(u, 0);
      co_return;
    }
    auto data = buf.span().subspan(kDataOffset, n);
    Status s = co_await node_->read(in->offset, data);
    if (!s) {
      reply(u, s.error().code);
      co_return;
    }
    reply(u, 0, data.data(), n);
  }

  Task<void> write(Req u, std::span<uint8_t> op, std::span<uint8_t> payload) {
    const auto* in = arg<fuse_write_in>(op);
    const auto data = u.ent ? payload : in ? op.subspan(sizeof(fuse_write_in)) : op;
    if (!in || data.size() < in->size) {
      reply(u, EINVAL);
      co_return;
    }
    if (!opts_.writable) {
      reply(u, EACCES);
      co_return;
    }
    uint64_t size = in->size;
    uint64_t end;
    if (__builtin_add_overflow(in->offset, size, &end) || end > static_cast<uint64_t>(INT64_MAX)) {
      reply(u, EFBIG);
      co_return;
    }
    const uint64_t len = node_->length();
    if (end > len) {
      if (opts_.growable) {
        Status s = co_await resize(end);
        if (!s) {
          reply(u, s.error().code);
          co_return;
        }
      } else {
        // As qemu-storage-daemon: a write past the end is cut short, one
        // at the end fails.
        size = in->offset >= len ? 0 : len - in->offset;
        if (size == 0) {
          reply(u, EIO);
          co_return;
        }
      }
    }
    Status s = co_await node_->write(in->offset, data.subspan(0, size));
    if (!s) {
      reply(u, s.error().code);
      co_return;
    }
    mtime_ = std::time(nullptr);
    fuse_write_out o{};
    o.size = static_cast<uint32_t>(size);
    reply(u, 0, &o, sizeof o);
  }

  // A size change: the export claims the resize permission only meanwhile
  // (as qemu-storage-daemon's fuse_do_truncate does).
  Task<Status> resize(uint64_t size) {
    PermPair old = node_.perms();
    VBLK_CO_TRY(node_.set_perms(PermPair{old.perm | kPermResize, old.shared}));
    Status s = co_await node_->truncate(size);
    (void)node_.set_perms(old);
    co_return s;
  }

  Task<void> setattr(Req u, const fuse_setattr_in* in) {
    if (!in) {
      reply(u, EINVAL);
      co_return;
    }
    if (in->valid & FATTR_SIZE) {
      if (!opts_.writable) {
        reply(u, EACCES);
        co_return;
      }
      Status s = co_await resize(in->size);
      if (!s) {
        reply(u, s.error().code);
        co_return;
      }
    }
    if (in->valid & FATTR_MODE) mode_ = S_IFREG | (in->mode & 07777);
    if (in->valid & FATTR_UID) uid_ = in->uid;
    if (in->valid & FATTR_GID) gid_ = in->gid;
    reply_attr(u);
  }

  Task<void> fallocate(Req u, const fuse_fallocate_in* in) {
    if (!in) {
      reply(u, EINVAL);
      co_return;
    }
    if (!opts_.writable) {
      reply(u, EACCES);
      co_return;
    }
    uint64_t end;
    if (__builtin_add_overflow(in->offset, in->length, &end) || end > static_cast<uint64_t>(INT64_MAX)) {
      reply(u, EFBIG);
      co_return;
    }
    const uint64_t len = node_->length();
    const bool keep = in->mode & FALLOC_FL_KEEP_SIZE;
    Status s;
    if (in->mode & FALLOC_FL_PUNCH_HOLE) {
      if (!keep) {
        reply(u, EINVAL);
        co_return;
      }
      // Reads of a punched range return zeroes: zero it, letting the node
      // deallocate (a discard alone may leave old data).
      if (in->offset < len) s = co_await node_->write_zeroes(in->offset, std::min(end, len) - in->offset, kReqMayUnmap);
    } else if (in->mode & FALLOC_FL_ZERO_RANGE) {
      // Past the end without KEEP_SIZE the file grows, growable or not
      // (as qemu-storage-daemon 7.2 does).
      if (!keep && end > len) s = co_await resize(end);
      if (s && in->offset < node_->length())
        s = co_await node_->write_zeroes(in->offset, std::min(end, node_->length()) - in->offset, 0);
    } else if (in->mode == 0) {
      // Allocation can only extend the file at its end (qemu-storage-daemon's
      // rule; glibc's posix_fallocate falls back to writing).
      if (in->offset != len) {
        reply(u, in->offset < len ? EOPNOTSUPP : EINVAL);
        co_return;
      }
      s = co_await resize(end);
    } else {
      reply(u, EOPNOTSUPP);
      co_return;
    }
    if (s) mtime_ = std::time(nullptr);
    reply(u, s ? 0 : s.error().code);
  }

  Task<void> lseek(Req u, const fuse_lseek_in* in) {
    if (!in) {
      reply(u, EINVAL);
      co_return;
    }
    if (in->whence != SEEK_DATA && in->whence != SEEK_HOLE) {
      reply(u, EINVAL);
      co_return;
    }
    const uint64_t len = node_->length();
    uint64_t off = in->offset;
    if (off >= len) {
      reply(u, ENXIO);
      co_return;
    }
    // Walk block status until the kind asked for (the end is a hole).
    while (off < len) {
      auto st = co_await node_->block_status_above(off, len - off);
      if (!st) {
        reply(u, st.error().code);
        co_return;
      }
      if (st->bytes == 0) break;
      const bool data = (st->flags & kStatusData) || !(st->flags & kStatusZero);
      if (data == (in->whence == SEEK_DATA)) break;
      off += st->bytes;
    }
    if (off >= len) {
      if (in->whence == SEEK_DATA) {
        reply(u, ENXIO);
        co_return;
      }
      off = len;
    }
    fuse_lseek_out o{};
    o.offset = off;
    reply(u, 0, &o, sizeof o);
  }

  Loop& loop_;
  Options opts_;
  NodeRef node_;
  Fd fd_;
  WaitGroup readers_;
  bool mounted_ = false;
  size_t open_files_ = 0;  // OPENs not yet RELEASEd (a loop device holds one)
  unsigned conn_id_ = 0;
  std::unique_ptr<UringTransport> ring_;  // io-uring=on
  bool ring_started_ = false;             // FUSE_INIT accepted it
  std::time_t created_;
  std::time_t mtime_;
  uint32_t mode_;
  uint32_t uid_ = ::getuid();
  uint32_t gid_ = ::getgid();
};

}  // namespace

Result<std::unique_ptr<FuseExport>> FuseExport::create(Loop& loop, Options o) {
  if (!o.node) return Error(EINVAL, "no node to export");
  if (o.writable && o.node->read_only()) return Error(EACCES, "Cannot export read-only node as writable");
  if (!o.writable) o.growable = false;
  auto e = std::make_unique<Export>(loop, std::move(o));
  VBLK_TRY(e->start());
  return std::unique_ptr<FuseExport>(std::move(e));
}

}  // namespace vblk::fuse
