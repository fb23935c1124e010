#include "planner/tune.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <unordered_map>

#include "core/files.h"
#include "core/parallel.h"
#include "core/version.h"
#include "planner/data.h"
#include "planner/modality.h"
#include "planner/plan.h"
#include "planner/schedules.h"
#include "planner/workload.h"
#include "planner/yaml_doc.h"

namespace pipeplan {
namespace {

// Keys a point sets, in this order (also the order of the output's columns).
constexpr const char* kTp = "parallelism.tp";
constexpr const char* kCp = "parallelism.cp";
constexpr const char* kPp = "parallelism.pp";
constexpr const char* kVp = "parallelism.vp";
constexpr const char* kEp = "parallelism.ep";
constexpr const char* kFirst = "parallelism.num_layers_in_first_pipeline_stage";  // 0: even
constexpr const char* kLast = "parallelism.num_layers_in_last_pipeline_stage";    // 0: even
// Uneven stages: each virtual stage of the first or the last pipeline rank (or both) holds
// this many layers fewer than each virtual stage of the other ranks.
constexpr int kLighter[] = {1, 2};
// Megatron's embedding and loss accounted for in the pipeline split ("true" / "false"): the
// first (last) virtual stage one layer lighter than the others; only with virtual stages
// (with one chunk per rank the first and last counts above give the same stages).
constexpr const char* kEmbedding = "parallelism.account_for_embedding_in_pipeline_split";
constexpr const char* kLoss = "parallelism.account_for_loss_in_pipeline_split";
constexpr const char* kMbs = "training.micro_batch_size";
constexpr const char* kRecompute = "training.recompute";
constexpr const char* kPipeline = "schedule.pipeline";
constexpr const char* kModality = "schedule.modality";

// Keys of the config that a point's values replace or that follow from them (and their
// aliases): erased before a point is applied, so that the file's own layout, micro-batch
// count or data-parallel size cannot contradict the point.
constexpr const char* kDerivedKeys[] = {
    "parallelism.tensor_model_parallel_size",
    "parallelism.pipeline_model_parallel_size",
    "parallelism.virtual_pipeline_model_parallel_size",
    "parallelism.context_parallel_size",
    "parallelism.expert_model_parallel_size",
    "parallelism.dp",
    "parallelism.data_parallel_size",
    "parallelism.pipeline_model_parallel_layout",
    "parallelism.layout",
    "parallelism.num_layers_in_first_pipeline_stage",
    "parallelism.first_stage_layers",
    "parallelism.num_layers_in_last_pipeline_stage",
    "parallelism.last_stage_layers",
    "parallelism.num_layers_per_virtual_pipeline_stage",
    "parallelism.account_for_embedding_in_pipeline_split",
    "parallelism.account_for_loss_in_pipeline_split",
    "parallelism.microbatch_group_size_per_vp_stage",
    "training.microbatches",
    "training.num_microbatches",
    "training.gbs",
    "training.mbs",
    "schedule.csv",
    "schedule.zb_max_pending",
};
// Other names of the axes' keys (config.cc's aliases), for --set.
constexpr std::pair<const char*, const char*> kAxisAliases[] = {
    {"parallelism.tensor_model_parallel_size", kTp},
    {"parallelism.context_parallel_size", kCp},
    {"parallelism.pipeline_model_parallel_size", kPp},
    {"parallelism.virtual_pipeline_model_parallel_size", kVp},
    {"parallelism.expert_model_parallel_size", kEp},
    {"training.mbs", kMbs},
    {"parallelism.first_stage_layers", kFirst},
    {"parallelism.last_stage_layers", kLast},
};
constexpr long kMaxAxisValue = 1 << 20;
// Per-rank (or per-stage) lists only fit the pipeline they were written for.
constexpr const char* kListKeys[] = {"training.saved_activations", "training.offload"};

std::vector<int> Divisors(int n, int most) {
  std::vector<int> d;
  for (int k = 1; k <= std::min(n, most); ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

std::vector<std::string> Strings(const std::vector<int>& v) {
  std::vector<std::string> s;
  for (int x : v) s.push_back(std::to_string(x));
  return s;
}

constexpr PipelineKind kSchedules[] = {
    PipelineKind::kGpipe,     PipelineKind::k1F1B,         PipelineKind::kInterleaved1F1B,
    PipelineKind::kZbH1,      PipelineKind::kZbH2,         PipelineKind::kZbv,
    PipelineKind::kDualPipeV, PipelineKind::kInterleavedZb};
constexpr ModalityPolicy kModalityPolicies[] = {
    ModalityPolicy::kInline, ModalityPolicy::kDecoupled, ModalityPolicy::kNested,
    ModalityPolicy::kBubbleFill, ModalityPolicy::kOptimus};

// Schedules that take a given vp (config.cc's rules).
bool ScheduleTakes(PipelineKind k, int pp, int vp) {
  if (pp == 1) return k == PipelineKind::k1F1B && vp == 1;  // one stage: all the same
  switch (k) {
    case PipelineKind::kGpipe:
    case PipelineKind::k1F1B:
    case PipelineKind::kZbH1:
    case PipelineKind::kZbH2:
      return vp == 1;
    case PipelineKind::kZbv:
    case PipelineKind::kDualPipeV:
      return vp == 2;
    case PipelineKind::kInterleaved1F1B:
    case PipelineKind::kInterleavedZb:
      return vp >= 2;
    case PipelineKind::kCsv:
      return false;
  }
  return false;
}

// Whether the first and last pipeline ranks' layer counts (0: not set) split `layers` over
// pp ranks of vp chunks as the space allows: evenly over pp x vp chunks when neither is
// set; else x layers on each other rank (at least one), x / vp per chunk, and on each rank
// set x - k vp, k in kLighter (config.cc: SetStages splits them as Megatron-core does).
bool StagesTake(int layers, int pp, int vp, int first, int last) {
  if (first == 0 && last == 0) return layers % (static_cast<int64_t>(pp) * vp) == 0;
  const int others = pp - (first > 0) - (last > 0);
  const int rest = layers - first - last;
  if (others < 1 || rest <= 0 || rest % (static_cast<int64_t>(others) * vp) != 0) return false;
  const int x = rest / others;
  auto lighter = [&](int n) {
    return n == 0 || (n % vp == 0 && std::find(std::begin(kLighter), std::end(kLighter),
                                               (x - n) / vp) != std::end(kLighter));
  };
  return lighter(first) && lighter(last);
}

// Whether the layers with the embedding and/or the loss counted as one each split evenly
// over pp ranks of vp >= 2 chunks (config.cc: RankStageSpans, as Megatron-core splits them).
bool AccountedTake(int layers, int pp, int vp, bool embedding, bool loss) {
  return vp >= 2 && (embedding || loss) &&
         (layers + embedding + loss) % (static_cast<int64_t>(pp) * vp) == 0;
}

// What every point starts from: the config file with the command line's --set overrides,
// the derived keys erased, the global batch and GPU count fixed. A point's document is a
// copy of it (parsing the file once: scanning YAML is most of the cost of a point's bounds)
// with the point's values set.
class Base {
 public:
  Status Init(const std::string& path, const std::vector<std::string>& sets, int global_batch,
              int nodes) {
    ASSIGN_OR_RETURN(YamlDoc doc, YamlDoc::FromFile(path));
    for (const std::string& s : sets) RETURN_IF_ERROR(doc.ApplySet(s));
    for (const char* k : kDerivedKeys) doc.Erase(k);
    std::vector<std::string> lists;
    if (const YAML::Node training = doc.root()["training"]; training.IsMap())
      for (const auto& kv : training)
        for (const char* k : kListKeys)
          if (kv.first.IsScalar() && kv.second.IsSequence() &&
              "training." + kv.first.as<std::string>() == k)
            lists.push_back(k);
    for (const std::string& k : lists) doc.Erase(k);
    RETURN_IF_ERROR(doc.ApplySet(fmt::format("training.global_batch_size={}", global_batch)));
    RETURN_IF_ERROR(doc.ApplySet(fmt::format("cluster.nodes={}", nodes)));
    doc_ = std::move(doc);
    return Status::Ok();
  }

  std::string Yaml() const { return doc_->Dump(); }

  StatusOr<YamlDoc> With(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) const {
    std::optional<YamlDoc> doc;
    {
      std::lock_guard<std::mutex> lock(mu_);  // yaml-cpp promises nothing on shared reads
      doc = doc_->Clone();
    }
    for (size_t a = 0; a < keys.size(); ++a)
      // 0 and false: the key left out
      if (!((keys[a] == kFirst || keys[a] == kLast) && values[a] == "0") &&
          !((keys[a] == kEmbedding || keys[a] == kLoss) && values[a] == "false"))
        RETURN_IF_ERROR(doc->ApplySet(fmt::format("{}={}", keys[a], values[a])));
    return std::move(*doc);
  }

 private:
  std::optional<YamlDoc> doc_;
  mutable std::mutex mu_;
};

std::string FirstLine(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

// GPU-seconds of the step's encoder and generator forwards and backwards, at the rates
// the cost model charges them (CostModel::ComputeParts adds GEMMs at the GEMM rate,
// attention at the attention rate and HBM traffic at its bandwidth; both run in bf16).
// Every sizing of a task (whole images side by side on a rank's GPUs, CP gang shards,
// layer-group pieces, generator shards) runs the same FLOPs and HBM traffic over its GPUs,
// and a rank is busy for its busiest GPU's share, so the ranks' busy seconds hold at least
// these over the GPUs. Left out: launches, gather-KV and TP collectives, decoupled's
// recompute forward. The backward: its GEMMs twice the forward's (three times with full
// recompute), attention as many times and once more under selective recompute (modality.cc:
// TaskFromLoad, BuildModalityWork), HBM traffic twice the forward's. They depend on the
// point only through the step's packing (dp, micro-batches, their size): kept per packing,
// as drawing and packing a large step's samples is most of a bound's cost.
struct ModalityBusy {
  double total_s = 0;           // all of it, GPU-seconds
  double replica_vision_s = 0;  // the encoder's of the replica with the most, GPU-seconds
};
class ModalitySeconds {
 public:
  ModalityBusy Of(const Config& k) {
    const VisionConfig& v = k.model.vision;
    const GeneratorConfig& gen = k.model.generator;
    if (!v.enabled && !gen.enabled) return {};
    const std::array<int, 3> key = {k.parallel.dp, k.training.microbatches,
                                    k.training.micro_batch_size};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = known_.find(key); it != known_.end()) return it->second;
    }
    auto batch = MakeStepBatch(k);
    if (!batch.ok()) return {};
    const GpuSpec& s = k.cluster.spec;
    // One forward's GEMM FLOPs, attention FLOPs and HBM bytes -> forward and backward seconds.
    auto seconds = [&](Recompute r, double gemm, double attn, double hbm) {
      const double again = r == Recompute::kFull ? 1 : 0, sel = r == Recompute::kSelective ? 1 : 0;
      return (3 + again) * gemm / (s.bf16_flops * s.compute_efficiency) +
             (3 + again + sel) * attn / (s.bf16_flops * s.attention_efficiency) +
             3 * hbm / (s.hbm_bw * s.hbm_efficiency);
    };
    ModalityBusy busy;
    for (const auto& replica : batch->replicas) {
      double vision = 0;
      for (const MicroBatch& mb : replica) {
        if (v.enabled)
          for (const Sample& smp : mb.samples)
            for (const Image& img : smp.images) {
              const double P = static_cast<double>(Patches(img, v.patch));
              const double attn = v.layers * 4 * P * P * v.hidden;
              vision += seconds(v.recompute, VisionImageFlops(k, Patches(img, v.patch)) - attn,
                                attn, P * v.layers * (20.0 * v.hidden + 4.0 * v.mlp));
            }
        if (gen.enabled) {
          const GeneratorFlops g = GeneratorForward(k, mb);
          busy.total_s += seconds(gen.recompute, g.flops - g.attn, g.attn,
                                  g.tokens * gen.layers * (20.0 * gen.hidden + 4.0 * gen.mlp));
        }
      }
      busy.total_s += vision;
      busy.replica_vision_s = std::max(busy.replica_vision_s, vision);
    }
    std::lock_guard<std::mutex> lock(mu_);
    return known_[key] = busy;
  }

 private:
  std::mutex mu_;
  std::map<std::array<int, 3>, ModalityBusy> known_;
};

// Per pipeline stage, the numbers of micro-batches whose saved activations each chunk
// holds after each forward of a text schedule's order (distinct vectors only): the text
// activations of a rank peak at one of them. The order is taken at its most frugal: a
// split backward frees at its I what its W frees later (the list scheduler may pull a W
// earlier, never before its I), and an overlapped pair frees before it allocates. Kept per
// schedule shape, which many points share.
class AliveCounts {
 public:
  using Counts = std::vector<std::vector<std::vector<int>>>;  // [stage][vector][chunk]
  // Null when the schedule cannot be built (the point's own plan then reports why).
  std::shared_ptr<const Counts> Of(const Config& k, PipelineKind kind) {
    const ParallelConfig& par = k.parallel;
    const std::array<int, 6> key = {static_cast<int>(kind),
                                    par.pp,
                                    par.vp,
                                    k.training.microbatches,
                                    par.microbatch_group_size_per_vp_stage,
                                    k.schedule.zb_max_pending};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = known_.find(key); it != known_.end()) return it->second;
    }
    std::shared_ptr<Counts> counts;
    auto orders = TextSchedule(kind, par.pp, par.vp, k.training.microbatches,
                               par.microbatch_group_size_per_vp_stage, k.schedule.zb_max_pending);
    if (orders.ok()) {
      counts = std::make_shared<Counts>();
      for (const StageOrder& order : *orders) {
        std::set<std::vector<int>> seen;
        std::vector<int> alive(par.vp, 0);
        for (size_t i = 0; i < order.size(); ++i) {
          // An overlapped pair (F and B as one unit): its backward's free first.
          const bool pair = order[i].overlap_next && i + 1 < order.size();
          const size_t last = pair ? i + 1 : i;
          for (int frees : {1, 0})
            for (size_t j = i; j <= last; ++j) {
              const Step& st = order[j];
              if (frees && (st.kind == OpKind::kB || st.kind == OpKind::kI)) --alive[st.chunk];
              if (!frees && st.kind == OpKind::kF) ++alive[st.chunk], seen.insert(alive);
            }
          i = last;
        }
        counts->emplace_back(seen.begin(), seen.end());
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    return known_[key] = counts;
  }

 private:
  std::mutex mu_;
  std::map<std::array<int, 6>, std::shared_ptr<const Counts>> known_;
};

// What the bounds of a group of points (one config, any schedule) are computed from: the
// text workload per stage placement, and the encoder's and generator's GPU-seconds.
struct ShapeWork {
  ModalitySeconds* modality;
  AliveCounts* alive;
  std::optional<TextWorkload> by_placement[2];  // StagePlacement kLoop, kV
  const TextWorkload& Text(const Config& k, StagePlacement placement) {
    auto& tw = by_placement[placement == StagePlacement::kV];
    if (tw) return *tw;
    // The first and last ranks' layer counts give each placement its own stages.
    const ParallelConfig& par = k.parallel;
    if (par.layout.empty() && (par.first_stage_layers || par.last_stage_layers) &&
        PlacementOf(k.schedule.pipeline) != placement) {
      Config other = k;
      other.parallel.stages = RankStageSpans(par, k.model.llm.layers, placement);
      tw = BuildTextWorkload(other, placement);
    } else {
      tw = BuildTextWorkload(k, placement);
    }
    return *tw;
  }
};

// The bounds of the header comment (tune.h). `kind`: the point's schedule (k may be the
// config of another point of its group).
void Bound(const Config& k, PipelineKind kind, ModalityPolicy policy, ShapeWork* shape,
           TunePoint* p) {
  const TextWorkload& tw = shape->Text(k, PlacementOf(kind));
  const CostModel cost = CostModel::Real(k.cluster.spec);
  const ParallelConfig& par = k.parallel;
  const StagePlacement placement = PlacementOf(kind);
  const bool pairs = kind == PipelineKind::kDualPipeV;  // F/B pairs hide their communication
  auto seconds = [&](const Work& w) {
    const auto parts =
        cost.ComputeParts(w, par.tp * par.cp, par.tp, par.ep, k.cluster.gpus_per_node);
    return pairs ? parts.kernels
                 : cost.ComputeSeconds(w, par.tp * par.cp, par.tp, par.ep, k.cluster.gpus_per_node);
  };
  const TrainingConfig& t = k.training;
  const double m = t.microbatches;
  const SimOptions so = SimOptionsFor(k);
  const bool split = SplitsBackward(kind);
  // The input-gradient part of a backward: B, or (split) I; what must follow it down the
  // pipeline.
  auto input_grad = [&](int g) { return split ? seconds(tw.i[g]) : seconds(tw.b[g]); };
  double head = 0, tail = 0;  // forwards / input gradients of global stages 0..s-1
  double text_rank_s = 0;     // text work of the mean rank
  double first_stage_s = 0;   // of the first stage's ranks
  p->time_bound_s = p->memory_bound_bytes = 0;
  // Saved text activations: none under memory: auto, which may choose modes that keep
  // fewer bytes than the configured ones; one forward's where activations are offloaded
  // (copies may leave as soon as a forward ends); else their peak over the schedule's order.
  bool offloads = t.offload != ActPlace::kDevice;
  for (ActPlace a : t.offload_by_rank) offloads = offloads || a != ActPlace::kDevice;
  const auto alive = t.memory_auto || offloads ? nullptr : shape->alive->Of(k, kind);
  for (int s = 0; s < par.pp; ++s) {
    double work = 0, before_last = 0, params = 0;
    double text_act = t.memory_auto ? 0 : std::numeric_limits<double>::infinity();
    std::vector<double> act(par.vp);
    for (int ch = 0; ch < par.vp; ++ch) {
      const int g = GlobalStage(placement, par.pp, ch, s);
      double b = seconds(tw.b[g]);
      if (split) b = std::min(b, seconds(tw.i[g]) + seconds(tw.w[g]));
      work += seconds(tw.f[g]) + b;
      before_last += seconds(tw.f[g]) + input_grad(g);
      params += tw.params_per_gpu[g];
      act[ch] = std::max(0.0, tw.f[g].mem_delta_bytes);
      if (!t.memory_auto) text_act = std::min(text_act, act[ch]);
    }
    if (alive)
      for (const std::vector<int>& n : (*alive)[s])
        text_act = std::max(text_act, std::inner_product(n.begin(), n.end(), act.begin(), 0.0));
    // Every text op of the rank starts after `head`; its last B (I) follows all its Fs and
    // Bs (Is) and is followed by the B (I) chain of the stages below.
    p->time_bound_s = std::max({p->time_bound_s, head + m * work, head + m * before_last + tail});
    if (s == 0) first_stage_s = m * work;
    const int g0 = GlobalStage(placement, par.pp, 0, s);
    head += seconds(tw.f[g0]), tail += input_grad(g0);
    const double shard = par.dp;
    // memory: auto with gradients may move them to ZeRO-2 (which shards the optimizer
    // states too) or to host memory.
    const bool movable = GradientsMovable(k);
    const double grads =
        t.grad_offload || movable ? 0 : 4 * params / (t.zero_stage >= 2 ? shard : 1);
    const double optimizer =
        (t.muon ? 8 : 12) * params / (t.zero_stage >= 1 || movable ? shard : 1);
    p->memory_bound_bytes = std::max(
        p->memory_bound_bytes, 2 * params + grads + optimizer + so.memory.reserve_bytes + text_act);
    text_rank_s += m * work / par.pp;
  }
  // The encoder's and generator's work adds to the ranks' busy time: the step is at least
  // the mean busy time of a rank, its text work plus that work's GPU-seconds spread over all
  // GPUs. Inline, a replica's first stage runs all of its images (modality.cc,
  // AddVisionTasks) on its tp x cp GPUs, after or between its own text work.
  const ModalityBusy busy = shape->modality->Of(k);
  p->time_bound_s = std::max(p->time_bound_s, text_rank_s + busy.total_s / k.world());
  if (policy == ModalityPolicy::kInline)
    p->time_bound_s =
        std::max(p->time_bound_s, first_stage_s + busy.replica_vision_s / (par.tp * par.cp));
}

// Whether a simulated point fits: not out of memory, and its peak within the capacity
// (the HBM less the headroom).
void Judge(double capacity, TunePoint* p) {
  p->fits = p->state == TuneState::kSimulated && !p->metrics.oom &&
            p->metrics.peak_memory_bytes <= capacity;
  if (p->state == TuneState::kSimulated)
    p->error = p->fits ? "" : p->metrics.oom ? "out of memory" : "within the headroom";
}

// A point's values as one string, in the keys' alphabetical order (a results file's JSON
// objects hold them so): the key of the results files.
std::string PointKey(const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::string>> kv;
  for (size_t a = 0; a < keys.size(); ++a) kv.emplace_back(keys[a], values[a]);
  std::sort(kv.begin(), kv.end());
  std::string k;
  for (const auto& [key, value] : kv) k += key + "=" + value + ";";
  return k;
}

// What a results file was written for: the config every point starts from (after the
// overrides, with the global batch and GPU count) and pipeplan's version (its cost model),
// as a 64-bit FNV-1a hash.
std::string SearchId(const Base& b) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : b.Yaml() + kVersion) h = (h ^ ch) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

constexpr const char* kResultsHeader = "pipeplan_tune_results";

// Reads a results file into `out` (by PointKey). `must_exist`: a missing file is an error
// (else no results). Only whole lines count: a last line without its newline (a run killed
// while writing it) is left out, and `*whole_bytes` (if given) is where it starts. The first
// line must be this search's header, whole; any other line that does not read is an error.
Status ReadResults(const std::string& path, const std::string& search, bool must_exist,
                   std::unordered_map<std::string, TunePoint>* out, size_t* whole_bytes) {
  if (whole_bytes) *whole_bytes = 0;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (must_exist) return InvalidInput(fmt::format("{}: no such results file", path));
    return Status::Ok();
  }
  ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  if (text.empty()) return Status::Ok();
  const size_t whole = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  size_t line_no = 0;
  for (size_t b = 0; b < whole;) {
    const size_t nl = text.find('\n', b);
    const std::string line = text.substr(b, nl - b);
    b = nl + 1;
    ++line_no;
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (line_no == 1) {
        if (!j.is_object() || !j.contains(kResultsHeader))
          return InvalidInput(fmt::format("{}:1: not a tune results file", path));
        const std::string theirs = j.at("search").get<std::string>();
        if (theirs != search)
          return InvalidInput(fmt::format(
              "{}:1: these results are of another search (another config, --set, --gpus or "
              "pipeplan version): search {}, this one {}",
              path, theirs, search));
        continue;
      }
      TunePoint p;
      std::vector<std::string> keys, values;
      for (const auto& [k, v] : j.at("values").items())
        keys.push_back(k), values.push_back(v.get<std::string>());
      const std::string state = j.at("state");
      p.state = state == "simulated" ? TuneState::kSimulated
                : state == "invalid" ? TuneState::kInvalid
                                     : TuneState::kFailed;
      p.error = j.value("error", "");
      if (p.state == TuneState::kSimulated) {
        Metrics& m = p.metrics;
        m.step_time_s = j.at("step_time_s"), m.tokens_per_s = j.at("tokens_per_s");
        m.samples_per_s = j.at("samples_per_s"), m.mfu = j.at("mfu");
        m.megatron_mfu = j.at("megatron_mfu");
        m.model_flops_per_gpu = j.at("model_flops_per_gpu");
        m.peak_memory_bytes = j.at("peak_memory_bytes"), m.hbm_bytes = j.at("hbm_bytes");
        m.oom = j.at("oom");
      }
      (*out)[PointKey(keys, values)] = std::move(p);
    } catch (const nlohmann::json::exception& e) {
      return InvalidInput(
          fmt::format("{}:{}: not a line of tune results: {}", path, line_no, FirstLine(e.what())));
    }
  }
  if (line_no == 0)  // not even a whole header: not a file of ours to append to
    return InvalidInput(fmt::format("{}: not a tune results file (no whole first line)", path));
  if (whole_bytes) *whole_bytes = whole;
  return Status::Ok();
}

