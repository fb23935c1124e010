// Modality placement policies: where the vision encoder's and the generator's ops go in
// the per-rank sequences, without changing the text order.
//
// Each policy decides, per task, a rank and anchors (insert before/after a text op);
// InsertModality then adds the ops and the SEND/RECV pairs that carry visual embeddings to
// the first-stage rank and their gradients back. Dependencies (architecture.md):
//   vision F(t of m) -> ... -> text F(chunk 0, m) on the first stage;
//   text B(chunk 0, m) -> vision B(t of m), after vision F(t);
//   text F(last, m) -> generator F(m) -> generator B(m) -> text B(last, m).
#pragma once

#include <vector>

#include "core/timeline.h"
#include "planner/config.h"
#include "planner/lower.h"
#include "planner/modality.h"

namespace pipeplan {

// A text op on a rank, as an anchor: insert before it (or at the end: mb = -1).
struct Anchor {
  OpKind kind = OpKind::kF;
  int32_t chunk = 0;
  int32_t mb = -1;  // -1 = end of the sequence
  bool after = false;
};

struct VisionPlacement {
  int rank = 0;
  Anchor f, b;
  bool recompute = false;  // RECOMPUTE right before the backward (decoupled DEP)
  // Planned start, s (list-scheduled policies; decoupled: an order key, gangs -1 / +1):
  // orders modality ops at one anchor.
  double f_at = 0, b_at = 0;
  // Layer-group pieces (ModalityWork's piece works, in layer order), each placed on
  // `rank`; empty = the task runs whole.
  struct Piece {
    Anchor f, b;
    double f_at = 0, b_at = 0;
  };
  std::vector<Piece> pieces;
};

struct GeneratorPlacement {
  int rank = 0;
  Anchor f, b;
  int shard = -1;  // shard of a generator split over its replica's ranks (-1: whole)
  double at = -1;  // planned start, s (orders it among the ops at its anchor)
};

// Most layer-group pieces of one task (gang tags leave room for this many).
inline constexpr int kMaxPieces = 64;

struct ModalityWorkIds {
  std::vector<WorkId> vision_f, vision_b, vision_recompute, vision_out;  // per vision task
  std::vector<WorkId> generator_f, generator_b;  // per generator task (a shard's if split)
  WorkId generator_io = 0;                       // a split generator's input (or gradient) transfer
  // Per vision task placed in pieces: each piece's forward and backward work (SplitTask).
  std::vector<std::vector<WorkId>> piece_f, piece_b;
};

// Policies (pure): from the text schedule shape and the tasks to placements.
std::vector<VisionPlacement> PlaceVisionInline(const PipelineShape& s, const ModalityWork& w);
std::vector<VisionPlacement> PlaceVisionDecoupled(const PipelineShape& s, const ModalityWork& w,
                                                  bool recompute);
// Nested, bubble-fill and optimus place tasks with the closed-loop list scheduler
// (planner/list_schedule.h); dynamic CP in BuildModalityWork chose each task's rank.
// The generator runs on the last stage between the text F and B of the last chunk.
std::vector<GeneratorPlacement> PlaceGenerator(const PipelineShape& s, const ModalityWork& w);

// Adds the modality ops and their SEND/RECV pairs to text compute sequences.
// Gang shards (multi-rank CP) get a group of their ranks from `builder`.
// `shards`: per (d * m + mb), a split generator's shards (empty: `generator` places each
// task whole). A split generator is a gang over its replica's ranks: the last stage sends
// its hidden states to every other rank after its text F and receives each shard's
// gradient before its text B.
Status InsertModality(std::vector<RankSeq>* seqs, const PipelineShape& s, const ModalityWork& w,
                      const ModalityWorkIds& ids, const std::vector<VisionPlacement>& vision,
                      const std::vector<GeneratorPlacement>& generator,
                      const std::vector<std::vector<GeneratorPlacement>>& shards,
                      TableBuilder* builder);

}  // namespace pipeplan
