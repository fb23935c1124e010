#include "planner/modality.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

#include "planner/workload.h"
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

// Attention part of SplitFlops (scores and values; run by fused attention kernels).
double SplitAttnFlops(const Config& c, int64_t patches, int k) {
  const VisionConfig& v = c.model.vision;
  const double P = static_cast<double>(patches);
  return v.layers * 4 * (P / k) * P * v.hidden;
}

double GatherBytes(const Config& c, int64_t patches, int k) {
  const VisionConfig& v = c.model.vision;
  return k <= 1 ? 0
                : v.layers * (k - 1.0) / k * static_cast<double>(patches) * 2 * v.hidden * kBf16;
}

// Gather-KV as ring attention runs it: each layer passes the k shards' K and V around the
// sub-group in k - 1 hops (P/k x 2d bf16 values each), and every hop overlaps the
// attention of the block already held (4 (P/k)^2 d FLOPs). Only what a hop takes beyond
// that block stays exposed: returns those bytes per GPU, all layers (0 if k = 1 or hidden).
double ExposedGatherBytes(const Config& c, int64_t patches, int k) {
  if (k <= 1) return 0;
  const VisionConfig& v = c.model.vision;
  const GpuSpec& s = c.cluster.spec;
  const double P = static_cast<double>(patches), q = P / k;
  const bool one_node = k <= c.cluster.gpus_per_node;
  const double bw = one_node ? s.nvlink_bw * s.nvlink_efficiency : s.nic_bw * s.nic_efficiency;
  const double hop = q * 2 * v.hidden * kBf16;
  const double block_s = 4 * q * q * v.hidden / (s.bf16_flops * s.attention_efficiency);
  return v.layers * (k - 1) * std::max(0.0, hop - block_s * bw);
}

// Seconds of one GPU's shard of an image split over k GPUs: GEMMs and attention at their
// rates, plus the exposed gather-KV.
double ShardSeconds(const Config& c, int64_t patches, int k) {
  const GpuSpec& s = c.cluster.spec;
  const bool one_node = k <= c.cluster.gpus_per_node;
  const double bw = one_node ? s.nvlink_bw * s.nvlink_efficiency : s.nic_bw * s.nic_efficiency;
  const double attn = SplitAttnFlops(c, patches, k);
  return (SplitFlops(c, patches, k) - attn) / (s.bf16_flops * s.compute_efficiency) +
         attn / (s.bf16_flops * s.attention_efficiency) + ExposedGatherBytes(c, patches, k) / bw;
}

// The same shard's backward, as TaskFromLoad charges it: twice the forward, and the
// forward again under full recompute or its core attention again under selective.
double ShardBackwardSeconds(const Config& c, int64_t patches, int k) {
  const Recompute rc = c.model.vision.recompute;
  const double again = rc == Recompute::kSelective
                           ? SplitAttnFlops(c, patches, k) /
                                 (c.cluster.spec.bf16_flops * c.cluster.spec.attention_efficiency)
                           : 0;
  return (rc == Recompute::kFull ? 3 : 2) * ShardSeconds(c, patches, k) + again;
}

SavedBytes VisionSavedPerPatch(const Config& c) {
  const VisionConfig& v = c.model.vision;
  SavedBytes s = SavedPerToken(v.recompute, v.saved_activations, v.hidden, v.mlp, v.heads);
  s.kept *= v.layers, s.quantise_hbm *= v.layers;
  return s;
}

double VisionActBytes(const Config& c, int64_t patches) {
  return static_cast<double>(patches) * VisionSavedPerPatch(c).kept;
}

}  // namespace

double CpPlan::max_flops() const {
  return gpu_flops.empty() ? 0 : *std::max_element(gpu_flops.begin(), gpu_flops.end());
}
double CpPlan::mean_flops() const {
  return gpu_flops.empty()
             ? 0
             : std::accumulate(gpu_flops.begin(), gpu_flops.end(), 0.0) / gpu_flops.size();
}

namespace {

// Loads of n GPUs with fast "least-loaded aligned block of 2^l GPUs" queries: a segment
// tree whose node keeps, for every block size up to its own, the smallest block maximum
// in its range. O(2^l log n) per assignment instead of a scan of all blocks.
class BlockLoads {
 public:
  BlockLoads(const std::vector<double>& base, int levels) : levels_(levels) {
    size_ = 1;
    while (size_ < static_cast<int>(base.size())) size_ *= 2;
    best_.assign(2 * size_ * (levels_ + 1), kInf);
    for (int g = 0; g < static_cast<int>(base.size()); ++g) At(size_ + g, 0) = base[g];
    for (int node = size_ - 1; node >= 1; --node) Pull(node, Height(node));
  }
  // First GPU of the aligned block of 2^level GPUs whose most loaded GPU is least loaded.
  int Best(int level) const {
    int node = 1, height = Height(1);
    while (height > level) {
      node = At(2 * node, level) <= At(2 * node + 1, level) ? 2 * node : 2 * node + 1;
      --height;
    }
    return (node << level) - size_;
  }
  double Load(int g) const { return At(size_ + g, 0); }
  void Add(int g, double x) { Set(g, Load(g) + x); }

