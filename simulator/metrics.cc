#include "simulator/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>

#include "core/parallel.h"
#include "simulator/contention.h"
#include "simulator/engine.h"

namespace pipeplan {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

bool IsBusy(OpKind k) {
  return IsCompute(k);
}

int ModuleOfCat(int cat) {
  return cat == kActVision ? 1 : cat == kActGenerator ? 2 : 0;
}

}  // namespace

std::array<double, 3> MinMeanMax(const std::vector<double>& v) {
  if (v.empty()) return {0, 0, 0};
  double sum = 0;
  for (double x : v) sum += x;
  return {*std::min_element(v.begin(), v.end()), sum / v.size(),
          *std::max_element(v.begin(), v.end())};
}

// Exposed seconds and hidden fraction of one module (see Metrics): the step against the
// same plan without the module's ops (SimulateWithout); {-1, -1} if the plan has none of it.
StatusOr<std::pair<double, double>> Exposure(const Table& t, const EngineIndex& index,
                                             const std::vector<double>& dur, double step,
                                             Module module, Timeline* scratch) {
  double busy = 0;
  bool any = false;
  for (OpId i = 0; i < t.size(); ++i) {
    if (t.module(i) != module) continue;
    any = true;
    if (IsCompute(t.kind(i))) busy += dur[i];
  }
  if (!any) return std::pair{-1.0, -1.0};
  ASSIGN_OR_RETURN(*scratch, SimulateWithout(t, dur, index, module, std::move(*scratch)));
  const double exposed = std::max(0.0, step - scratch->Makespan());
  const double mean = busy / std::max(1, t.num_ranks());
  return std::pair{exposed, mean > 0 ? std::clamp(1 - exposed / mean, 0.0, 1.0) : 1.0};
}

void VisionLoad(const Table& t, const std::vector<double>& dur, Metrics* m) {
  std::vector<double> before(t.num_ranks(), 0.0), after(t.num_ranks(), 0.0);
  for (OpId i = 0; i < t.size(); ++i) {
    if (t.module(i) != Module::kVision || !IsCompute(t.kind(i))) continue;
    const int32_t r = t.rank(i);
    after[r] += dur[i];
    before[r - t.ranks()[r].pp] += dur[i];  // the replica's first stage consumes it
  }
  m->vision_load_before = MinMeanMax(before);
  m->vision_load_after = MinMeanMax(after);
}

StatusOr<SimResult> RunSimulation(const Table& t, const SimOptions& o) {
  // Independent parts of the work run side by side on large tables (results do not depend
  // on it: each part writes its own outputs).
  const bool parallel = t.size() >= kParallelFromOps;
  SimResult r;
  StatusOr<EngineIndex> indexed = Internal("no index");
  std::vector<double> base;
  std::optional<LinkContention> links;
  RunParallel(
      3,
      [&](size_t k) {
        if (k == 0) indexed = IndexForEngine(t);
        if (k == 1) base = o.cost.Durations(t);
        if (k == 2) links.emplace(t, o.cost);
      },
      parallel ? 0 : 1);
  ASSIGN_OR_RETURN(const EngineIndex index, std::move(indexed));
  RETURN_IF_ERROR(links->KeepBase(base));
  r.durations = std::move(base);
  ASSIGN_OR_RETURN(r.timeline, Simulate(t, r.durations, index));
  for (int pass = 0; pass < kContentionPasses; ++pass) {  // link contention (contention.h)
    ASSIGN_OR_RETURN(const bool changed, links->Update(r.timeline, &r.durations));
    if (!changed) break;
    ASSIGN_OR_RETURN(r.timeline, Simulate(t, r.durations, index, std::move(r.timeline)));
  }
  // The passes without a module, or with instant copies, beside the memory and metrics.
  const double step = r.timeline.Makespan();
  Status exposed = Status::Ok();
  std::pair<double, double> vision{0, 0}, gen{0, 0};  // (exposed s, hidden fraction)
  double copy_exposed = 0;
  auto exposure = [&]() -> Status {
    Timeline scratch;  // buffers of the passes without a module
    ASSIGN_OR_RETURN(vision, Exposure(t, index, r.durations, step, Module::kVision, &scratch));
    ASSIGN_OR_RETURN(gen, Exposure(t, index, r.durations, step, Module::kGenerator, &scratch));
    bool copies = false;
    for (OpId i = 0; i < t.size() && !copies; ++i) copies = IsCopy(t.kind(i)) && r.durations[i] > 0;
    if (copies) {  // the same step with instant copies
      std::vector<double> instant = r.durations;
      for (OpId i = 0; i < t.size(); ++i)
        if (IsCopy(t.kind(i))) instant[i] = 0;
      ASSIGN_OR_RETURN(scratch, Simulate(t, instant, index, std::move(scratch)));
      copy_exposed = std::max(0.0, step - scratch.Makespan());
    }
    return Status::Ok();
  };
  RunParallel(
      2,
      [&](size_t k) {
        if (k == 1) {
          if (o.exposure) exposed = exposure();
          return;
        }
        r.memory = ComputeMemory(t, r.timeline, o.memory, o.memory_curves);
        r.metrics =
            ComputeMetrics(t, index, r.timeline, r.durations, r.memory, o.cost, o.memory.hbm_bytes);
      },
      parallel ? 0 : 1);
  RETURN_IF_ERROR(exposed);
  if (o.exposure) {
    std::tie(r.metrics.vision_exposed_s, r.metrics.vision_hidden_fraction) = vision;
    std::tie(r.metrics.generator_exposed_s, r.metrics.generator_hidden_fraction) = gen;
    if (r.metrics.copy_seconds > 0) r.metrics.copy_exposed_s = copy_exposed;
  }
  VisionLoad(t, r.durations, &r.metrics);
  return r;
}

