// A unix socket path in a private temporary directory, for the fuzz targets
// whose code under test only connects by address (the NBD client) or only
// accepts on a listener (the QMP monitor). The directory goes when the
// process ends normally; a crashed run leaves an empty /tmp/vblk-fuzz-*.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <string>

namespace vblk::fuzz {

class TempSocketPath {
 public:
  TempSocketPath() {
    char dir[] = "/tmp/vblk-fuzz-XXXXXX";
    if (::mkdtemp(dir)) dir_ = dir;
  }
  ~TempSocketPath() {
    if (dir_.empty()) return;
    ::unlink(path().c_str());
    ::rmdir(dir_.c_str());
  }
  TempSocketPath(const TempSocketPath&) = delete;
  TempSocketPath& operator=(const TempSocketPath&) = delete;
  bool ok() const { return !dir_.empty(); }
  std::string path() const { return dir_ + "/s"; }

 private:
  std::string dir_;
};

}  // namespace vblk::fuzz
