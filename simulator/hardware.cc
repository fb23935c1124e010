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
// Host link: PCIe Gen5 x16 on the Hopper SXM parts (datasheets: 128 GB/s, 64 GB/s per
// direction), Gen4 x16 on A100 SXM (64 GB/s, 32 per direction); pinned-memory copies reach
// about 80 % of it (nvbandwidth host<->device copy-engine tests: about 50-55 GB/s on H100
// Gen5, 25-26 GB/s on A100 Gen4): we take 0.80. Each GPU has its own x16 link to a PCIe
// switch; the model charges a copy on that link only (not shared with the NIC's GPUDirect
// traffic). Host memory per node: DGX H100 / H200 and DGX A100 640GB systems have 2 TB
// (HGX H800 and H20 servers are built like them: 2 TB taken).
const std::vector<GpuSpec> kCatalog = {
    // name      bf16     fp8      HBM     HBM bw   NVLink  NIC    a_in   a_out  gemm attn  hbm  nvl
    // nic  launch  host link  eff  host memory
    {"H100", 989e12, 1979e12, 80e9, 3.35e12, 450e9, 50e9, 8e-6, 20e-6, 0.75, 0.50, 0.80, 0.80, 0.90,
     3e-6, 64e9, 0.80, 2e12},
    {"H200", 989e12, 1979e12, 141e9, 4.8e12, 450e9, 50e9, 8e-6, 20e-6, 0.80, 0.50, 0.80, 0.80, 0.90,
     3e-6, 64e9, 0.80, 2e12},
    {"H800", 989e12, 1979e12, 80e9, 3.35e12, 200e9, 50e9, 8e-6, 20e-6, 0.75, 0.50, 0.80, 0.80, 0.90,
     3e-6, 64e9, 0.80, 2e12},
    {"H20", 148e12, 296e12, 96e9, 4.0e12, 450e9, 50e9, 8e-6, 20e-6, 0.80, 0.50, 0.80, 0.80, 0.90,
     3e-6, 64e9, 0.80, 2e12},
    {"A100", 312e12, 0, 80e9, 2.04e12, 300e9, 25e9, 8e-6, 20e-6, 0.75, 0.60, 0.80, 0.80, 0.90, 4e-6,
     32e9, 0.80, 2e12},
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
    {"host_link_bw", &GpuSpec::host_link_bw},
    {"host_link_efficiency", &GpuSpec::host_link_efficiency},
    {"node_host_bytes", &GpuSpec::node_host_bytes},
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
