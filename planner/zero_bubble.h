// Zero-bubble schedules: the backward split into I (input gradient) and W (weight
// gradient), W deferred into the bubbles.
//
// - ZeroBubbleH: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), the greedy
//   construction of section 3.1 (the authors' scheduler), for unit costs F = I = W = 1 and
//   free transfers. A micro-batch is pending on a stage from its F until its W; at most
//   `max_pending` may be (pp: ZB-H1, the memory of 1F1B; 2 pp: ZB-H2). Of the heuristic's
//   eight variants the one with the shortest per-stage span is kept (the first on ties).
// - ZeroBubbleV: the authors' ZB-V, two chunks per rank in V placement, the same costs,
//   pending limit counted in chunk activations (2 pp: the memory of 1F1B).
// - InterleavedZeroBubble: PyTorch's ScheduleInterleavedZeroBubble (loop placement).
// - DualPipeV: PyTorch's ScheduleDualPipeV (V placement); a step with `overlap_next` runs
//   together with the step after it (an OVERLAP_F_B pair).
#pragma once

#include <vector>

#include "core/status.h"
#include "planner/schedules.h"

namespace pipeplan {

StatusOr<std::vector<StageOrder>> ZeroBubbleH(int pp, int m, int max_pending);
StatusOr<std::vector<StageOrder>> ZeroBubbleV(int pp, int m, int max_pending);
StatusOr<std::vector<StageOrder>> InterleavedZeroBubble(int pp, int vp, int m);
StatusOr<std::vector<StageOrder>> DualPipeV(int pp, int m);

}  // namespace pipeplan