Metrics ComputeMetrics(const Table& t, const EngineIndex& index, const Timeline& tl,
                       const std::vector<double>& dur, const std::vector<RankMemory>& memory,
                       const CostModel& cost, double hbm_bytes) {
  Metrics m;
  m.unit_costs = cost.unit();
  m.ops = t.size();
  m.step_time_s = tl.Makespan();
  m.hbm_bytes = hbm_bytes;
  double busy_total = 0;
  std::map<int32_t, double> node_host;  // per node: its GPUs' host peaks
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    RankMetrics rm;
    rm.rank = r, rm.pp = t.ranks()[r].pp, rm.dp = t.ranks()[r].dp;
    m.world_gpus += t.ranks()[r].gpus;
    double copies = 0;
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      if (IsBusy(t.kind(i))) {
        rm.busy_s += dur[i];
        rm.busy_by_module[static_cast<int>(t.module(i))] += dur[i];
      }
      if (IsCopy(t.kind(i))) copies += dur[i];
      m.model_flops += t.work(i).model_flops;
    }
    m.copy_seconds = std::max(m.copy_seconds, copies);
    rm.idle_s = std::max(0.0, m.step_time_s - rm.busy_s);
    rm.bubble_fraction = m.step_time_s > 0 ? rm.idle_s / m.step_time_s : 0;
    if (r < static_cast<int32_t>(memory.size())) {
      const RankMemory& mem = memory[r];
      rm.peak_memory_bytes = mem.peak_bytes;
      rm.at_peak = mem.at_peak;
      for (int c = kActText; c <= kActGenerator; ++c)
        rm.peak_by_module[ModuleOfCat(c)] = mem.peak_by_cat[c];
      rm.oom = mem.oom;
      rm.host_peak_bytes = mem.host_peak_bytes;
      node_host[t.ranks()[r].node] += mem.host_peak_bytes * t.ranks()[r].gpus;
      m.host_peak_bytes = std::max(m.host_peak_bytes, mem.host_peak_bytes);
      m.held_peak_bytes = std::max(m.held_peak_bytes, mem.peak_by_cat[kActHeld]);
    }
    busy_total += rm.busy_s;
    m.lower_bound_s = std::max(m.lower_bound_s, rm.busy_s);
    if (rm.oom && m.oom_detail.empty() && r < static_cast<int32_t>(memory.size())) {
      m.oom_detail = fmt::format("rank {} at {:.4g} s:", r, memory[r].peak_time_s);
      for (int c = 0; c < kNumMemCats; ++c)
        if (c != kActHeld || memory[r].at_peak[c] > 0)  // held: only where a rank holds some
          m.oom_detail += fmt::format(" {} {:.2f} GiB", MemCatName(c), memory[r].at_peak[c] / kGiB);
    }
    m.peak_memory_bytes = std::max(m.peak_memory_bytes, rm.peak_memory_bytes);
    m.oom = m.oom || rm.oom;
    m.ranks.push_back(rm);
  }
  if (!cost.unit()) m.node_host_bytes = cost.spec().node_host_bytes;
  for (auto [node, bytes] : node_host)
    m.node_host_peak_bytes = std::max(m.node_host_peak_bytes, bytes);
  if (m.node_host_bytes > 0 && m.node_host_peak_bytes > m.node_host_bytes) {
    m.host_oom = m.oom = true;
    if (m.oom_detail.empty())
      m.oom_detail = fmt::format(
          "host memory: offloaded activations and gradients take up to {:.2f} GiB "
          "per node",
          m.node_host_peak_bytes / kGiB);
  }
  if (m.step_time_s > 0) {
    m.bubble_fraction = 1 - busy_total / (t.num_ranks() * m.step_time_s);
    m.tokens_per_s = t.meta().tokens_per_step / m.step_time_s;
    m.samples_per_s = t.meta().samples_per_step / m.step_time_s;
    m.model_flops_per_gpu = t.meta().megatron_flops_per_step / (m.step_time_s * m.world_gpus);
    if (!cost.unit()) {
      const double peak = m.step_time_s * m.world_gpus * cost.spec().bf16_flops;
      m.mfu = m.model_flops / peak;
      m.megatron_mfu = t.meta().megatron_model_flops_per_step / peak;
    }
  }
  for (OpId i : CriticalPath(t, tl, index)) m.critical_path.push_back(t.str(i));
  return m;
}

