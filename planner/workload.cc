#include "planner/workload.h"

namespace pipeplan {
namespace {

constexpr double kBf16 = 2;  // bytes per bf16 element
constexpr int kKernelsPerLayerF =
    12;  // norm, qkv, rope, attention, proj, norm, fc1, act, fc2, adds

bool IsMoeLayer(const LlmConfig& l, int layer) {
  return l.moe.experts > 0 && layer >= l.moe.dense_layers;
}

}  // namespace

LayerCost TextLayerCost(const Config& c, bool moe_layer) {
  const LlmConfig& l = c.model.llm;
  const ParallelConfig& p = c.parallel;
  const double b = c.training.micro_batch_size, s = c.training.seq_length, h = l.hidden;
  const double T = b * s, q = static_cast<double>(l.heads) * l.head_dim;
  const double kv = static_cast<double>(l.kv_heads) * l.head_dim, mats = l.gated_ffn ? 3 : 2;
  const double tp = p.tp, cp = p.cp, shard = tp * cp;
  LayerCost lc;
  // Attention: QKV + output projections; scores and values 4*T*s*(heads*head_dim),
  // causal -> half.
  const double attn_params = h * (q + 2 * kv) + q * h;
  lc.attn_core_flops = 0.5 * 4 * T * s * q;
  lc.fwd_flops = 2 * T * attn_params + lc.attn_core_flops;
  double ffn_act;  // FFN activation bytes per token (before sharding)
  if (moe_layer) {
    const double E = l.moe.experts, k = l.moe.top_k, fe = l.moe.expert_ffn,
                 sh = l.moe.shared_experts;
    lc.fwd_flops += 2 * T * h * E + 2 * T * (k + sh) * h * fe * mats;
    lc.params_per_gpu =
        attn_params / tp + (E / p.ep) * h * fe * mats + sh * h * fe * mats / tp + h * E;
    ffn_act = 2 * mats * (k + sh) * fe;
    if (p.ep >
        1) {  // dispatch + combine, each T/(tp*cp) tokens x top-k x h, (ep-1)/ep leaves the GPU
      lc.ep_calls = 2;
      lc.ep_bytes = 2 * (T / shard) * k * h * kBf16 * (p.ep - 1) / p.ep;
    }
  } else {
    lc.fwd_flops += 2 * T * h * l.ffn * mats;
    lc.params_per_gpu = (attn_params + h * l.ffn * mats) / tp;
    ffn_act = 2 * mats * l.ffn;
  }
  lc.params_per_gpu += 2 * h;  // norms
  // Memory-bound kernels per token (bf16 reads + writes): 2 norms (8h), 2 residual adds
  // (12h), rotary embedding on q and k (4(q+kv)), the FFN activation (read gate and up,
  // write one: 3 x 2 bytes per FFN element, or 2 x 2 without gating), and for MoE the token
  // permutation to and from experts (2 x 2 x top-k x h).
  double ffn_elems =
      moe_layer ? (l.moe.top_k + l.moe.shared_experts) * double(l.moe.expert_ffn) : l.ffn;
  // Without sequence parallelism, norms and residual adds run replicated on every TP rank.
  const double sp = c.training.sequence_parallel ? tp : 1;
  lc.elementwise_bytes =
      20 * h * T / (sp * cp) +
      (4 * (q + kv) + (l.gated_ffn ? 6 : 4) * ffn_elems + (moe_layer ? 8.0 * l.moe.top_k * h : 0)) *
          T / shard;
  // Korthikanti et al.: 34*s*b*h + 5*a*s^2*b per layer for a 4h GELU FFN, i.e. 18*h for
  // attention, norms and FFN input plus 4*f for the FFN (6*f gated); scores only without
  // recompute; full recompute keeps the layer input (2*s*b*h). Sharded over tp (sequence
  // parallel) and cp.
  // Without sequence parallelism the 10*s*b*h of norm inputs and dropout masks is not
  // sharded over tp (Korthikanti et al., table 2).
  switch (c.training.recompute) {
    case Recompute::kNone:
      lc.act_bytes = T * (18 * h + ffn_act) + 5.0 * l.heads * s * T;
      break;
    case Recompute::kSelective:
      lc.act_bytes = T * (18 * h + ffn_act);
      break;
    case Recompute::kFull:
      lc.act_bytes = 2 * T * h;
      break;
  }
  lc.act_bytes /= shard;
  if (!c.training.sequence_parallel && c.training.recompute != Recompute::kFull)
    lc.act_bytes += 10 * T * h * (1 / cp - 1 / shard);
  if (p.tp > 1) {  // sequence parallel: 2 all-gathers + 2 reduce-scatters (= 2 all-reduces) per F
    lc.tp_calls = 4;
    lc.tp_bytes = 2 * (2 * (tp - 1) / tp) * (T / cp) * h * kBf16;
  }
  return lc;
}

TextWorkload BuildTextWorkload(const Config& c) {
  const LlmConfig& l = c.model.llm;
  const ParallelConfig& p = c.parallel;
  const int stages = p.pp * p.vp, per_chunk = l.layers / stages;
  const double T = static_cast<double>(c.training.micro_batch_size) * c.training.seq_length;
  const double shard = static_cast<double>(p.tp) * p.cp;
  const LayerCost dense = TextLayerCost(c, false), moe = TextLayerCost(c, true);
  TextWorkload w;
  w.tokens_per_mb = T;
  w.p2p_bytes = T * l.hidden * kBf16 / (c.training.sequence_parallel ? shard : p.cp);
  for (int g = 0; g < stages; ++g) {
    Work f, bw;
    double params = 0, act = 0, attn_core = 0;
    f.layer_begin = bw.layer_begin = g * per_chunk;
    f.layer_end = bw.layer_end = (g + 1) * per_chunk;
    for (int layer = f.layer_begin; layer < f.layer_end; ++layer) {
      const LayerCost& lc = IsMoeLayer(l, layer) ? moe : dense;
      f.flops += lc.fwd_flops;
      attn_core += lc.attn_core_flops;
      params += lc.params_per_gpu;
      act += lc.act_bytes;
      f.hbm_bytes += lc.elementwise_bytes;
      f.tp_bytes += lc.tp_bytes, f.tp_calls += lc.tp_calls;
      f.ep_bytes += lc.ep_bytes, f.ep_calls += lc.ep_calls;
    }
    f.kernels = kKernelsPerLayerF * per_chunk;
    if (g == 0) params += static_cast<double>(l.vocab) * l.hidden / p.tp;  // embedding
    if (g == stages - 1) {  // output layer + loss; fp32 logits kept for backward
      params += static_cast<double>(l.vocab) * l.hidden / p.tp;
      f.flops += 2 * T * l.hidden * l.vocab;
      act += T * l.vocab * 4 / shard;
      f.hbm_bytes += 2 * T * l.vocab * 4 / shard;  // fp32 softmax / cross-entropy over logits
      f.kernels += 3;
    }
    f.attn_flops = attn_core;
    f.model_flops = f.flops;
    f.mem_delta_bytes = act;
    // Backward: 2x forward, plus the recomputed forward part.
    double recompute = c.training.recompute == Recompute::kFull        ? f.flops
                       : c.training.recompute == Recompute::kSelective ? attn_core
                                                                       : 0;
    bw.flops = 2 * f.flops + recompute;
    bw.attn_flops = 2 * attn_core + (c.training.recompute == Recompute::kNone ? 0 : attn_core);
    bw.model_flops = 2 * f.model_flops;
    bw.hbm_bytes = 2 * f.hbm_bytes;
    bw.tp_bytes = f.tp_bytes * (c.training.recompute == Recompute::kFull ? 2 : 1);
    bw.tp_calls = f.tp_calls * (c.training.recompute == Recompute::kFull ? 2 : 1);
    bw.ep_bytes = f.ep_bytes * (c.training.recompute == Recompute::kFull ? 2 : 1);
    bw.ep_calls = f.ep_calls * (c.training.recompute == Recompute::kFull ? 2 : 1);
    bw.kernels = 2 * f.kernels;
    bw.mem_delta_bytes = -act;
    w.f.push_back(f);
    w.b.push_back(bw);
    w.params_per_gpu.push_back(params);
  }
  return w;
}

}  // namespace pipeplan