 private:
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  int Height(int node) const {
    int h = 0;
    for (int n = node; n < size_; n *= 2) ++h;
    return h;
  }
  double& At(int node, int level) { return best_[node * (levels_ + 1) + level]; }
  double At(int node, int level) const { return best_[node * (levels_ + 1) + level]; }
  // Node `node` (at height h) from its children.
  void Pull(int node, int h) {
    for (int l = 0; l <= std::min(h, levels_); ++l)
      At(node, l) = l == h ? std::max(At(2 * node, h - 1), At(2 * node + 1, h - 1))
                           : std::min(At(2 * node, l), At(2 * node + 1, l));
  }
  void Set(int g, double load) {
    int node = size_ + g;
    At(node, 0) = load;
    for (int h = 1; node > 1; ++h) Pull(node /= 2, h);
  }
  int levels_, size_ = 1;
  std::vector<double> best_;
};

// An item's per-GPU load for its split factor k.
CpItem Sized(const Config& c, int64_t patches, CpItem it) {
  it.flops_per_gpu = SplitFlops(c, patches, it.k);
  it.attn_flops_per_gpu = SplitAttnFlops(c, patches, it.k);
  it.gather_bytes_per_gpu = GatherBytes(c, patches, it.k);
  it.exposed_gather_bytes_per_gpu = ExposedGatherBytes(c, patches, it.k);
  return it;
}

// Split factor (PlanVisionCp's rule) and per-GPU load of each image, in image order;
// `levels`: log2 of the largest sub-group. With ranks of `rank_gpus` GPUs that are not a
// power of two, no image is split over more GPUs than a rank has (a gang's sub-group
// would not fall on whole ranks).
std::vector<CpItem> SplitItems(const Config& c, const std::vector<int64_t>& patches, int gpus,
                               double budget_s, int* levels, int rank_gpus = 1) {
  const VisionConfig& v = c.model.vision;
  // Target time per GPU: the images' per-GPU share (K3's sizing rule), or the latency
  // budget if larger. A large image is split over the fewest GPUs whose shard time
  // (ShardSeconds: gather-KV included) meets the target, and never further than splitting
  // makes it faster.
  double total = 0;
  for (int64_t p : patches) total += ShardSeconds(c, p, 1);
  const double target = std::max(total / gpus, budget_s);
  int kmax = 1;
  *levels = 0;
  int most = std::min(v.cp_max_group, gpus);
  if ((rank_gpus & (rank_gpus - 1)) != 0) most = std::min(most, rank_gpus);
  while (kmax * 2 <= most) kmax *= 2, ++*levels;
  std::vector<CpItem> items;
  for (size_t i = 0; i < patches.size(); ++i) {
    CpItem it;
    it.image = static_cast<int>(i);
    if (v.cp && patches[i] > v.cp_threshold_patches)
      while (it.k < kmax && ShardSeconds(c, patches[i], it.k) > target &&
             ShardSeconds(c, patches[i], 2 * it.k) < ShardSeconds(c, patches[i], it.k))
        it.k *= 2;
    items.push_back(Sized(c, patches[i], it));
  }
  return items;
}

CpPlan EmptyPlan(int gpus) {
  CpPlan plan;
  plan.gpu_flops.assign(gpus, 0);
  plan.gpu_attn_flops.assign(gpus, 0);
  plan.gpu_comm_bytes.assign(gpus, 0);
  plan.gpu_exposed_bytes.assign(gpus, 0);
  return plan;
}

// Adds a placed item's load to its sub-group's GPUs.
void Charge(const CpItem& it, CpPlan* plan) {
  for (int g = it.first_gpu; g < it.first_gpu + it.k; ++g) {
    plan->gpu_flops[g] += it.flops_per_gpu;
    plan->gpu_attn_flops[g] += it.attn_flops_per_gpu;
    plan->gpu_comm_bytes[g] += it.gather_bytes_per_gpu;
    plan->gpu_exposed_bytes[g] += it.exposed_gather_bytes_per_gpu;
  }
}

int Level(int k) {
  int level = 0;
  while ((1 << level) < k) ++level;
  return level;
}

// Items longest first (total FLOPs over their sub-group), for placement.
void LongestFirst(std::vector<CpItem>* items) {
  std::stable_sort(items->begin(), items->end(), [](const CpItem& a, const CpItem& b) {
    return a.flops_per_gpu * a.k > b.flops_per_gpu * b.k;
  });
}

void ImageOrder(std::vector<CpItem>* items) {
  std::stable_sort(items->begin(), items->end(),
                   [](const CpItem& a, const CpItem& b) { return a.image < b.image; });
}

// One round's tasks on ranks of G GPUs. A rank runs one task per replica, that replica's
// whole images side by side on its GPUs (the task takes its busiest GPU's time), and its
// tasks and gang shards one after another. An image narrower than a rank joins a task of
// its replica where it adds no time; else it opens a task on a rank of its own, and the
// rank's every GPU carries its load (the rank is busy with it).
class RoundTasks {
 public:
  explicit RoundTasks(int gpus) : gpus_(gpus) {}
  // First GPU of k (< G) GPUs of a task of `source` on which `load` per GPU adds no time,
  // or -1.
  int Join(int source, int k, double load) {
    for (auto& [first, loads] : tasks_[source]) {
      const double most = *std::max_element(loads.begin(), loads.end());
      for (int b = 0; b + k <= gpus_; b += k) {
        const auto from = loads.begin() + b;
        if (*std::max_element(from, from + k) + load > most) continue;
        for (auto x = from; x != from + k; ++x) *x += load;
        return first + b;
      }
    }
    return -1;
  }
  // A task of `source` on the rank of `first_gpu`, its first image on k GPUs from there.
  void Open(int source, int first_gpu, int k, double load) {
    const int rank_first = first_gpu / gpus_ * gpus_;
    std::vector<double> loads(gpus_, 0.0);
    for (int g = first_gpu; g < first_gpu + k; ++g) loads[g - rank_first] = load;
    tasks_[source].push_back({rank_first, std::move(loads)});
  }