// Appends points to a results file as they are simulated (one write and flush per line).
class ResultsWriter {
 public:
  ~ResultsWriter() {
    if (f_) std::fclose(f_);
  }
  bool open() const { return f_ != nullptr; }
  // `whole_bytes`: the file's whole lines (ReadResults); a partial last line is cut off.
  Status Open(const std::string& path, const std::string& search, size_t whole_bytes) {
    path_ = path;
    std::error_code ec;
    if (std::filesystem::exists(path, ec) && std::filesystem::file_size(path, ec) != whole_bytes) {
      std::filesystem::resize_file(path, whole_bytes, ec);
      if (ec) return Internal(fmt::format("{}: cannot drop its last, partial line", path));
    }
    f_ = std::fopen(path.c_str(), "a");
    if (!f_) return Internal(fmt::format("{}: cannot open for appending", path));
    if (whole_bytes == 0) return Write(nlohmann::json{{kResultsHeader, 1}, {"search", search}});
    return Status::Ok();
  }
  Status Append(const std::vector<std::string>& keys, const TunePoint& p) {
    return Write(TunePointJson(keys, p));
  }

 private:
  Status Write(const nlohmann::json& j) {
    const std::string line = j.dump() + "\n";
    if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
      return Internal(fmt::format("{}: write failed", path_));
    return Status::Ok();
  }
  std::string path_;
  std::FILE* f_ = nullptr;
};

