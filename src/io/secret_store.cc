// Secret objects: see secret_store.h.
#include "vblk/secret_store.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <string.h>
#include <unistd.h>

#include <cstring>
#include <memory>

#include "vblk/base64.h"

namespace vblk {

namespace {

void wipe(std::string& s) {
  explicit_bzero(s.data(), s.size());
  s.clear();
}

// glib's g_file_get_contents, with its error texts (QEMU prints them).
Result<std::string> read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return Error(e, "Failed to open file \u201c" + path + "\u201d: " + std::strerror(e));
  }
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      wipe(out);
      return Error(e, "Error reading file \u201c" + path + "\u201d: " + std::strerror(e));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  explicit_bzero(buf, sizeof buf);
  ::close(fd);
  return out;
}

// AES-256-CBC without padding, then QEMU's own padding check.
Result<std::string> decrypt(const std::string& key, const std::string& iv, const std::string& in) {
  if (in.size() % 16) {
    return Error(EINVAL, "Length " + std::to_string(in.size()) + " must be a multiple of block size 16");
  }
  std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)> ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  std::string out(in.size(), '\0');
  int len = 0;
  if (!ctx ||
      !EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_cbc(), nullptr, reinterpret_cast<const unsigned char*>(key.data()),
                          reinterpret_cast<const unsigned char*>(iv.data())) ||
      !EVP_CIPHER_CTX_set_padding(ctx.get(), 0) ||
      !EVP_DecryptUpdate(ctx.get(), reinterpret_cast<unsigned char*>(out.data()), &len,
                         reinterpret_cast<const unsigned char*>(in.data()), static_cast<int>(in.size()))) {
    wipe(out);
    return Error(EINVAL, "Cannot decrypt data");
  }
  uint8_t pad = out.empty() ? 0 : static_cast<uint8_t>(out.back());
  if (out.empty() || pad > 16 || pad > out.size()) {
    wipe(out);
    return Error(EINVAL, "Incorrect number of padding bytes (" + std::to_string(pad) + ") found on decrypted data");
  }
  explicit_bzero(out.data() + out.size() - pad, pad);
  out.resize(out.size() - pad);
  return out;
}

}  // namespace

SecretStore& SecretStore::process() {
  static SecretStore store;
  return store;
}

SecretStore::~SecretStore() {
  for (auto& [id, v] : objects_)
    if (v) wipe(*v);
}

Result<std::string> SecretStore::load(const SecretSpec& spec) const {
  std::string input;
  if (spec.file) {
    if (spec.data) return Error(EINVAL, "'file' and 'data' are mutually exclusive");
    auto f = read_file(*spec.file);
    if (!f) return Error(f.error().code, "Unable to read " + *spec.file + ": " + f.error().what());
    input = std::move(*f);
  } else if (spec.data) {
    input = *spec.data;
  } else {
    return Error(EINVAL, "Either 'file' or 'data' must be provided");
  }
  if (spec.format == SecretFormat::kBase64) {
    auto d = base64_decode(input);
    wipe(input);
    if (!d) return d.error();
    input = std::move(*d);
  }
  if (!spec.keyid) return input;
  // An encrypted secret: the key is another secret, the IV is base64.
  auto key = lookup(*spec.keyid);
  if (!key) {
    wipe(input);
    return key.error();
  }
  Result<std::string> out = Error(EINVAL);
  if (key->size() != 32) {
    out = Error(EINVAL, "Key should be 32 bytes in length");
  } else if (!spec.iv) {
    out = Error(EINVAL, "IV is required to decrypt secret");
  } else if (auto iv = base64_decode(*spec.iv); !iv) {
    out = iv.error();
  } else if (iv->size() != 16) {
    out = Error(EINVAL, "IV should be 16 bytes in length not " + std::to_string(iv->size()));
  } else {
    out = decrypt(*key, *iv, input);
  }
  wipe(*key);
  wipe(input);
  return out;
}

Status SecretStore::add(const std::string& id, const SecretSpec& spec) {
  if (contains(id)) return Error(EEXIST, "attempt to add duplicate property '" + id + "' to object (type 'container')");
  // Loaded without the lock: a keyid lookup takes it.
  auto v = load(spec);
  if (!v) return v.error();
  std::lock_guard g(mu_);
  objects_[id] = std::move(*v);
  return {};
}

Status SecretStore::add_other(const std::string& id) {
  std::lock_guard g(mu_);
  if (objects_.count(id))
    return Error(EEXIST, "attempt to add duplicate property '" + id + "' to object (type 'container')");
  objects_[id] = std::nullopt;
  return {};
}

bool SecretStore::contains(const std::string& id) const {
  std::lock_guard g(mu_);
  return objects_.count(id) != 0;
}

bool SecretStore::is_secret(const std::string& id) const {
  std::lock_guard g(mu_);
  auto it = objects_.find(id);
  return it != objects_.end() && it->second.has_value();
}

bool SecretStore::remove(const std::string& id) {
  std::lock_guard g(mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return false;
  if (it->second) wipe(*it->second);
  objects_.erase(it);
  return true;
}

Result<std::string> SecretStore::lookup(const std::string& id) const {
  std::lock_guard g(mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return Error(EINVAL, "No secret with id '" + id + "'");
  if (!it->second) return Error(EINVAL, "Object with id '" + id + "' is not a secret");
  return *it->second;
}

Result<std::string> SecretStore::lookup_base64(const std::string& id) const {
  auto raw = lookup(id);
  if (!raw) return raw.error();
  std::string b = base64_encode(*raw);
  wipe(*raw);
  return b;
}

}  // namespace vblk
