// Config -> operator table: workload, text schedule, lowering passes, linking.
#pragma once

#include "core/table.h"
#include "planner/config.h"
#include "simulator/metrics.h"

namespace pipeplan {

// What `training.memory: auto` chose: the recompute mode of each pipeline rank's LLM
// layers and of the encoder and generator, found by simulating candidate plans (see
// BuildPlan). Times in seconds, memory in bytes per GPU (max over ranks).
struct MemoryChoice {
  std::vector<Recompute> text;  // per pipeline rank
  Recompute vision = Recompute::kNone, generator = Recompute::kNone;
  bool has_vision = false, has_generator = false;
  bool fits = false;
  int plans = 0;                                  // plans built and simulated by the search
  double start_step_s = 0, start_peak_bytes = 0;  // with the configured modes (the start)
  double step_s = 0, peak_bytes = 0;              // with the chosen modes
  double hbm_bytes = 0;                           // capacity per GPU
};
std::string MemoryChoiceText(const MemoryChoice& m);  // one line with units
nlohmann::json MemoryChoiceJson(const MemoryChoice& m);

// The operator table of a config. Under `training.memory: auto` the recompute modes are
// searched first (the start: the configured modes, none where not given): while a rank runs
// out of memory, the module holding the most activation bytes at that rank's peak (its
// pipeline rank's LLM layers, the encoder or the generator) goes one level up (none ->
// selective -> full) and the plan is simulated again; once it fits, each raised mode is
// tried one level lower and kept there if the plan still fits and is no slower, so no
// single mode can be lowered without running out of memory or slowing the step. The plan stores the
// chosen modes (and `memory: manual`) in its config, so a re-plan of that config reproduces it.
// `choice`, when given, receives the outcome.
StatusOr<Table> BuildPlan(const Config& config, MemoryChoice* choice = nullptr);

// Ranks of a config: (replica d, stage s) -> rank d*pp + s with GPU placement in
// Megatron's tp-cp-dp-pp order.
std::vector<RankInfo> MakeRanks(const Config& config);

// Simulation options of a config: its GPU (with overrides), ZeRO stage, reserve.
SimOptions SimOptionsFor(const Config& config, bool unit_costs = false);

// The config a plan was made from (stored in the plan), parsed again.
StatusOr<Config> ConfigOfPlan(const Table& plan, const std::string& plan_path,
                              const std::vector<std::string>& sets = {});

}  // namespace pipeplan