void Simulate(const Config& k, double capacity, PlanShare* share, TunePoint* p) {
  MemoryChoice choice;
  auto table = BuildPlan(k, &choice, share);
  if (!table.ok()) {  // a schedule's own rules (micro-batches per stage) refuse it: invalid
    const bool refused = table.status().code() == ErrorCode::kInvalidInput;
    p->state = refused ? TuneState::kInvalid : TuneState::kFailed;
    p->error = FirstLine(table.status().message());
    return;
  }
  auto sim = RunSimulation(*table, SimOptionsFor(WithChoice(k, choice)));
  if (!sim.ok()) {
    p->state = TuneState::kFailed, p->error = FirstLine(sim.status().message());
    return;
  }
  p->metrics = std::move(sim->metrics);
  p->metrics.critical_path.clear();
  p->metrics.ranks.clear();
  p->state = TuneState::kSimulated;
  Judge(capacity, p);
}

bool Better(const TunePoint& a, size_t ai, const TunePoint& b, size_t bi) {
  return a.metrics.step_time_s != b.metrics.step_time_s
             ? a.metrics.step_time_s < b.metrics.step_time_s
             : ai < bi;
}

// A config's values on the search's axes (`keys`), or empty where it is on none of the
// grid's points: a layout string, recompute per pipeline rank.
std::vector<std::string> AxisValues(const Config& k, const std::vector<std::string>& keys) {
  const ParallelConfig& p = k.parallel;
  if (!p.layout.empty() || !k.training.recompute_by_rank.empty()) return {};
  std::vector<std::string> v;
  for (const std::string& key : keys) {
    if (key == kTp)
      v.push_back(std::to_string(p.tp));
    else if (key == kCp)
      v.push_back(std::to_string(p.cp));
    else if (key == kPp)
      v.push_back(std::to_string(p.pp));
    else if (key == kVp)
      v.push_back(std::to_string(p.vp));
    else if (key == kEp)
      v.push_back(std::to_string(p.ep));
    else if (key == kFirst)
      v.push_back(std::to_string(p.first_stage_layers));
    else if (key == kLast)
      v.push_back(std::to_string(p.last_stage_layers));
    else if (key == kEmbedding)
      v.emplace_back(p.account_for_embedding ? "true" : "false");
    else if (key == kLoss)
      v.emplace_back(p.account_for_loss ? "true" : "false");
    else if (key == kMbs)
      v.push_back(std::to_string(k.training.micro_batch_size));
    else if (key == kRecompute)
      v.emplace_back(RecomputeName(k.training.recompute));
    else if (key == kPipeline)
      v.emplace_back(PipelineName(k.schedule.pipeline));
    else if (key == kModality)
      v.emplace_back(ModalityName(k.schedule.modality));
    else
      return {};
  }
  return v;
}

}  // namespace

