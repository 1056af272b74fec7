#include "image_check.h"

#include <sys/wait.h>

#include <cstdio>

namespace vblk::power {

int run_cmd(const std::vector<std::string>& argv, std::string* out) {
  std::string cmd;
  for (const auto& a : argv) cmd += "'" + a + "' ";
  cmd += "2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  int st = ::pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

bool write_file(const std::string& path, const std::vector<uint8_t>& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  bool ok = std::fwrite(data.data(), 1, data.size(), f) == data.size();
  return std::fclose(f) == 0 && ok;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::vector<uint8_t> v;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return v;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + n);
  std::fclose(f);
  return v;
}

namespace {

// qcow2 v3's incompatible "dirty" bit (lazy refcounts in use).
bool dirty_bit(const std::vector<uint8_t>& img) {
  if (img.size() < 80 || img[7] < 3) return false;
  return img[79] & 1;
}

// Every error qemu-img check reports is an OFLAG_COPIED flag missing on an
// entry whose refcount is 1 (with refcount 1 the message can only mean a
// missing flag; a flag set on a shared cluster shows refcount > 1).
bool only_copied_behind(const std::string& out) {
  size_t pos = 0, errors = 0;
  while ((pos = out.find("ERROR", pos)) != std::string::npos) {
    const size_t eol = out.find('\n', pos);
    const std::string line = out.substr(pos, eol == std::string::npos ? std::string::npos : eol - pos);
    if (line.rfind("ERROR OFLAG_COPIED", 0) != 0 || line.size() < 11 ||
        line.compare(line.size() - 11, 11, " refcount=1") != 0)
      return false;
    ++errors;
    pos += 5;
  }
  return errors > 0;
}

}  // namespace

std::string check_qcow2(const std::string& qemu_img, const std::string& path, const std::vector<uint8_t>& img,
                        CheckStats& stats) {
  std::string out;
  // 0: clean; 3: leaked clusters only.
  int rc = run_cmd({qemu_img, "check", "-f", "qcow2", path}, &out);
  const bool dirty = rc == 2 && dirty_bit(img);
  const bool copied = rc == 2 && !dirty && only_copied_behind(out);
  if (dirty || copied) {
    ++(dirty ? stats.dirty : stats.copied_behind);
    out.clear();
    rc = run_cmd({qemu_img, "check", "-r", "all", "-f", "qcow2", path}, &out);
    if (rc == 0) rc = run_cmd({qemu_img, "check", "-f", "qcow2", path}, &out);
  }
  if (rc != 0 && rc != 3) return "qemu-img check " + path + " rc " + std::to_string(rc) + ": " + out;
  return {};
}

}  // namespace vblk::power
