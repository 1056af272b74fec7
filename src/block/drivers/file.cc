// The `file` protocol driver: a regular file or block device.
//
// Reads and writes go through the loop (io_uring, or the thread pool with
// aio=threads). Block status comes from SEEK_DATA/SEEK_HOLE, write-zeroes and
// discard from fallocate, copy offload from copy_file_range. With
// cache.direct=on the file is opened O_DIRECT and the request alignment is
// probed, as QEMU does, so the generic layer pads and bounces for it.
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "drivers/file_lock.h"
#include "vblk/buffer.h"
#include "vblk/open.h"

namespace vblk {

using drivers::ImageLock;
using drivers::LockingMode;

class FileNode final : public Node {
 public:
  FileNode(Loop& loop, std::string path, int fd, bool is_blockdev, AioMode aio, LockingMode locking)
      : Node(loop, is_blockdev ? "host_device" : "file"),
        path_(std::move(path)),
        fd_(fd),
        blockdev_(is_blockdev),
        aio_(loop.effective(aio)),
        lock_(fd, path_, locking) {
    caps_.zeroes = true;
    caps_.discard = true;
    caps_.copy_range = true;
    // Whole extents from lseek, kept by the node (status_cache.h).
    caps_.cache_status = !is_blockdev;
  }
  ~FileNode() override { ::close(fd_); }

  std::string filename() const override { return path_; }

  // The node's permissions become QEMU's OFD lock bytes on the image.
  Status apply_perms(PermPair p) override { return lock_.apply(p); }

  Result<uint64_t> allocated_size() const override {
    struct stat st;
    if (::fstat(fd_, &st) < 0) return Error(errno);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  }

  Status init_length() {
    auto sz = host_size();
    VBLK_TRY(sz);
    exact_length_ = *sz;
    set_length(align_up(*sz, 512));  // QEMU counts whole 512-byte sectors
    return {};
  }

  Status probe_alignment(bool direct) {
    if (!direct) return {};
    uint32_t align = 0;
    if (blockdev_) {
      int ssz = 0;
      if (::ioctl(fd_, BLKSSZGET, &ssz) == 0 && ssz > 0) align = static_cast<uint32_t>(ssz);
    }
    if (!align) {
      AlignedBuffer probe(4096, 4096);
      for (uint32_t a : {512u, 1024u, 2048u, 4096u}) {
        if (::pread(fd_, probe.data(), a, 0) >= 0 || errno != EINVAL) {
          align = a;
          break;
        }
      }
    }
    if (!align) return Error(EINVAL, "Could not find working O_DIRECT alignment");
    limits_.request_alignment = align;
    limits_.buffer_alignment = std::max<uint32_t>(align, 512);
    return {};
  }

  void set_page_copies(bool v) { page_copies_ = v; }
  void set_memory_backed(bool v) { memory_backed_ = v; }
  int fd() const { return fd_; }
  uint64_t exact_length() const override { return exact_length_; }
  Node* copy_target(uint64_t&) override { return this; }

 protected:
  Task<Status> do_read(uint64_t offset, std::span<uint8_t> buf, uint32_t) override {
    if (copy_inline(buf.size())) co_return read_inline(offset, buf);
    const AioMode aio = read_mode(buf.size());
    size_t done = 0;
    while (done < buf.size()) {
      long r = co_await loop().pread(fd_, buf.data() + done, buf.size() - done, offset + done, aio);
      if (r == -EINTR || r == -EAGAIN) continue;
      if (r < 0) co_return Error(static_cast<int>(-r));
      if (r == 0) {  // past the end of the file: the rest reads as zeroes
        std::memset(buf.data() + done, 0, buf.size() - done);
        break;
      }
      done += static_cast<size_t>(r);
    }
    co_return Status{};
  }

  Task<Status> do_write(uint64_t offset, std::span<const uint8_t> buf, uint32_t) override {
    if (copy_inline(buf.size())) co_return write_inline(offset, buf);
    size_t done = 0;
    while (done < buf.size()) {
      long r = co_await loop().pwrite(fd_, buf.data() + done, buf.size() - done, offset + done, aio_);
      if (r == -EINTR || r == -EAGAIN) continue;
      if (r < 0) co_return Error(static_cast<int>(-r));
      if (r == 0) co_return Error(EIO);
      done += static_cast<size_t>(r);
    }
    co_return Status{};
  }

