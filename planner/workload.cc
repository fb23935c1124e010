#include "planner/workload.h"

#include <algorithm>
#include <array>

namespace pipeplan {
namespace {

constexpr double kBf16 = 2;  // bytes per bf16 element
constexpr int kKernelsPerLayerF =
    12;  // norm, qkv, rope, attention, proj, norm, fc1, act, fc2, adds

bool IsMoeLayer(const LlmConfig& l, int layer) {
  return l.moe.experts > 0 && layer >= l.moe.dense_layers;
}

}  // namespace

SavedBytes Saved(double bf16, double other, ActStorage storage) {
  if (storage == ActStorage::kBf16) return {bf16 + other, 0};
  // Quantise: read the bf16 tensor, write the fp8 one with its scales; dequantise: the
  // reverse.
  return {bf16 * kFp8StoredPerBf16 + other, bf16 * (1 + kFp8StoredPerBf16)};
}

SavedBytes SavedPerToken(Recompute rc, ActStorage storage, double d, double mlp, double heads) {
  switch (rc) {
    case Recompute::kNone:
      return Saved(16 * d + 4 * mlp, 2 * d + 4 * heads, storage);
    case Recompute::kSelective:
      return Saved(16 * d + 4 * mlp, 2 * d, storage);
    case Recompute::kFull:
      return Saved(2 * d, 0, storage);
  }
  return {};
}

LayerCost TextLayerCost(const Config& c, bool moe_layer, Recompute rc, ActStorage storage) {
  const LlmConfig& l = c.model.llm;
  const ParallelConfig& p = c.parallel;
  const double b = c.training.micro_batch_size, s = c.training.seq_length, h = l.hidden;
  const double T = b * s, q = static_cast<double>(l.heads) * l.head_dim;
  const double kv = static_cast<double>(l.kv_heads) * l.head_dim, mats = l.gated_ffn ? 3 : 2;
  const double tp = p.tp, cp = p.cp, shard = tp * cp;
  LayerCost lc;
  // Attention: QKV + output projections; scores and values 4*T*s*(heads*head_dim).
  // Causal masking halves the useful part. FlashAttention skips the masked blocks and its
  // backward recomputes the scores (5 matmuls against the forward's 2: 2.5x, as the
  // FlashAttention-2 paper counts). Unfused attention multiplies the full s x s matrix in
  // batched GEMMs (backward 2x) and moves the probabilities through HBM: scale-mask-softmax
  // reads and writes 2 bytes per score (backward: reads gradient and output, writes one:
  // 6); dropout reads and writes 2 and writes a 1-byte mask (backward: 2 + 1 read, 2
  // written).
  const double attn_params = h * (q + 2 * kv) + q * h;
  const double scores = 4 * T * s * q, elems = static_cast<double>(l.heads) * s * T / shard;
  const bool flash = c.model.attention == Attention::kFlash;
  const bool dropout = c.model.attention_dropout > 0;
  lc.attn_fused = flash;
  lc.attn_core_flops = flash ? 0.5 * scores : scores;
  lc.attn_bwd_factor = flash ? 2.5 : 2;
  if (!flash) {
    lc.attn_hbm_f = elems * (4 + (dropout ? 5 : 0));
    lc.attn_hbm_b = elems * (6 + (dropout ? 5 : 0));
  }
  lc.fwd_flops = 2 * T * attn_params + lc.attn_core_flops;
  lc.model_flops = 2 * T * attn_params + 0.5 * scores;
  lc.linear_flops = 2 * T * attn_params;
  double ffn_act;                // FFN activation bytes per token (before sharding)
  double ffn_flops, ffn_linear;  // forward FLOPs of the FFN (or MoE block), of its FP8 GEMMs
  if (moe_layer) {
    const double E = l.moe.experts, k = l.moe.top_k, fe = l.moe.expert_ffn,
                 sh = l.moe.shared_experts;
    ffn_linear = 2 * T * (k + sh) * h * fe * mats;  // the router stays in bf16
    ffn_flops = 2 * T * h * E + ffn_linear;
    lc.fwd_flops += ffn_flops, lc.model_flops += ffn_flops;
    lc.linear_flops += ffn_linear;
    lc.params_per_gpu =
        attn_params / tp + (E / p.ep) * h * fe * mats + sh * h * fe * mats / tp + h * E;
    ffn_act = 2 * mats * (k + sh) * fe;
    if (p.ep >
        1) {  // dispatch + combine, each T/(tp*cp) tokens x top-k x h, (ep-1)/ep leaves the GPU
      lc.ep_calls = 2;
      lc.ep_bytes = 2 * (T / shard) * k * h * kBf16 * (p.ep - 1) / p.ep;
    }
  } else {
    ffn_flops = ffn_linear = 2 * T * h * l.ffn * mats;
    lc.fwd_flops += ffn_flops, lc.model_flops += ffn_flops;
    lc.linear_flops += ffn_linear;
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
  // attention, norms and FFN input plus 4*f for the FFN (6*f gated); full recompute keeps
  // the layer input (2*s*b*h). Of the 16*h that are bf16: the two norms' inputs (2*h each)
  // and outputs (the QKV and FC1 / router inputs, 2*h each), Q and K (4*h), V (2*h), the
  // output projection's input (2*h). An MoE layer also keeps the dispatched tokens, its
  // routed experts' FC1 input (2*h per routed copy), which the dense count has no place
  // for. Sharded over tp (sequence parallel) and cp. The 5*a*s^2*b
  // are unfused attention's softmax output (2 bytes), dropout mask (1) and dropout output
  // (2), kept without recompute; without dropout only the softmax output. FlashAttention
  // keeps no s^2 tensor, only the fp32 log-sum-exp per head and token.
  // Without sequence parallelism the 10*s*b*h of norm inputs and dropout masks is not
  // sharded over tp (Korthikanti et al., table 2).
  // Of the 18*h, 2*h are the two 1-byte dropout masks; of the 5*a*s, 1*a*s is the
  // attention-dropout mask; the log-sum-exp is fp32: FP8 storage leaves those as they are
  // and quantises the bf16 rest (as it does the 10*s*b*h replicated without sequence
  // parallelism: kept bf16 here, an overestimate).
  // Selective recompute drops the classes of training.recompute_modules: core_attn the s^2
  // tensors (or the log-sum-exp), layernorm the norms' outputs (4*h), moe_act the experts'
  // activation output (FC2's input, 2 bytes per FFN element), mlp / moe everything the
  // FFN or MoE block keeps (its FFN outputs, the dispatched tokens) but its input.
  const double dispatch = moe_layer ? 2 * h * l.moe.top_k : 0;
  const double act_out = 2 * ffn_elems;
  const uint8_t mods = rc == Recompute::kSelective ? c.training.recompute_modules : 0;
  const bool whole_ffn = mods & (moe_layer ? kRecMoe : kRecMlp);
  const bool moe_act = moe_layer && (mods & kRecMoeAct) && !whole_ffn;
  double bf16 = 2 * T * h, other = 0;  // full recompute: the layer's input
  if (rc != Recompute::kFull) {
    bf16 = T * (16 * h + ffn_act + dispatch), other = 2 * T * h;
    if (!(mods & kRecCoreAttn)) {
      bf16 += flash ? 0 : (dropout ? 4.0 : 2.0) * l.heads * s * T;
      other += flash ? 4.0 * l.heads * T : dropout ? 1.0 * l.heads * s * T : 0;
    }
    if (mods & kRecLayernorm) bf16 -= 4 * h * T;
    if (whole_ffn) bf16 -= T * (ffn_act + dispatch);
    if (moe_act) bf16 -= T * act_out;
  }
  // The tensor classes (Megatron's offload module names: each module's input) among what
  // is kept, bf16 bytes per token before sharding: attn_norm the layer input 2*h (under
  // full recompute all that is kept), qkv_linear the input norm's output 2*h (not kept
  // when layernorm is recomputed), core_attn Q, K and V 6*h, attn_proj 2*h, mlp_norm 2*h,
  // expert_fc1 the dispatched tokens 2*h per routed copy and moe_act the routed experts'
  // FC1 output (2 bytes per element of FC1's 2*fe gated, fe not) unless the MoE block is
  // recomputed. Without sequence parallelism the three norm tensors are also replicated
  // over tp (`replicated`).
  const double fc1_out = moe_layer ? 2 * (mats - 1) * l.moe.top_k * l.moe.expert_ffn : 0;
  auto class_bf16 = [&](uint8_t classes, bool replicated) {
    if (rc == Recompute::kFull) return replicated ? 0.0 : (classes & kTcAttnNorm) ? 2 * h * T : 0.0;
    double x = 0;
    if (classes & kTcAttnNorm) x += 2 * h;
    if ((classes & kTcQkvLinear) && !(mods & kRecLayernorm)) x += 2 * h;
    if (classes & kTcMlpNorm) x += 2 * h;
    if (replicated) return x * T;
    if (classes & kTcCoreAttn) x += 6 * h;
    if (classes & kTcAttnProj) x += 2 * h;
    if (moe_layer && !whole_ffn) {
      if (classes & kTcExpertFc1) x += dispatch;
      if (classes & kTcMoeAct) x += fc1_out;
    }
    return x * T;
  };
  const uint8_t fp8_classes = c.training.fp8_modules, off_classes = c.training.offload_modules;
  // FP8 storage quantises the fp8_modules classes (all bf16 tensors when none are named).
  const double quantised = fp8_classes ? class_bf16(fp8_classes, false) : bf16;
  const double unquantised = fp8_classes ? bf16 - quantised : 0;
  const SavedBytes saved = Saved(quantised / shard, (other + unquantised) / shard, storage);
  lc.act_bytes = saved.kept;
  lc.store_hbm_f = lc.store_hbm_b = saved.quantise_hbm;
  const double replicated = 1 / cp - 1 / shard;  // per GPU and byte, without sequence parallelism
  const bool unsharded_norms = !c.training.sequence_parallel && rc != Recompute::kFull;
  if (unsharded_norms) lc.act_bytes += ((mods & kRecLayernorm) ? 6 : 10) * T * h * replicated;
  if (off_classes) {
    // The offloaded classes as stored: FP8 where both name them (or fp8_modules is unset).
    const double off = class_bf16(off_classes, false);
    const double off_fp8 = storage == ActStorage::kBf16 ? 0
                           : fp8_classes ? class_bf16(off_classes & fp8_classes, false)
                                         : off;
    lc.offload_bytes = (off - off_fp8 + off_fp8 * kFp8StoredPerBf16) / shard;
    if (unsharded_norms) lc.offload_bytes += class_bf16(off_classes, true) * replicated;
  }
  if (c.training.precision == Precision::kFp8) {
    // Transformer Engine casts each FP8 GEMM's input in the forward and its output gradient
    // in the backward with a fused cast-transpose: read 2 bytes, write 1 + 1 (the transpose
    // feeds the weight-gradient GEMM). Inputs: QKV h, projection q, FC1 h per routed copy,
    // FC2 the FFN width; output gradients: QKV q + 2kv, projection h, FC1 the FFN width
    // (x2 gated), FC2 h per routed copy.
    const double copies = moe_layer ? l.moe.top_k + l.moe.shared_experts : 1;
    lc.fp8_cast_f = 4 * (h + q + copies * h + ffn_elems) * T / shard;
    lc.fp8_cast_b =
        4 * ((q + 2 * kv) + h + ffn_elems * (l.gated_ffn ? 2 : 1) + copies * h) * T / shard;
  }
  {
    // Linear inputs (QKV h, projection q, FC1 h per routed copy, FC2 the FFN width) and
    // output gradients (QKV q + 2kv, projection h, FC1 the FFN width, x2 gated, FC2 h per
    // routed copy), bf16, sharded as the activations are.
    const double copies = moe_layer ? l.moe.top_k + l.moe.shared_experts : 1;
    lc.wgrad_keep_bytes = 2 *
                          ((h + q + copies * h + ffn_elems) +
                           ((q + 2 * kv) + h + ffn_elems * (l.gated_ffn ? 2 : 1) + copies * h)) *
                          T / shard;
  }
  if (p.tp > 1) {  // sequence parallel: 2 all-gathers + 2 reduce-scatters (= 2 all-reduces) per F
    lc.tp_calls = c.training.sequence_parallel ? 4 : 2;
    lc.tp_bytes = 2 * (2 * (tp - 1) / tp) * (T / cp) * h * kBf16;
  }
  LayerCost::Again& a = lc.again;
  if (rc == Recompute::kFull) {
    a = {lc.fwd_flops,    lc.attn_core_flops,
         lc.linear_flops, lc.elementwise_bytes + lc.attn_hbm_f + lc.fp8_cast_f,
         lc.tp_bytes,     lc.ep_bytes,
         lc.tp_calls,     lc.ep_calls};
    return lc;
  }
  if (mods & kRecCoreAttn) a.flops += lc.attn_core_flops, a.attn_flops += lc.attn_core_flops;
  if (mods & kRecCoreAttn) a.hbm_bytes += lc.attn_hbm_f;
  if (mods & kRecLayernorm) a.hbm_bytes += 8 * h * T / (sp * cp);  // both norms again
  const double act_hbm = (l.gated_ffn ? 6 : 4) * ffn_elems * T / shard;
  if (moe_act) a.hbm_bytes += act_hbm;
  if (whole_ffn) {
    // The block's forward from its input: its GEMMs (and the router), the activation, for
    // MoE the token permutation and the dispatch and combine all-to-alls, and with TP its
    // half of the layer's collectives (the all-gather before and the reduce-scatter after).
    const double copies = moe_layer ? l.moe.top_k + l.moe.shared_experts : 1;
    a.flops += ffn_flops, a.linear_flops += ffn_linear;
    a.hbm_bytes += act_hbm + (moe_layer ? 8.0 * l.moe.top_k * h * T / shard : 0);
    if (c.training.precision == Precision::kFp8)
      a.hbm_bytes += 4 * (copies * h + ffn_elems) * T / shard;
    a.tp_bytes += lc.tp_bytes / 2, a.tp_calls += lc.tp_calls / 2;
    a.ep_bytes += lc.ep_bytes, a.ep_calls += lc.ep_calls;
    if (moe_layer && lc.ep_calls > 0 && c.training.overlap_moe_recompute) {
      // K3's recomputed dispatch: a layer's dispatch is issued on its own stream while the
      // experts' data-gradient GEMMs of the layer after it (the one before it in the
      // backward) run (one GEMM per routed copy and matrix, as many FLOPs as its forward),
      // so the backward waits only for what they do not cover. The chunk's last MoE layer,
      // the first in its backward, has nothing to hide behind (BuildTextWorkload). The
      // combine stays in series.
      a.ep_overlap_bytes = lc.ep_bytes / 2, a.ep_overlap_calls = 1;
      a.ep_overlap_flops = 2 * T * l.moe.top_k * h * l.moe.expert_ffn * mats;
    }
  }
  return lc;
}

double MegatronFlopsPerStep(const Config& c, bool recompute_pass) {
  const LlmConfig& l = c.model.llm;
  const double B = c.training.global_batch_size, s = c.training.seq_length, h = l.hidden;
  const double q_ratio = static_cast<double>(l.heads) * l.head_dim / h;
  const double gated = l.gated_ffn ? 1.5 : 1, groups = static_cast<double>(l.kv_heads) / l.heads;
  const double attention = (1 + groups + s / h) * q_ratio;
  auto mlp = [&](bool moe) {
    return moe ? (static_cast<double>(l.moe.expert_ffn) / h) *
                     (l.moe.top_k + l.moe.shared_experts) * gated
               : (static_cast<double>(l.ffn) / h) * gated;
  };
  double layers = 0;  // sum over layers of the per-layer bracket
  for (int layer = 0; layer < l.layers; ++layer) layers += attention + mlp(IsMoeLayer(l, layer));
  // Per layer 2 (GEMM) x 2 (stacked GEMMs) x 4 (forward, recompute, two backward) = 16,
  // or 12 without the recompute; the logits 2 x 3.
  return (recompute_pass ? 16 : 12) * B * s * h * h * layers + 6 * B * s * h * l.vocab;
}

TextWorkload BuildTextWorkload(const Config& c, StagePlacement placement) {
  const LlmConfig& l = c.model.llm;
  const ParallelConfig& p = c.parallel;
  const double T = static_cast<double>(c.training.micro_batch_size) * c.training.seq_length;
  const double shard = static_cast<double>(p.tp) * p.cp;
  const double sp_shard = c.training.sequence_parallel ? shard : p.cp;
  const double V = l.vocab, h = l.hidden;
  // Layer costs by recompute mode and activation storage (both per pipeline rank or stage).
  std::array<LayerCost, 6> dense_of, moe_of;
  for (int k = 0; k < 6; ++k) {
    const auto rc = static_cast<Recompute>(k / 2);
    const auto st = static_cast<ActStorage>(k % 2);
    dense_of[k] = TextLayerCost(c, false, rc, st);
    moe_of[k] = TextLayerCost(c, true, rc, st);
  }
  TextWorkload w;
  w.tokens_per_mb = T;
  w.p2p_bytes = T * h * kBf16 / sp_shard;
  if (!c.training.sequence_parallel && p.tp > 1 && c.training.scatter_gather_p2p) {
    // Narayanan et al. (SC21) section 4.1: each TP GPU sends its 1/tp chunk of the (replicated)
    // activation over its own NIC; the receivers all-gather the chunks over NVLink.
    w.p2p_bytes /= p.tp;
    w.p2p_gather_bytes = (p.tp - 1) * w.p2p_bytes;
  }
  for (size_t g = 0; g < p.stages.size(); ++g) {
    const StageSpan& span = p.stages[g];
    const int32_t pp_rank = HomeOf(placement, p.pp, static_cast<int32_t>(g)).pp_rank;
    const Recompute rc = c.training.RecomputeOf(pp_rank, static_cast<int>(g));
    const int st = static_cast<int>(c.training.StorageOf(pp_rank, static_cast<int>(g)));
    const LayerCost& dense = dense_of[2 * static_cast<int>(rc) + st];
    Work f, bw;
    double params = 0, act = 0, attn_core = 0, attn_hbm_f = 0, attn_hbm_b = 0;
    double linear = 0, cast_f = 0, cast_b = 0, keep = 0, store_f = 0, store_b = 0, offload = 0;
    // What the backward recomputes, summed over the layers (each layer's own mode).
    double rec_flops = 0, rec_attn = 0, rec_linear = 0, rec_hbm = 0, rec_tp = 0, rec_ep = 0;
    int rec_tp_calls = 0, rec_ep_calls = 0, stored_layers = 0;
    double hidden_ep = 0, hiding_flops = 0;
    int hidden_ep_calls = 0;
    const LayerCost::Again* first_in_backward = nullptr;  // the chunk's last overlapping layer
    f.layer_begin = bw.layer_begin = span.layer_begin;
    f.layer_end = bw.layer_end = span.layer_end;
    for (int layer = span.layer_begin; layer < span.layer_end; ++layer) {
      // Full recompute by Megatron's method: `uniform` recomputes every layer and keeps the
      // input of each group of recompute_num_layers layers; `block` recomputes the chunk's
      // first recompute_num_layers layers (keeping their inputs) and keeps everything of
      // the others.
      const int i = layer - span.layer_begin, n = c.training.recompute_num_layers;
      const bool block = c.training.recompute_method == RecomputeMethod::kBlock;
      const Recompute lr = rc == Recompute::kFull && block && i >= n ? Recompute::kNone : rc;
      const bool kept = !(lr == Recompute::kFull && !block && i % n != 0);
      const int k = 2 * static_cast<int>(lr) + st;
      const LayerCost& lc = IsMoeLayer(l, layer) ? moe_of[k] : dense_of[k];
      const LayerCost::Again& a = lc.again;
      rec_flops += a.flops, rec_attn += a.attn_flops, rec_linear += a.linear_flops;
      rec_hbm += a.hbm_bytes, rec_tp += a.tp_bytes, rec_tp_calls += a.tp_calls;
      rec_ep += a.ep_bytes, rec_ep_calls += a.ep_calls;
      hidden_ep += a.ep_overlap_bytes, hidden_ep_calls += a.ep_overlap_calls;
      hiding_flops += a.ep_overlap_flops;
      if (a.ep_overlap_calls > 0) first_in_backward = &a;
      f.flops += lc.fwd_flops;
      f.model_flops += lc.model_flops;
      attn_core += lc.attn_core_flops;
      attn_hbm_f += lc.attn_hbm_f, attn_hbm_b += lc.attn_hbm_b;
      linear += lc.linear_flops, cast_f += lc.fp8_cast_f, cast_b += lc.fp8_cast_b;
      params += lc.params_per_gpu;
      if (kept) {
        act += lc.act_bytes, offload += lc.offload_bytes;
        store_f += lc.store_hbm_f, store_b += lc.store_hbm_b;
        stored_layers += lc.store_hbm_f > 0;
      }
      keep += lc.wgrad_keep_bytes;
      f.hbm_bytes += lc.elementwise_bytes;
      f.tp_bytes += lc.tp_bytes, f.tp_calls += lc.tp_calls;
      f.ep_bytes += lc.ep_bytes, f.ep_calls += lc.ep_calls;
    }
    f.kernels = kKernelsPerLayerF * (span.layer_end - span.layer_begin);
    if (span.embedding) {  // vocab-parallel lookup: gather rows, write the hidden states
      params += V * h / p.tp;
      f.hbm_bytes += 2 * T * h * kBf16 / sp_shard;
      if (rc == Recompute::kFull) rec_hbm += 2 * T * h * kBf16 / sp_shard;
      f.kernels += 1;
    }
    if (span.loss) {  // final norm, vocab-parallel logits, fp32 softmax / cross-entropy
      params += (l.tie_embeddings && span.embedding ? 0 : V * h / p.tp) + h;
      f.flops += 2 * T * h * V;
      f.model_flops += 2 * T * h * V;
      act += T * V * 4 / shard;                          // fp32 softmax kept for the backward
      keep += 2 * T * h / sp_shard + 2 * T * V / shard;  // logits input and gradient
      f.hbm_bytes += 2 * T * V * 4 / shard;
      f.kernels += 3;
    }
    const double other_hbm = f.hbm_bytes;
    f.hbm_bytes += attn_hbm_f + cast_f;
    f.attn_flops = dense.attn_fused ? attn_core : 0;
    const bool fp8 = c.training.precision == Precision::kFp8;
    f.fp8_flops = fp8 ? linear : 0;
    f.mem_delta_bytes = act;
    // Backward: 2x the forward outside the core attention, the attention's own factor
    // inside, plus what is recomputed (full: the layer's forward and its TP/EP
    // communication; selective: the core attention).
    const double core_bwd = dense.attn_bwd_factor * attn_core;
    bw.flops = 2 * (f.flops - attn_core) + core_bwd + rec_flops;
    bw.attn_flops = dense.attn_fused ? core_bwd + rec_attn : 0;
    bw.fp8_flops = fp8 ? 2 * linear + rec_linear : 0;
    bw.model_flops = 2 * f.model_flops;
    bw.hbm_bytes = 2 * other_hbm + attn_hbm_b + cast_b + rec_hbm;
    // FP8 storage: the forward quantises what it saves, the backward dequantises it (one
    // pass per stored layer each: a kernel).
    f.hbm_bytes += store_f, bw.hbm_bytes += store_b;
    f.saved_fp8 = stored_layers > 0;
    bw.tp_bytes = f.tp_bytes + rec_tp, bw.tp_calls = f.tp_calls + rec_tp_calls;
    bw.ep_bytes = f.ep_bytes + rec_ep, bw.ep_calls = f.ep_calls + rec_ep_calls;
    if (first_in_backward) {  // its dispatch has no GEMMs before it
      hidden_ep -= first_in_backward->ep_overlap_bytes;
      hidden_ep_calls -= first_in_backward->ep_overlap_calls;
      hiding_flops -= first_in_backward->ep_overlap_flops;
    }
    bw.ep_overlap_bytes = hidden_ep, bw.ep_overlap_calls = hidden_ep_calls;
    bw.ep_overlap_flops = hiding_flops;
    bw.kernels = 2 * f.kernels + stored_layers;
    f.kernels += stored_layers;
    bw.mem_delta_bytes = -act;
    // W: the weight gradient of every parametric GEMM (as many FLOPs as its forward);
    // I: the rest.
    Work wg;
    wg.layer_begin = bw.layer_begin, wg.layer_end = bw.layer_end;
    wg.flops = wg.model_flops = f.flops - attn_core;
    wg.fp8_flops = fp8 ? linear : 0;
    wg.kernels = std::max(1, bw.kernels / 4);
    wg.mem_delta_bytes = -keep;
    Work in = bw;
    in.flops -= wg.flops, in.model_flops -= wg.model_flops, in.fp8_flops -= wg.fp8_flops;
    in.kernels = std::max(1, bw.kernels - wg.kernels);
    in.mem_delta_bytes = keep - act;
    w.f.push_back(f);
    w.b.push_back(bw);
    w.i.push_back(in);
    w.w.push_back(wg);
    w.params_per_gpu.push_back(params);
    w.offload_bytes.push_back(offload);
  }
  return w;
}

MuonCost MuonOfStage(const Config& c, const StageSpan& span) {
  const LlmConfig& l = c.model.llm;
  const ParallelConfig& p = c.parallel;
  const double h = l.hidden, q = static_cast<double>(l.heads) * l.head_dim;
  const double kv = static_cast<double>(l.kv_heads) * l.head_dim, up = l.gated_ffn ? 2 : 1;
  MuonCost m;
  // `held`: the fraction of one m x n matrix a GPU holds (a count for whole experts).
  auto add = [&](double rows, double cols, double held, bool tp_sharded = true) {
    const double lo = std::min(rows, cols), hi = std::max(rows, cols);
    m.params_per_gpu += held * rows * cols;
    if (tp_sharded) m.tp_sharded_per_gpu += held * rows * cols;
    m.ns_flops_per_gpu +=
        held * c.training.muon_ns_steps * (4 * lo * lo * hi + 2 * lo * lo * lo) / p.dp;
  };
  for (int layer = span.layer_begin; layer < span.layer_end; ++layer) {
    add(h, q + 2 * kv, 1.0 / p.tp);  // fused QKV
    add(q, h, 1.0 / p.tp);
    if (IsMoeLayer(l, layer)) {
      const double fe = l.moe.expert_ffn;
      const double routed = double(l.moe.experts) / p.ep, shared = l.moe.shared_experts;
      add(h, up * fe, routed, false), add(fe, h, routed, false);
      add(h, up * fe, shared / p.tp), add(fe, h, shared / p.tp);
    } else {
      add(h, up * l.ffn, 1.0 / p.tp), add(l.ffn, h, 1.0 / p.tp);
    }
  }
  return m;
}

TextWorkload BuildTextWorkload(const Config& c) {
  return BuildTextWorkload(c, PlacementOf(c.schedule.pipeline));
}

}  // namespace pipeplan
