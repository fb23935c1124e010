#include "executor/cuda_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "executor/cuda_device.h"

namespace pipeplan {
namespace {

Status Check(const std::string& e) {
  return e.empty() ? Status::Ok() : Internal(e);
}

class CudaBackend : public Backend {
 public:
  CudaBackend(const Table& t, int32_t rank, std::shared_ptr<cudadev::Pool> pool)
      : t_(t), rank_(rank), pool_(pool) {}
  Status Compute(OpId op) override {
    const Work& w = t_.work(op);
    const auto bytes = static_cast<size_t>(w.payload_bytes);
    const bool out = t_.kind(op) == OpKind::kOffload;
    if (IsCopy(t_.kind(op)) && t_.peer(op) >= 0)  // to the holder rank's memory and back
      return Check(out ? pool_->Copy(t_.peer(op), rank_, bytes)
                       : pool_->Copy(rank_, t_.peer(op), bytes));
    if (IsCopy(t_.kind(op)))  // saved activations to pinned host memory and back
      return Check(pool_->HostCopy(rank_, bytes, out));
    return Check(pool_->Gemm(rank_, GemmDim(w, t_.ranks()[rank_].gpus),
                             std::max(1, w.layer_end - w.layer_begin)));
  }
  // The payload stays on the device: a SEND passes its rank, the RECV copies from it.
  StatusOr<Tensor> Outgoing(OpId) override { return Tensor{static_cast<double>(rank_)}; }
  Status Incoming(OpId op, Tensor from) override {
    if (from.size() != 1) return Internal("a SEND from another backend");
    return Check(pool_->Copy(rank_, static_cast<int>(from[0]),
                             static_cast<size_t>(t_.work(op).payload_bytes)));
  }
  StatusOr<Tensor> Contribution(OpId) override { return Tensor{0.0}; }
  Status Reduced(OpId op, Tensor) override {
    return Check(pool_->Touch(rank_, static_cast<size_t>(t_.work(op).payload_bytes)));
  }

 private:
  const Table& t_;
  int32_t rank_;
  std::shared_ptr<cudadev::Pool> pool_;
};

}  // namespace

size_t GemmDim(const Work& w, int gpus) {
  const int layers = std::max(1, w.layer_end - w.layer_begin);
  const double per_layer = w.flops / std::max(gpus, 1) / layers;
  if (per_layer <= 0) return 0;
  return std::max<size_t>(64, static_cast<size_t>(std::cbrt(per_layer / 2) / 64 + 0.5) * 64);
}

StatusOr<int> CudaDeviceCount() {
  int n = 0;
  RETURN_IF_ERROR(Check(cudadev::DeviceCount(&n)));
  return n;
}

StatusOr<std::string> CudaDeviceName() {
  std::string name;
  RETURN_IF_ERROR(Check(cudadev::DeviceName(&name)));
  return name;
}

StatusOr<std::vector<std::unique_ptr<Backend>>> MakeCudaBackends(const Table& t) {
  size_t dim = 0, payload = 0;
  std::set<size_t> dims;
  for (OpId i = 0; i < t.size(); ++i) {
    if (size_t n = GemmDim(t.work(i), t.ranks()[t.rank(i)].gpus); n > 0)
      dims.insert(n), dim = std::max(dim, n);
    payload = std::max(payload, static_cast<size_t>(t.work(i).payload_bytes));
  }
  std::unique_ptr<cudadev::Pool> pool;
  RETURN_IF_ERROR(Check(cudadev::Pool::Create(t.num_ranks(), dim,
                                              std::min<size_t>(payload, size_t{1} << 30), &pool)));
  RETURN_IF_ERROR(Check(pool->Warmup({dims.begin(), dims.end()})));
  for (OpId i = 0; i < t.size(); ++i)
    if (IsCopy(t.kind(i)) && t.peer(i) < 0) {  // host copies: pinned memory before the clock
      RETURN_IF_ERROR(Check(pool->PinHost()));
      break;
    }
  std::shared_ptr<cudadev::Pool> shared = std::move(pool);
  std::vector<std::unique_ptr<Backend>> out;
  for (int32_t r = 0; r < t.num_ranks(); ++r)
    out.push_back(std::make_unique<CudaBackend>(t, r, shared));
  return out;
}

}  // namespace pipeplan
