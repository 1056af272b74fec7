// Result<T>: the value-or-error type every fallible vblk operation returns.
//
// An Error is a positive errno code plus an optional human message. The data
// path creates errors with a code only (cheap: no allocation); the control path
// adds context on the way up with Error::prefixed(), the way qemu-img says
// "Could not open 'x': No such file or directory".
//
// Thread-safety: plain values; no shared state.
#pragma once

#include <cassert>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <variant>

namespace vblk {

struct Error {
  int code = EIO;       // positive errno value
  std::string message;  // empty: strerror(code) is the whole message
  // QEMU's error_append_hint: a second line the command-line tools print
  // ("Is another process using the image [x]?"); QMP replies leave it out.
  std::string hint;

  Error() = default;
  explicit Error(int c, std::string msg = {}) : code(c), message(std::move(msg)) {}

  // The message a user sees: the context if any, otherwise strerror(code).
  std::string what() const { return message.empty() ? std::string(std::strerror(code)) : message; }

  // "context: <what()>" — adds one level of context on the way up.
  Error prefixed(const std::string& context) const {
    Error e(code, context + ": " + what());
    e.hint = hint;
    return e;
  }
};

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}
  Result(Error error) : v_(std::in_place_index<1>, std::move(error)) {}

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }

  T& value() & {
    assert(ok());
    return std::get<0>(v_);
  }
  const T& value() const& {
    assert(ok());
    return std::get<0>(v_);
  }
  T&& value() && {
    assert(ok());
    return std::get<0>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  const Error& error() const {
    assert(!ok());
    return std::get<1>(v_);
  }
  Error&& take_error() {
    assert(!ok());
    return std::get<1>(std::move(v_));
  }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : err_(std::move(error)), failed_(true) {}

  bool ok() const { return !failed_; }
  explicit operator bool() const { return ok(); }
  const Error& error() const {
    assert(failed_);
    return err_;
  }
  Error&& take_error() {
    assert(failed_);
    return std::move(err_);
  }

 private:
  Error err_;
  bool failed_ = false;
};

using Status = Result<void>;

// Turns a syscall-style return (negative errno on failure) into a Status.
inline Status status_from_ret(long ret) {
  if (ret < 0) return Error(static_cast<int>(-ret));
  return {};
}

}  // namespace vblk

// Propagates a failed Result out of a coroutine returning Task<Result<...>>.
#define VBLK_CO_TRY(expr)                                      \
  do {                                                         \
    auto&& vblk_try_r_ = (expr);                               \
    if (!vblk_try_r_.ok()) co_return vblk_try_r_.take_error(); \
  } while (0)

// Same for plain functions.
#define VBLK_TRY(expr)                                      \
  do {                                                      \
    auto&& vblk_try_r_ = (expr);                            \
    if (!vblk_try_r_.ok()) return vblk_try_r_.take_error(); \
  } while (0)
