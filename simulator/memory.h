// Memory per rank (per GPU of the rank): static (weights, gradients, optimizer states by
// ZeRO stage) plus activations per module, with lifetimes from the timeline: an op's
// mem_delta_bytes applies when it ends, a RELOAD's (and a collective's that fills a buffer:
// Muon's gathers) when it starts (its buffer is allocated before the copy). Host memory holds what
// OFFLOADs copied out, from the OFFLOAD's start to the end of its RELOAD; a remote OFFLOAD's bytes
// are held in its peer rank's device memory (act_held) over the same interval.
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/chrome_trace.h"
#include "core/table.h"
#include "core/timeline.h"

namespace pipeplan {

struct MemoryOptions {
  int zero_stage = 1;        // 0: none; 1: optimizer states sharded over DP; 2: + gradients
  double reserve_bytes = 0;  // communication buffers and allocator slack, bytes
  double hbm_bytes = 0;      // capacity per GPU, bytes (OOM threshold)
  // Pipeline ZeRO-2 with host gradients: the LLM's fp32 gradient shard lives in host memory;
  // the GPU keeps a double buffer of its largest chunk's full fp32 gradients.
  bool grads_on_host = false;
  // ZeRO-2 on the GPU (dp > 1): the fp32 shard accumulates each micro-batch's reduced
  // gradients; the backward fills buckets of `grad_bucket_params` parameters (at most a
  // chunk) of `grad_bytes` each, two at a time (one filling, one being reduced).
  double grad_bucket_params = 40e6;  // training.grad_bucket_size's default
  double grad_bytes = 4;
};

// Categories of the memory curve (Chrome trace counters use these names).
enum MemCat {
  kWeights = 0,
  kGrads,
  kOptimizer,
  kReserve,
  kActText,
  kActVision,
  kActGenerator,
  kActHeld,  // activations this rank holds for another (remote offload)
  kNumMemCats
};
const char* MemCatName(int cat);

struct MemorySample {
  double time_s;
  std::array<double, kNumMemCats> bytes;
  double host_bytes;  // host memory: offloaded activations, gradient shards
  OpId op;            // the op whose effect this is (UINT32_MAX: the step's start)
};

struct RankMemory {
  std::array<double, kNumMemCats> peak_by_cat{};  // each category's own peak, bytes
  double peak_bytes = 0;                          // peak of the total, bytes
  double peak_time_s = 0;
  std::array<double, kNumMemCats> at_peak{};  // each category at the total's peak, bytes
  bool oom = false;
  double host_peak_bytes = 0;       // host memory: offloaded activations, gradient shards
  std::vector<MemorySample> curve;  // one sample per change (if requested)
};

// A rank's memory per GPU that does not depend on the timeline, by category: bf16 weights,
// fp32 main gradients (sharded with ZeRO-2), fp32 master weights and two moments (one
// momentum for Muon's weights; sharded with ZeRO >= 1), each over the module's state_shard ranks,
// and the reserve; `host` gets the bytes it keeps in host memory (gradient shards with
// grads_on_host). `chunk_params`: the LLM parameters per GPU of the rank's largest chunk (the
// host-gradient double buffer holds two of its gradients, ZeRO-2's buckets at most one each;
// <= 0: the rank's mean chunk over `vp`).
std::array<double, kNumMemCats> StaticMemory(const RankInfo& ri, int vp, double chunk_params,
                                             const MemoryOptions& o, double* host);

std::vector<RankMemory> ComputeMemory(const Table& t, const Timeline& tl, const MemoryOptions& o,
                                      bool with_curves);

// Memory curves as Chrome-trace counter tracks ("memory GiB": one key per category + total).
std::vector<CounterTrack> MemoryCounters(const std::vector<RankMemory>& memory);

// The memory timeline of the ranks `include` marks (empty: all), from their curves: per
// rank its peak and one sample per op with a memory effect (the op, its time, bytes per
// category, the device total and host bytes).
nlohmann::json MemoryTimelineJson(const Table& t, const std::vector<RankMemory>& memory,
                                  const std::vector<uint8_t>& include);

}  // namespace pipeplan