 private:
  int gpus_;
  std::map<int, std::vector<std::pair<int, std::vector<double>>>> tasks_;
};

// Encoder load per GPU of ranks of G GPUs, where a rank runs its tasks in turn: a task's
// load is on every GPU of its rank, a gang shard's on its rank's. Finds the least-loaded
// rank for an item of k <= G GPUs, and the least-loaded aligned sub-group for a gang.
// Covers GPUs [from, from + count) of `carry` (each GPU's load so far), which Add updates.
class RankLoads {
 public:
  RankLoads(std::vector<double>* carry, int from, int count, int gpus, int levels)
      : gpus_(gpus),
        from_(from),
        carry_(carry),
        gpu_({carry->begin() + from, carry->begin() + from + count}, levels),
        rank_(RankMax(carry, from, count, gpus), 0) {}
  // First GPU (from `from`) of the block an item of k GPUs goes to.
  int Best(int k) const { return k <= gpus_ ? rank_.Best(0) * gpus_ : gpu_.Best(Level(k)); }
  // Load of the most loaded rank of an item of k GPUs from `first_gpu`.
  double Load(int first_gpu, int k) const {
    double most = 0;
    for (int r = first_gpu / gpus_; r * gpus_ < first_gpu + std::max(k, gpus_); ++r)
      most = std::max(most, rank_.Load(r));
    return most;
  }
  // An item of k GPUs from `first_gpu` holds max(k, G) GPUs: `load` on each.
  void Add(int first_gpu, int k, double load) {
    const int width = std::max(k, gpus_);
    for (int g = first_gpu; g < first_gpu + width; ++g)
      gpu_.Add(g, load), (*carry_)[from_ + g] += load;
    for (int r = first_gpu / gpus_; r * gpus_ < first_gpu + width; ++r) rank_.Add(r, load);
  }

 private:
  static std::vector<double> RankMax(const std::vector<double>* carry, int from, int count,
                                     int gpus) {
    std::vector<double> out(count / gpus, 0.0);
    for (int g = 0; g < count / gpus * gpus; ++g)
      out[g / gpus] = std::max(out[g / gpus], (*carry)[from + g]);
    return out;
  }
  int gpus_, from_;
  std::vector<double>* carry_;
  BlockLoads gpu_, rank_;
};

}  // namespace

CpPlan PlanVisionCp(const Config& c, const std::vector<int64_t>& patches, int gpus,
                    const std::vector<double>& base, double budget_s,
                    const std::vector<int>& min_k) {
  CpPlan plan = EmptyPlan(gpus);
  int levels = 0;
  plan.items = SplitItems(c, patches, gpus, budget_s, &levels);
  if (min_k.size() == patches.size())
    for (CpItem& it : plan.items) {
      int k = it.k;  // at least min_k, a power of two within the GPUs
      while (k < min_k[it.image] && 2 * k <= gpus) k *= 2;
      if (k == it.k) continue;
      it.k = k;
      it = Sized(c, patches[it.image], it);
      levels = std::max(levels, Level(k));
    }
  LongestFirst(&plan.items);
  std::vector<double> start = base;
  start.resize(gpus, 0.0);
  BlockLoads loads(start, levels);
  for (CpItem& it : plan.items) {
    it.first_gpu = loads.Best(Level(it.k));
    for (int g = it.first_gpu; g < it.first_gpu + it.k; ++g) loads.Add(g, it.flops_per_gpu);
    Charge(it, &plan);
  }
  ImageOrder(&plan.items);
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

void TextTimeline::Index(double min_gap_s) {
  if (min_gap_s == indexed_gap_s_) return;  // merging again would change nothing
  indexed_gap_s_ = min_gap_s;
  idle_at_.assign(busy.size(), {});
  for (size_t r = 0; r < busy.size(); ++r) {
    auto& b = busy[r];
    size_t n = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      if (n > 0 && b[i].first - b[n - 1].second < min_gap_s)
        b[n - 1].second = std::max(b[n - 1].second, b[i].second);
      else
        b[n++] = b[i];
    }
    b.resize(n);
    double busy_s = 0;
    for (const auto& [start, stop] : b) {
      idle_at_[r].push_back(start - busy_s);
      busy_s += stop - start;
    }
  }
}

double TextTimeline::IdleBefore(int rank, double t) const {
  const auto& b = busy[rank];
  const auto it = std::upper_bound(b.begin(), b.end(), t,
                                   [](double x, const auto& iv) { return x < iv.first; });
  if (it == b.begin()) return t;
  const size_t i = it - b.begin() - 1;  // the last interval that starts at or before t
  return idle_at_[rank][i] + std::max(0.0, t - b[i].second);
}

