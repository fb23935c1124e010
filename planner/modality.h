// Vision encoder and generator work: per-image costs, dynamic context parallelism for
// large images (K3's gather-KV sub-groups), per-micro-batch tasks with their Work.
#pragma once

#include <vector>

#include "core/table.h"
#include "planner/config.h"
#include "planner/data.h"

namespace pipeplan {

// ---- Dynamic CP (pure) ----------------------------------------------------------------
// Places images on a pool of `gpus` GPUs. An image above the patch threshold is split
// along patches over k GPUs (a power of two, k <= cp_max_group): the smallest k whose
// shard time meets the target, max(the pool's per-GPU share of the images' time, the
// latency budget), doubling only while that makes the shard faster. Shard time = GEMMs
// at the GEMM rate + attention at the attention rate + the gather-KV that ring attention
// cannot hide: each layer passes K and V around the sub-group in k - 1 hops, each hop
// overlapping the attention of the block already held. Its k GPUs form an aligned
// sub-group. Items are placed longest first on the least-loaded sub-group (k = 1:
// least-loaded GPU), so several large images spread over sub-groups evenly.
struct CpItem {
  int image = 0;      // index into the input
  int first_gpu = 0;  // sub-group [first_gpu, first_gpu + k)
  int k = 1;
  double flops_per_gpu = 0;
  double attn_flops_per_gpu = 0;            // attention part of flops_per_gpu
  double gather_bytes_per_gpu = 0;          // all layers
  double exposed_gather_bytes_per_gpu = 0;  // the part ring attention cannot hide
};
struct CpPlan {
  std::vector<CpItem> items;
  std::vector<double> gpu_flops;          // compute per GPU
  std::vector<double> gpu_attn_flops;     // its attention part
  std::vector<double> gpu_comm_bytes;     // gather-KV bytes per GPU
  std::vector<double> gpu_exposed_bytes;  // of which not hidden under attention
  double max_flops() const;
  double mean_flops() const;
};
// `base`: load (FLOPs) already on each GPU, e.g. its text work; empty = none. `min_k`: per
// image, a split factor chosen elsewhere that it keeps at least (within the GPUs); empty
// = none.
CpPlan PlanVisionCp(const Config& c, const std::vector<int64_t>& patches, int gpus,
                    const std::vector<double>& base = {}, double budget_s = 0,
                    const std::vector<int>& min_k = {});

// Seconds of gather-KV over the busiest GPU's compute, from a cost model's numbers:
// comm / (comm + compute) for the GPU with the most gather traffic.
double CpCommFraction(const Config& c, const CpPlan& plan);

// ---- Tasks -------------------------------------------------------------------------------
// One vision task = some images of one micro-batch, run by one rank's GPUs.
struct VisionTask {
  int d = 0, mb = 0, task = 0;  // consumer replica, micro-batch, task index within it
  int rank = 0;                 // rank that runs it (chosen by dynamic CP; policies may move
                                // whole-image tasks)
  int shard = -1;               // gang shard index (op chunk), -1 = a whole-image task
  std::vector<int> gang_ranks;  // ranks of the gang, in shard order (empty = not a gang)
  Work f, b, recompute;         // forward, backward, forward recompute (decoupled DEP)
  double out_bytes = 0;         // visual embeddings per GPU (SEND payload), bytes
  double act_bytes = 0;         // activations kept from F to B per GPU, bytes
  double seconds = 0;           // predicted forward time (for placement)
};

// Forward and backward work of one part of a task.
struct PieceWork {
  Work f, b;
};

struct GeneratorTask {
  int d = 0, mb = 0;
  Work f, b;
  double seconds = 0;
  double tokens = 0;  // latent + condition tokens of the micro-batch
};

// The generator of one micro-batch split over k ranks along its tokens (each rank T/k
// queries; K and V passed around the k ranks as in ring attention, each hop overlapping
// the attention of the block already held; `across_nodes`: the ranks are on different
// nodes). Returns one shard's forward and backward work.
PieceWork GeneratorShard(const Config& c, const GeneratorTask& t, int k, bool across_nodes);

struct ModalityWork {
  std::vector<VisionTask> vision;        // in (replica, micro-batch) order
  std::vector<GeneratorTask> generator;  // in (replica, micro-batch) order
  double vision_params = 0;              // total encoder + merger parameters
  double generator_params = 0;           // total generator parameters
};

// Layer-group pieces of a task: bounds {0, l1, ..., layers} -> per piece its forward and
// backward work, each the share of the task's layers it covers (FLOPs, bytes, collective
// calls, kernels) with its own layer range. A piece's forward keeps its layers'
// activations until its backward; the last piece's forward also holds the output.
std::vector<PieceWork> SplitTask(const VisionTask& t, const std::vector<int>& bounds);

// When each rank is busy in a step without vision work (the list scheduler's text-only
// pass), for placing vision work where it can be hidden.
struct TextTimeline {
  // Per rank: busy intervals [start, end) in time order (after Index, gaps too short for
  // a piece of encoder work merged into them).
  std::vector<std::vector<std::pair<double, double>>> busy;
  // Per (d * m + mb): the consumer's text F of chunk 0 starts (encoder outputs due), and
  // its text backward of chunk 0 ends (encoder gradients released).
  std::vector<double> due, release;
  double end = 0;  // last text op's end
  // Once `busy` holds each rank's intervals in time order: merges gaps shorter than
  // `min_gap_s` into them and indexes the idle time (once per gap size).
  void Index(double min_gap_s);
  // Seconds of idle time on `rank` in [0, t), and the time at which `x` > 0 seconds of
  // idle time after `t` have passed (after the last busy interval every second is idle).
  double IdleBefore(int rank, double t) const;
  double Advance(int rank, double t, double x) const;
  double TextEnd(int rank) const { return busy[rank].empty() ? 0 : busy[rank].back().second; }

