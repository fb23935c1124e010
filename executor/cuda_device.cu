#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "executor/cuda_device.h"

namespace pipeplan::cudadev {
namespace {

std::string Err(cudaError_t e, const char* what) {
  return e == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(e);
}
std::string Err(cublasStatus_t e, const char* what) {
  return e == CUBLAS_STATUS_SUCCESS
             ? std::string()
             : std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(e));
}

}  // namespace

struct Pool::Impl {
  size_t dim = 0;
  void* a = nullptr;
  void* b = nullptr;
  std::vector<void*> c, payload;
  std::vector<cudaStream_t> streams;
  std::vector<cublasHandle_t> handles;
  void* host[2] = {nullptr, nullptr};  // pinned, per direction (to host, from host)
  ~Impl() {
    for (void* h : host) cudaFreeHost(h);
    for (auto h : handles) cublasDestroy(h);
    for (auto s : streams) cudaStreamDestroy(s);
    for (void* p : c) cudaFree(p);
    for (void* p : payload) cudaFree(p);
    cudaFree(a), cudaFree(b);
  }
};

std::string DeviceCount(int* n) {
  *n = 0;
  cudaError_t e = cudaGetDeviceCount(n);
  if (e != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(e);
  if (*n == 0) return "no CUDA device";
  return "";
}

std::string DeviceName(std::string* name) {
  int n = 0;
  if (std::string e = DeviceCount(&n); !e.empty()) return e;
  cudaDeviceProp p;
  if (std::string e = Err(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties"); !e.empty())
    return e;
  *name = p.name;
  return "";
}

std::string Pool::Create(int ranks, size_t gemm_dim, size_t payload_bytes,
                         std::unique_ptr<Pool>* out) {
  int n = 0;
  if (std::string e = DeviceCount(&n); !e.empty()) return e;
  auto pool = std::unique_ptr<Pool>(new Pool());
  pool->impl_ = std::make_unique<Impl>();
  Impl& m = *pool->impl_;
  m.dim = std::max<size_t>(gemm_dim, 64);
  pool->payload_bytes_ = std::max<size_t>(payload_bytes, 1);
  const size_t bytes = m.dim * m.dim * sizeof(__nv_bfloat16);
  std::string e;
  if (!(e = Err(cudaMalloc(&m.a, bytes), "cudaMalloc")).empty()) return e;
  if (!(e = Err(cudaMalloc(&m.b, bytes), "cudaMalloc")).empty()) return e;
  if (!(e = Err(cudaMemset(m.a, 0, bytes), "cudaMemset")).empty()) return e;
  if (!(e = Err(cudaMemset(m.b, 0, bytes), "cudaMemset")).empty()) return e;
  for (int r = 0; r < ranks; ++r) {
    void *c = nullptr, *p = nullptr;
    cudaStream_t s;
    cublasHandle_t h;
    if (!(e = Err(cudaMalloc(&c, bytes), "cudaMalloc")).empty()) return e;
    m.c.push_back(c);
    if (!(e = Err(cudaMalloc(&p, pool->payload_bytes_), "cudaMalloc")).empty()) return e;
    m.payload.push_back(p);
    if (!(e = Err(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"))
             .empty())
      return e;
    m.streams.push_back(s);
    if (!(e = Err(cublasCreate(&h), "cublasCreate")).empty()) return e;
    m.handles.push_back(h);
    if (!(e = Err(cublasSetStream(h, s), "cublasSetStream")).empty()) return e;
  }
  *out = std::move(pool);
  return "";
}

Pool::~Pool() = default;

std::string Pool::Gemm(int rank, size_t n, int count) {
  if (std::string e = EnqueueGemm(rank, n, count); !e.empty()) return e;
  return Err(cudaStreamSynchronize(impl_->streams[rank]), "compute");
}

std::string Pool::EnqueueWrite(int rank, size_t bytes) {
  Impl& m = *impl_;
  for (size_t done = 0; done < bytes; done += payload_bytes_)
    if (std::string e =
            Err(cudaMemsetAsync(m.payload[rank], 0, std::min(payload_bytes_, bytes - done),
                                m.streams[rank]),
                "cudaMemsetAsync");
        !e.empty())
      return e;
  return "";
}

std::string Pool::Warmup(const std::vector<size_t>& dims) {
  for (size_t n : dims)
    if (std::string e = EnqueueGemm(0, n, 1); !e.empty()) return e;
  if (std::string e = EnqueueWrite(0, 1); !e.empty()) return e;
  return Err(cudaStreamSynchronize(impl_->streams[0]), "warm-up");
}

void* Pool::stream(int rank) const {
  return impl_->streams[rank];
}

std::string Pool::EnqueueGemm(int rank, size_t n, int count) {
  Impl& m = *impl_;
  n = std::min(n, m.dim);
  const float alpha = 1, beta = 0;
  for (int i = 0; i < count && n > 0; ++i)
    if (std::string e = Err(cublasGemmEx(m.handles[rank], CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha,
                                         m.a, CUDA_R_16BF, n, m.b, CUDA_R_16BF, n, &beta, m.c[rank],
                                         CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                            "cublasGemmEx");
        !e.empty())
      return e;
  return "";
}

std::string Pool::Copy(int dst, int src, size_t bytes) {
  Impl& m = *impl_;
  bytes = std::min(bytes, payload_bytes_);
  if (std::string e = Err(cudaMemcpyAsync(m.payload[dst], m.payload[src], bytes,
                                          cudaMemcpyDeviceToDevice, m.streams[dst]),
                          "cudaMemcpyAsync");
      !e.empty())
    return e;
  return Err(cudaStreamSynchronize(m.streams[dst]), "p2p");
}

std::string Pool::EnqueueHostCopy(int rank, size_t bytes, bool to_host, void* stream) {
  Impl& m = *impl_;
  void*& host = m.host[to_host ? 0 : 1];
  if (host == nullptr)
    if (std::string e = Err(cudaMallocHost(&host, payload_bytes_), "cudaMallocHost"); !e.empty())
      return e;
  cudaStream_t s = stream ? static_cast<cudaStream_t>(stream) : m.streams[rank];
  for (size_t done = 0; done < bytes; done += payload_bytes_) {
    const size_t n = std::min(payload_bytes_, bytes - done);
    const cudaError_t c =
        to_host ? cudaMemcpyAsync(host, m.payload[rank], n, cudaMemcpyDeviceToHost, s)
                : cudaMemcpyAsync(m.payload[rank], host, n, cudaMemcpyHostToDevice, s);
    if (std::string e = Err(c, "cudaMemcpyAsync"); !e.empty()) return e;
  }
  return "";
}

std::string Pool::PinHost() {
  for (void*& host : impl_->host)
    if (host == nullptr)
      if (std::string e = Err(cudaMallocHost(&host, payload_bytes_), "cudaMallocHost"); !e.empty())
        return e;
  return "";
}

std::string Pool::HostCopy(int rank, size_t bytes, bool to_host) {
  if (std::string e = EnqueueHostCopy(rank, bytes, to_host, nullptr); !e.empty()) return e;
  return Err(cudaStreamSynchronize(impl_->streams[rank]), "host copy");
}

std::string Pool::Touch(int rank, size_t bytes) {
  Impl& m = *impl_;
  bytes = std::min(bytes, payload_bytes_);
  if (std::string e =
          Err(cudaMemsetAsync(m.payload[rank], 0, bytes, m.streams[rank]), "cudaMemsetAsync");
      !e.empty())
    return e;
  return Err(cudaStreamSynchronize(m.streams[rank]), "collective");
}

}  // namespace pipeplan::cudadev
