// Metrics of one simulated (or measured) step, and the one-call simulation driver.
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/table.h"
#include "core/timeline.h"
#include "simulator/cost_model.h"
#include "simulator/engine.h"
#include "simulator/memory.h"

namespace pipeplan {

struct RankMetrics {
  int32_t rank = 0, pp = 0, dp = 0;
  double busy_s = 0;  // compute time (F/B/I/W/recompute/optimizer), s
  std::array<double, kNumModules> busy_by_module{};  // busy_s per module, s
  double idle_s = 0;             // step time - busy, s (waiting and communication)
  double bubble_fraction = 0;    // idle / step time
  double peak_memory_bytes = 0;  // per GPU
  std::array<double, kNumModules> peak_by_module{};  // activation peak per module, bytes
  std::array<double, kNumMemCats> at_peak{};  // each memory category at the rank's peak, bytes
  double host_peak_bytes = 0;  // host memory (offloaded activations, gradient shards), per GPU
  bool oom = false;
};

struct Metrics {
  bool unit_costs = false;  // times are in units (F = 1, B = 2), not seconds
  double step_time_s = 0;
  double bubble_fraction = 0;  // 1 - sum(busy) / (ranks x step time)
  double mfu = 0;              // model FLOPs / (step time x GPUs x peak bf16)
  double model_flops = 0;      // per step, all GPUs
  // Megatron's "model TFLOP/s per GPU": eq. (3) FLOPs / (step time x GPUs), FLOP/s.
  double model_flops_per_gpu = 0;
  // Megatron's MFU (Korthikanti et al. 2022; Megatron-LM today): the same FLOPs without
  // the recompute forward / (step time x GPUs x peak bf16).
  double megatron_mfu = 0;
  double tokens_per_s = 0;
  double samples_per_s = 0;
  double peak_memory_bytes = 0;  // max over ranks, per GPU
  double hbm_bytes = 0;          // capacity per GPU
  bool oom = false;
  std::string oom_detail;  // the first rank out of memory: its bytes by category at its peak
  // Host offload (plans with OFFLOAD/RELOAD ops; copy_exposed_s -1 otherwise). Host memory:
  // offloaded activations and host gradient shards; per node: the sum of its GPUs' peaks
  // (an upper bound: they need not peak together).
  double host_peak_bytes = 0;       // max over ranks, per GPU
  double node_host_peak_bytes = 0;  // max over nodes
  double node_host_bytes = 0;       // capacity per node
  double held_peak_bytes = 0;       // remote offload: most a rank holds for another, per GPU
  bool host_oom = false;
  // step - the step of the same plan with instant copies: the time the step waits on them.
  double copy_exposed_s = -1;
  double copy_seconds = 0;  // busiest rank's copy time, both directions, s
  size_t ops = 0;
  int world_gpus = 0;
  std::vector<RankMetrics> ranks;
  std::vector<std::string> critical_path;  // op strings, in time order

  // Lower bound of the step: the busiest rank's compute (no schedule can be faster), s.
  double lower_bound_s = 0;
  // Modalities (-1 when the plan has none). Exposed: step - the step of the same plan
  // without that module's ops (SimulateWithout: none runs, nothing waits for one), s.
  // Hidden fraction:
  // 1 - exposed / the mean over ranks of that module's compute seconds (clamped to [0, 1]).
  double vision_exposed_s = -1;
  double vision_hidden_fraction = -1;
  double generator_exposed_s = -1;
  double generator_hidden_fraction = -1;
  // Vision compute seconds per rank: before = if every task ran on its consumer (the
  // replica's first stage), after = as placed. {min, mean, max} over ranks.
  std::array<double, 3> vision_load_before{};
  std::array<double, 3> vision_load_after{};
};

struct SimOptions {
  CostModel cost = CostModel::Unit();
  MemoryOptions memory;
  bool memory_curves = false;  // keep per-rank curves (for traces)
  // Run the passes without each modality that give the exposed and hidden times (off: those
  // metrics stay -1; the memory search in planner/plan.cc needs only time and memory).
  bool exposure = true;
};

struct SimResult {
  std::vector<double> durations;
  Timeline timeline;
  std::vector<RankMemory> memory;
  Metrics metrics;
};

StatusOr<SimResult> RunSimulation(const Table& t, const SimOptions& o);

// `index`: the table's (IndexForEngine), for the critical path.
Metrics ComputeMetrics(const Table& t, const EngineIndex& index, const Timeline& tl,
                       const std::vector<double>& durations, const std::vector<RankMemory>& memory,
                       const CostModel& cost, double hbm_bytes);
nlohmann::json MetricsJson(const Metrics& m);
std::string MetricsText(const Metrics& m);  // human-readable table with units

}  // namespace pipeplan
