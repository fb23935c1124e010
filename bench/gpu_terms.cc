// Measures on the GPU the cost-model terms that issue-level checks need and prints them
// beside the prediction: unfused attention (Megatron's core attention kernels) and a
// gradient reduction on its own stream overlapping GEMMs. Exit 77 (skipped) without a GPU.
// Usage: pipeplan_gpu_terms [--reps N]
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "gpu_terms_device.h"
#include "simulator/cost_model.h"
#include "simulator/hardware.h"

using namespace pipeplan;

namespace {

void Row(const char* what, double measured, double predicted) {
  fmt::print("{:<44} measured {:9.3f} ms  predicted {:9.3f} ms  predicted/measured {:.3f}\n", what,
             measured * 1e3, predicted * 1e3, predicted / measured);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
  gpu_terms::Device dev = gpu_terms::Open();
  if (!dev.error.empty()) {
    fmt::print("skipped: {}\n", dev.error);
    return 77;
  }
  GpuSpec spec;
  for (const GpuSpec& g : GpuCatalog())
    if (dev.name.find(g.name) != std::string::npos) spec = g;
  if (spec.name.empty()) {
    fmt::print("skipped: {} is not in the catalog (simulator/hardware.cc)\n", dev.name);
    return 77;
  }
  const CostModel cost = CostModel::Real(spec);
  fmt::print("device: {} (catalog entry {})\n", dev.name, spec.name);
  std::string error;

  // Core attention of one micro-batch: 32 heads of 128, sequence 4096 (a Llama-2-7B layer
  // at tp 1). Unfused (planner/workload.cc): 4*s^2*(heads*d) FLOPs at the GEMM rate over the
  // full matrix, softmax reads and writes 2 bytes per score; fused: half the FLOPs (causal)
  // at the attention rate, no s^2 traffic.
  const int heads = 32, seq = 4096, d = 128;
  const double scores = static_cast<double>(heads) * seq * seq;
  Work unfused;
  unfused.flops = 4.0 * seq * seq * heads * d, unfused.hbm_bytes = 4 * scores, unfused.kernels = 3;
  const double measured = gpu_terms::UnfusedAttentionSeconds(heads, seq, d, reps, &error);
  if (!error.empty()) {
    fmt::print("error: unfused attention: {}\n", error);
    return 1;
  }
  Row("attention unfused (32 x 128, s 4096)", measured, cost.ComputeSeconds(unfused, 1, 1, 1, 8));
  Work flash;
  flash.flops = flash.attn_flops = 2.0 * seq * seq * heads * d, flash.kernels = 1;
  fmt::print("{:<44} not measured: no FlashAttention kernel is built here; predicted {:.3f} ms\n",
             "attention flash (32 x 128, s 4096)", cost.ComputeSeconds(flash, 1, 1, 1, 8) * 1e3);

  // Overlap: 4 GEMMs of 8192^3 on the compute stream, the local sum of a 1 GiB fp32 gradient
  // bucket (reads 2, writes 1) on the collective stream. The engine runs the two streams
  // side by side with no contention, so it predicts max(GEMMs, reduction).
  const int n = 8192, gemms = 4;
  const double bytes = 1024.0 * 1024 * 1024;
  gpu_terms::Overlap o = gpu_terms::OverlapSeconds(n, gemms, bytes, reps, &error);
  if (!error.empty()) {
    fmt::print("error: overlap: {}\n", error);
    return 1;
  }
  Work gemm, reduce;
  gemm.flops = gemms * 2.0 * n * n * n, gemm.kernels = gemms;
  reduce.hbm_bytes = 3 * bytes;
  const double pg = cost.ComputeSeconds(gemm, 1, 1, 1, 8),
               pr = cost.ComputeSeconds(reduce, 1, 1, 1, 8);
  Row("GEMMs alone (4 x 8192^3 bf16)", o.gemm_s, pg);
  Row("gradient reduction alone (1 GiB fp32 sum)", o.reduce_s, pr);
  Row("both, on two streams", o.both_s, std::max(pg, pr));
  fmt::print("contention the engine leaves out: {:.3f} ms ({:.1f} % of the overlapped time)\n",
             (o.both_s - std::max(o.gemm_s, o.reduce_s)) * 1e3,
             100 * (o.both_s - std::max(o.gemm_s, o.reduce_s)) / o.both_s);
  return 0;
}