double TextTimeline::Advance(int rank, double t, double x) const {
  const auto& b = busy[rank];
  const auto& idle = idle_at_[rank];
  const double target = IdleBefore(rank, t) + x;
  const size_t i = std::lower_bound(idle.begin(), idle.end(), target) - idle.begin();
  if (i == idle.size()) return b.empty() ? target : b.back().second + (target - idle.back());
  return std::max(t, b[i].first - (idle[i] - target));
}

namespace {

// The busiest GPU's load of a task: FLOPs, attention part, gather-KV bytes not hidden
// under attention (ExposedGatherBytes).
struct GpuLoad {
  double flops = 0, attn_flops = 0, exposed_bytes = 0;
};

// A vision task (or a gang shard) from its busiest GPU's load on a rank of `gpus` GPUs;
// the other totals are for the whole task.
VisionTask TaskFromLoad(const Config& c, const GpuLoad& load, double model_flops, double act,
                        double tokens, double patches, int gpus, bool recompute_outputs_only) {
  const VisionConfig& v = c.model.vision;
  VisionTask t;
  t.f.flops = load.flops * gpus;  // time is set by the most loaded GPU
  t.f.attn_flops = load.attn_flops * gpus;
  t.f.model_flops = model_flops;
  t.f.hbm_bytes = patches / gpus * v.layers * (20.0 * v.hidden + 4.0 * v.mlp);
  const double store_hbm = patches / gpus * VisionSavedPerPatch(c).quantise_hbm;
  t.f.tp_bytes = load.exposed_bytes;
  t.f.tp_calls = load.exposed_bytes > 0 ? v.layers : 0;
  t.f.kernels = 12 * v.layers;
  t.f.layer_begin = 0, t.f.layer_end = v.layers;
  t.act_bytes = act / gpus;
  t.out_bytes = tokens * c.model.llm.hidden * kBf16 / gpus;
  t.b = t.f;
  // Backward = 2x forward, + the forward again under full recompute, + the core attention's
  // forward again under selective (it keeps no attention output or log-sum-exp).
  t.b.flops = (v.recompute == Recompute::kFull ? 3 : 2) * t.f.flops;
  t.b.attn_flops = (v.recompute == Recompute::kFull ? 3 : 2) * t.f.attn_flops;
  if (v.recompute == Recompute::kSelective)
    t.b.flops += t.f.attn_flops, t.b.attn_flops += t.f.attn_flops;
  t.b.model_flops = 2 * model_flops, t.b.hbm_bytes = 2 * t.f.hbm_bytes;
  t.f.hbm_bytes += store_hbm, t.b.hbm_bytes += store_hbm;  // FP8 storage: (de)quantise
  t.b.tp_bytes = 2 * t.f.tp_bytes, t.b.tp_calls = 2 * t.f.tp_calls, t.b.kernels = 2 * t.f.kernels;
  if (store_hbm > 0) t.f.kernels += v.layers, t.b.kernels += v.layers;  // (de)quantise
  t.f.saved_fp8 = store_hbm > 0;
  if (v.tp > 1) {
    // Encoder tensor parallelism (model.vision.tp): a TP group runs the images its GPUs
    // would have run one by one, with Megatron's 2 all-reduces per layer in the forward and
    // 2 in the backward (again in a full-recompute forward), each 2(t-1)/t of the group's
    // activations (bf16) per GPU.
    const double t_ = v.tp, group_patches = patches / gpus * t_;
    const double ar = 2 * (t_ - 1) / t_ * group_patches * v.hidden * kBf16;
    const int again = v.recompute == Recompute::kFull ? 2 : 1;
    t.f.tp_bytes += 2 * v.layers * ar, t.f.tp_calls += 2 * v.layers;
    t.b.tp_bytes += again * 2 * v.layers * ar, t.b.tp_calls += again * 2 * v.layers;
  }
  if (recompute_outputs_only) {
    t.f.mem_delta_bytes = t.out_bytes;
    // It keeps its output only; RECOMPUTE rebuilds the rest (stored as the mode says).
    t.recompute = t.f;
    t.f.saved_fp8 = false;
    t.recompute.model_flops = 0;
    t.recompute.mem_delta_bytes = t.act_bytes;
  } else {
    t.f.mem_delta_bytes = t.act_bytes + t.out_bytes;
  }
  t.b.mem_delta_bytes = -(t.act_bytes + t.out_bytes);
  t.seconds =
      CostModel::Real(c.cluster.spec).ComputeSeconds(t.f, gpus, gpus, 1, c.cluster.gpus_per_node);
  return t;
}

double Tokens(const Config& c, int64_t patches) {
  const int mm = c.model.vision.merge * c.model.vision.merge;
  return static_cast<double>((patches + mm - 1) / mm);
}

// One task over whole images on one rank: dynamic CP inside the rank's GPUs.
VisionTask RankTask(const Config& c, const std::vector<int64_t>& patches, int gpus, double budget_s,
                    bool recompute_outputs_only, const std::vector<int>& min_k = {}) {
  CpPlan plan = PlanVisionCp(c, patches, gpus, {}, budget_s, min_k);
  double model = 0, act = 0, tokens = 0, total = 0;
  for (int64_t p : patches) {
    model += VisionImageFlops(c, p), act += VisionActBytes(c, p), tokens += Tokens(c, p);
    total += static_cast<double>(p);
  }
  size_t busiest =
      std::max_element(plan.gpu_flops.begin(), plan.gpu_flops.end()) - plan.gpu_flops.begin();
  const GpuLoad load{plan.gpu_flops[busiest], plan.gpu_attn_flops[busiest],
                     plan.gpu_exposed_bytes[busiest]};
  return TaskFromLoad(c, load, model, act, tokens, total, gpus, recompute_outputs_only);
}

// Per rank, where its encoder work would end so far in its idle time (fluid: work may be
// cut anywhere): forwards from the step's start, backwards from their release.
struct Cursors {
  std::vector<double> fwd, bwd;
};

// PlanVisionCp's items of round m, placed on the stage where they would be least late
// (VisionPool::timeline). Stage s owns GPUs [s * per_stage, (s + 1) * per_stage) of the
// global order, G = `gpus` per rank; a gang's sub-group stays in one stage. A rank runs
// one task per replica, its whole images side by side on the G GPUs, and its tasks (and
// gang shards) one after another: an image joins its replica's task on a rank where it
// adds no time, else it holds a rank of its own (its load on each of the rank's GPUs).
// `rank_of`: a GPU's rank.
template <class RankOf>
CpPlan PlanVisionTimed(const Config& c, const std::vector<int64_t>& patches,
                       const std::vector<int>& source, int m, int per_stage, int gpus,
                       const TextTimeline& tl, const RankOf& rank_of, std::vector<double>* carry,
                       double budget_s, Cursors* cur) {
  const int world = static_cast<int>(carry->size()), stages = world / per_stage;
  CpPlan plan = EmptyPlan(world);
  int levels = 0;
  plan.items = SplitItems(c, patches, world, budget_s, &levels, gpus);
  LongestFirst(&plan.items);
  std::vector<RankLoads> loads;
  for (int s = 0; s < stages; ++s)
    loads.emplace_back(carry, s * per_stage, per_stage, gpus, levels);
  const VisionConfig& v = c.model.vision;
  const int kmax = 1 << levels;
  // Where an item of split k would go: the block, how late, and the tie-break.
  struct Choice {
    int first = -1;
    double late = 0, tie = 0;
  };
  RoundTasks tasks(gpus);
  for (CpItem& it : plan.items) {
    const int64_t P = patches[it.image];
    const size_t key = static_cast<size_t>(source[it.image]) * c.training.microbatches + m;
    const int joined =
        it.k < gpus ? tasks.Join(source[it.image], it.k, ShardSeconds(c, P, it.k)) : -1;
    if (joined >= 0) {
      it.first_gpu = joined;
      Charge(it, &plan);
      continue;
    }
    // Ranks of a block of k GPUs: its first GPU's rank, and one per G GPUs of a gang.
    auto for_ranks = [&](int first, int k, auto&& fn) {
      for (int g = first; g < first + std::max(k, gpus); g += gpus) fn(rank_of(g));
    };
    // Where the forward and the backward of a block's item (k GPUs from `first`; its shard
    // takes f and b seconds) would end: a gang's shards run together, from when the last of
    // its ranks is free, and hold every one of them until the slowest ends.
    auto ends = [&](int first, int k, double f, double b) {
      double fs = 0, bs = tl.release[key], fe = 0, be = 0;
      for_ranks(first, k,
                [&](int r) { fs = std::max(fs, cur->fwd[r]), bs = std::max(bs, cur->bwd[r]); });
      for_ranks(first, k, [&](int r) {
        fe = std::max(fe, tl.Advance(r, fs, f)), be = std::max(be, tl.Advance(r, bs, b));
      });
      return std::pair{fe, be};
    };
    // Least late first (the forward past the consumer's text F, the backward past the
    // end of the text); among blocks on time the least loaded, among blocks late by as
    // much the one whose text ends first (a text that runs late delays the others more).
    auto choose = [&](int k) {
      Choice best;
      const double f = ShardSeconds(c, P, k), b = ShardBackwardSeconds(c, P, k);
      for (int s = 0; s < stages; ++s) {
        const int local = loads[s].Best(k);
        const int first = s * per_stage + local;
        // On time on a stage already: one at least as loaded is not chosen (on time it
        // loses the tie, late it loses on lateness), so where its item would end is not
        // needed.
        const double load = loads[s].Load(local, k);
        if (best.first >= 0 && best.late == 0 && load >= best.tie) continue;
        const auto [fe, be] = ends(first, k, f, b);
        const double late = std::max({0.0, fe - tl.due[key], be - tl.end});
        const double tie = late > 0 ? tl.TextEnd(rank_of(first)) : load;
        if (best.first < 0 || late < best.late || (late == best.late && tie < best.tie))
          best = {first, late, tie};
      }
      return best;
    };
    Choice best = choose(it.k);
    // Released too late to end before the text does even on a rank with nothing else to
    // run (the last micro-batches' backwards): no text can hide such an item, only its
    // latency counts, so it may be split below cp_threshold_patches, over its rank's GPUs
    // (a gang over ranks would hold them together while their forwards, mid-step, wait
    // for each other). An item late for the load around it is not (its gather-KV would
    // add to that load), nor are the first micro-batches' forwards (measured: splitting
    // them lengthens the step's head, all of whose work runs before any text).
    auto critical = [&](int k) {
      return 2 * k <= gpus && tl.release[key] + ShardBackwardSeconds(c, P, k) > tl.end;
    };
    // Late everywhere: an image that may be split is split further while that makes it
    // less late (its shard faster), so the last micro-batches' work spreads out.
    while (best.late > 0 && v.cp && (P > v.cp_threshold_patches || critical(it.k)) && it.k < kmax &&
           ShardSeconds(c, P, 2 * it.k) < ShardSeconds(c, P, it.k)) {
      const Choice wider = choose(2 * it.k);
      if (wider.late >= best.late) break;
      best = wider, it.k *= 2;
    }
    it = Sized(c, P, it);
    it.first_gpu = best.first;
    const auto [fe, be] =
        ends(best.first, it.k, ShardSeconds(c, P, it.k), ShardBackwardSeconds(c, P, it.k));
    for_ranks(best.first, it.k, [&](int r) { cur->fwd[r] = fe, cur->bwd[r] = be; });
    loads[best.first / per_stage].Add(best.first % per_stage, it.k, it.flops_per_gpu);
    if (it.k < gpus) tasks.Open(source[it.image], best.first, it.k, ShardSeconds(c, P, it.k));
    Charge(it, &plan);
  }
  ImageOrder(&plan.items);
  return plan;
}

// PlanVisionCp's items of round m over every GPU of the job, in ranks of G = `gpus`
// (RoundTasks): an image joins its replica's task where it adds no time, else it goes to
// the least-loaded rank (a gang: the least-loaded aligned sub-group).
CpPlan PlanVisionRanks(const Config& c, const std::vector<int64_t>& patches,
                       const std::vector<int>& source, int gpus, std::vector<double>* carry,
                       double budget_s) {
  const int world = static_cast<int>(carry->size());
  CpPlan plan = EmptyPlan(world);
  int levels = 0;
  plan.items = SplitItems(c, patches, world, budget_s, &levels, gpus);
  LongestFirst(&plan.items);
  RankLoads loads(carry, 0, world, gpus, levels);
  RoundTasks tasks(gpus);
  for (CpItem& it : plan.items) {
    const int src = source[it.image];
    const double secs = ShardSeconds(c, patches[it.image], it.k);
    it.first_gpu = it.k < gpus ? tasks.Join(src, it.k, secs) : -1;
    if (it.first_gpu < 0) {
      it.first_gpu = loads.Best(it.k);
      loads.Add(it.first_gpu, it.k, it.flops_per_gpu);
      if (it.k < gpus) tasks.Open(src, it.first_gpu, it.k, secs);
    }
    Charge(it, &plan);
  }
  ImageOrder(&plan.items);
  return plan;
}

// The vision tasks of micro-batch m of every replica.
// Consumer mode (inline): all images of (d, m) on the replica's first stage, its GPUs.
// Pool mode: dynamic CP plans all images of round m over every GPU of the job (global
// GPU order: a node is a contiguous block, so sub-groups stay inside nodes) in ranks of
// G GPUs (RoundTasks). Images on one rank become that rank's task (one per source
// replica); an image whose sub-group spans ranks becomes a gang, one shard per rank.
// `carry`: each GPU's encoder load from earlier rounds (pool mode; a task's load is on
// every GPU of its rank), so that the rounds balance in total and a tie does not send
// every round's largest image to one rank.
void AddVisionTasks(const Config& c, const StepBatch& batch, int m, const VisionPool& pool,
                    const std::vector<double>& text_flops, bool recompute_outputs_only,
                    std::vector<double>* carry, Cursors* cur, std::vector<VisionTask>* out) {
  const ParallelConfig& p = c.parallel;
  const int G = p.tp * p.cp, dp = static_cast<int>(batch.replicas.size());
  std::vector<int64_t> patches;
  std::vector<int> source;
  for (int d = 0; d < dp; ++d)
    for (const Sample& s : batch.replicas[d][m].samples)
      for (const Image& img : s.images)
        patches.push_back(Patches(img, c.model.vision.patch)), source.push_back(d);
  // Task ids are unique within the round (micro-batch index) across replicas, so that
  // (micro-batch, task, shard) names a task on whichever rank runs it.
  int next_task = 0;
  if (pool.consumer_only) {
    for (int d = 0; d < dp; ++d) {
      std::vector<int64_t> mine;
      for (size_t i = 0; i < patches.size(); ++i)
        if (source[i] == d) mine.push_back(patches[i]);
      if (mine.empty()) continue;
      VisionTask t = RankTask(c, mine, G, pool.latency_budget_s, recompute_outputs_only);
      t.d = d, t.mb = m, t.task = next_task++, t.rank = d * p.pp;
      out->push_back(t);
    }
    return;
  }
  const int world = dp * p.pp * G;
  auto rank_of = [&](int gpu) { return (gpu % (dp * G)) / G * p.pp + gpu / (dp * G); };
  carry->resize(world, 0.0);
  const double budget = pool.latency_budget_s;
  const bool timed = pool.timeline && TimedPlacementFits(c);
  if (!timed && !text_flops.empty())
    for (int g = 0; g < world; ++g) (*carry)[g] += text_flops[g / (dp * G)];
  if (timed && cur->fwd.empty()) cur->fwd.assign(world / G, 0.0), cur->bwd.assign(world / G, 0.0);
  CpPlan plan = timed ? PlanVisionTimed(c, patches, source, m, dp * G, G, *pool.timeline, rank_of,
                                        carry, budget, cur)
                      : PlanVisionRanks(c, patches, source, G, carry, budget);
  // Per (rank, source replica): its images and, timed, the split each was placed with (a
  // rank task keeps it).
  struct Images {
    std::vector<int64_t> patches;
    std::vector<int> k;
  };
  std::map<std::pair<int, int>, Images> whole;
  std::vector<const CpItem*> gangs;
  for (const CpItem& it : plan.items) {
    if (it.k > G) {
      gangs.push_back(&it);
      continue;
    }
    Images& mine = whole[{rank_of(it.first_gpu), source[it.image]}];
    mine.patches.push_back(patches[it.image]);
    if (timed) mine.k.push_back(it.k);
  }
  for (auto& [key, task] : whole) {
    VisionTask t = RankTask(c, task.patches, G, budget, recompute_outputs_only, task.k);
    t.d = key.second, t.mb = m, t.task = next_task++, t.rank = key.first;
    out->push_back(t);
  }
  for (const CpItem* it : gangs) {
    const int n = it->k / G, d = source[it->image];
    const int64_t P = patches[it->image];
    std::vector<int> ranks;
    for (int k = 0; k < n; ++k) ranks.push_back(rank_of(it->first_gpu + k * G));
    for (int k = 0; k < n; ++k) {
      VisionTask t = TaskFromLoad(
          c, {it->flops_per_gpu, it->attn_flops_per_gpu, it->exposed_gather_bytes_per_gpu},
          VisionImageFlops(c, P) / n, VisionActBytes(c, P) / n, Tokens(c, P) / n,
          static_cast<double>(P) / n, G, recompute_outputs_only);
      t.d = d, t.mb = m, t.task = next_task, t.rank = ranks[k], t.shard = k, t.gang_ranks = ranks;
      out->push_back(t);
    }
    ++next_task;
  }
}

}  // namespace

