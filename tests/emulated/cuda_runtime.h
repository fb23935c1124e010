// Test double of the CUDA runtime API subset the NCCL backend uses, on the CPU: device
// memory is host memory, each stream is a worker thread running its tasks in order, an
// event completes when its stream reaches it. Lets the backend's logic (ordering, waits,
// matching, checks, gathers) run in CI on machines without a GPU. Not a simulator of
// timing: work takes no time.
#pragma once

#include <cstddef>

struct EmuStream;
struct EmuEvent;
using cudaStream_t = EmuStream*;
using cudaEvent_t = EmuEvent*;

enum cudaError_t { cudaSuccess = 0, cudaErrorNotReady = 600, cudaErrorInvalidValue = 1 };
enum cudaMemcpyKind {
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3
};
constexpr unsigned cudaStreamNonBlocking = 1;

struct cudaDeviceProp {
  char name[256];
};

const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d);
cudaError_t cudaDeviceSynchronize();

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t s);
cudaError_t cudaFreeAsync(void* p, cudaStream_t s);
// As CUDA's own templates: any pointer type.
template <class T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind k,
                            cudaStream_t s);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);

cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b);

// Test controls.
namespace emu {
// Enqueues a task on a stream (what a kernel would do).
void Enqueue(cudaStream_t s, void (*fn)(void*), void* arg);
// Number of GPUs the runtime reports (0: cudaGetDeviceCount fails as without a GPU).
void SetDeviceCount(int n);
// Flips the bytes of the n-th point-to-point transfer delivered (0-based; -1: none).
void CorruptTransfer(int n);
}  // namespace emu
