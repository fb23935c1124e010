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
// along patches over k GPUs (a power of two, k <= cp_max_group), the smallest k that
// brings its per-GPU cost to the pool's target load (total / gpus); its k GPUs form an
// aligned sub-group. Items are placed longest first on the least-loaded sub-group
// (k = 1: least-loaded GPU), so several large images spread over sub-groups evenly.
// Each layer of a split image all-gathers K and V among its k GPUs (gather-KV).
struct CpItem {
  int image = 0;      // index into the input
  int first_gpu = 0;  // sub-group [first_gpu, first_gpu + k)
  int k = 1;
  double flops_per_gpu = 0;
  double gather_bytes_per_gpu = 0;  // all layers
};
struct CpPlan {
  std::vector<CpItem> items;
  std::vector<double> gpu_flops;       // compute per GPU
  std::vector<double> gpu_comm_bytes;  // gather-KV bytes per GPU
  double max_flops() const;
  double mean_flops() const;
};
// `base`: load (FLOPs) already on each GPU, e.g. its text work; empty = none.
CpPlan PlanVisionCp(const Config& c, const std::vector<int64_t>& patches, int gpus,
                    const std::vector<double>& base = {});

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

struct GeneratorTask {
  int d = 0, mb = 0;
  Work f, b;
  double seconds = 0;
};

struct ModalityWork {
  std::vector<VisionTask> vision;        // in (replica, micro-batch) order
  std::vector<GeneratorTask> generator;  // in (replica, micro-batch) order
  double vision_params = 0;              // total encoder + merger parameters
  double generator_params = 0;           // total generator parameters
};

// Where vision work may run: only on the consumer (inline), or on any GPU of the job.
struct VisionPool {
  bool consumer_only = false;
};
// Tasks of every micro-batch (see AddVisionTasks in modality.cc for how images become
// tasks and gangs). `recompute_outputs_only`: decoupled DEP (F keeps the output;
// RECOMPUTE restores the rest before the backward).
ModalityWork BuildModalityWork(const Config& c, const StepBatch& batch, const VisionPool& pool,
                               bool recompute_outputs_only);

}  // namespace pipeplan