bool TimedPlacementFits(const Config& c) {
  const int world = c.world();
  return std::min(c.model.vision.cp_max_group, world) <= world / c.parallel.pp;
}

GeneratorFlops GeneratorForward(const Config& c, const MicroBatch& mb) {
  const GeneratorConfig& g = c.model.generator;
  const double D = g.hidden, M = g.mlp;
  GeneratorFlops out;
  for (const Sample& s : mb.samples) {
    if (s.gen_height == 0) continue;
    const double latent = std::ceil(double(s.gen_height) / g.latent_patch) *
                          std::ceil(double(s.gen_width) / g.latent_patch);
    // Joint attention over latent + condition tokens.
    const double T = latent + static_cast<double>(s.text_tokens);
    out.flops += g.layers * (2 * T * (4 * D * D + 2 * D * M + 6 * D * D) + 4 * T * T * D);
    out.attn += g.layers * 4 * T * T * D;
    out.tokens += T;
  }
  return out;
}

ModalityWork BuildModalityWork(const Config& c, const StepBatch& batch, const VisionPool& pool,
                               bool recompute_outputs_only) {
  ModalityWork w;
  const VisionConfig& v = c.model.vision;
  const GeneratorConfig& g = c.model.generator;
  const double h = c.model.llm.hidden;
  const int gpus = c.parallel.tp * c.parallel.cp;
  CostModel cost = CostModel::Real(c.cluster.spec);
  if (v.enabled) {
    const double d = v.hidden, mlp = v.mlp, in = d * v.merge * v.merge;
    w.vision_params = v.layers * (4 * d * d + 2 * d * mlp + 4 * d) + in * h + h * h;
  }
  if (g.enabled)
    w.generator_params =
        g.layers * (4.0 * g.hidden * g.hidden + 2.0 * g.hidden * g.mlp + 6.0 * g.hidden * g.hidden);
  const int rounds = batch.replicas.empty() ? 0 : static_cast<int>(batch.replicas[0].size());
  std::vector<double> carry;
  Cursors cursors;
  VisionPool round_pool = pool;
  const bool text_balanced = pool.text_round_s.size() == static_cast<size_t>(c.parallel.pp);
  // The step's images, each on one GPU: forward seconds, forward FLOPs, forward and
  // backward seconds.
  double step = 0, image_flops = 0, busy = 0;
  if (v.enabled && !pool.consumer_only && (pool.latency_budget_s > 0 || text_balanced))
    for (const auto& replica : batch.replicas)
      for (const MicroBatch& mb : replica)
        for (const Sample& smp : mb.samples)
          for (const Image& img : smp.images) {
            const int64_t P = Patches(img, v.patch);
            const double f = ShardSeconds(c, P, 1);
            step += f;
            image_flops += SplitFlops(c, P, 1);
            busy += f + ShardBackwardSeconds(c, P, 1);
          }
  if (v.enabled && pool.latency_budget_s > 0 && !pool.consumer_only) {
    // Balance: longest-first placement on the least-loaded rank leaves the busiest rank at
    // most one item above the mean, so an image may stay whole only while its forward is
    // at most what a GPU's encoder forwards take in `window_rounds` rounds on average (the
    // same rule for any micro-batch count).
    const double per_gpu = step / c.world();
    round_pool.latency_budget_s =
        std::min(pool.latency_budget_s, per_gpu / std::max(1, rounds) * pool.window_rounds);
  }
  // Per stage, a round's text seconds over the lightest stage's, in encoder forward FLOPs
  // per GPU of as many seconds of encoder work (its forwards and backwards, at the rates of
  // the step's images on one GPU each).
  std::vector<double> text_flops;
  if (v.enabled && text_balanced && !pool.consumer_only && busy > 0) {
    const double lightest = *std::min_element(pool.text_round_s.begin(), pool.text_round_s.end());
    for (double s : pool.text_round_s) text_flops.push_back((s - lightest) * image_flops / busy);
  }
  if (v.enabled)
    for (int m = 0; m < rounds; ++m)
      AddVisionTasks(c, batch, m, round_pool, text_flops, recompute_outputs_only, &carry, &cursors,
                     &w.vision);
  for (size_t d = 0; d < batch.replicas.size(); ++d) {
    for (size_t m = 0; m < batch.replicas[d].size(); ++m) {
      const MicroBatch& mb = batch.replicas[d][m];
      if (g.enabled) {
        GeneratorTask t;
        t.d = static_cast<int>(d), t.mb = static_cast<int>(m);
        const double D = g.hidden, M = g.mlp;
        const auto [flops, attn, tokens] = GeneratorForward(c, mb);
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
        const SavedBytes saved = SavedPerToken(g.recompute, g.saved_activations, D, M, g.heads);
        const double act = tokens / gpus * g.layers * saved.kept;
        t.f.mem_delta_bytes = act;
        t.b = t.f;
        // Recomputed in the backward: the whole forward (full) or its core attention
        // (selective).
        const int again = g.recompute == Recompute::kFull ? 1 : 0;
        const double attn_again = g.recompute == Recompute::kSelective ? attn : 0;
        t.b.flops = (2 + again) * flops + attn_again, t.b.model_flops = 2 * flops,
        t.b.attn_flops = (2 + again) * attn + attn_again;
        t.b.hbm_bytes = 2 * t.f.hbm_bytes;
        const double store_hbm = tokens / gpus * g.layers * saved.quantise_hbm;
        t.f.hbm_bytes += store_hbm, t.b.hbm_bytes += store_hbm;  // FP8 storage: (de)quantise
        t.b.tp_bytes = t.f.tp_bytes, t.b.tp_calls = t.f.tp_calls, t.b.kernels = 2 * t.f.kernels;
        if (store_hbm > 0) t.f.kernels += g.layers, t.b.kernels += g.layers;  // (de)quantise
        t.f.saved_fp8 = store_hbm > 0;
        t.b.mem_delta_bytes = -act;
        t.seconds = cost.ComputeSeconds(t.f, gpus, gpus, 1, c.cluster.gpus_per_node);
        t.tokens = tokens;
        w.generator.push_back(t);
      }
    }
  }
  return w;
}

