// CUDA backend (built when nvcc is found): replays a plan on one GPU with one stream per
// rank (single-process multi-rank mode). A compute op runs cuBLAS bf16 GEMMs whose FLOPs
// per GPU equal the op's (one square GEMM per layer of the op), so measured times are
// comparable with the simulated ones; a RECV copies the op's payload from the sender's
// device buffer; a collective touches its payload once. Every op synchronises its stream,
// so the runner's timestamps are the op's GPU time plus a launch. One process per GPU with
// NCCL is nccl_backend.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/table.h"
#include "executor/runner.h"

namespace pipeplan {

// Number of CUDA devices, or an error with CUDA's message (never a crash without a GPU).
StatusOr<int> CudaDeviceCount();
// A description of device 0 ("NVIDIA H200, 139 GiB").
StatusOr<std::string> CudaDeviceName();

// Side of the square GEMM whose 2 n^3 FLOPs match one layer's share of the op on one of
// the rank's `gpus` GPUs (0: no GEMM), rounded to a multiple of 64.
size_t GemmDim(const Work& w, int gpus);

// Backends for every rank of `t` on the current device.
StatusOr<std::vector<std::unique_ptr<Backend>>> MakeCudaBackends(const Table& t);

}  // namespace pipeplan
