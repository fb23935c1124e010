#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "gpu_terms_device.h"

namespace pipeplan::gpu_terms {
namespace {

bool Fail(cudaError_t e, const char* what, std::string* error) {
  if (e == cudaSuccess) return false;
  *error = std::string(what) + ": " + cudaGetErrorString(e);
  return true;
}
bool Fail(cublasStatus_t s, const char* what, std::string* error) {
  if (s == CUBLAS_STATUS_SUCCESS) return false;
  *error = std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(s));
  return true;
}

// One block per score row: scale, causal mask (columns after the row), softmax, in place.
__global__ void ScaleMaskSoftmax(__nv_bfloat16* scores, int seq, float scale) {
  const long row = blockIdx.x;
  const int q = static_cast<int>(row % seq);
  __nv_bfloat16* x = scores + row * seq;
  __shared__ float red[32];
  float mx = -1e30f;
  for (int j = threadIdx.x; j <= q; j += blockDim.x) mx = fmaxf(mx, __bfloat162float(x[j]) * scale);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < blockDim.x / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float sum = 0;
  for (int j = threadIdx.x; j <= q; j += blockDim.x)
    sum += __expf(__bfloat162float(x[j]) * scale - mx);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sum;
  __syncthreads();
  sum = 0;
  for (int w = 0; w < blockDim.x / 32; ++w) sum += red[w];
  for (int j = threadIdx.x; j < seq; j += blockDim.x)
    x[j] = __float2bfloat16(j <= q ? __expf(__bfloat162float(x[j]) * scale - mx) / sum : 0.f);
}

__global__ void SumInto(const float* a, const float* b, float* out, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

template <typename F>
double Median(int reps, cudaStream_t s, F&& body, std::string* error) {
  cudaEvent_t a, b;
  if (Fail(cudaEventCreate(&a), "cudaEventCreate", error) ||
      Fail(cudaEventCreate(&b), "cudaEventCreate", error))
    return 0;
  std::vector<float> ms;
  for (int r = 0; r <= reps; ++r) {  // the first run warms up
    cudaEventRecord(a, s);
    if (!body()) return 0;
    cudaEventRecord(b, s);
    if (Fail(cudaEventSynchronize(b), "kernel", error)) return 0;
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    if (r > 0) ms.push_back(t);
  }
  cudaEventDestroy(a), cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] / 1e3;
}

}  // namespace

Device Open() {
  Device d;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    d.error = "no CUDA GPU";
    return d;
  }
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  d.name = p.name;
  return d;
}

double UnfusedAttentionSeconds(int heads, int seq, int head_dim, int reps, std::string* error) {
  const size_t qkv = static_cast<size_t>(heads) * seq * head_dim;
  const size_t sc = static_cast<size_t>(heads) * seq * seq;
  __nv_bfloat16 *q, *k, *v, *s, *o;
  if (Fail(cudaMalloc(&q, qkv * 2), "cudaMalloc", error) ||
      Fail(cudaMalloc(&k, qkv * 2), "cudaMalloc", error) ||
      Fail(cudaMalloc(&v, qkv * 2), "cudaMalloc", error) ||
      Fail(cudaMalloc(&o, qkv * 2), "cudaMalloc", error) ||
      Fail(cudaMalloc(&s, sc * 2), "cudaMalloc (scores)", error))
    return 0;
  cudaMemset(q, 0, qkv * 2), cudaMemset(k, 0, qkv * 2), cudaMemset(v, 0, qkv * 2);
  cublasHandle_t h;
  if (Fail(cublasCreate(&h), "cublasCreate", error)) return 0;
  const float one = 1, zero = 0;
  const long long sd = static_cast<long long>(seq) * head_dim,
                  ss = static_cast<long long>(seq) * seq;
  auto body = [&] {
    // Column-major: S^T (seq x seq) = K (seq x d as d x seq, transposed) ... per head.
    if (Fail(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, seq, seq, head_dim, &one, k,
                                        CUDA_R_16BF, head_dim, sd, q, CUDA_R_16BF, head_dim, sd,
                                        &zero, s, CUDA_R_16BF, seq, ss, heads, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT),
             "QK^T", error))
      return false;
    ScaleMaskSoftmax<<<static_cast<unsigned>(static_cast<long>(heads) * seq), 256>>>(
        s, seq, 1.0f / sqrtf(static_cast<float>(head_dim)));
    return !Fail(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, head_dim, seq, seq, &one,
                                            v, CUDA_R_16BF, head_dim, sd, s, CUDA_R_16BF, seq, ss,
                                            &zero, o, CUDA_R_16BF, head_dim, sd, heads,
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "PV", error);
  };
  const double t = Median(reps, 0, body, error);
  cublasDestroy(h);
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(s), cudaFree(o);
  return t;
}

Overlap OverlapSeconds(int n, int gemms, double bytes, int reps, std::string* error) {
  Overlap r;
  const size_t nn = static_cast<size_t>(n) * n, floats = static_cast<size_t>(bytes / 4);
  __nv_bfloat16 *a, *b, *c;
  float *x, *y, *z;
  if (Fail(cudaMalloc(&a, nn * 2), "cudaMalloc", error) ||
      Fail(cudaMalloc(&b, nn * 2), "cudaMalloc", error) ||
      Fail(cudaMalloc(&c, nn * 2), "cudaMalloc", error) ||
      Fail(cudaMalloc(&x, floats * 4), "cudaMalloc", error) ||
      Fail(cudaMalloc(&y, floats * 4), "cudaMalloc", error) ||
      Fail(cudaMalloc(&z, floats * 4), "cudaMalloc", error))
    return r;
  cudaMemset(a, 0, nn * 2), cudaMemset(b, 0, nn * 2), cudaMemset(x, 0, floats * 4),
      cudaMemset(y, 0, floats * 4);
  cudaStream_t compute, comm;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking);
  cublasHandle_t h;
  if (Fail(cublasCreate(&h), "cublasCreate", error)) return r;
  cublasSetStream(h, compute);
  const float one = 1, zero = 0;
  auto gemm = [&] {
    for (int g = 0; g < gemms; ++g)
      if (Fail(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b,
                            CUDA_R_16BF, n, &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "GEMM", error))
        return false;
    return true;
  };
  auto reduce = [&](cudaStream_t s) {
    SumInto<<<1024, 256, 0, s>>>(x, y, z, floats);
    return !Fail(cudaGetLastError(), "reduction kernel", error);
  };
  r.gemm_s = Median(reps, compute, gemm, error);
  r.reduce_s = Median(
      reps, comm, [&] { return reduce(comm); }, error);
  // Both: the reduction on its own stream, joined back before the stop event.
  cudaEvent_t fork, join;
  cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
  r.both_s = Median(
      reps, compute,
      [&] {
        cudaEventRecord(fork, compute);
        cudaStreamWaitEvent(comm, fork, 0);
        if (!reduce(comm) || !gemm()) return false;
        cudaEventRecord(join, comm);
        cudaStreamWaitEvent(compute, join, 0);
        return true;
      },
      error);
  cudaEventDestroy(fork), cudaEventDestroy(join);
  cublasDestroy(h);
  cudaStreamDestroy(compute), cudaStreamDestroy(comm);
  cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(x), cudaFree(y), cudaFree(z);
  return r;
}

}  // namespace pipeplan::gpu_terms
