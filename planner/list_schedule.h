// Closed-loop modality placement: a list scheduler that runs the step in time order,
// rank by rank, and decides at every moment a rank's compute stream is free whether it
// runs its next text op (in the schedule's order, never changed) or a vision task.
//
// Model (the engine's, at op granularity): each rank has one compute stream; a text F
// starts when the previous stage's F of that micro-batch has ended plus its transfer, a
// text B when the next stage's B has; the first stage's F of chunk 0 also waits for every
// vision output of its micro-batch (task end + transfer); a vision B waits for its
// gradient (the consumer's B of chunk 0 + transfer); a CP gang starts when all of its
// ranks have posted it, together. Every decision sees the real state of the schedule so
// far (closed loop): a gap is known exactly when the op that ends it has been placed, and
// a rank whose next text op waits on an op not yet placed parks until it is, then fills
// the gap [free, ready) with tasks that fit it.
//
// Rules (ListRules, set by the policy):
// - urgency: a forward whose latest start (its consumer's predicted text F start minus
//   its own time and transfer) has come runs first;
// - gaps: when the next text op is not ready, the rank runs the task that fits the gap
//   (backwards first when released, else the forward with the earliest deadline);
// - windows (nested): the forward of micro-batch m waits until its consumer has started
//   the text forward of m - window; its backward is due (runs before ready text) once the
//   consumer has started the text backward of m + backward_window; with a memory budget,
//   a forward waits while the rank holds its budget of encoder activations and released
//   backwards are due: encoder activations stay bounded; a rank's room (nested and
//   bubble-fill: its device memory less its static bytes and text activation peak) acts
//   the same way;
// - phases (optimus): forwards fill gaps only until the rank's first text backward,
//   backwards only after its last text forward;
// - pieces: a task may run as layer-group pieces (ListInput::bounds), each placed on its
//   own, forwards in layer order and backwards in reverse;
// - stealing (bubble-fill): a rank in a gap with nothing of its own that fits takes a
//   whole-image forward that another rank has not started (its backward follows it);
// - gangs in common gaps (bubble-fill, fill_gangs): a gang that is not urgent starts only
//   when every one of its ranks is free and its next text op is not ready before the
//   gang's piece ends; otherwise the rank that starts it posts at once and the others
//   follow when they reach that text position;
// - own first: before a rank posts a forward gang it follows, it runs a piece of a forward
//   of its own that is due earlier;
// - gangs first at the tail: once its text is done, a rank runs a released gang backward
//   whose other ranks are all free before its own backwards (they would idle a piece at a
//   time behind them);
// - text first: a rank whose next text op is ready leaves a gang it would start or follow
//   for later (and decides as if it were not there) if the gang's other ranks are busy
//   until that op ends (and, to start one, are already at the rank's next text position,
//   so that they follow it one op later at no cost);
// - weight gradients (split backward): a rank in a gap that no encoder work fills runs a
//   later W of its order whose I has run, if it ends before the next text op is ready;
// - a generator split over its replica's ranks is a gang released by the last stage's text
//   F, whose text B waits for it (its ranks post it at their next decision).
// Deadlines come from the previous pass's consumer times (pass 0 has no vision work);
// passes repeat while the makespan improves, up to ListRules::passes; then, with
// ListRules::move_tail, images move off the step's tail (MoveTail: up to 8 more passes).
// Cost per pass:
// O((ops + tasks) log ranks).
#pragma once

#include <limits>
#include <vector>

#include "planner/lower.h"
#include "planner/modality.h"
#include "planner/placement.h"
#include "planner/schedules.h"