nlohmann::json MetricsJson(const Metrics& m) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankMetrics& r : m.ranks) {
    nlohmann::json by_module, busy;
    for (int k = 0; k < 3; ++k)
      by_module[std::string(ModuleName(static_cast<Module>(k)))] = r.peak_by_module[k];
    for (int k = 0; k < kNumModules; ++k)
      busy[std::string(ModuleName(static_cast<Module>(k)))] = r.busy_by_module[k];
    nlohmann::json at_peak;
    for (int c = 0; c < kNumMemCats; ++c) at_peak[MemCatName(c)] = r.at_peak[c];
    ranks.push_back({{"rank", r.rank},
                     {"pp", r.pp},
                     {"dp", r.dp},
                     {"busy_s", r.busy_s},
                     {"busy_by_module_s", busy},
                     {"idle_s", r.idle_s},
                     {"bubble_fraction", r.bubble_fraction},
                     {"peak_memory_bytes", r.peak_memory_bytes},
                     {"peak_memory_by_module", by_module},
                     {"memory_at_peak_bytes", at_peak},
                     {"host_peak_bytes", r.host_peak_bytes},
                     {"oom", r.oom}});
  }
  return {{"unit_costs", m.unit_costs},
          {"step_time_s", m.step_time_s},
          {"bubble_fraction", m.bubble_fraction},
          {"mfu", m.mfu},
          {"model_flops", m.model_flops},
          {"model_tflops_per_gpu", m.model_flops_per_gpu / 1e12},
          {"megatron_mfu", m.megatron_mfu},
          {"tokens_per_s", m.tokens_per_s},
          {"samples_per_s", m.samples_per_s},
          {"peak_memory_bytes", m.peak_memory_bytes},
          {"hbm_bytes", m.hbm_bytes},
          {"oom", m.oom},
          {"ops", m.ops},
          {"gpus", m.world_gpus},
          {"ranks", ranks},
          {"critical_path", m.critical_path},
          {"lower_bound_s", m.lower_bound_s},
          {"step_over_bound", m.lower_bound_s > 0 ? m.step_time_s / m.lower_bound_s : 0},
          {"oom_detail", m.oom_detail},
          {"vision_exposed_s", m.vision_exposed_s},
          {"vision_hidden_fraction", m.vision_hidden_fraction},
          {"generator_exposed_s", m.generator_exposed_s},
          {"generator_hidden_fraction", m.generator_hidden_fraction},
          {"vision_load_before_s", m.vision_load_before},
          {"vision_load_after_s", m.vision_load_after},
          {"host_peak_bytes", m.host_peak_bytes},
          {"node_host_peak_bytes", m.node_host_peak_bytes},
          {"node_host_bytes", m.node_host_bytes},
          {"held_peak_bytes", m.held_peak_bytes},
          {"host_oom", m.host_oom},
          {"copy_seconds", m.copy_seconds},
          {"copy_exposed_s", m.copy_exposed_s}};
}

