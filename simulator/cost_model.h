// Cost model: op work -> seconds.
//   compute    = GEMM FLOPs / GPUs / (peak x GEMM efficiency)
//                + attention FLOPs / GPUs / (peak x attention efficiency)
//                + memory-bound kernel bytes / (HBM bw x efficiency)
//                + kernels x launch + folded TP (intra-node) and MoE all-to-all time
//                (the kernels of a layer run one after another; each class at its roofline)
//   SEND/RECV  = alpha(tier) + payload / bw(tier), tier = same node (NVLink) or not (NIC)
//   collective = alpha(tier) + bus factor x payload / bw, bus factors as nccl-tests
//                (all-reduce 2(n-1)/n, others (n-1)/n); across nodes the bandwidth is that
//                of the NICs of the group's GPUs on one node (k x NIC), capped by NVLink.
// `unit` model: F = 1, B = 2, I = W = RECOMPUTE = 1, everything else 0 (schedule checks).
#pragma once

#include <utility>
#include <vector>

#include "core/table.h"
#include "simulator/hardware.h"

namespace pipeplan {

class CostModel {
 public:
  static CostModel Unit();
  static CostModel Real(const GpuSpec& spec);

  bool unit() const { return unit_; }
  const GpuSpec& spec() const { return spec_; }
  // Seconds for every op of the table.
  std::vector<double> Durations(const Table& t) const;

  // `fold_across_nodes`: the folded TP/CP collectives span nodes (a gang over ranks on
  // several nodes) and run at NIC rather than NVLink speed.
  double ComputeSeconds(const Work& w, int gpus, int tp, int ep, int gpus_per_node,
                        bool fold_across_nodes = false) const;
  // The same in two parts: kernels (GEMMs, attention, memory-bound, launches) and the
  // folded TP/CP and EP communication. An overlapped F/B pair (DualPipeV) hides each one's
  // communication behind the other's kernels: it takes max(kernels, communication) of the
  // two together.
  struct Parts {
    double kernels = 0, comm = 0;
    double covering = 0;  // of kernels, the seconds already hiding overlapped all-to-alls
  };
  Parts ComputeParts(const Work& w, int gpus, int tp, int ep, int gpus_per_node,
                     bool fold_across_nodes = false) const;
  // An overlapped pair's two ops, first and second: the first keeps its kernels, the
  // second takes its own kernels and what of the pair's communication the two kernels'
  // time does not hide (kernel time that already hides an op's own overlapped all-to-alls
  // hides nothing else).
  static std::pair<double, double> PairSeconds(const Parts& first, const Parts& second);
  double P2PSeconds(double bytes, bool same_node) const;
  double P2PSeconds(const Work& w, bool same_node) const;  // + a folded all-gather (tp_bytes)
  // A copy of saved activations between a GPU and host memory over the GPU's own host link
  // (one direction; the other direction's copy engine runs at the same time).
  double CopySeconds(double bytes) const;
  // n: group members; per_node: most members on one node; nodes: nodes spanned.
  double CollectiveSeconds(OpKind kind, double bytes, int n, int per_node, int nodes) const;

 private:
  // A collective over the TP group folded into an op (Work::tp_bytes, tp_calls): NVLink.
  double NvlinkFoldSeconds(const Work& w) const;
  bool unit_ = false;
  GpuSpec spec_;
};

}  // namespace pipeplan