namespace pipeplan {

struct ListRules {
  int window = 0;           // rounds a forward may run ahead of its consumer; 0 = no window
  int backward_window = 0;  // micro-batches a backward may trail its consumer's text
                            // backward; 0 = none
  // Encoder activation bytes per GPU a rank may hold: a forward piece that would exceed it
  // waits (unless its deadline has come) and released backwards become due; 0 = none.
  double memory_budget_bytes = 0;
  // Per rank: the encoder activation bytes per GPU its device memory has room for, acting
  // as a budget of the rank's own (nested, bubble-fill); empty = none.
  std::vector<double> memory_room_bytes;
  bool steal = false;   // whole-image forwards move to ranks in a gap
  bool phases = false;  // optimus: forwards only until the first text backward, backwards
                        // only after the last text forward (and on deadlines)
  // A gang that is not urgent starts only in a gap of every one of its ranks (else in the
  // gap of the rank that starts it, the others following at once).
  bool fill_gangs = false;
  // Where the best pass's step ends with the backward of a whole image (not a gang's
  // shard), the image moves to the rank that could end that backward first by the pass's
  // times (the rank free earliest once the gradient is back; its forward moves too) and
  // the pass runs again, while that does not lengthen the step; the shortest pass is kept
  // (bubble-fill).
  bool move_tail = false;
  int passes = 4;
  bool operator==(const ListRules&) const = default;
};

// Timing inputs, all in seconds.
struct ListInput {
  PipelineShape shape;
  std::vector<StageOrder> orders;      // per stage: text compute order
  std::vector<double> f_s, b_s;        // per global stage: text F and B
  std::vector<double> i_s, w_s;        // per global stage: I and W of a split backward
  std::vector<double> after_last_f_s;  // per (d * m + mb): work right after F of the last
                                       // stage (the generator's F and B), else empty
  // A generator split over every rank of its replica (a gang after the last stage's text
  // F, before its B): per (d * m + mb) one shard's F and B seconds (< 0: no generation in
  // that micro-batch); per rank the transfer between it and its replica's last stage
  // (input there, gradient back). Empty = none.
  std::vector<double> gen_shard_s, gen_in_s;
  std::vector<double> next_p2p_s;  // per rank r: a text transfer between r and r + 1
  // Per stage, per position of its order: the seconds of a step that is half of an
  // overlapped pair (Step::overlap_next on the first; CostModel::PairSeconds), else < 0.
  // Empty where no step overlaps the next.
  std::vector<std::vector<double>> pair_s;
  std::vector<double> vf_s, vb_s;  // per vision task: forward, backward (with recompute)
  std::vector<double> out_s;       // per vision task: transfer to (and from) its consumer
  std::vector<double> bytes;       // per vision task: activation + output bytes per GPU
  // The largest of those with each gang taken as one task (its shards' bytes together):
  // the same for every sizing of the images (nested's default budget, RulesOf).
  double largest_whole_bytes = 0;
  // Per vision task: layer bounds of its pieces {0, l1, ..., layers}; empty = whole tasks.
  // Piece k takes the share (l[k+1] - l[k]) / layers of the task's forward and backward.
  std::vector<std::vector<int>> bounds;
};

struct ListResult {
  std::vector<VisionPlacement> vision;  // rank, anchors and order within an anchor
  // Sharded generator per (d * m + mb): one placement per shard (rank, anchor for its F and
  // B, planned start).
  std::vector<std::vector<GeneratorPlacement>> generator;
  // Per rank (d * pp + stage), its text order with W passes moved into gaps; empty when
  // every rank keeps its stage's order.
  std::vector<StageOrder> rank_orders;
  double makespan_s = 0;       // predicted end of the last text or vision op
  double text_makespan_s = 0;  // the same without vision work (pass 0)
  int passes = 0;              // passes run
  int tail_moves = 0;          // images moved off the tail (ListRules::move_tail) and kept
  // With ListRules::move_tail, where MoveTail starts: the deadlines of the pass kept and its
  // first move (image, rank; kNone = -1 where the step does not end with a movable image).
  std::vector<double> tail_deadline;
  int tail_task = -1, tail_rank = -1;
  double unmoved_s = 0;  // the makespan before MoveTail
  // The deadlines another pass of the kept alternative would start from (its last pass's
  // consumer starts), where its passes ran out (ListRules::passes) rather than stopped.
  std::vector<double> next_deadline;
  // Per alternative: its best makespan (+inf where it did not run: a repeat, or a twin
  // without windows whose windows never acted).
  std::vector<double> alternative_s;
  std::vector<double> first_pass_s;  // per alternative: its first pass's makespan (+inf: none)
  int alternative = -1;              // the one kept
};

// One rule set, from its text-only pass.
StatusOr<ListResult> ScheduleModality(const ListInput& in, const ModalityWork& w,
                                      const ListRules& rules);
// Whether one more pass of `rules` from `deadline` (ListResult::next_deadline of a placement
// of that one rule set whose passes ran out) ends before `makespan_s` (the placement's
// makespan before MoveTail): where it does not, more passes would have kept the placement.
StatusOr<bool> NextPassFaster(const ListInput& in, const ModalityWork& w, const ListRules& rules,
                              const std::vector<double>& deadline, double makespan_s);
// The text-only pass (no modality work; the rules do not act): its timeline (text ops, and
// a split generator's gangs; not yet indexed), `due` the consumers' text F starts and `end`
// the text makespan. It depends on the text part of `in` only.
StatusOr<TextTimeline> ScheduleText(const ListInput& in);
// The best of several rule sets (shortest predicted step; the first wins ties), passes
// starting from `text` (ScheduleText of the same text part).
StatusOr<ListResult> ScheduleModality(const ListInput& in, const ModalityWork& w,
                                      const std::vector<ListRules>& alternatives,
                                      const TextTimeline& text);
// ListRules::move_tail on a placement ScheduleModality kept (`rules`: its alternative, with
// move_tail; ScheduleModality runs it where the winner's rules ask for it): where the step
// ends with one whole image's backward, the image moves to the rank that could end that
// backward first (its forward with it) and the pass runs again with the same deadlines,
// while the makespan does not grow (up to 8 moves); the shortest pass replaces the
// placement (`placed->tail_moves` says how many moves it kept).
Status MoveTail(const ListInput& in, const ModalityWork& w, const ListRules& rules,
                ListResult* placed);

// A first pass of one rule set (deadlines from the text-only timeline, as an alternative's
// first pass in ScheduleModality) whose makespan only matters below `bound`.
struct ListProbe {
  const ListInput* in = nullptr;
  const ModalityWork* work = nullptr;
  ListRules rules;
  double bound = std::numeric_limits<double>::infinity();
};
// Each probe's makespan, or +inf where it exceeds its bound: the pass stops as soon as a
// rank's clock passes the bound (the makespan is at least every rank's clock). Probes run
// on the machine's cores. A probe whose rules differ from an earlier probe's of the same
// images and bound only by having no windows reports that probe's makespan where no window
// acted in it (the two passes make the same decisions); it runs after it, where a window
// did, or beside it when the machine has a core per probe.
StatusOr<std::vector<double>> Probe(const std::vector<ListProbe>& probes, const TextTimeline& text);

}  // namespace pipeplan