  Task<Status> do_write_zeroes(uint64_t offset, uint64_t bytes, uint32_t flags) override {
    if (!blockdev_) {
      // Beyond the end of the file, growing it is the cheapest zeroing.
      auto sz = host_size();
      if (!sz) co_return sz.take_error();
      if (offset + bytes > *sz) {
        uint64_t old = *sz;
        if (::ftruncate(fd_, static_cast<off_t>(offset + bytes)) < 0) co_return Error(errno);
        if (offset >= old) co_return Status{};
        bytes = old - offset;
      }
    }
    if (flags & kReqMayUnmap) {
      long r = co_await loop().fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, bytes, aio_);
      if (r == 0) co_return Status{};
    }
    long r = co_await loop().fallocate(fd_, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, bytes, aio_);
    if (r == 0) co_return Status{};
    if (r != -EOPNOTSUPP && r != -EINVAL && r != -ENOTSUP) co_return Error(static_cast<int>(-r));
    // No ZERO_RANGE (e.g. tmpfs): punch, then allocate again unless unmapping is fine.
    r = co_await loop().fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, bytes, aio_);
    if (r == 0 && !(flags & kReqMayUnmap)) r = co_await loop().fallocate(fd_, 0, offset, bytes, aio_);
    if (r == 0) co_return Status{};
    co_return Error(ENOTSUP);
  }

  Task<Status> do_discard(uint64_t offset, uint64_t bytes) override {
    long r = co_await loop().fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, bytes, aio_);
    if (r == 0) co_return Status{};
    if (r == -EOPNOTSUPP || r == -EINVAL) co_return Error(ENOTSUP);
    co_return Error(static_cast<int>(-r));
  }

  Task<Status> do_flush() override {
    long r = co_await loop().fsync(fd_, true, aio_);
    if (r < 0) co_return Error(static_cast<int>(-r));
    co_return Status{};
  }

  // The whole extent at offset, up to the next hole or data boundary, not
  // clipped to `bytes`: the node caches it (status_cache.h), so a fully
  // written file costs one lseek pair per pass, a sparse one a pair per extent.
  Task<Result<BlockStatus>> do_block_status(uint64_t offset, uint64_t bytes) override {
    BlockStatus s{.flags = kStatusOffsetValid, .bytes = bytes, .map = offset, .file = this};
    if (blockdev_) {
      s.flags |= kStatusData;
      co_return s;
    }
    const uint64_t align = limits_.request_alignment;
    // lseek on a local file is a metadata lookup that does not wait for I/O.
    off_t d = ::lseek(fd_, static_cast<off_t>(offset), SEEK_DATA);
    if (d < 0) {
      if (errno == ENXIO) {  // a hole up to the end of the file
        s.flags |= kStatusZero;
        s.bytes = std::max(bytes, length() > offset ? length() - offset : 0);
      } else {
        s.flags |= kStatusData;
      }
      co_return s;
    }
    if (static_cast<uint64_t>(d) > offset) {
      // A hole up to d; a hole shorter than the alignment unit reads as
      // part of a data block.
      uint64_t n = align_down(static_cast<uint64_t>(d) - offset, align);
      if (n) {
        s.flags |= kStatusZero;
        s.bytes = n;
        co_return s;
      }
    }
    off_t h = ::lseek(fd_, static_cast<off_t>(offset), SEEK_HOLE);
    s.flags |= kStatusData;
    if (h > static_cast<off_t>(offset)) s.bytes = align_up(static_cast<uint64_t>(h) - offset, align);
    co_return s;
  }

  Task<Status> do_copy_range_to(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes, uint32_t) override;

  Task<Status> do_truncate(uint64_t length, bool) override {
    if (blockdev_) {
      if (length > this->length()) co_return Error(EINVAL, "Cannot grow device files");
      co_return Status{};
    }
    if (::ftruncate(fd_, static_cast<off_t>(length)) < 0)
      co_return Error(errno, std::string("Failed to resize the file: ") + std::strerror(errno));
    exact_length_ = length;
    set_length(align_up(length, 512));
    co_return Status{};
  }
  // Grows the file and allocates the new area (QEMU's raw_regular_truncate):
  // falloc reserves it, full writes zeroes into it.
  Task<Status> do_truncate_prealloc(uint64_t length, bool exact, Prealloc p) override {
    if (blockdev_ || (p != Prealloc::Falloc && p != Prealloc::Full))
      co_return co_await Node::do_truncate_prealloc(length, exact, p);
    auto sz = host_size();
    if (!sz) co_return sz.take_error();
    if (length <= *sz) co_return co_await do_truncate(length, exact);
    const uint64_t old = *sz;
    if (p == Prealloc::Falloc) {
      int r = ::posix_fallocate(fd_, static_cast<off_t>(old), static_cast<off_t>(length - old));
      if (r != 0) co_return Error(r, std::string("Could not preallocate new data: ") + std::strerror(r));
    } else {
      if (::ftruncate(fd_, static_cast<off_t>(length)) < 0)
        co_return Error(errno, std::string("Could not resize file: ") + std::strerror(errno));
      AlignedBuffer zero(1 << 20, 4096);
      zero.zero();
      for (uint64_t pos = old; pos < length;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(zero.size(), length - pos));
        ssize_t w = ::pwrite(fd_, zero.data(), n, static_cast<off_t>(pos));
        if (w < 0) {
          if (errno == EINTR) continue;
          co_return Error(errno, std::string("Could not write zeros for preallocation: ") + std::strerror(errno));
        }
        pos += static_cast<uint64_t>(w);
      }
    }
    set_length(align_up(length, 512));
    co_return Status{};
  }

 private:
  Result<uint64_t> host_size() const {
    if (blockdev_) {
      uint64_t sz = 0;
      if (::ioctl(fd_, BLKGETSIZE64, &sz) < 0) return Error(errno);
      return sz;
    }
    struct stat st;
    if (::fstat(fd_, &st) < 0) return Error(errno);
    return static_cast<uint64_t>(st.st_size);
  }

  std::string path_;
  int fd_;
  uint64_t exact_length_ = 0;  // the file size when opened (or last resized)
  bool blockdev_;
  bool page_copies_ = false;    // reads are copies out of the page cache (see read_mode)
  bool memory_backed_ = false;  // tmpfs: no request ever waits for a device (see copy_inline)
  AioMode aio_;
  ImageLock lock_;

  // Large reads that are page-cache copies (a file opened without O_DIRECT,
  // or on tmpfs, whose O_DIRECT is a copy too) go to the thread pool even
  // with aio=io_uring. Such a read is a CPU copy, and io_uring runs it either
  // inline on the loop thread (a file system with non-blocking buffered
  // reads, a cached page) or on an io-wq worker (tmpfs); io-wq adds a worker
  // only when one blocks, and a page-cache copy never blocks, so either way
  // every copy of a block-copy job ran on one core (1.05 CPUs for a 1 GiB
  // raw convert on tmpfs, against qemu-img's threads). The pool's threads
  // copy in parallel; below kPoolReadMin the hand-off costs more than the
  // copy (4 KiB NBD reads through the pool ran at half the rate).
  static constexpr size_t kPoolReadMin = 256 << 10;
  AioMode read_mode(size_t len) const {
    return page_copies_ && aio_ == AioMode::IoUring && len >= kPoolReadMin ? AioMode::Threads : aio_;
  }

  // Small reads and writes of a file on tmpfs are done by the loop thread
  // itself. tmpfs has no non-blocking buffered I/O (RWF_NOWAIT gives
  // EOPNOTSUPP), so io_uring hands every such request to an io-wq worker:
  // a wake-up and two context switches around a copy of a few KiB that
  // cannot block on a device. On a file system with non-blocking buffered
  // I/O io_uring already does a cached copy inline; this makes tmpfs the
  // same. Large copies still go out, where other cores can do them.
  static constexpr size_t kInlineMax = 64 << 10;
  bool copy_inline(size_t len) const { return memory_backed_ && aio_ == AioMode::IoUring && len <= kInlineMax; }

  Status read_inline(uint64_t offset, std::span<uint8_t> buf) const {
    size_t done = 0;
    while (done < buf.size()) {
      ssize_t r = ::pread(fd_, buf.data() + done, buf.size() - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return Error(errno);
      if (r == 0) {  // past the end of the file: the rest reads as zeroes
        std::memset(buf.data() + done, 0, buf.size() - done);
        break;
      }
      done += static_cast<size_t>(r);
    }
    return {};
  }

  Status write_inline(uint64_t offset, std::span<const uint8_t> buf) const {
    size_t done = 0;
    while (done < buf.size()) {
      ssize_t r = ::pwrite(fd_, buf.data() + done, buf.size() - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return Error(errno);
      if (r == 0) return Error(EIO);
      done += static_cast<size_t>(r);
    }
    return {};
  }
};

// Copy offload reaches the destination's file through pass-through layers.
int copy_target_fd(Node& dst, uint64_t& offset);

Task<Status> FileNode::do_copy_range_to(uint64_t offset, Node& dst, uint64_t dst_offset, uint64_t bytes, uint32_t) {
  int out = copy_target_fd(dst, dst_offset);
  if (out < 0) co_return Error(ENOTSUP);
  uint64_t done = 0;
  while (done < bytes) {
    loff_t in_off = static_cast<loff_t>(offset + done), out_off = static_cast<loff_t>(dst_offset + done);
    size_t n = static_cast<size_t>(std::min<uint64_t>(bytes - done, 1u << 30));
    int in = fd_;
    std::function<long()> fn = [&] {
      ssize_t r = ::copy_file_range(in, &in_off, out, &out_off, n, 0);
      return r < 0 ? -static_cast<long>(errno) : static_cast<long>(r);
    };
    long r = co_await loop().run_blocking(fn);
    if (r == -EXDEV || r == -ENOSYS || r == -EOPNOTSUPP || r == -EINVAL || r == -EBADF) co_return Error(ENOTSUP);
    if (r < 0) co_return Error(static_cast<int>(-r));
    if (r == 0) {
      // Source shorter than its virtual size: the tail reads as zeroes.
      co_return co_await dst.write_zeroes(dst_offset + done, bytes - done, 0);
    }
    done += static_cast<uint64_t>(r);
  }
  co_return Status{};
}

int copy_target_fd(Node& dst, uint64_t& offset) {
  if (auto* f = dynamic_cast<FileNode*>(dst.copy_target(offset))) return f->fd();
  return -1;
}

namespace drivers {

namespace {
Result<std::shared_ptr<Node>> open_posix(OpenContext& ctx, Json& opts, bool host_device) {
  auto filename = take_string(opts, "filename");
  VBLK_TRY(filename);
  if (!*filename || filename->value().empty())
    return Error(EINVAL,
                 std::string("The '") + (host_device ? "host_device" : "file") + "' block driver requires a file name");
  std::string path = **filename;
  if (path.rfind("file:", 0) == 0) path = path.substr(5);
  // cache.* is a generic option: open_node() put it in the context.
  const bool direct = ctx.cache_direct, no_flush = ctx.cache_no_flush;
  auto aio_s = take_string(opts, "aio");
  VBLK_TRY(aio_s);
  AioMode aio = AioMode::IoUring;
  if (*aio_s) {
    const std::string& a = **aio_s;
    if (a == "threads") {
      aio = AioMode::Threads;
    } else if (a == "io_uring") {
      aio = AioMode::IoUring;
    } else if (a == "native") {
      if (!direct)
        return Error(EINVAL, "aio=native was specified, but it requires cache.direct=on, which was not specified.");
      aio = AioMode::IoUring;  // Linux AIO's job is done by io_uring here
    } else {
      return Error(EINVAL, "Parameter 'aio' does not accept value '" + a + "'");
    }
  }
  auto ro = take_bool(opts, "read-only");
  VBLK_TRY(ro);
  bool read_only = ro->value_or(ctx.read_only);
  auto locking_s = take_string(opts, "locking");
  VBLK_TRY(locking_s);
  LockingMode locking = LockingMode::Auto;
  if (*locking_s) {
    if (**locking_s == "on") {
      locking = LockingMode::On;
    } else if (**locking_s == "off") {
      locking = LockingMode::Off;
    } else if (**locking_s != "auto") {
      return Error(EINVAL, "invalid parameter value: " + **locking_s);
    }
  }

  int flags = (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC;
  int fd = ::open(path.c_str(), flags | (direct ? O_DIRECT : 0));
  if (fd < 0 && direct && errno == EINVAL) {
    int probe = ::open(path.c_str(), flags);
    if (probe >= 0) {
      ::close(probe);
      return Error(EINVAL, "Could not open '" + path + "': filesystem does not support O_DIRECT");
    }
  }
  if (fd < 0) return Error(errno, "Could not open '" + path + "': " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) < 0) {
    int e = errno;
    ::close(fd);
    return Error(e, "Could not stat '" + path + "': " + std::strerror(e));
  }
  // As in QEMU: `file` is for regular files, `host_device` for block devices.
  if (!host_device && !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Error(EINVAL, "'file' driver requires '" + path + "' to be a regular file");
  }
  if (host_device && !S_ISBLK(st.st_mode) && !S_ISCHR(st.st_mode)) {
    ::close(fd);
    return Error(EINVAL, "'host_device' driver requires '" + path + "' to be either a character or block device");
  }
  auto node = std::make_shared<FileNode>(ctx.loop, path, fd, S_ISBLK(st.st_mode), aio, locking);
  node->set_read_only(read_only);
  node->set_no_flush(no_flush);
  struct statfs fs;
  const bool tmpfs = ::fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC;
  node->set_page_copies(!direct || tmpfs);
  node->set_memory_backed(tmpfs);
  VBLK_TRY(node->probe_alignment(direct));
  VBLK_TRY(node->init_length());
  return std::shared_ptr<Node>(node);
}

}  // namespace

Result<std::shared_ptr<Node>> open_file(OpenContext& ctx, Json& opts) { return open_posix(ctx, opts, false); }
Result<std::shared_ptr<Node>> open_host_device(OpenContext& ctx, Json& opts) { return open_posix(ctx, opts, true); }

// Creates (or truncates) a file the way qemu-img create does for raw/file:
// size rounded up to 512, preallocation off|falloc|full, first block written
// so later O_DIRECT alignment probing reads real data. `exact` (QMP's
// blockdev-create) keeps the size as given, as QEMU's file driver does.
Status create_file(const std::string& path, uint64_t size, const std::string& prealloc, bool exact = false) {
  // An unknown mode fails before anything is touched; "metadata" is a valid
  // mode that raw cannot do, so (as in QEMU) the file is created first.
  if (prealloc != "off" && prealloc != "falloc" && prealloc != "full" && prealloc != "metadata")
    return Error(EINVAL, "invalid parameter value: " + prealloc);
  uint64_t rounded = exact ? size : align_up(size, 512);
  if (rounded < size) return Error(EINVAL, "Could not resize file: Invalid argument");
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Error(errno, "Could not create '" + path + "': " + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  // Nobody may be using the file we are about to truncate (QEMU's
  // raw_co_create takes write and resize, sharing all but resize, first).
  ImageLock lock(fd, path, LockingMode::Auto);
  VBLK_TRY(lock.apply(PermPair{kPermWrite | kPermResize, kPermAll & ~kPermResize}));
  if (::ftruncate(fd, 0) < 0) return Error(errno, std::string("Could not resize file: ") + std::strerror(errno));
  if (prealloc == "metadata") return Error(EINVAL, "Unsupported preallocation mode: metadata");
  auto first_block = [&] {
    // Written so that O_DIRECT alignment probing later reads real data.
    size_t n = exact ? static_cast<size_t>(std::min<uint64_t>(rounded, 4096)) : (rounded < 4096 ? 512 : 4096);
    AlignedBuffer zero(n, 4096);
    zero.zero();
    [[maybe_unused]] ssize_t w = ::pwrite(fd, zero.data(), n, 0);
  };
  if (rounded > static_cast<uint64_t>(INT64_MAX)) return Error(EINVAL, "Could not resize file: Invalid argument");
  if (prealloc == "full") {
    if (::ftruncate(fd, static_cast<off_t>(rounded)) < 0) {
      int e = errno;
      return Error(e, std::string("Could not resize file: ") + std::strerror(e));
    }
    AlignedBuffer zero(64 << 10, 4096);
    zero.zero();
    for (uint64_t pos = 0; pos < rounded;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(zero.size(), rounded - pos));
      ssize_t w = ::pwrite(fd, zero.data(), n, static_cast<off_t>(pos));
      if (w < 0) {
        if (errno == EINTR) continue;
        return Error(errno, std::string("Could not write zeros for preallocation: ") + std::strerror(errno));
      }
      pos += static_cast<uint64_t>(w);
    }
    if (::fsync(fd) < 0) return Error(errno, std::string("Could not flush file to disk: ") + std::strerror(errno));
    return {};
  }
  if (prealloc == "falloc") {
    int r = rounded ? ::posix_fallocate(fd, 0, static_cast<off_t>(rounded)) : 0;
    if (r != 0) return Error(r, std::string("Could not preallocate new data: ") + std::strerror(r));
    if (rounded) first_block();
    return {};
  }
  if (::ftruncate(fd, static_cast<off_t>(rounded)) < 0) {
    int e = errno;
    if (e == EFBIG) return Error(EFBIG, "The image size is too large for file format 'raw'");
    return Error(e, std::string("Could not resize file: ") + std::strerror(e));
  }
  if (rounded) first_block();
  return {};
}

namespace {

// file-posix's create_opts (QEMU's raw_create_opts), in its order.
const CreateOpt kFileCreateOpts[] = {
    {"size", CreateOptKind::Size, nullptr, "Virtual disk size"},
    {"nocow", CreateOptKind::Bool, nullptr, "Turn off copy-on-write (valid only on btrfs)"},
    {"preallocation", CreateOptKind::String, nullptr, "Preallocation mode (allowed values: off, falloc, full)"},
    {"extent_size_hint", CreateOptKind::Size, nullptr, "Extent size hint for the image file, 0 to disable"},
};

Task<Status> create_file_opts(Loop&, const CreateRequest& req) {
  if (req.get("extent_size_hint") && req.sizes.at("extent_size_hint") > UINT32_MAX)
    co_return Error(EINVAL, "Extent size hint is too large");
  co_return create_file(req.filename, req.size, req.get_or("preallocation", "off"));
}

// BlockdevCreateOptionsFile: the size exactly as given, as QEMU's file driver.
Result<CreateBody> blockdev_create_file(const BlockdevCreateArgs& a) {
  const Json& o = a.options;
  if (o.contains("extent-size-hint") && o["extent-size-hint"].get<uint64_t>() > UINT32_MAX)
    return Error(EINVAL, "Extent size hint is too large");
  std::string path = o["filename"].get<std::string>();
  uint64_t size = o["size"].get<uint64_t>();
  std::string prealloc = o.value("preallocation", std::string("off"));
  return CreateBody([path, size, prealloc]() -> Task<Status> { co_return create_file(path, size, prealloc, true); });
}

Status delete_file(const std::string& filename) {
  if (::unlink(filename.c_str()) != 0) return Error(errno, "Could not delete '" + filename + "'");
  return {};
}

}  // namespace

extern const DriverInfo file_driver = {.name = "file",
                                       .kind = DriverKind::Protocol,
                                       .open = open_file,
                                       .create_opts = kFileCreateOpts,
                                       .create = create_file_opts,
                                       .blockdev_create = blockdev_create_file,
                                       .remove = delete_file};
extern const DriverInfo host_device_driver = {
    .name = "host_device", .kind = DriverKind::Protocol, .open = open_host_device};

}  // namespace drivers
}  // namespace vblk
