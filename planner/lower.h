// Lowering passes: compute order -> + SEND/RECV -> + gradient sync and optimizer step ->
// link dependencies -> table. Each pass is a function over per-rank op lists.
#pragma once

#include <array>
#include <functional>
#include <vector>

#include "core/parallel.h"
#include "core/table.h"
#include "planner/schedules.h"

namespace pipeplan {

struct PendingOp {
  OpKey key;
  WorkId work = 0;
  uint32_t tag = 0;
};
using RankSeq = std::vector<PendingOp>;

// Pipeline shape shared by the passes. Rank of (replica d, stage s) = d*pp + s.
struct PipelineShape {
  int pp = 1, vp = 1, dp = 1, m = 1;
  StagePlacement placement = StagePlacement::kLoop;
  int rank(int d, int stage) const { return d * pp + stage; }
  int stages() const { return pp * vp; }
  // Global virtual stage of a chunk of pp rank `stage`, and the (pp rank, chunk) of one.
  int global(int chunk, int stage) const { return GlobalStage(placement, pp, chunk, stage); }
  StageHome home(int g) const { return HomeOf(placement, pp, g); }
};

// Work ids per global stage of each text compute kind.
struct TextWorkIds {
  std::vector<WorkId> f, b, i, w;
  WorkId of(OpKind k, int g) const {
    return k == OpKind::kF ? f[g] : k == OpKind::kI ? i[g] : k == OpKind::kW ? w[g] : b[g];
  }
};

// Runs f(r) for each rank r >= `from` of `seqs`, where f reads and writes rank r's sequence
// alone: on the machine's cores where the sequences hold kParallelFromOps ops or more, else
// one rank after the other.
void ForEachRank(const std::vector<RankSeq>& seqs, size_t from,
                 const std::function<void(size_t)>& f);

// Text compute ops: stage orders (pp of them) replicated over DP replicas, or one order
// per rank (dp * pp, dp > 1). A step that overlaps the next gets kOverlapNextTag.
std::vector<RankSeq> ExpandStages(const std::vector<StageOrder>& orders, const PipelineShape& shape,
                                  const TextWorkIds& works);

// SEND right after the producing op (F, and B or I), RECV right before the consuming op
// (an overlapped pair: both RECVs before the pair, both SENDs after it). Consecutive
// SEND/RECV ops on a rank form one group posted together (Megatron's batched p2p).
// Tags pair them: 1 + ((replica*stages + sender stage)*m + mb)*2 + direction.
void AddSendRecv(std::vector<RankSeq>* seqs, const PipelineShape& shape, WorkId p2p_work);

struct GradSyncWorks {
  std::vector<WorkId> reduce;    // per global stage: gradient reduction payload
  std::vector<WorkId> gather;    // per global stage: parameter all-gather (ZeRO >= 1)
  std::vector<WorkId> opt_step;  // per stage (pp rank)
  // Overlapped reduction (Megatron's overlap_grad_reduce), per global stage: the last
  // micro-batch's backward as bucket pieces (piece 0 = the last layers, run first) and the
  // reduction of each bucket, posted as soon as its piece has run. Empty: not overlapped.
  std::vector<std::vector<WorkId>> bucket_piece, bucket_reduce;
  std::vector<std::vector<WorkId>> bucket_piece_w;  // the same pieces of W (split backward)
  // overlap_param_gather: the all-gathers open the step (they fetch the parameters the
  // previous step's optimizer updated) and each chunk's first forward waits for its own.
  bool gather_first = false;
  // Muon, per pp rank (empty lists: Adam or dp 1, where the optimizer step carries the TP
  // legs' time), over the DP group with a TP leg folded in (Work::tp_bytes). muon_kind all-gather:
  // one gather of the whole buffer (muon_gather[s][0]) before the optimizer step. All-to-all
  // (targeted p2p), per model chunk c: the gather of the matrices the GPU owns
  // (muon_gather[s][c]), their Newton-Schulz step (muon_step[s][c], OPT_STEP of chunk c,
  // after the Adam step opt_step[s]) and the updates sent back (muon_scatter[s][c]); chunk
  // c + 1's gather runs under chunk c's step.
  std::vector<std::vector<WorkId>> muon_gather, muon_step, muon_scatter;
  OpKind muon_kind = OpKind::kAllToAll;
  // ZeRO-2 (per global stage; empty: ZeRO 0/1 or dp 1): after every micro-batch's B or W
  // of a chunk, the chunk's gradients reduce-scattered over DP (mb_reduce), no reduction at
  // the end of the step. With host gradients (grad_out, grad_in; else empty) the GPU's
  // shard is then copied to its host partition (an optimizer OFFLOAD), and before the
  // optimizer step each chunk's shard comes back (RELOAD).
  std::vector<WorkId> mb_reduce, grad_out, grad_in;
};

// Tag of a per-micro-batch gradient reduction (bit 31 set; fewer than 2^15 micro-batches).
inline uint32_t GradTag(int32_t chunk, int32_t mb) {
  return 0x80000000u | static_cast<uint32_t>(mb) << 16 | static_cast<uint32_t>(chunk + 1);
}

// Up to 64 buckets per chunk (tag bits); a bucket is at least one layer.
inline constexpr int kMaxBuckets = 64;

// Per rank and chunk: gradient reduction over the stage's DP group right after the
// chunk's last backward (ALL_REDUCE, or REDUCE_SCATTER with ZeRO >= 1), per bucket after
// each bucket piece of it, or (ZeRO-2) after every micro-batch's backward; then OPT_STEP
// (and Muon's exchanges and per-chunk steps); then parameter ALL_GATHER per chunk with
// ZeRO >= 1 (or first in the step with gather_first). Returns nothing when dp == 1 except
// the optimizer steps.
// A modality's parameters (vision, generator) synchronised over `group`: the reduction
// comes after the rank's text ops, before its optimizer step (the same place on every
// rank: ranks post their collectives in one order, and a member's text reductions do not
// wait behind a group-wide one); an all-gather opens the step (FSDP: the module's first
// forward waits for it) or follows the optimizer step (a replicated module with ZeRO >= 1);
// gather_work = -1: none.
// A gradient sync outside the text's per-chunk DP reductions: a modality's parameters over
// the ranks holding them, or (module text) the tied word embedding's gradient between a
// replica's first and last stage. After the text reductions, in this vector's order on
// every rank (the same order everywhere: no blocking executor deadlocks), before the
// optimizer step.
struct ModalitySync {
  Module module;
  OpKind reduce = OpKind::kReduceScatter;
  WorkId reduce_work = 0;
  int64_t gather_work = -1;
  bool gather_first = false;
  int32_t group = -1;
  std::vector<bool> member;  // per rank
};
void AddGradSync(std::vector<RankSeq>* seqs, const PipelineShape& shape, int zero_stage,
                 const GradSyncWorks& works, const std::vector<int32_t>& dp_group_of_stage,
                 const std::vector<ModalitySync>& modality = {});

// The activations an op saves (F) or reads (RECOMPUTE, B, I): module, chunk, micro-batch,
// task and, for modalities, piece (a text backward cut into bucket pieces reads them in its
// first piece). Copies of them carry the same.
using CopyKey = std::array<int32_t, 5>;
CopyKey CopyKeyOf(const OpKey& k);
inline bool ReadsSaved(OpKind k) {
  return k == OpKind::kRecompute || k == OpKind::kB || k == OpKind::kI;
}

// Offload of saved activations. A forward op that saves activations of a module that
// offloads (`saved(op)` bytes per GPU, 0: none) is followed by an OFFLOAD of them (freeing
// them on the device once copied); a RELOAD brings them back for the first op that reads
// them (RECOMPUTE, B or I of the same module, chunk, micro-batch, task and, for
// modalities, piece). Where they go is planned on the compute ops' predicted times
// (`times`: the same plan without copies, simulated): each RELOAD is posted after the last
// compute op that ends before it must start to end as its reader starts (reloads one after
// another on their stream, latest reader first), and a forward whose OFFLOAD (queued behind
// earlier ones) would not end before its RELOAD starts keeps its activations on the device.
// `holder(op)`: the rank whose device memory holds them (remote offload), or -1: host
// memory; copies to a holder are OFFLOAD ->r / RELOAD <-r.
struct HostCopyModel {
  std::function<double(const PendingOp&)> saved;
  std::function<int32_t(const PendingOp&)> holder;
  std::function<std::pair<double, double>(const PendingOp&)> times;  // a compute op's start, end
  // Bytes a holder may keep for `rank` at once (remote offload).
  std::function<double(int32_t rank)> hold_cap;
  // The rank's predicted device memory: (time, bytes from then) steps.
  std::function<const std::vector<std::pair<double, double>>&(int32_t rank)> curve;
  // One copy of `bytes` between rank `rank` and `holder` (-1: host memory), either way.
  std::function<double(double bytes, int32_t rank, int32_t holder)> copy_seconds;
};
// Remote offload: a forward's activations are away from its rank over [away_from, away_to)
// (its end to its RELOAD's start) and held by the holder until held_to (the RELOAD's end).
struct RemoteSpan {
  double away_from, away_to, held_to, bytes;
};
// Which spans go to the holder: greedy peak reduction on the rank's predicted memory
// `curve` ((time, bytes) steps, less the spans chosen): while a span away at the curve's
// highest point keeps the holder within `cap` bytes at once, the one of them away longest
// while the rank is within its bytes of that point is chosen.
std::vector<uint8_t> ChooseRemote(const std::vector<RemoteSpan>& spans,
                                  const std::vector<std::pair<double, double>>& curve, double cap);

// Fails where `times` has no time for a compute op (start < 0).
Status AddHostCopies(std::vector<RankSeq>* seqs, const HostCopyModel& model, TableBuilder* builder);

// Adds every op to the builder in sequence order and links dependencies by rule:
// RECV -> its SEND (by tag); a gradient collective -> the last backward of its module and
// chunk on the rank; OPT_STEP -> the gradient RELOADs and (the step over the shard) the
// rank's gradient collectives or (a Muon chunk's step) its chunk's gather; Muon's gather ->
// the gradient collectives; the updates sent back -> their chunk's OPT_STEP; ALL_GATHER ->
// the last OPT_STEP and its chunk's Muon updates;
// an ALL_GATHER before any compute of its chunk: that chunk's first text F -> it;
// OFFLOAD -> the compute op before it (its forward); RELOAD -> its OFFLOAD and the compute
// op before it; the first reader of the activations -> their RELOAD.
// Sequences of `parallel_from` ops and more are linked in two parts of ranks side by side
// (the same table as one pass).
Status Link(std::vector<RankSeq> seqs, TableBuilder* builder,
            size_t parallel_from = kParallelFromOps);

// `bucket` < kMaxBuckets: one reduction per bucket of an overlapped gradient reduction.
uint32_t CollectiveTag(OpKind kind, Module module, int32_t chunk, int bucket = 0);

}  // namespace pipeplan
