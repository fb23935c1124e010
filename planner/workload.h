// Work estimates from the model config: FLOPs, HBM bytes, folded TP/EP communication,
// activation bytes and parameters, per pipeline chunk. Formulas: reference.md (FLOPs per
// transformer/MoE layer; activation memory after Korthikanti et al. 2022).
#pragma once

#include <vector>

#include "core/table.h"
#include "planner/config.h"

namespace pipeplan {

struct LayerCost {
  double fwd_flops = 0;          // one layer, one micro-batch, all GPUs of the rank
  double attn_core_flops = 0;    // part of fwd_flops recomputed by selective recompute
  double params_per_gpu = 0;     // parameters per GPU
  double act_bytes = 0;          // activation bytes per GPU kept for backward (by recompute mode)
  double elementwise_bytes = 0;  // HBM traffic of memory-bound kernels per GPU, forward
  double tp_bytes = 0;           // TP collective bus bytes per GPU, forward
  int tp_calls = 0;
  double ep_bytes = 0;  // MoE all-to-all bytes per GPU, forward
  int ep_calls = 0;
};

struct TextWorkload {
  std::vector<Work> f, b;              // per global virtual stage (chunk*pp + stage)
  std::vector<double> params_per_gpu;  // per global virtual stage
  double p2p_bytes = 0;                // activation (or gradient) bytes per GPU between stages
  double tokens_per_mb = 0;            // LLM tokens per micro-batch
};

LayerCost TextLayerCost(const Config& c, bool moe_layer);
TextWorkload BuildTextWorkload(const Config& c);

}  // namespace pipeplan
