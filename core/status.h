// Status and StatusOr: library code returns these; only apps/ turns them into messages
// and exit codes.
#pragma once

#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

namespace pipeplan {

// Error classes map to the CLI's exit codes (see apps/main.cc).
enum class ErrorCode {
  kOk = 0,
  kInternal = 1,      // I/O failure or anything else; exit 1
  kInvalidInput = 2,  // bad config, bad option, unreadable input file; exit 2
  kInvalidPlan = 3,   // a plan that fails validation or deadlocks; exit 3
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

inline Status InvalidInput(std::string m) {
  return {ErrorCode::kInvalidInput, std::move(m)};
}
inline Status InvalidPlan(std::string m) {
  return {ErrorCode::kInvalidPlan, std::move(m)};
}
inline Status Internal(std::string m) {
  return {ErrorCode::kInternal, std::move(m)};
}

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status s) : status_(std::move(s)) { assert(!status_.ok()); }
  StatusOr(T value) : value_(std::move(value)) {}

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // The value of an error is a bug in the caller: it stops here, naming the error, instead
  // of reading an empty optional.
  T& value() & { return Get(); }
  const T& value() const& { return const_cast<StatusOr*>(this)->Get(); }
  T&& value() && { return std::move(Get()); }
  T* operator->() { return &Get(); }
  const T* operator->() const { return &const_cast<StatusOr*>(this)->Get(); }
  T& operator*() { return Get(); }
  const T& operator*() const { return const_cast<StatusOr*>(this)->Get(); }

 private:
  T& Get() {
    if (!value_) {
      std::fprintf(stderr, "pipeplan: internal error: the value of a failed result: %s\n",
                   status_.message().c_str());
      std::abort();
    }
    return *value_;
  }

  Status status_;
  std::optional<T> value_;
};

#define PP_CONCAT_INNER(a, b) a##b
#define PP_CONCAT(a, b) PP_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)        \
  do {                               \
    ::pipeplan::Status _st = (expr); \
    if (!_st.ok()) return _st;       \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) ASSIGN_OR_RETURN_IMPL(PP_CONCAT(_sor_, __LINE__), lhs, expr)

}  // namespace pipeplan
