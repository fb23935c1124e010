#include "executor/transport.h"

#include <fmt/format.h>

#include <chrono>

#include "executor/deadline.h"
namespace pipeplan {
Status InProcessTransport::Send(int32_t, uint32_t tag, Tensor data) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_.empty()) return Internal(aborted_);
  if (!mailbox_.emplace(tag, std::move(data)).second)
    return Internal(fmt::format("tag {} sent twice", tag));
  cv_.notify_all();
  return Status::Ok();
}

Status InProcessTransport::Recv(int32_t, uint32_t tag, double timeout_s, Tensor* out) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] { return !aborted_.empty() || mailbox_.count(tag); };
  if (!cv_.wait_until(lock, Deadline(timeout_s), ready))
    return Internal(fmt::format("timed out after {} s: the matching SEND never came", timeout_s));
  if (!aborted_.empty()) return Internal(aborted_);
  auto it = mailbox_.find(tag);
  *out = std::move(it->second);
  mailbox_.erase(it);
  return Status::Ok();
}

Status InProcessTransport::AllReduce(int32_t group, uint32_t tag, size_t members, double timeout_s,
                                     Tensor* data) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!aborted_.empty()) return Internal(aborted_);
  Reduction& r = reductions_[{group, tag}];
  if (r.arrived == 0) r.sum.assign(data->size(), 0.0), r.left = members;
  if (r.sum.size() != data->size())
    return Internal(fmt::format("collective @g{} tag {}: sizes differ", group, tag));
  for (size_t i = 0; i < data->size(); ++i) r.sum[i] += (*data)[i];
  if (++r.arrived == members) r.done = true, cv_.notify_all();
  if (!cv_.wait_until(lock, Deadline(timeout_s), [&] { return !aborted_.empty() || r.done; }))
    return Internal(fmt::format("timed out after {} s: {} of {} group members arrived", timeout_s,
                                r.arrived, members));
  if (!aborted_.empty()) return Internal(aborted_);
  *data = r.sum;
  if (--r.left == 0) reductions_.erase({group, tag});
  return Status::Ok();
}

void InProcessTransport::Abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.empty()) aborted_ = why;
  cv_.notify_all();
}

}  // namespace pipeplan
