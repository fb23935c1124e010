// Thin wrapper over the CUDA runtime and cuBLAS (compiled by nvcc; plain C++17 header so
// that nothing of the rest of pipeplan passes through nvcc). Errors are returned as text
// ("" = success); nothing here exits or prints.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace pipeplan::cudadev {

std::string DeviceCount(int* n);  // fails with CUDA's message where there is no GPU
std::string DeviceName(std::string* name);

// Device memory and one stream + cuBLAS handle per rank, on the current device.
class Pool {
 public:
  static std::string Create(int ranks, size_t gemm_dim, size_t payload_bytes,
                            std::unique_ptr<Pool>* out);
  ~Pool();
  // `count` bf16 GEMMs of n x n x n (fp32 accumulate) on the rank's stream, then sync.
  std::string Gemm(int rank, size_t n, int count);
  // The same without the sync, and a memory-bound pass writing `bytes` (in chunks of the
  // payload buffer): for callers that time with events on stream(rank).
  std::string EnqueueGemm(int rank, size_t n, int count);
  std::string EnqueueWrite(int rank, size_t bytes);
  void* stream(int rank) const;  // the rank's cudaStream_t
  // Runs one GEMM of each size and a memory pass on rank 0's stream, then syncs: cuBLAS
  // and CUDA load kernels on first use, which must not land inside a timed op (nor while
  // NCCL kernels spin waiting for peers).
  std::string Warmup(const std::vector<size_t>& dims);
  // Copies `bytes` of src's payload buffer into dst's on dst's stream, then sync.
  std::string Copy(int dst, int src, size_t bytes);
  // Touches `bytes` of the rank's payload buffer (a collective's local traffic), then sync.
  std::string Touch(int rank, size_t bytes);
  // Copies `bytes` between the rank's payload buffer and pinned host memory (chunks of the
  // payload buffer's size; their contents are not used), device to host or back, on
  // `stream` (a cudaStream_t; nullptr: the rank's stream). HostCopy also syncs.
  std::string EnqueueHostCopy(int rank, size_t bytes, bool to_host, void* stream);
  // Allocates the pinned host buffers now (outside timed ops; cudaMallocHost may sync).
  std::string PinHost();
  std::string HostCopy(int rank, size_t bytes, bool to_host);
  size_t payload_bytes() const { return payload_bytes_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  size_t payload_bytes_ = 0;
};

}  // namespace pipeplan::cudadev
