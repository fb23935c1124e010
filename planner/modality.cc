#include "planner/modality.h"

#include <algorithm>
#include <numeric>

#include "simulator/cost_model.h"

namespace pipeplan {
namespace {

constexpr double kBf16 = 2;

// Per-GPU forward FLOPs of an image of P patches split over k GPUs: the linear layers
// take P/k patches; attention of P/k queries against all P keys.
double SplitFlops(const Config& c, int64_t patches, int k) {
  const VisionConfig& v = c.model.vision;
  const double P = static_cast<double>(patches), d = v.hidden, m = v.mlp, q = P / k;
  double layer = 2 * q * (4 * d * d + 2 * d * m) + 4 * q * P * d;
  const double tokens = q / (v.merge * v.merge), in = d * v.merge * v.merge, h = c.model.llm.hidden;
  return v.layers * layer + 2 * tokens * (in * h + h * h);
}

double GatherBytes(const Config& c, int64_t patches, int k) {
  const VisionConfig& v = c.model.vision;
  return k <= 1 ? 0 : v.layers * (k - 1.0) / k * static_cast<double>(patches) * 2 * v.hidden * kBf16;
}

// Activation bytes one image keeps for the encoder backward (Korthikanti et al. per layer
// per token: 18*d + 4*mlp with fused attention, + 5*heads*P for stored attention scores
// without recompute; full recompute keeps the layer inputs, 2*d).
double VisionActBytes(const Config& c, int64_t patches) {
  const VisionConfig& v = c.model.vision;
  const double P = static_cast<double>(patches);
  switch (v.recompute) {
    case Recompute::kNone: return v.layers * P * (18.0 * v.hidden + 4.0 * v.mlp + 5.0 * v.heads * P);
    case Recompute::kSelective: return v.layers * P * (18.0 * v.hidden + 4.0 * v.mlp);
    case Recompute::kFull: return v.layers * P * 2.0 * v.hidden;
  }
  return 0;
}

}  // namespace

double CpPlan::max_flops() const { return gpu_flops.empty() ? 0 : *std::max_element(gpu_flops.begin(), gpu_flops.end()); }
double CpPlan::mean_flops() const {
  return gpu_flops.empty() ? 0 : std::accumulate(gpu_flops.begin(), gpu_flops.end(), 0.0) / gpu_flops.size();
}

CpPlan PlanVisionCp(const Config& c, const std::vector<int64_t>& patches, int gpus) {
  const VisionConfig& v = c.model.vision;
  CpPlan plan;
  plan.gpu_flops.assign(gpus, 0);
  plan.gpu_comm_bytes.assign(gpus, 0);
  double total = 0;
  for (int64_t p : patches) total += VisionImageFlops(c, p);
  const double target = total / gpus;
  int kmax = 1;
  while (kmax * 2 <= std::min(v.cp_max_group, gpus)) kmax *= 2;
  for (size_t i = 0; i < patches.size(); ++i) {
    CpItem it;
    it.image = static_cast<int>(i);
    if (v.cp && patches[i] > v.cp_threshold_patches)
      while (it.k < kmax && SplitFlops(c, patches[i], it.k) > target) it.k *= 2;
    it.flops_per_gpu = SplitFlops(c, patches[i], it.k);
    it.gather_bytes_per_gpu = GatherBytes(c, patches[i], it.k);
    plan.items.push_back(it);
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const CpItem& a, const CpItem& b) { return a.flops_per_gpu * a.k > b.flops_per_gpu * b.k; });
  for (CpItem& it : plan.items) {
    double best = -1;
    for (int g = 0; g + it.k <= gpus; g += it.k) {
      double worst = *std::max_element(plan.gpu_flops.begin() + g, plan.gpu_flops.begin() + g + it.k);
      if (best < 0 || worst < best) best = worst, it.first_gpu = g;
    }
    for (int g = it.first_gpu; g < it.first_gpu + it.k; ++g) {
      plan.gpu_flops[g] += it.flops_per_gpu;
      plan.gpu_comm_bytes[g] += it.gather_bytes_per_gpu;
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const CpItem& a, const CpItem& b) { return a.image < b.image; });
  return plan;
}