StatusOr<TuneObjective> ParseTuneObjective(const std::string& name) {
  for (TuneObjective o :
       {TuneObjective::kTokensPerS, TuneObjective::kStepTime, TuneObjective::kMfu})
    if (name == TuneObjectiveName(o)) return o;
  return InvalidInput(fmt::format("--objective {}: expected tokens_per_s, step_time or mfu", name));
}

std::string_view TuneObjectiveName(TuneObjective o) {
  switch (o) {
    case TuneObjective::kTokensPerS:
      return "tokens_per_s";
    case TuneObjective::kStepTime:
      return "step_time";
    case TuneObjective::kMfu:
      return "mfu";
  }
  return "?";
}

std::string_view TuneStateName(TuneState s) {
  switch (s) {
    case TuneState::kInvalid:
      return "invalid";
    case TuneState::kPrunedMemory:
      return "pruned (memory bound)";
    case TuneState::kPrunedTime:
      return "pruned (time bound)";
    case TuneState::kOverBudget:
      return "not reached (budget)";
    case TuneState::kFailed:
      return "failed";
    case TuneState::kSimulated:
      return "simulated";
    case TuneState::kOtherShard:
      return "another shard's";
  }
  return "?";
}

nlohmann::json TunePointJson(const std::vector<std::string>& keys, const TunePoint& p) {
  nlohmann::json values = nlohmann::json::object();
  for (size_t a = 0; a < p.values.size(); ++a) values[keys[a]] = p.values[a];
  nlohmann::json j = {{"values", values},
                      {"state", TuneStateName(p.state)},
                      {"time_bound_s", p.time_bound_s},
                      {"memory_bound_bytes", p.memory_bound_bytes}};
  if (!p.error.empty()) j["error"] = p.error;
  if (p.state == TuneState::kSimulated) {
    const Metrics& m = p.metrics;
    j.update({{"step_time_s", m.step_time_s},
              {"tokens_per_s", m.tokens_per_s},
              {"samples_per_s", m.samples_per_s},
              {"mfu", m.mfu},
              {"megatron_mfu", m.megatron_mfu},
              {"model_flops_per_gpu", m.model_flops_per_gpu},
              {"peak_memory_bytes", m.peak_memory_bytes},
              {"hbm_bytes", m.hbm_bytes},
              {"oom", m.oom},
              {"fits", p.fits},
              {"pareto", p.pareto}});
  }
  return j;
}

