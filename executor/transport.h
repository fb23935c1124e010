// Transports move tensors between ranks for the runner: point-to-point by tag (sends are
// eager, receives block) and sum-collectives over a group. Every blocking call has a
// timeout; Abort() wakes every waiter with an error (a failed rank must not hang the job).
#pragma once

#include <condition_variable>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace pipeplan {

using Tensor = std::vector<double>;

class Transport {
 public:
  virtual ~Transport() = default;
  // `peer`: the other rank; tags are unique per pair in a plan.
  virtual Status Send(int32_t peer, uint32_t tag, Tensor data) = 0;
  virtual Status Recv(int32_t peer, uint32_t tag, double timeout_s, Tensor* out) = 0;
  // Element-wise sum over the `members` of `group`; every member passes the same length.
  virtual Status AllReduce(int32_t group, uint32_t tag, size_t members, double timeout_s,
                           Tensor* data) = 0;
  virtual void Abort(const std::string& why) = 0;
};

// All ranks as threads of one process.
class InProcessTransport : public Transport {
 public:
  Status Send(int32_t peer, uint32_t tag, Tensor data) override;
  Status Recv(int32_t peer, uint32_t tag, double timeout_s, Tensor* out) override;
  Status AllReduce(int32_t group, uint32_t tag, size_t members, double timeout_s,
                   Tensor* data) override;
  void Abort(const std::string& why) override;

 private:
  struct Reduction {
    Tensor sum;
    size_t arrived = 0, left = 0;
    bool done = false;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint32_t, Tensor> mailbox_;
  std::map<std::pair<int32_t, uint32_t>, Reduction> reductions_;
  std::string aborted_;
};

}  // namespace pipeplan