std::string MetricsText(const Metrics& m) {
  std::string s;
  // Unit costs (F = 1, B = 2, communication 0) give times in units: no rates then.
  const char* unit = m.unit_costs ? "units" : "s";
  s += fmt::format("step time        {:.6g} {}\n", m.step_time_s, unit);
  if (m.lower_bound_s > 0)
    s += fmt::format("lower bound      {:.6g} {} (busiest rank's compute; step / bound {:.3f})\n",
                     m.lower_bound_s, unit, m.step_time_s / m.lower_bound_s);
  s += fmt::format("bubble fraction  {:.2f} %\n", 100 * m.bubble_fraction);
  if (!m.unit_costs) {
    s += fmt::format("MFU              {:.2f} % (Megatron's: {:.2f} %)\n", 100 * m.mfu,
                     100 * m.megatron_mfu);
    if (m.model_flops_per_gpu > 0)
      s += fmt::format("model TFLOP/s    {:.1f} per GPU (Megatron's eq. 3, recompute included)\n",
                       m.model_flops_per_gpu / 1e12);
    s += fmt::format("throughput       {:.6g} tokens/s, {:.6g} samples/s\n", m.tokens_per_s,
                     m.samples_per_s);
  }
  s += fmt::format("peak memory      {:.2f} GiB per GPU of {:.2f} GiB{}\n",
                   m.peak_memory_bytes / kGiB, m.hbm_bytes / kGiB,
                   m.oom ? "  ** OUT OF MEMORY **" : "");
  if (!m.oom_detail.empty()) s += fmt::format("  out of memory on {}\n", m.oom_detail);
  if (m.host_peak_bytes > 0)
    s += fmt::format(
        "host memory      {:.2f} GiB per GPU at peak; up to {:.2f} of {:.2f} GiB per node{}\n",
        m.host_peak_bytes / kGiB, m.node_host_peak_bytes / kGiB, m.node_host_bytes / kGiB,
        m.host_oom ? "  ** OUT OF HOST MEMORY **" : "");
  if (m.held_peak_bytes > 0)
    s += fmt::format("held for others  {:.2f} GiB per GPU at most on one rank (remote offload)\n",
                     m.held_peak_bytes / kGiB);
  if (m.copy_seconds > 0) {
    s += fmt::format("offload copies   {:.4g} s on the busiest rank (offload + reload)",
                     m.copy_seconds);
    if (m.copy_exposed_s >= 0)
      s += fmt::format("; the step waits {:.4g} s for them", m.copy_exposed_s);
    s += "\n";
  }
  s += fmt::format("ops              {}  ({} GPUs)\n", m.ops, m.world_gpus);
  if (m.vision_hidden_fraction >= 0) {
    s +=
        fmt::format("vision exposed   {:.4g} s (hidden {:.1f} % of the mean rank's encoder time)\n",
                    m.vision_exposed_s, 100 * m.vision_hidden_fraction);
    s += fmt::format(
        "vision load      {:.4g} / {:.4g} / {:.4g} s per rank (min / mean / max; all on consumers: "
        "{:.4g} / {:.4g} / {:.4g} s)\n",
        m.vision_load_after[0], m.vision_load_after[1], m.vision_load_after[2],
        m.vision_load_before[0], m.vision_load_before[1], m.vision_load_before[2]);
  }
  if (m.generator_hidden_fraction >= 0)
    s += fmt::format(
        "generator exposed {:.4g} s (hidden {:.1f} % of the mean rank's generator time)\n",
        m.generator_exposed_s, 100 * m.generator_hidden_fraction);
  s += fmt::format("critical path    {} ops", m.critical_path.size());
  if (!m.critical_path.empty())
    s += fmt::format(": {} ... {}", m.critical_path.front(), m.critical_path.back());
  s += "\n\n";
  s += fmt::format("{:>6} {:>4} {:>4} {:>10} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>4}\n", "rank",
                   "pp", "dp", "busy s", "idle s", "bubble%", "peak GiB", "text act", "vis act",
                   "gen act", "oom");
  // Large plans: one row per pipeline stage of replica 0, plus any OOM rank.
  for (const RankMetrics& r : m.ranks) {
    if (r.dp != 0 && !r.oom) continue;
    s += fmt::format(
        "{:>6} {:>4} {:>4} {:>10.4g} {:>10.4g} {:>8.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} "
        "{:>4}\n",
        r.rank, r.pp, r.dp, r.busy_s, r.idle_s, 100 * r.bubble_fraction, r.peak_memory_bytes / kGiB,
        r.peak_by_module[0] / kGiB, r.peak_by_module[1] / kGiB, r.peak_by_module[2] / kGiB,
        r.oom ? "yes" : "");
  }
  return s;
}

}  // namespace pipeplan
