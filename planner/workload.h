// Work estimates from the model config: FLOPs, HBM bytes, folded TP/EP communication,
// activation bytes and parameters, per pipeline chunk. Formulas: reference.md (FLOPs per
// transformer/MoE layer; activation memory after Korthikanti et al. 2022).
#pragma once

#include <vector>

#include "core/table.h"
#include "planner/config.h"

namespace pipeplan {

struct LayerCost {
  double fwd_flops = 0;        // one layer, one micro-batch, all GPUs of the rank
  double model_flops = 0;      // fwd_flops with the causal half of the scores only
  double attn_core_flops = 0;  // scores and values: the part selective recompute redoes
  bool attn_fused = true;      // core attention runs as one fused kernel (attention rate)
  double attn_bwd_factor = 2;  // backward FLOPs of the core attention / forward
  double attn_hbm_f = 0;       // s^2 traffic per GPU of unfused attention, forward
  double attn_hbm_b = 0;       // the same, backward
  double linear_flops = 0;     // forward FLOPs of the linear layers (FP8-eligible GEMMs)
  double fp8_cast_f = 0;       // FP8 cast-transpose traffic per GPU, forward (precision fp8)
  double fp8_cast_b = 0;       // the same, backward
  double params_per_gpu = 0;   // parameters per GPU
  double act_bytes = 0;        // activation bytes per GPU kept for backward (by recompute mode)
  // Of act_bytes, those of the classes of training.offload_modules (0 when none are named).
  double offload_bytes = 0;
  // FP8 storage of the saved activations: quantise in the forward (read the bf16 tensor,
  // write the fp8 one and its scales), dequantise in the backward; HBM bytes per GPU.
  double store_hbm_f = 0, store_hbm_b = 0;
  double elementwise_bytes = 0;  // HBM traffic of memory-bound kernels per GPU, forward
  double tp_bytes = 0;           // TP collective bus bytes per GPU, forward
  int tp_calls = 0;
  double ep_bytes = 0;  // MoE all-to-all bytes per GPU, forward
  int ep_calls = 0;
  // A split backward: bytes per GPU its weight-gradient pass (W) needs after the input-
  // gradient pass (I): every linear layer's input and output gradient, bf16.
  double wgrad_keep_bytes = 0;
  // What the backward runs again under the layer's recompute mode (full: the forward;
  // selective: training.recompute_modules), with its folded communication.
  struct Again {
    double flops = 0, attn_flops = 0, linear_flops = 0, hbm_bytes = 0, tp_bytes = 0, ep_bytes = 0;
    int tp_calls = 0, ep_calls = 0;
    // The recomputed dispatch beside the experts' data-gradient GEMMs
    // (training.overlap_moe_recompute): Work::ep_overlap_*.
    double ep_overlap_bytes = 0, ep_overlap_flops = 0;
    int ep_overlap_calls = 0;
  } again;
};

struct TextWorkload {
  std::vector<Work> f, b;  // per global virtual stage (chunk*pp + stage)
  // The backward split (zero-bubble schedules): I computes the input gradient (all of the
  // core attention, recompute, memory-bound kernels and folded communication, and the
  // linear layers' data gradients) and frees what W does not need; W computes the weight
  // gradients of every parametric GEMM and frees the rest. I + W = B in every amount.
  std::vector<Work> i, w;
  std::vector<double> params_per_gpu;  // per global virtual stage
  // Per global virtual stage: the saved bytes per GPU of a forward that training.
  // offload_modules names (0 when none are named: the whole forward's are offloaded).
  std::vector<double> offload_bytes;
  double p2p_bytes = 0;         // activation (or gradient) bytes per GPU between stages
  double p2p_gather_bytes = 0;  // scatter/gather p2p: NVLink all-gather bytes per GPU
  double tokens_per_mb = 0;     // LLM tokens per micro-batch
};

// FP8 storage of a saved bf16 tensor: 1 byte per element plus one fp32 scale per 1x128
// block (the tile-wise activation quantisation of DeepSeek-V3, section 3.3.1), per bf16
// byte.
constexpr double kFp8StoredPerBf16 = (1 + 4.0 / 128) / 2;

// Saved activation bytes of `bf16` bytes of quantisable tensors plus `other` bytes (1-byte
// masks, fp32 statistics: kept as they are) under `storage`, and the HBM traffic of
// quantising them once (the same again to dequantise).
struct SavedBytes {
  double kept = 0, quantise_hbm = 0;
};
SavedBytes Saved(double bf16, double other, ActStorage storage);

// What one token keeps per layer of the encoder or generator for its backward (Korthikanti
// et al.): 18*d + 4*mlp; their attention is fused, so without recompute only the fp32
// log-sum-exp per head (4*heads) is added, no scores; full recompute keeps the layer input,
// 2*d. Of the 18*d, 2*d are 1-byte dropout masks: FP8 storage quantises the bf16 rest.
SavedBytes SavedPerToken(Recompute rc, ActStorage storage, double d, double mlp, double heads);

LayerCost TextLayerCost(const Config& c, bool moe_layer, Recompute rc,
                        ActStorage storage = ActStorage::kBf16);
// Chunks in global stage order; `placement` maps them to pipeline ranks (whose recompute
// mode applies).
TextWorkload BuildTextWorkload(const Config& c, StagePlacement placement);

// Muon over the LLM layers' 2-D weights of a stage (per GPU): the parameters it updates
// (attention's fused QKV and output projections, the FFN's or experts' two matrices; the
// router, norms, embedding and output layer stay on Adam) and the Newton-Schulz FLOPs of
// the matrices it owns. Newton-Schulz (Jordan et al. 2024, Moonlight: Liu et al. 2025) runs
// `muon_ns_steps` quintic iterations on the whole m x n matrix (m <= n): X X^T (2 m^2 n),
// b A + c A^2 (2 m^3), B X (2 m^2 n). Each matrix is owned by one of the GPUs that hold a
// shard of it, the owners spread evenly: a GPU's share is the fraction of each matrix it
// holds divided by the dp replicas that hold the same. `tp_sharded_per_gpu`: of
// `params_per_gpu`, those of matrices split over the TP group (attention, dense FFN, shared
// experts; routed experts are held whole by their EP rank): their owners also need the
// other tp - 1 shards, from their TP peers.
struct MuonCost {
  double params_per_gpu = 0, ns_flops_per_gpu = 0, tp_sharded_per_gpu = 0;
};
MuonCost MuonOfStage(const Config& c, const StageSpan& span);
// The same with the placement of the config's schedule.
TextWorkload BuildTextWorkload(const Config& c);

// LLM FLOPs of one step (all replicas) as Megatron reports them: eq. (3) of Narayanan et
// al. (SC21), 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) for GPT, generalised as Megatron-LM's
// num_floating_point_operations (query groups, gated FFN, MoE top-k and shared experts),
// with the recompute forward of every layer that eq. (3) assumes (4 GEMM passes per layer,
// 3 for the logits). `recompute_pass` false: 3 passes per layer, the model FLOPs of
// Korthikanti et al. (2022) and of Megatron-LM's MFU today.
double MegatronFlopsPerStep(const Config& c, bool recompute_pass = true);

}  // namespace pipeplan