std::vector<PieceWork> SplitTask(const VisionTask& t, const std::vector<int>& bounds) {
  std::vector<PieceWork> out;
  const int layers = t.f.layer_end - t.f.layer_begin;
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    const bool last = k + 2 == bounds.size();
    const double act = t.act_bytes * (bounds[k + 1] - bounds[k]) / layers;
    PieceWork p{LayerShare(t.f, bounds[k], bounds[k + 1]),
                LayerShare(t.b, bounds[k], bounds[k + 1])};
    p.f.mem_delta_bytes = act + (last ? t.out_bytes : 0);
    p.b.mem_delta_bytes = -p.f.mem_delta_bytes;
    out.push_back(p);
  }
  return out;
}

PieceWork GeneratorShard(const Config& c, const GeneratorTask& t, int k, bool across_nodes) {
  const GeneratorConfig& g = c.model.generator;
  const GpuSpec& s = c.cluster.spec;
  PieceWork p{t.f, t.b};
  for (Work* w : {&p.f, &p.b}) {
    w->flops /= k, w->attn_flops /= k, w->model_flops /= k, w->hbm_bytes /= k;
    w->mem_delta_bytes /= k;
  }
  if (k > 1) {
    const double q = t.tokens / k;
    const double bw =
        across_nodes ? s.nic_bw * s.nic_efficiency : s.nvlink_bw * s.nvlink_efficiency;
    const double hop = q * 2 * g.hidden * kBf16;
    const double block_s = 4 * q * q * g.hidden / (s.bf16_flops * s.attention_efficiency);
    const double exposed = g.layers * (k - 1) * std::max(0.0, hop - block_s * bw);
    // Forward: one ring per layer; backward: K/V again and their gradients back.
    p.f.tp_bytes += exposed, p.b.tp_bytes += 2 * exposed;
    if (exposed > 0) p.f.tp_calls += g.layers, p.b.tp_calls += 2 * g.layers;
  }
  return p;
}

}  // namespace pipeplan
