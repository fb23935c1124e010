// `pipeplan tune`: search the parallel configuration, micro-batch size, recompute mode,
// pipeline schedule and modality policy of a config for the fastest step that fits in
// memory, with the model, the data, the global batch and the number of GPUs fixed.
//
// Every candidate gets two bounds from the model alone (no plan, no simulation):
//  - memory: the bf16 weights, fp32 gradients and optimizer states of its busiest pipeline
//    rank's LLM layers (what StaticMemory charges, leaving out what ZeRO-2, host gradients
//    or Muon could shrink; no gradients under memory: auto with `gradients`, which may
//    move them), the reserve, and the saved text activations at their peak over the
//    rank's schedule order (every rank runs its text ops in that order; a W's frees taken
//    at its I, as the list scheduler may pull a W earlier, and an overlapped pair's
//    backward before its forward; none under memory: auto, which may keep fewer; one
//    forward's where activations are offloaded): no plan of the point can need less, so a
//    point whose bound is above the HBM less the headroom cannot fit;
//  - step time: for each pipeline rank, no text op starts before the first micro-batch's
//    forwards through the stages before it (`head`); the rank's last backward (split
//    schedules: its last input-gradient pass) comes after all its forwards and backwards
//    (input-gradient passes) and is followed by that micro-batch's backwards (input-
//    gradient passes) through the stages before it (`tail`): step >= head + m x (F + B) +
//    tail, and >= head + m x (F + B) with the weight-gradient passes. Each op is taken at
//    its compute time (GEMMs, attention and memory-bound kernels at their rates, the folded
//    TP/EP communication; only the kernels where F/B pairs overlap, as in DualPipeV): every
//    text op of a rank runs on its one compute stream and transfers and modality work only
//    add, so no schedule, policy or placement ends the step sooner. For 1F1B this is the
//    text step with the textbook bubble (pp - 1)(F + B); interleaved: (pp - 1)(F + B) / vp.
//    With an encoder or generator, the step is also at least the mean rank's text work plus
//    their GPU-seconds over all GPUs at the cost model's rates (ModalitySeconds, tune.cc).
// Points are simulated in order of their time bound; once K points fit, a point whose bound
// is not below the K-th best step cannot enter the top K, nor can any after it.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"
#include "planner/config.h"
#include "planner/plan.h"
#include "planner/sweep.h"
#include "simulator/metrics.h"

namespace pipeplan {

// What `tune` ranks by. With the model, data, global batch and GPUs fixed, tokens and model
// FLOPs per step are the same at every point, so all three order points alike; the
// objective names the column reported.
enum class TuneObjective { kTokensPerS, kStepTime, kMfu };
StatusOr<TuneObjective> ParseTuneObjective(const std::string& name);
std::string_view TuneObjectiveName(TuneObjective o);

enum class TuneState : uint8_t {
  kInvalid,       // the config rules refuse the combination (first line in `error`)
  kPrunedMemory,  // memory bound above the HBM less the headroom
  kPrunedTime,    // time bound not below the K-th best step
  kOverBudget,    // not reached within --budget
  kFailed,        // planning or simulation failed (error)
  kSimulated,     // metrics hold the simulation
  kOtherShard,    // left to another shard (TuneOptions::shards)
};
std::string_view TuneStateName(TuneState s);

struct TunePoint {
  std::vector<std::string> values;  // one per axis
  TuneState state = TuneState::kInvalid;
  std::string error;
  double time_bound_s = 0, memory_bound_bytes = 0;
  Metrics metrics;    // kSimulated only (critical path dropped)
  bool fits = false;  // simulated, not out of memory, peak within the HBM less the headroom
  bool pareto = false;
};

struct TuneOptions {
  int gpus = 0;  // 0: the config's cluster (else cluster.nodes = gpus / gpus_per_node)
  TuneObjective objective = TuneObjective::kTokensPerS;
  double headroom_bytes = 0;  // memory kept free per GPU on top of the config's reserve
  double budget_s = 0;        // wall-clock seconds after which no simulation starts; 0: none
  int top_k = 5;
  int jobs = 1;                // points simulated at once
  bool prune = true;           // false: simulate every valid point (an exhaustive sweep)
  std::vector<VaryAxis> only;  // replaces the candidate values of these axes
  // Results (JSON Lines: a header naming the search, then one line per simulated or refused
  // point). `results_path` is read first, if it exists, and every point simulated is
  // appended to it: a run stopped (or out of budget) resumes where it ended. `resume_from`:
  // more files only read (the shards' results, when merging them).
  std::string results_path;
  std::vector<std::string> resume_from;
  // Sharding: this run takes the groups of points (those that differ only in schedule and
  // modality policy) whose index modulo `shards` is `shard`. The union of the shards' top K
  // holds the top K of the whole search (each shard prunes with its own K-th best, never
  // better than the whole search's).
  int shard = 0, shards = 1;
  // After each simulated point: (simulated, simulated + left to simulate at most); and
  // while bounding, after each group of points: (groups bounded, groups).
  std::function<void(size_t, size_t)> progress, bound_progress;
};

// Candidates a search may hold (about 1 KiB of memory each), and combinations of the axes'
// values (prefixes included) it walks to find them.
inline constexpr size_t kMaxTunePoints = 1000000;
inline constexpr double kMaxTuneGrid = 1e8;

struct TuneResult {
  std::vector<std::string> keys;  // the axes, as --set keys
  std::vector<TunePoint> points;  // every candidate, in the axes' row-major order
  std::vector<size_t> top;        // indices of the best fitting points, best first
  TunePoint configured;           // the config as written (values empty), simulated
  double hbm_bytes = 0, headroom_bytes = 0;
  int gpus = 0, global_batch = 0;
  size_t count(TuneState s) const;
  // Bound checks over simulated points: a time bound above the simulated step, a memory
  // bound above the simulated peak (either would make pruning unsafe; expected 0).
  size_t time_bound_misses = 0, memory_bound_misses = 0;
  double bound_wall_s = 0, simulate_wall_s = 0;  // wall-clock seconds of the two phases
  size_t resumed = 0;                            // points whose results were read, not simulated
  PlanShare::Reused shared;  // what plans took from others (points that differ in policy)
};

// The candidate values of each axis for a config (tp, cp, pp, vp, the first and last
// pipeline ranks' layers, the embedding and loss accounted for in the split where some
// pp x vp takes them, ep, micro-batch size, recompute, pipeline schedule, modality policy),
// before the config rules filter them.
std::vector<VaryAxis> TuneSpace(const Config& c, int gpus);

// A point as JSON (--json, and a line of a results file): its values by key, state, error,
// bounds and, simulated, its metrics, whether it fits and is on the Pareto frontier.
nlohmann::json TunePointJson(const std::vector<std::string>& keys, const TunePoint& p);

StatusOr<TuneResult> RunTune(const std::string& config_path, const std::vector<std::string>& sets,
                             const TuneOptions& o);

// The config file's YAML with point `p` applied (and its fixed keys: the global batch, the
// nodes), ready for `plan`.
StatusOr<std::string> TunedConfigYaml(const std::string& config_path,
                                      const std::vector<std::string>& sets, const TuneResult& r,
                                      const TunePoint& p);

}  // namespace pipeplan