double CpCommFraction(const Config& c, const CpPlan& plan) {
  const GpuSpec& s = c.cluster.spec;
  double worst = 0;
  for (size_t g = 0; g < plan.gpu_flops.size(); ++g) {
    if (plan.gpu_comm_bytes[g] == 0) continue;
    double comm = plan.gpu_comm_bytes[g] / (s.nvlink_bw * s.nvlink_efficiency);
    double compute = plan.gpu_flops[g] / (s.bf16_flops * s.compute_efficiency);
    worst = std::max(worst, comm / (comm + compute));
  }
  return worst;
}

namespace {

// One vision task over `patches` (images of one micro-batch) on a rank of `gpus` GPUs.
VisionTask MakeVisionTask(const Config& c, const std::vector<int64_t>& patches, int gpus, bool recompute_outputs_only) {
  const VisionConfig& v = c.model.vision;
  const double h = c.model.llm.hidden;
  CpPlan plan = PlanVisionCp(c, patches, gpus);
  VisionTask t;
  double total_flops = 0, total_patches = 0, act = 0, tokens = 0;
  for (int64_t p : patches) {
    total_flops += VisionImageFlops(c, p);
    total_patches += static_cast<double>(p);
    act += VisionActBytes(c, p);
    tokens += static_cast<double>((p + v.merge * v.merge - 1) / (v.merge * v.merge));
  }
  // Time is set by the most loaded GPU: flops = gpus x its load.
  size_t busiest = std::max_element(plan.gpu_flops.begin(), plan.gpu_flops.end()) - plan.gpu_flops.begin();
  t.f.flops = plan.gpu_flops[busiest] * gpus;
  t.f.model_flops = total_flops;
  t.f.hbm_bytes = total_patches / gpus * v.layers * (20.0 * v.hidden + 4.0 * v.mlp);
  t.f.tp_bytes = plan.gpu_comm_bytes[busiest];
  t.f.tp_calls = t.f.tp_bytes > 0 ? v.layers : 0;
  t.f.kernels = 12 * v.layers;
  t.f.layer_begin = 0, t.f.layer_end = v.layers;
  t.act_bytes = act / gpus;
  t.out_bytes = tokens * h * kBf16 / gpus;
  t.b = t.f;
  // Backward = 2x forward, + the forward again under full recompute.
  t.b.flops = (v.recompute == Recompute::kFull ? 3 : 2) * t.f.flops;
  t.b.model_flops = 2 * total_flops, t.b.hbm_bytes = 2 * t.f.hbm_bytes;
  t.b.tp_bytes = 2 * t.f.tp_bytes, t.b.tp_calls = 2 * t.f.tp_calls, t.b.kernels = 2 * t.f.kernels;
  if (recompute_outputs_only) {
    t.f.mem_delta_bytes = t.out_bytes;
    t.recompute = t.f;
    t.recompute.model_flops = 0;
    t.recompute.mem_delta_bytes = t.act_bytes;
  } else {
    t.f.mem_delta_bytes = t.act_bytes + t.out_bytes;
  }
  t.b.mem_delta_bytes = -(t.act_bytes + t.out_bytes);
  t.seconds = CostModel::Real(c.cluster.spec).ComputeSeconds(t.f, gpus, gpus, 1, c.cluster.gpus_per_node);
  return t;
}

}  // namespace

