// Text pipeline schedules: pure generators of each pipeline stage's compute order.
//
// Conventions: pp stages, vp chunks per stage, m micro-batches per DP replica. Chunk c
// on stage s holds global virtual stage c*pp + s (loop placement; zbv and dualpipev use V
// placement, core/table.h). Every stage runs F and B (or I then W) exactly once per
// (chunk, micro-batch). Orders follow Megatron-core (1F1B, interleaved 1F1B with
// microbatch_group_size_per_vp_stage) and PyTorch pipelining (GPipe; the rounds rule when
// m is not a multiple of pp).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/op.h"
#include "core/status.h"
#include "planner/config.h"

namespace pipeplan {

struct Step {
  OpKind kind;  // kF, kB, or kI and kW (a split backward)
  int32_t chunk;
  int32_t mb;
  bool overlap_next = false;  // runs together with the next step (an overlapped F/B pair)
  friend bool operator==(const Step&, const Step&) = default;
};
using StageOrder = std::vector<Step>;

// group_size: Megatron's microbatch_group_size_per_vp_stage; 0 = pp when pp divides m,
// else PyTorch's rounds rule (m / max(1, m / pp)).
// max_pending: zb-h1 / zb-h2 / zbv pending limit (0 = DefaultMaxPending).
StatusOr<std::vector<StageOrder>> TextSchedule(PipelineKind kind, int pp, int vp, int m,
                                               int group_size = 0, int max_pending = 0);
int DefaultMaxPending(PipelineKind kind, int pp);

// Number of warm-up forwards of `stage` (Megatron's formula), for reports and tests.
int WarmupForwards(PipelineKind kind, int pp, int vp, int m, int group_size, int stage);

// Resolved group size for interleaved schedules (see TextSchedule).
int EffectiveGroupSize(int pp, int m, int group_size);

// A text schedule read from a PyTorch pipeline-order CSV (core/torch_csv.h): pp rows, each
// stage on one row, stages placed loop or V (inferred), every (stage, micro-batch) run
// once as F and B, or F, I and W; SEND/RECV actions are accepted and left to the planner.
// Errors name the file, line and column.
struct TorchCsvSchedule {
  std::vector<StageOrder> orders;
  StagePlacement placement = StagePlacement::kLoop;
};
StatusOr<TorchCsvSchedule> ReadTorchCsvSchedule(const std::string& path, int pp, int vp, int m);
StatusOr<TorchCsvSchedule> ParseTorchCsvSchedule(std::string_view text, const std::string& name,
                                                 int pp, int vp, int m);

// "F0.1 B1.0 ..." (F<chunk>.<mb>, "&" after a step that overlaps the next), for tests.
std::string FormatOrder(const StageOrder& order);

}  // namespace pipeplan
