// Config -> operator table: workload, text schedule, lowering passes, linking.
#pragma once

#include "core/table.h"
#include "planner/config.h"
#include "simulator/metrics.h"

namespace pipeplan {

// How one module keeps its activations for the backward.
struct MemoryMode {
  Recompute recompute = Recompute::kNone;
  ActStorage storage = ActStorage::kBf16;
  ActPlace place = ActPlace::kDevice;
  bool operator==(const MemoryMode&) const = default;
};
std::string MemoryModeName(MemoryMode m);  // "full", "none+fp8", "selective+host", ...

// Where the LLM's fp32 gradients live: ZeRO stage and host gradients (whole job).
struct GradMode {
  int zero_stage = 1;
  bool host = false;
  bool operator==(const GradMode&) const = default;
};
std::string GradModeName(GradMode g);  // "ZeRO-1", "ZeRO-2", "ZeRO-2+host"

// What `training.memory: auto` chose: the mode of each pipeline rank's LLM layers and of
// the encoder and generator, and the gradients, found by simulating candidate plans (see
// BuildPlan). Times in seconds, memory in bytes per GPU (max over ranks).
struct MemoryChoice {
  std::vector<MemoryMode> text;  // per pipeline rank
  MemoryMode vision, generator;
  GradMode gradients;
  bool gradients_searched = false;  // the gradients had a rung above the configured one
  bool has_vision = false, has_generator = false;
  bool fits = false;
  int plans = 0;                                  // plans built and simulated by the search
  double start_step_s = 0, start_peak_bytes = 0;  // with the configured modes (the start)
  double step_s = 0, peak_bytes = 0;              // with the chosen modes
  double hbm_bytes = 0;                           // capacity per GPU
};
std::string MemoryChoiceText(const MemoryChoice& m);  // one line with units
nlohmann::json MemoryChoiceJson(const MemoryChoice& m);

// The operator table of a config. Under `training.memory: auto` the modes are searched
// first. Each module (a pipeline rank's LLM layers, the encoder, the generator) has a
// ladder of modes from its configured one (none / bf16 where not given) up, each keeping
// fewer bytes: none, fp8 storage, full recompute, full + fp8 (plan.cc: Ladder; fp8 only
// when training.memory_policies lists it). While a rank runs out of memory, the module
// holding the most activation bytes at that rank's peak goes one step up and the plan is
// simulated again (with `gradients` listed, the job's fp32 gradients are one more such
// module: ZeRO-2, then host gradients, raised when they are the most bytes at the peak);
// once it fits, each raised module is tried one step lower and kept there
// if the plan still fits and is no slower, so no single module can step down without
// running out of memory or slowing the step. The plan stores the chosen modes (and
// `memory: manual`) in its config, so a re-plan of that config reproduces it. Under
// bubble-fill the search also runs with nested's placement and keeps the better plan (it
// fits, or is faster), as bubble-fill's. `choice`, when given, receives the outcome.
StatusOr<Table> BuildPlan(const Config& config, MemoryChoice* choice = nullptr);
// `config` as its plan was built under memory: auto: with the gradients the search chose
// (they set static memory, which the simulator takes from the config; the activation
// modes are in the table).
Config WithChoice(Config config, const MemoryChoice& choice);
// Whether memory: auto may move the LLM's fp32 gradients (ZeRO-2, host gradients).
bool GradientsMovable(const Config& config);

// Ranks of a config: (replica d, stage s) -> rank d*pp + s with GPU placement in
// Megatron's tp-cp-dp-pp order.
std::vector<RankInfo> MakeRanks(const Config& config);

// Simulation options of a config: its GPU (with overrides), ZeRO stage, reserve.
SimOptions SimOptionsFor(const Config& config, bool unit_costs = false);

// The config a plan was made from (stored in the plan), parsed again.
StatusOr<Config> ConfigOfPlan(const Table& plan, const std::string& plan_path,
                              const std::vector<std::string>& sets = {});

}  // namespace pipeplan
