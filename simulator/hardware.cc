#include "simulator/hardware.h"

#include <fmt/format.h>
#include <strings.h>

namespace pipeplan {
namespace {

// Sources: vendor datasheets for peak rates, HBM and NVLink (dense, no sparsity);
// InfiniBand NDR 400 Gb/s = 50 GB/s per NIC per direction, one NIC per GPU (HDR 200 Gb/s
// = 25 GB/s on A100 systems). Latencies: nccl-tests small-message collectives take about
// 7-15 us inside a node and 15-40 us across nodes; we take the low-middle of each range.
// compute_efficiency: measured large bf16 GEMMs reach 70-80% of peak on H100/H200 (8192^3
// bf16 matmul on H200 about 790 TFLOP/s = 0.80); A100 cuBLAS bf16 GEMMs at training shapes
// measure about 230-250 of 312 TFLOP/s (0.74-0.80): we take the low end.
// attention_efficiency: FlashAttention-2 reaches about 50-70% of peak on A100 and 35-50% on
// H100 (forward and backward together lower than forward alone); FlashAttention-3 more.
// nvlink_efficiency: NCCL all-reduce bus bandwidth without NVLink SHARP is about 80% of the
// link rate (H800: 200 GB/s -> about 160 effective). nic_efficiency: NCCL over NDR reaches
// about 45 of 50 GB/s per NIC. launch_s: CUDA kernel launch overhead of a few microseconds.
const std::vector<GpuSpec> kCatalog = {
    // name      bf16     fp8      HBM     HBM bw   NVLink  NIC    a_in   a_out  gemm attn  hbm  nvl
    // nic  launch
    {"H100", 989e12, 1979e12, 80e9, 3.35e12, 450e9, 50e9, 8e-6, 20e-6, 0.75, 0.50, 0.80, 0.80, 0.90,
     3e-6},
    {"H200", 989e12, 1979e12, 141e9, 4.8e12, 450e9, 50e9, 8e-6, 20e-6, 0.80, 0.50, 0.80, 0.80, 0.90,
     3e-6},
    {"H800", 989e12, 1979e12, 80e9, 3.35e12, 200e9, 50e9, 8e-6, 20e-6, 0.75, 0.50, 0.80, 0.80, 0.90,
     3e-6},
    {"H20", 148e12, 296e12, 96e9, 4.0e12, 450e9, 50e9, 8e-6, 20e-6, 0.80, 0.50, 0.80, 0.80, 0.90,
     3e-6},
    {"A100", 312e12, 0, 80e9, 2.04e12, 300e9, 25e9, 8e-6, 20e-6, 0.75, 0.60, 0.80, 0.80, 0.90,
     4e-6},
};

struct FieldRef {
  const char* name;
  double GpuSpec::*field;
};
constexpr FieldRef kFields[] = {
    {"bf16_flops", &GpuSpec::bf16_flops},
    {"fp8_flops", &GpuSpec::fp8_flops},
    {"hbm_bytes", &GpuSpec::hbm_bytes},
    {"hbm_bw", &GpuSpec::hbm_bw},
    {"nvlink_bw", &GpuSpec::nvlink_bw},
    {"nic_bw", &GpuSpec::nic_bw},
    {"intra_latency_s", &GpuSpec::intra_latency_s},
    {"inter_latency_s", &GpuSpec::inter_latency_s},
    {"compute_efficiency", &GpuSpec::compute_efficiency},
    {"attention_efficiency", &GpuSpec::attention_efficiency},
    {"hbm_efficiency", &GpuSpec::hbm_efficiency},
    {"nvlink_efficiency", &GpuSpec::nvlink_efficiency},
    {"nic_efficiency", &GpuSpec::nic_efficiency},
    {"launch_s", &GpuSpec::launch_s},
};

}  // namespace

std::vector<std::string> GpuSpecFieldNames() {
  std::vector<std::string> names;
  for (const FieldRef& f : kFields) names.push_back(f.name);
  return names;
}

double* GpuSpecField(GpuSpec* spec, const std::string& name) {
  for (const FieldRef& f : kFields)
    if (name == f.name) return &(spec->*f.field);
  return nullptr;
}

const std::vector<GpuSpec>& GpuCatalog() {
  return kCatalog;
}

std::vector<std::string> GpuNames() {
  std::vector<std::string> names;
  for (const GpuSpec& g : kCatalog) names.push_back(g.name);
  return names;
}

StatusOr<GpuSpec> FindGpu(const std::string& name) {
  for (const GpuSpec& g : kCatalog)
    if (strcasecmp(g.name.c_str(), name.c_str()) == 0) return g;
  return InvalidInput(fmt::format("unknown GPU '{}'", name));
}

}  // namespace pipeplan