 private:
  std::vector<std::vector<double>> idle_at_;  // per rank, per interval: idle before its start
  double indexed_gap_s_ = -1;                 // the gap size of the last Index
};

// Where vision work may run: only on the consumer (inline), or on any GPU of the job.
struct VisionPool {
  bool consumer_only = false;
  // An image is not split while its unsplit time is within this, s (PlanVisionCp).
  double latency_budget_s = 0;
  int window_rounds = 1;  // rounds a forward may run ahead of its consumer (balance bound)
  // Set: each round's images go to the stage where they would be least late (their
  // forward before the consumer's text F, their backward after the gradient is released
  // and before the text ends, both in that stage's idle time), FLOPs balancing the
  // ranks of a stage and breaking ties; null: to the least-loaded ranks of the job.
  const TextTimeline* timeline = nullptr;
  // Per pipeline stage: the compute seconds of one round of its text ops (each chunk's
  // forward and backward). Set, one per stage (not timed): each round's images are balanced with
  // the text, a rank carrying the seconds its stage's text adds over the lightest stage's, in
  // encoder FLOPs of as many seconds, so that ranks with less text take more encoder work.
  std::vector<double> text_round_s;
};
// Whether timed placement applies: a gang's sub-group (up to cp_max_group GPUs) fits in
// one stage's GPUs.
bool TimedPlacementFits(const Config& c);

// One micro-batch's generator forward over its generation targets: FLOPs (all GPUs), of
// them the joint attention's, and tokens (latent + condition).
struct GeneratorFlops {
  double flops = 0, attn = 0, tokens = 0;
};
GeneratorFlops GeneratorForward(const Config& c, const MicroBatch& mb);

// Tasks of every micro-batch (see AddVisionTasks in modality.cc for how images become
// tasks and gangs). `recompute_outputs_only`: decoupled DEP (F keeps the output;
// RECOMPUTE restores the rest before the backward).
ModalityWork BuildModalityWork(const Config& c, const StepBatch& batch, const VisionPool& pool,
                               bool recompute_outputs_only);

}  // namespace pipeplan