size_t TuneResult::count(TuneState s) const {
  return std::count_if(points.begin(), points.end(),
                       [s](const TunePoint& p) { return p.state == s; });
}

std::vector<VaryAxis> TuneSpace(const Config& c, int gpus) {
  const LlmConfig& l = c.model.llm;
  const int gpn = c.cluster.gpus_per_node;
  std::vector<VaryAxis> axes;
  std::vector<int> tp;
  for (int d : Divisors(gpn, gpn))
    if (l.heads % d == 0) tp.push_back(d);
  axes.push_back({kTp, Strings(tp)});
  std::vector<int> cp;
  for (int d = 1; d <= 8; d *= 2)
    if (c.training.seq_length % (2 * d) == 0 || d == 1) cp.push_back(d);
  axes.push_back({kCp, Strings(cp)});
  // pp: even stages (a divisor of the layers), or ranks of x layers with a first rank, a
  // last one or both of kLighter fewer per chunk (StagesTake): the first holds the
  // embedding and, in 1F1B, the most micro-batches' activations; the last the output layer
  // and loss; or, with virtual stages, the embedding and/or the loss counted as a layer
  // (AccountedTake).
  std::set<int> vp_set;
  for (int extra : {0, 1, 2})
    for (int v : Divisors(l.layers + extra, 8)) vp_set.insert(v);
  const std::vector<int> vps(vp_set.begin(), vp_set.end());
  std::vector<int> pp;
  std::set<int> first = {0}, last = {0};
  bool accounted = false;
  for (int d = 1; d <= std::min(l.layers, gpus); ++d) {
    if (gpus % d != 0) continue;
    bool takes = l.layers % d == 0;
    for (int v : vps)
      for (bool e : {false, true})
        for (bool f : {false, true})
          if ((e || f) && AccountedTake(l.layers, d, v, e, f)) takes = accounted = true;
    for (int v : vps)
      for (int f : {0, kLighter[0], kLighter[1]})
        for (int e : {0, kLighter[0], kLighter[1]}) {
          const int fewer = (f + e) * v;  // the layers the lighter ranks leave out
          if ((f == 0 && e == 0) || (l.layers + fewer) % (d * v) != 0) continue;
          const int x = (l.layers + fewer) / d;  // the other ranks' layers
          const int a = f ? x - f * v : 0, b = e ? x - e * v : 0;
          if ((f && a < v) || (e && b < v) || !StagesTake(l.layers, d, v, a, b)) continue;
          takes = true;
          first.insert(a), last.insert(b);
        }
    if (takes) pp.push_back(d);
  }
  axes.push_back({kPp, Strings(pp)});
  axes.push_back({kVp, Strings(vps)});
  axes.push_back({kFirst, Strings(std::vector<int>(first.begin(), first.end()))});
  axes.push_back({kLast, Strings(std::vector<int>(last.begin(), last.end()))});
  if (accounted) {
    axes.push_back({kEmbedding, {"false", "true"}});
    axes.push_back({kLoss, {"false", "true"}});
  }
  if (l.moe.experts > 0) {
    std::vector<int> ep;
    for (int d : Divisors(l.moe.experts, l.moe.experts))
      if (gpus % d == 0) ep.push_back(d);
    axes.push_back({kEp, Strings(ep)});
  }
  axes.push_back({kMbs, Strings(Divisors(c.training.global_batch_size, 8))});
  axes.push_back({kRecompute, {"none", "selective", "full"}});
  std::vector<std::string> schedules;
  for (PipelineKind k : kSchedules) schedules.emplace_back(PipelineName(k));
  axes.push_back({kPipeline, schedules});
  if (c.model.vision.enabled || c.model.generator.enabled) {
    std::vector<std::string> policies;
    for (ModalityPolicy p : kModalityPolicies) policies.emplace_back(ModalityName(p));
    axes.push_back({kModality, policies});
  }
  return axes;
}

