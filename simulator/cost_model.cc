#include "simulator/cost_model.h"

#include <algorithm>
#include <array>
#include <map>
#include <tuple>

namespace pipeplan {

CostModel CostModel::Unit() {
  CostModel m;
  m.unit_ = true;
  return m;
}

CostModel CostModel::Real(const GpuSpec& spec) {
  CostModel m;
  m.spec_ = spec;
  return m;
}

double CostModel::ComputeSeconds(const Work& w, int gpus, int tp, int ep, int gpus_per_node,
                                 bool fold_across_nodes) const {
  const Parts p = ComputeParts(w, gpus, tp, ep, gpus_per_node, fold_across_nodes);
  return p.kernels + p.comm;
}

std::pair<double, double> CostModel::PairSeconds(const Parts& a, const Parts& b) {
  return {a.kernels, b.kernels + std::max(0.0, a.comm + b.comm - (a.kernels - a.covering) -
                                                   (b.kernels - b.covering))};
}

CostModel::Parts CostModel::ComputeParts(const Work& w, int gpus, int tp, int ep, int gpus_per_node,
                                         bool fold_across_nodes) const {
  const GpuSpec& s = spec_;
  const double per_gpu = 1.0 / std::max(gpus, 1);
  double gemm_s =
      (w.flops - w.attn_flops - w.fp8_flops) * per_gpu / (s.bf16_flops * s.compute_efficiency);
  if (w.fp8_flops > 0) gemm_s += w.fp8_flops * per_gpu / (s.fp8_flops * s.compute_efficiency);
  double attn_s = w.attn_flops * per_gpu / (s.bf16_flops * s.attention_efficiency);
  double mem_s = w.hbm_bytes / (s.hbm_bw * s.hbm_efficiency);
  Parts parts;
  parts.kernels = gemm_s + attn_s + mem_s + w.kernels * s.launch_s;
  double& t = parts.comm;
  const double nvl = s.nvlink_bw * s.nvlink_efficiency, nic = s.nic_bw * s.nic_efficiency;
  if (w.tp_calls > 0)
    t += fold_across_nodes ? w.tp_calls * s.inter_latency_s + w.tp_bytes / nic
                           : NvlinkFoldSeconds(w);
  if (w.ep_calls > 0 && ep > 1) {
    // EP group: ep GPUs, `tp` apart; k of them share a node. Bytes to peers on the same
    // node go over NVLink, the rest over the NIC, in parallel.
    const int k = std::clamp(gpus_per_node / std::max(tp, 1), 1, ep);
    const double alpha = k == ep ? s.intra_latency_s : s.inter_latency_s;
    auto all_to_all = [&](double bytes, int calls) {
      const double intra = bytes * (k - 1) / (ep - 1), inter = bytes * (ep - k) / (ep - 1);
      return calls * alpha + std::max(intra / nvl, inter / nic);
    };
    t += all_to_all(w.ep_bytes, w.ep_calls);
    // All-to-alls on their own stream beside GEMMs (the recomputed dispatch beside the
    // experts' data-gradient GEMMs): what those GEMMs' time covers is hidden.
    if (w.ep_overlap_flops > 0) {
      const double rate = (w.fp8_flops > 0 ? s.fp8_flops : s.bf16_flops) * s.compute_efficiency;
      parts.covering = std::min(all_to_all(w.ep_overlap_bytes, w.ep_overlap_calls),
                                w.ep_overlap_flops * per_gpu / rate);
      t -= parts.covering;
    }
  }
  return parts;
}

double CostModel::P2PSeconds(double bytes, bool same_node) const {
  const GpuSpec& s = spec_;
  if (same_node) return s.intra_latency_s + bytes / (s.nvlink_bw * s.nvlink_efficiency);
  return s.inter_latency_s + bytes / (s.nic_bw * s.nic_efficiency);
}

double CostModel::CopySeconds(double bytes) const {
  return spec_.launch_s + bytes / (spec_.host_link_bw * spec_.host_link_efficiency);
}

double CostModel::P2PSeconds(const Work& w, bool same_node) const {
  // Scatter/gather: the receivers' all-gather over NVLink.
  return P2PSeconds(w.payload_bytes, same_node) + NvlinkFoldSeconds(w);
}

double CostModel::NvlinkFoldSeconds(const Work& w) const {
  if (w.tp_calls <= 0) return 0;
  return w.tp_calls * spec_.intra_latency_s +
         w.tp_bytes / (spec_.nvlink_bw * spec_.nvlink_efficiency);
}

double CostModel::CollectiveSeconds(OpKind kind, double bytes, int n, int per_node,
                                    int nodes) const {
  if (n <= 1) return 0;
  const GpuSpec& s = spec_;
  double factor = (kind == OpKind::kAllReduce ? 2.0 : 1.0) * (n - 1) / n;
  double nvl = s.nvlink_bw * s.nvlink_efficiency;
  double bw = nodes <= 1 ? nvl : std::min(nvl, per_node * s.nic_bw * s.nic_efficiency);
  double alpha = nodes <= 1 ? s.intra_latency_s : s.inter_latency_s;
  return alpha + factor * bytes / bw;
}

std::vector<double> CostModel::Durations(const Table& t) const {
  std::vector<double> d(t.size(), 0.0);
  if (unit_) {
    for (OpId i = 0; i < t.size(); ++i) {
      switch (t.kind(i)) {
        case OpKind::kF:
          d[i] = 1;
          break;
        case OpKind::kB:
          d[i] = 2;
          break;
        case OpKind::kI:
        case OpKind::kW:
        case OpKind::kRecompute:
          d[i] = 1;
          break;
        default:
          break;
      }
    }
    return d;
  }
  const PlanMeta& m = t.meta();
  const auto& ranks = t.ranks();
  // Per group: members, most members on one node, nodes spanned.
  std::vector<std::array<int, 3>> groups(t.num_groups());
  for (int32_t g = 0; g < t.num_groups(); ++g) {
    std::map<int, int> per_node;
    for (int32_t r : t.group(g)) ++per_node[ranks[r].node];
    int most = 0;
    for (auto& [node, count] : per_node) most = std::max(most, count);
    groups[g] = {static_cast<int>(t.group(g).size()), most, static_cast<int>(per_node.size())};
  }
  std::vector<double> compute_cache(t.works().size(), -1.0);
  // Overlapped pairs: the first op keeps its kernels, the second takes its own kernels and
  // what of the pair's communication the two kernels' time does not hide.
  std::vector<OpId> pair_second(t.size(), UINT32_MAX);
  for (int32_t r = 0; r < t.num_ranks(); ++r)
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      if (!t.overlaps_next(i)) continue;
      for (OpId j = i + 1; j < t.rank_end(r); ++j)
        if (IsCompute(t.kind(j))) {
          pair_second[i] = j;
          break;
        }
    }
  for (OpId i = 0; i < t.size(); ++i) {
    const OpKind k = t.kind(i);
    const Work& w = t.work(i);
    const RankInfo& r = ranks[t.rank(i)];
    if (IsP2P(k)) {
      d[i] = P2PSeconds(w, ranks[t.peer(i)].node == r.node);
    } else if (IsCollective(k)) {
      auto [n, most, nodes] = groups[t.peer(i)];
      d[i] = CollectiveSeconds(k, w.payload_bytes, n, most, nodes);
      d[i] += NvlinkFoldSeconds(w);  // a leg over the TP group (Muon's owners)
    } else if (IsCopy(k)) {          // host memory, or another rank's over NVLink or the NIC
      d[i] = t.peer(i) < 0 ? CopySeconds(w.payload_bytes)
                           : P2PSeconds(w.payload_bytes, ranks[t.peer(i)].node == r.node);
    } else if (t.grouped(i)) {  // a gang: its gather-KV runs at the group's tier
      d[i] = ComputeSeconds(w, r.gpus, m.tp, m.ep, m.gpus_per_node, groups[t.peer(i)][2] > 1);
    } else {
      double& c = compute_cache[t.work_id(i)];
      if (c < 0) c = ComputeSeconds(w, r.gpus, m.tp, m.ep, m.gpus_per_node);
      d[i] = c;
    }
  }
  for (OpId i = 0; i < t.size(); ++i) {
    const OpId j = pair_second[i];
    if (j == UINT32_MAX) continue;
    const RankInfo& r = ranks[t.rank(i)];
    std::tie(d[i], d[j]) =
        PairSeconds(ComputeParts(t.work(i), r.gpus, m.tp, m.ep, m.gpus_per_node),
                    ComputeParts(t.work(j), r.gpus, m.tp, m.ep, m.gpus_per_node));
  }
  return d;
}

}  // namespace pipeplan
