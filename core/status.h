// Status and StatusOr: library code returns these; only apps/ turns them into messages
// and exit codes.
#pragma once

#include <cassert>
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
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
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
