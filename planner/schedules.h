// Text pipeline schedules: pure generators of each pipeline stage's compute order.
//
// Conventions: pp stages, vp chunks per stage, m micro-batches per DP replica. Chunk c
// on stage s holds global virtual stage c*pp + s. Every stage runs F and B exactly once
// per (chunk, micro-batch). Orders follow Megatron-core (1F1B, interleaved 1F1B with
// microbatch_group_size_per_vp_stage) and PyTorch pipelining (GPipe; the rounds rule when
// m is not a multiple of pp).
#pragma once

#include <vector>

#include "core/op.h"
#include "core/status.h"
#include "planner/config.h"

namespace pipeplan {

struct Step {
  OpKind kind;  // kF or kB
  int32_t chunk;
  int32_t mb;
  friend bool operator==(const Step&, const Step&) = default;
};
using StageOrder = std::vector<Step>;

// group_size: Megatron's microbatch_group_size_per_vp_stage; 0 = pp when pp divides m,
// else PyTorch's rounds rule (m / max(1, m / pp)).
StatusOr<std::vector<StageOrder>> TextSchedule(PipelineKind kind, int pp, int vp, int m,
                                               int group_size = 0);

// Number of warm-up forwards of `stage` (Megatron's formula), for reports and tests.
int WarmupForwards(PipelineKind kind, int pp, int vp, int m, int group_size, int stage);

// Resolved group size for interleaved schedules (see TextSchedule).
int EffectiveGroupSize(int pp, int m, int group_size);

// "F0.1 B1.0 ..." (F<chunk>.<mb>), for tests and debugging.
std::string FormatOrder(const StageOrder& order);

}  // namespace pipeplan
