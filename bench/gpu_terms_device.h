// Timed GPU kernels behind bench/gpu_terms.cc (plain C++ interface; CUDA in the .cu).
#pragma once

#include <string>

namespace pipeplan::gpu_terms {

struct Device {
  std::string name;
  std::string error;  // empty when a GPU was found and set up
};
Device Open();

// Megatron's unfused core attention forward for one micro-batch: QK^T as a strided-batched
// bf16 GEMM over the full s x s matrix of each head, a causal scale-mask-softmax kernel
// (reads and writes 2 bytes per score) and the PV GEMM. Median seconds of `reps` runs.
double UnfusedAttentionSeconds(int heads, int seq, int head_dim, int reps, std::string* error);

// A bf16 n^3 GEMM repeated `gemms` times on one stream, a bandwidth-bound gradient
// reduction (sum of two fp32 buffers of `bytes` each into one, the local work of a
// reduce-scatter) on another; each alone and both at once. Median seconds of `reps` runs.
struct Overlap {
  double gemm_s = 0, reduce_s = 0, both_s = 0;
};
Overlap OverlapSeconds(int n, int gemms, double bytes, int reps, std::string* error);

}  // namespace pipeplan::gpu_terms
