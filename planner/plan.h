// Config -> operator table: workload, text schedule, lowering passes, linking.
#pragma once

#include <memory>
#include <optional>

#include "core/table.h"
#include "planner/config.h"
#include "simulator/metrics.h"

namespace pipeplan {

struct TextTimeline;  // planner/modality.h

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
//
// `share`: what plans of other configs built with the same share computed and this one
// can reuse (PlanShare). Without one, BuildPlan keeps the choices of the plans it builds
// (not their parts, which would raise its peak memory).
class PlanShare;
StatusOr<Table> BuildPlan(const Config& config, MemoryChoice* choice = nullptr,
                          PlanShare* share = nullptr);
// `config` as its plan was built under memory: auto: with the gradients the search chose
// (they set static memory, which the simulator takes from the config; the activation
// modes are in the table).
Config WithChoice(Config config, const MemoryChoice& choice);
// Whether memory: auto may move the LLM's fp32 gradients (ZeRO-2, host gradients).
bool GradientsMovable(const Config& config);

// What placed a plan's images under a list-scheduled policy (nested, bubble-fill, optimus):
// the policy whose rules placed them (bubble-fill may keep nested's plan), the images'
// sizing (0: dynamic CP's; 1 to 4: the other sizings the search tries; 5: the timed
// placement) and the rule set's index among the policy's alternatives (plan.cc:
// Alternatives). sizing -1: no list-scheduled placement.
struct ModalityChoice {
  ModalityPolicy policy = ModalityPolicy::kInline;
  int sizing = -1;
  int rules = -1;
  bool tail_moves = true;  // bubble-fill may move images off the tail (ListRules::move_tail)
  // Per rank, bytes taken off its room for encoder activations (EncoderRoom) by the repairs
  // of a plan that ran out of device memory (PlanOrdered); empty: none.
  std::vector<double> room_less;
  bool operator==(const ModalityChoice&) const = default;
};

// The plan of `config` with its images placed by `choice` (what a search of this config
// chose, e.g. Replanner::choice() where the config's memory modes and micro-batch order
// are not searched: Replanner places its steps with the searched ones) without searching;
// the plan is named as config's.
StatusOr<Table> PlanWithChoice(const Config& config, const ModalityChoice& choice);

// What plans of one config built under different modality policies, or built again (as
// the memory search and bubble-fill's comparison with nested do), have in common, kept
// for the plans that follow:
//  - for the list-scheduled policies (nested, bubble-fill, optimus), which place the same
//    images against the same text: the list scheduler's text-only timeline and the
//    step's encoder and generator work in each sizing the placement search tries;
//  - per config and policy, what its search chose (ModalityChoice): the same config is
//    placed again with that choice, without searching.
// What is reused is what the same config computes, so a plan is the same, byte for byte,
// with a share or without. Configs are told apart by every field that plans read (all but
// the file name and the stored YAML; the policy where the part is the policy's own). Safe
// to use from several threads at once. Keeps the timelines and work of the last `parts`
// configs (they can take tens of MiB each; a plan's peak memory grows by theirs) and the
// choices of the last `choices`.
class PlanShare {
 public:
  explicit PlanShare(size_t parts = 4, size_t choices = 256);
  ~PlanShare();
  PlanShare(const PlanShare&) = delete;
  PlanShare& operator=(const PlanShare&) = delete;
  // Parts found instead of computed, since the share was made.
  struct Reused {
    size_t timelines = 0, sizings = 0, choices = 0;
  };
  Reused reused() const;
  struct Impl;  // planner/plan.cc
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// The simulation of a replanned step's plan.
struct ReplanStep {
  double step_s = 0;
  bool oom = false;
  bool searched = false;  // out of memory with the first step's choices: its own search kept
};

// Replanning step after step of one config, each step with its own images (`data.seed`).
// The first step is planned with every search `plan` runs (memory modes under memory:
// auto, the micro-batch order under auto, the images' sizing and the list scheduler's rule
// sets); later steps keep those choices and place their own images (drawn with their own
// seed, or read from their own manifest) with them without
// searching: one rule set's passes instead of some tens (a warm start). A step's plan is
// the plan of the config with the searched modes and order, its seed, and the first step's
// sizing and rule set (checked, where that runs out of device memory: see Plan): with the
// first step's seed, the first step's plan.
class Replanner {
 public:
  struct Options {
    // Simulate each step's plan and plan it again where it runs out of device memory (see
    // Plan); without, a step is placed with the first step's choices and not simulated.
    bool check = true;
    // Keep the memory a step frees for the next step's plan (KeepFreedMemory, from the end
    // of Start): process-wide and not undone; false leaves the allocator as it is (unless
    // another replanner of the process set it).
    bool keep_memory = true;
  };
  static StatusOr<Replanner> Start(const Config& config, Options options);
  static StatusOr<Replanner> Start(const Config& config) { return Start(config, Options{}); }
  const Table& first() const { return first_; }
  const ModalityChoice& choice() const { return choice_; }
  // The plan of the step whose images are drawn with `seed`, or read from `manifest` where
  // given (`data.manifest`). Not safe to call from two threads at once (it keeps what later
  // steps reuse).
  // With Options::check, each step's plan is simulated. Where it runs out of device memory
  // and the first step's plan fits, the step's own search of the images' sizing and rule
  // sets is run (the first step's memory modes and order kept), and its plan kept where it
  // fits or is faster.
  StatusOr<Table> Plan(uint64_t seed, const std::string& manifest = "");
  // With Options::check, the simulation of the last plan returned (the first step's until
  // Plan is called).
  const std::optional<ReplanStep>& last() const { return last_; }
  // A step's first list-scheduler pass is lowered while its second runs beside it (which
  // mostly only shows that the first's placement is kept): the steps where the second
  // was faster, so their plans were made again with the placement the passes then kept.
  size_t lowered_again() const { return lowered_again_; }

 private:
  Config config_;  // with the modes and order the search chose
  ModalityChoice choice_;
  Table first_;
  // The text-only timeline of the list scheduler (without a generator it is the same for
  // every step), empty until a step has computed it.
  std::shared_ptr<TextTimeline> text_;
  Options options_;
  bool first_fits_ = false;  // whether the first step's plan fits the device memory
  size_t lowered_again_ = 0;
  std::optional<ReplanStep> last_;
};

// Ranks of a config: (replica d, stage s) -> rank d*pp + s with GPU placement in
// Megatron's tp-cp-dp-pp order.
std::vector<RankInfo> MakeRanks(const Config& config);

// Simulation options of a config: its GPU (with overrides), ZeRO stage, reserve.
SimOptions SimOptionsFor(const Config& config, bool unit_costs = false);

// The config a plan was made from (stored in the plan), parsed again.
StatusOr<Config> ConfigOfPlan(const Table& plan, const std::string& plan_path,
                              const std::vector<std::string>& sets = {});

}  // namespace pipeplan