StatusOr<TuneResult> RunTune(const std::string& path, const std::vector<std::string>& sets,
                             const TuneOptions& o) {
  if (o.top_k < 1) return InvalidInput(fmt::format("--top {}: expected >= 1", o.top_k));
  if (o.jobs < 1) return InvalidInput(fmt::format("--jobs {}: expected >= 1", o.jobs));
  if (o.shards < 1 || o.shard < 0 || o.shard >= o.shards)
    return InvalidInput(
        fmt::format("--shard {}/{}: expected I/N with 0 <= I < N", o.shard, o.shards));
  const auto start = std::chrono::steady_clock::now();  // --budget counts from here
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  ASSIGN_OR_RETURN(const Config base, LoadConfig(path, sets));
  const int gpn = base.cluster.gpus_per_node;
  const int gpus = o.gpus > 0 ? o.gpus : base.world();
  if (gpus % gpn != 0)
    return InvalidInput(
        fmt::format("--gpus {}: not a multiple of cluster.gpus_per_node = {}", gpus, gpn));
  Base b;
  RETURN_IF_ERROR(b.Init(path, sets, base.training.global_batch_size, gpus / gpn));

  std::vector<VaryAxis> axes = TuneSpace(base, gpus);
  // --only replaces an axis's values; a --set of an axis (by its name or an alias) fixes it.
  std::vector<VaryAxis> only = o.only;
  for (const std::string& set : sets) {
    const size_t eq = set.find('=');
    std::string key = set.substr(0, eq);
    for (const auto& [alias, name] : kAxisAliases)
      if (key == alias) key = name;
    if (eq != std::string::npos &&
        std::any_of(axes.begin(), axes.end(), [&](const VaryAxis& a) { return a.key == key; }))
      only.push_back({key, {set.substr(eq + 1)}});
  }
  for (const VaryAxis& restrict : only) {
    auto it = std::find_if(axes.begin(), axes.end(),
                           [&](const VaryAxis& a) { return a.key == restrict.key; });
    if (it == axes.end()) {
      std::string names;
      for (const VaryAxis& a : axes) names += (names.empty() ? "" : ", ") + a.key;
      return InvalidInput(
          fmt::format("--only {}: not an axis of this search (axes: {})", restrict.key, names));
    }
    for (const std::string& v : restrict.values) {
      const bool numeric =
          (it->key.rfind("parallelism.", 0) == 0 && it->key != kEmbedding && it->key != kLoss) ||
          it->key == kMbs;
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      const long least = it->key == kFirst || it->key == kLast ? 0 : 1;
      if (numeric ? (end == v.c_str() || *end != '\0' || n < least || n > kMaxAxisValue)
                  : std::find(it->values.begin(), it->values.end(), v) == it->values.end()) {
        std::string choices;
        for (const std::string& c : it->values) choices += (choices.empty() ? "" : ", ") + c;
        return InvalidInput(fmt::format(
            "{}={}: expected {}", restrict.key, v,
            numeric ? (least ? "a positive integer" : "an integer >= 0") : "one of " + choices));
      }
    }
    it->values = restrict.values;
  }
  TuneResult r;
  r.gpus = gpus, r.global_batch = base.training.global_batch_size,
  r.headroom_bytes = o.headroom_bytes;
  r.hbm_bytes = base.cluster.spec.hbm_bytes;
  for (const VaryAxis& a : axes) r.keys.push_back(a.key);

  // Candidates: the grid, less what arithmetic alone rules out (GPUs not divisible, layers
  // not divisible into pp x vp chunks, a schedule that does not take the vp, a global batch
  // not divisible by micro-batch x dp, experts over ep or ep over dp x cp); the config
  // rules decide the rest.
  auto at = [&](const std::vector<std::string>& v, const char* key) {
    const size_t i = std::find(r.keys.begin(), r.keys.end(), key) - r.keys.begin();
    return i < v.size() ? v[i] : std::string();
  };
  auto num = [&](const std::vector<std::string>& v, const char* key, int fallback) {
    const std::string s = at(v, key);
    return s.empty() ? fallback : std::atoi(s.c_str());
  };
  const LlmConfig& l = base.model.llm;
  std::vector<std::string> values(axes.size());
  // The rules, each checked as soon as the axes it reads have their values (at the depth of
  // the last of them), so that a prefix of the grid that breaks one is skipped whole.
  auto depth = [&](std::initializer_list<const char*> keys) {
    size_t d = 0;
    for (const char* key : keys) {
      const size_t i = std::find(r.keys.begin(), r.keys.end(), key) - r.keys.begin();
      if (i < r.keys.size()) d = std::max(d, i);
    }
    return d;
  };
  auto dp_of = [&] {
    return gpus / (num(values, kTp, 1) * num(values, kPp, 1) * num(values, kCp, 1));
  };
  const std::vector<std::pair<size_t, std::function<bool()>>> rules = {
      {depth({kTp, kPp, kCp}),
       [&] {
         const int tp = num(values, kTp, 1), pp = num(values, kPp, 1), cp = num(values, kCp, 1);
         return tp > 0 && pp > 0 && cp > 0 && gpus % (static_cast<int64_t>(tp) * pp * cp) == 0;
       }},
      {depth({kTp, kPp, kCp, kMbs}),
       [&] {
         const int mbs = num(values, kMbs, 1);
         return mbs > 0 && r.global_batch % (static_cast<int64_t>(mbs) * dp_of()) == 0;
       }},
      {depth({kPp, kVp, kFirst, kLast}),
       [&] {
         const int pp = num(values, kPp, 1), vp = num(values, kVp, 1);
         const int first = num(values, kFirst, 0), last = num(values, kLast, 0);
         if (vp <= 0 || first < 0 || last < 0) return false;
         // Even stages may still come from the embedding or loss accounting (below).
         const bool accountable = first == 0 && last == 0 &&
                                  (AccountedTake(l.layers, pp, vp, true, false) ||
                                   AccountedTake(l.layers, pp, vp, false, true) ||
                                   AccountedTake(l.layers, pp, vp, true, true));
         return accountable || StagesTake(l.layers, pp, vp, first, last);
       }},
      {depth({kPp, kVp, kFirst, kLast, kEmbedding, kLoss}),
       [&] {
         const int pp = num(values, kPp, 1), vp = num(values, kVp, 1);
         const bool embedding = at(values, kEmbedding) == "true";
         const bool loss = at(values, kLoss) == "true";
         if (embedding || loss)
           return num(values, kFirst, 0) == 0 && num(values, kLast, 0) == 0 &&
                  AccountedTake(l.layers, pp, vp, embedding, loss);
         return StagesTake(l.layers, pp, vp, num(values, kFirst, 0), num(values, kLast, 0));
       }},
      {depth({kTp, kPp, kCp, kEp}),
       [&] {
         const int ep = num(values, kEp, 1);
         return ep > 0 && (l.moe.experts == 0 ||
                           (l.moe.experts % ep == 0 && (dp_of() * num(values, kCp, 1)) % ep == 0));
       }},
      {depth({kPp, kVp, kPipeline}),
       [&] {
         const std::string sched = at(values, kPipeline);
         for (PipelineKind k : kSchedules)
           if (sched == PipelineName(k))
             return ScheduleTakes(k, num(values, kPp, 1), num(values, kVp, 1));
         return true;
       }},
  };
  double walked = 0;  // combinations (prefixes included) looked at
  std::function<Status(size_t)> walk = [&](size_t a) -> Status {
    for (const std::string& v : axes[a].values) {  // the last axis fastest
      values[a] = v;
      if (++walked > kMaxTuneGrid)
        return InvalidInput(fmt::format(
            "the search's grid takes more than {:.0e} combinations to walk: fix some axes with "
            "--only",
            kMaxTuneGrid));
      bool ok = true;
      for (const auto& [at_depth, rule] : rules)
        if (at_depth == a && !(ok = rule())) break;
      if (!ok) continue;
      if (a + 1 < axes.size()) {
        RETURN_IF_ERROR(walk(a + 1));
        continue;
      }
      if (r.points.size() == kMaxTunePoints)
        return InvalidInput(fmt::format(
            "the search has more than {} candidates: fix some axes with --only", kMaxTunePoints));
      r.points.emplace_back().values = values;
    }
    return Status::Ok();
  };
  if (!axes.empty()) RETURN_IF_ERROR(walk(0));

  // Each candidate's config and bounds.
  const double bound_start = elapsed();
  // Points that differ only in their schedule and modality policy (the last axes) share
  // their config's text workload and data: one config per group is parsed here (the first
  // of its points the config rules accept) and each point bounded with its own schedule;
  // each point's own config is parsed when it is simulated.
  auto parse = [&](TunePoint& p) -> std::optional<Config> {
    auto doc = b.With(r.keys, p.values);
    auto k = doc.ok() ? ParseConfig(std::move(*doc)) : StatusOr<Config>(doc.status());
    if (k.ok()) return std::move(*k);
    p.state = TuneState::kInvalid, p.error = FirstLine(k.status().message());
    return std::nullopt;
  };
  const size_t shape_axes = std::find(r.keys.begin(), r.keys.end(), kPipeline) - r.keys.begin();
  auto same_shape = [&](size_t x, size_t y) {
    return std::equal(r.points[x].values.begin(), r.points[x].values.begin() + shape_axes,
                      r.points[y].values.begin());
  };
  std::vector<size_t> groups;
  for (size_t i = 0; i < r.points.size(); ++i)
    if (i == 0 || !same_shape(i - 1, i)) groups.push_back(i);
  std::vector<uint8_t> valid(r.points.size(), 1);
  ModalitySeconds modality;
  AliveCounts alive;
  const size_t schedule_axis = shape_axes;
  const size_t modality_axis = std::find(r.keys.begin(), r.keys.end(), kModality) - r.keys.begin();
  std::atomic<size_t> bounded{0};
  std::mutex progress_mu;
  const size_t threads = static_cast<size_t>(std::max(1, o.jobs));
  RunParallel(
      groups.size(),
      [&](size_t gi) {
        if (o.bound_progress && ++bounded % 64 == 0) {
          std::lock_guard<std::mutex> lock(progress_mu);
          o.bound_progress(bounded, groups.size());
        }
        const size_t first = groups[gi];
        size_t end = first + 1;
        while (end < r.points.size() && same_shape(first, end)) ++end;
        if (static_cast<int>(gi % o.shards) != o.shard) {
          for (size_t i = first; i < end; ++i)
            r.points[i].state = TuneState::kOtherShard, valid[i] = 0;
          return;
        }
        std::optional<Config> k;
        size_t i = first;
        for (; i < end && !k; ++i)
          if (!(k = parse(r.points[i]))) valid[i] = 0;
        if (!k) return;
        ShapeWork shape{&modality, &alive};
        for (size_t j = i - 1; j < end; ++j) {
          PipelineKind kind = k->schedule.pipeline;
          for (PipelineKind s : kSchedules)
            if (schedule_axis < r.keys.size() &&
                r.points[j].values[schedule_axis] == PipelineName(s))
              kind = s;
          ModalityPolicy policy = k->schedule.modality;
          if (modality_axis < r.keys.size())
            for (ModalityPolicy m : kModalityPolicies)
              if (r.points[j].values[modality_axis] == ModalityName(m)) policy = m;
          Bound(*k, kind, policy, &shape, &r.points[j]);
        }
      },
      threads);
  if (o.bound_progress) o.bound_progress(groups.size(), groups.size());

  r.bound_wall_s = elapsed() - bound_start;

  // The configured point, for comparison (the config as written, on `gpus`).
  const double capacity = r.hbm_bytes - o.headroom_bytes;
  // Points that differ only in their modality policy have the same time bound but
  // inline's, and the policies are the last axis: they are simulated one after another,
  // and their plans share what the policies have in common (PlanShare).
  PlanShare share(2 * threads);
  std::vector<std::string> configured;  // its values on the axes; empty: not a candidate
  {
    std::vector<std::string> on_gpus = sets;
    on_gpus.push_back(fmt::format("cluster.nodes={}", gpus / gpn));
    auto k = LoadConfig(path, on_gpus);
    if (k.ok()) {
      ShapeWork shape{&modality, &alive};
      Bound(*k, k->schedule.pipeline, k->schedule.modality, &shape, &r.configured);
      Simulate(*k, capacity, &share, &r.configured);
      configured = AxisValues(*k, r.keys);
    } else {
      r.configured.error = FirstLine(k.status().message());
    }
  }

  // Simulations in order of the time bound, `jobs` at a time; the candidate on the
  // configured point's values first, so that a search cut short by its budget still has
  // that point's answer (the candidate keeps the rest of the config as tune sets it).
  std::vector<size_t> order;
  for (size_t i = 0; i < r.points.size(); ++i)
    if (valid[i]) order.push_back(i);
  const auto is_configured = [&](size_t i) { return r.points[i].values == configured; };
  const auto found = std::find_if(order.begin(), order.end(), is_configured);
  const std::optional<size_t> candidate =
      found == order.end() ? std::nullopt : std::optional<size_t>(*found);
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    return r.points[x].time_bound_s < r.points[y].time_bound_s;
  });
  if (candidate) {  // first, the others keeping their order
    const auto at_c = std::find(order.begin(), order.end(), *candidate);
    std::rotate(order.begin(), at_c, at_c + 1);
  }
  const double simulate_start = elapsed();
  std::vector<size_t> fits;  // simulated points that fit, best first
  auto add = [&](size_t i) {
    TunePoint& p = r.points[i];
    if (p.fits)
      fits.insert(std::upper_bound(
                      fits.begin(), fits.end(), i,
                      [&](size_t x, size_t y) { return Better(r.points[x], x, r.points[y], y); }),
                  i);
    if (p.state == TuneState::kSimulated) {
      r.time_bound_misses += p.time_bound_s > p.metrics.step_time_s * (1 + 1e-9);
      r.memory_bound_misses += p.memory_bound_bytes > p.metrics.peak_memory_bytes * (1 + 1e-9);
    }
  };
  // Results of earlier runs (or of the shards) first: their points are not simulated again.
  const std::string search = SearchId(b);
  std::unordered_map<std::string, TunePoint> own, stored;  // results_path's, the others'
  size_t whole_bytes = 0;
  if (!o.results_path.empty())
    RETURN_IF_ERROR(ReadResults(o.results_path, search, false, &own, &whole_bytes));
  for (const std::string& in : o.resume_from)
    RETURN_IF_ERROR(ReadResults(in, search, true, &stored, nullptr));
  ResultsWriter writer;
  if (!o.results_path.empty()) RETURN_IF_ERROR(writer.Open(o.results_path, search, whole_bytes));
  std::vector<uint8_t> done(r.points.size(), 0);
  for (size_t i : order) {
    const std::string key = PointKey(r.keys, r.points[i].values);
    auto it = own.find(key);
    const bool mine = it != own.end();
    if (!mine && (it = stored.find(key)) == stored.end()) continue;
    TunePoint& p = r.points[i];
    p.state = it->second.state, p.error = it->second.error, p.metrics = it->second.metrics;
    Judge(capacity, &p);
    add(i), done[i] = 1;
    r.resumed += p.state == TuneState::kSimulated;
    // The results file gathers the other files' points (shards merged into it).
    if (!mine && writer.open()) RETURN_IF_ERROR(writer.Append(r.keys, p));
  }
  size_t simulated = std::count(done.begin(), done.end(), 1);
  double wave_seconds = 0;  // of the waves simulated so far
  int waves = 0;
  for (size_t pos = 0; pos < order.size();) {
    // No wave starts that would end after the budget, by the mean time of those so far.
    const double next_wave = waves > 0 ? wave_seconds / waves : 0;
    if (o.budget_s > 0 && elapsed() + next_wave > o.budget_s) {
      for (; pos < order.size(); ++pos)
        if (!done[order[pos]]) r.points[order[pos]].state = TuneState::kOverBudget;
      break;
    }
    const bool full = fits.size() >= static_cast<size_t>(o.top_k);
    const double kth = full ? r.points[fits[o.top_k - 1]].metrics.step_time_s
                            : std::numeric_limits<double>::infinity();
    std::vector<size_t> wave;
    for (; pos < order.size() && wave.size() < static_cast<size_t>(o.jobs); ++pos) {
      TunePoint& p = r.points[order[pos]];
      if (done[order[pos]]) continue;
      if (o.prune && p.memory_bound_bytes > capacity) {
        p.state = TuneState::kPrunedMemory;
      } else if (o.prune && p.time_bound_s >= kth) {
        // Sorted by bound: none of the rest can enter the top K either.
        for (; pos < order.size(); ++pos) {
          TunePoint& q = r.points[order[pos]];
          if (done[order[pos]]) continue;
          q.state =
              q.memory_bound_bytes > capacity ? TuneState::kPrunedMemory : TuneState::kPrunedTime;
        }
      } else {
        wave.push_back(order[pos]);
      }
    }
    const double wave_start = elapsed();
    RunParallel(
        wave.size(),
        [&](size_t w) {
          if (auto k = parse(r.points[wave[w]])) Simulate(*k, capacity, &share, &r.points[wave[w]]);
        },
        threads);
    if (!wave.empty()) wave_seconds += elapsed() - wave_start, ++waves;
    for (size_t i : wave) {
      add(i), ++simulated;
      if (writer.open()) RETURN_IF_ERROR(writer.Append(r.keys, r.points[i]));
    }
    if (o.progress && !wave.empty()) o.progress(simulated, simulated + (order.size() - pos));
  }
  if (o.progress) o.progress(simulated, simulated);  // the rest pruned or out of budget
  r.simulate_wall_s = elapsed() - simulate_start;
  r.shared = share.reused();
  r.top.assign(fits.begin(), fits.begin() + std::min(fits.size(), static_cast<size_t>(o.top_k)));

  // Pareto frontier in (tokens/s, peak memory) among the points that fit.
  std::vector<const Metrics*> metrics;
  for (size_t i : fits) metrics.push_back(&r.points[i].metrics);
  const std::vector<bool> front = ParetoFront(metrics);
  for (size_t f = 0; f < fits.size(); ++f) r.points[fits[f]].pareto = front[f];
  return r;
}

StatusOr<std::string> TunedConfigYaml(const std::string& path, const std::vector<std::string>& sets,
                                      const TuneResult& r, const TunePoint& p) {
  ASSIGN_OR_RETURN(const Config base, LoadConfig(path, sets));
  Base b;
  RETURN_IF_ERROR(b.Init(path, sets, r.global_batch, r.gpus / base.cluster.gpus_per_node));
  ASSIGN_OR_RETURN(YamlDoc doc, b.With(r.keys, p.values));
  return doc.Dump();
}

}  // namespace pipeplan
