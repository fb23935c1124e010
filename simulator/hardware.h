// Hardware catalog: GPU types with peak rates, memory, links and achievable efficiencies.
// The numbers are data with their sources in hardware.cc; configs may override any field.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace pipeplan {

struct GpuSpec {
  std::string name;
  double bf16_flops = 0;            // dense peak, FLOP/s
  double fp8_flops = 0;             // dense peak, FLOP/s (0 = unsupported)
  double hbm_bytes = 0;             // HBM capacity, bytes
  double hbm_bw = 0;                // HBM bandwidth, bytes/s
  double nvlink_bw = 0;             // NVLink bandwidth per GPU per direction, bytes/s
  double nic_bw = 0;                // network bandwidth per GPU (one NIC) per direction, bytes/s
  double intra_latency_s = 0;       // alpha of one collective / p2p transfer inside a node, s
  double inter_latency_s = 0;       // alpha across nodes, s
  double compute_efficiency = 0;    // achievable fraction of peak for large bf16 GEMMs
  double attention_efficiency = 0;  // achievable fraction of peak in fused attention kernels
  double hbm_efficiency = 0;        // achievable fraction of HBM bandwidth
  double nvlink_efficiency = 0;     // achievable fraction of NVLink bandwidth (NCCL bus bw)
  double nic_efficiency = 0;        // achievable fraction of NIC bandwidth (NCCL bus bw)
  double launch_s = 0;              // launch overhead per kernel, s
  double host_link_bw = 0;          // GPU <-> host memory (PCIe) per direction, bytes/s
  double host_link_efficiency = 0;  // achievable fraction of it (pinned cudaMemcpyAsync)
  double node_host_bytes = 0;       // host memory of one node, bytes
  bool operator==(const GpuSpec&) const = default;
};

// Field names as used in configs (cluster.hardware.<name>) and calibration files.
// Values are in the units above; *_bw in bytes/s, latencies in seconds.
std::vector<std::string> GpuSpecFieldNames();
double* GpuSpecField(GpuSpec* spec, const std::string& name);  // nullptr if unknown

const std::vector<GpuSpec>& GpuCatalog();
StatusOr<GpuSpec> FindGpu(const std::string& name);  // case-insensitive
std::vector<std::string> GpuNames();

}  // namespace pipeplan