ModalityWork BuildModalityWork(const Config& c, const StepBatch& batch, int gpus, int tasks_per_mb,
                               bool recompute_outputs_only) {
  ModalityWork w;
  const VisionConfig& v = c.model.vision;
  const GeneratorConfig& g = c.model.generator;
  const double h = c.model.llm.hidden;
  CostModel cost = CostModel::Real(c.cluster.spec);
  if (v.enabled) {
    const double d = v.hidden, mlp = v.mlp, in = d * v.merge * v.merge;
    w.vision_params = v.layers * (4 * d * d + 2 * d * mlp + 4 * d) + in * h + h * h;
  }
  if (g.enabled) w.generator_params = g.layers * (4.0 * g.hidden * g.hidden + 2.0 * g.hidden * g.mlp + 6.0 * g.hidden * g.hidden);
  for (size_t d = 0; d < batch.replicas.size(); ++d) {
    for (size_t m = 0; m < batch.replicas[d].size(); ++m) {
      const MicroBatch& mb = batch.replicas[d][m];
      if (v.enabled) {
        // Images split into up to tasks_per_mb tasks, longest first onto the lightest.
        std::vector<int64_t> patches;
        for (const Sample& s : mb.samples)
          for (const Image& img : s.images) patches.push_back(Patches(img, v.patch));
        std::stable_sort(patches.begin(), patches.end(), std::greater<>());
        const size_t n = std::min<size_t>(std::max(tasks_per_mb, 1), patches.size());
        std::vector<std::vector<int64_t>> groups(n);
        std::vector<double> load(n, 0.0);
        for (int64_t p : patches) {
          size_t k = std::min_element(load.begin(), load.end()) - load.begin();
          groups[k].push_back(p);
          load[k] += VisionImageFlops(c, p);
        }
        for (size_t k = 0; k < n; ++k) {
          VisionTask t = MakeVisionTask(c, groups[k], gpus, recompute_outputs_only);
          t.d = static_cast<int>(d), t.mb = static_cast<int>(m), t.task = static_cast<int>(k);
          w.vision.push_back(t);
        }
      }
      if (g.enabled) {
        GeneratorTask t;
        t.d = static_cast<int>(d), t.mb = static_cast<int>(m);
        const double D = g.hidden, M = g.mlp;
        double flops = 0, attn = 0, tokens = 0;
        for (const Sample& s : mb.samples) {
          if (s.gen_height == 0) continue;
          double latent = std::ceil(double(s.gen_height) / g.latent_patch) * std::ceil(double(s.gen_width) / g.latent_patch);
          double T = latent + static_cast<double>(s.text_tokens);  // joint attention over latent + condition
          flops += g.layers * (2 * T * (4 * D * D + 2 * D * M + 6 * D * D) + 4 * T * T * D);
          attn += g.layers * 4 * T * T * D;
          tokens += T;
        }
        if (tokens == 0) continue;
        t.f.flops = t.f.model_flops = flops;
        t.f.attn_flops = attn;
        t.f.hbm_bytes = tokens / gpus * g.layers * (20 * D + 4 * M);
        t.f.kernels = 14 * g.layers;
        t.f.layer_begin = 0, t.f.layer_end = g.layers;
        if (gpus > 1) {  // the rank's GPUs split the generator like TP: 2 all-reduces per layer
          t.f.tp_calls = 2 * g.layers;
          t.f.tp_bytes = g.layers * 2 * (2.0 * (gpus - 1) / gpus) * tokens * D * kBf16;
        }
        double act = tokens / gpus * g.layers *
                     (g.recompute == Recompute::kFull ? 2 * D : 18 * D + 4 * M);  // + scores w/o recompute
        if (g.recompute == Recompute::kNone) act += attn / (4 * D) * 5 * g.heads / gpus;
        t.f.mem_delta_bytes = act;
        t.b = t.f;
        const int again = g.recompute == Recompute::kFull ? 1 : 0;
        t.b.flops = (2 + again) * flops, t.b.model_flops = 2 * flops, t.b.attn_flops = (2 + again) * attn;
        t.b.hbm_bytes = 2 * t.f.hbm_bytes;
        t.b.tp_bytes = t.f.tp_bytes, t.b.tp_calls = t.f.tp_calls, t.b.kernels = 2 * t.f.kernels;
        t.b.mem_delta_bytes = -act;
        t.seconds = cost.ComputeSeconds(t.f, gpus, gpus, 1, c.cluster.gpus_per_node);
        w.generator.push_back(t);
      }
    }
  }
  return w;
}

}  // namespace pipeplan
