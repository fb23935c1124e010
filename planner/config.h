// The typed config: parsed once from YAML (strictly: unknown keys, wrong types and bad
// enum values are errors with FILE:LINE:COL), then checked for consistency.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/table.h"
#include "planner/yaml_doc.h"
#include "simulator/hardware.h"

namespace pipeplan {

struct ClusterConfig {
  std::string gpu = "H100";
  int nodes = 1;
  int gpus_per_node = 8;
  GpuSpec spec;  // catalog entry with cluster.hardware overrides applied
  bool operator==(const ClusterConfig&) const = default;
};

struct MoeConfig {
  int experts = 0;  // 0 = dense model
  int top_k = 0;
  int expert_ffn = 0;      // FFN hidden size of one expert
  int shared_experts = 0;  // shared experts, each of size expert_ffn
  int dense_layers = 0;    // leading layers that stay dense (e.g. DeepSeek/Qwen-style first layers)
  bool operator==(const MoeConfig&) const = default;
};

struct LlmConfig {
  int layers = 0, hidden = 0, ffn = 0, heads = 0, kv_heads = 0, vocab = 0;
  int head_dim = 0;       // 0 = hidden / heads
  bool gated_ffn = true;  // SwiGLU-style 3-matrix FFN
  // The output layer reuses the embedding's weights (Megatron's default; pipeplan's is
  // untied). Modelled where one stage holds both (pp 1): their parameters counted once.
  bool tie_embeddings = false;
  MoeConfig moe;
  bool operator==(const LlmConfig&) const = default;
};

enum class Recompute { kNone, kSelective, kFull };
// Megatron's --recompute-method for full recompute (see TrainingConfig).
enum class RecomputeMethod { kUniform, kBlock };
// What selective recompute drops and recomputes in the LLM's layers, as Megatron's
// --recompute-modules names it (bits of TrainingConfig::recompute_modules): the core
// attention; the two norms' outputs; the MoE experts' activation function; a dense layer's
// whole MLP; an MoE layer's whole MoE block (router, dispatch and combine all-to-alls,
// experts). planner/workload.cc: TextLayerCost.
enum RecomputeModule : uint8_t {
  kRecCoreAttn = 1,
  kRecLayernorm = 2,
  kRecMoeAct = 4,
  kRecMlp = 8,
  kRecMoe = 16,
};
inline constexpr std::string_view kRecomputeModuleNames[] = {"core_attn", "layernorm", "moe_act",
                                                             "mlp", "moe"};  // in bit order
// Classes of the LLM layers' saved tensors, by the module whose input they are, as
// Megatron's --offload-modules names them (fine-grained activation offloading): the input
// norm's input (the layer input), the QKV projection's input (the norm's output), the core
// attention's Q, K and V, the output projection's input, the MLP norm's input, the routed
// experts' FC1 input (the dispatched tokens) and the experts' activation input (FC1's
// output). Bits of TrainingConfig::offload_modules and fp8_modules; 0 there means every
// saved tensor of the layer. planner/workload.cc: TextLayerCost.
enum TensorClass : uint8_t {
  kTcAttnNorm = 1,
  kTcQkvLinear = 2,
  kTcCoreAttn = 4,
  kTcAttnProj = 8,
  kTcMlpNorm = 16,
  kTcExpertFc1 = 32,
  kTcMoeAct = 64,
};
inline constexpr std::string_view kTensorClassNames[] = {"attn_norm", "qkv_linear", "core_attn",
                                                         "attn_proj", "mlp_norm",   "expert_fc1",
                                                         "moe_act"};  // in bit order
// How saved activations are stored between forward and backward: bf16 as computed, or fp8
// block-quantised (planner/workload.h: kFp8StoredPerBf16).
enum class ActStorage { kBf16, kFp8 };
// Where saved activations wait for their backward: in device memory, or copied after the
// forward (OFFLOAD) and back before the backward (RELOAD) to host memory or to the device
// memory of another pipeline stage of the replica (remote).
enum class ActPlace { kDevice, kHost, kRemote };

// Where a modality's parameters live. fsdp: sharded over every GPU of the job, gathered
// before the step's first use, gradients reduce-scattered over the job. replicated: a full
// copy (split over the module's tp) on every rank that runs the module, gradients
// all-reduced (reduce-scattered with ZeRO >= 1) over those ranks.
enum class ParamPlacement { kFsdp, kReplicated };

struct VisionConfig {
  bool enabled = false;
  ParamPlacement placement = ParamPlacement::kFsdp;
  int tp = 1;                                   // encoder tensor parallelism inside a rank's GPUs
  Recompute recompute = Recompute::kSelective;  // activations kept for the encoder backward
  ActStorage saved_activations = ActStorage::kBf16;
  ActPlace offload = ActPlace::kDevice;
  int layers = 0, hidden = 0, mlp = 0, heads = 0;
  int patch = 14;  // patch side, pixels
  int merge = 2;   // spatial merge (2 = 2x2 pixel-shuffle -> patches / 4 tokens)
  // Dynamic context parallelism: images above `cp_threshold_patches` are split along
  // patches over a sub-group of up to `cp_max_group` GPUs (gather-KV per layer).
  bool cp = true;
  int cp_threshold_patches = 16384;
  int cp_max_group = 8;
  bool operator==(const VisionConfig&) const = default;
};

struct GeneratorConfig {
  bool enabled = false;
  ParamPlacement placement = ParamPlacement::kFsdp;
  int layers = 0, hidden = 0, mlp = 0, heads = 0;
  int latent_patch = 16;  // pixels per latent token side (VAE 8x downsampling x 2x2 patchify)
  Recompute recompute = Recompute::kSelective;
  ActStorage saved_activations = ActStorage::kBf16;
  ActPlace offload = ActPlace::kDevice;
  bool operator==(const GeneratorConfig&) const = default;
};

// Attention kernels of the LLM. flash: fused (FlashAttention), causal blocks skipped, nothing
// of size s^2 in HBM, the backward recomputes the scores. unfused: Megatron's core attention
// (batched score GEMMs over the full s x s matrix, fused scale-mask-softmax, dropout), the
// s^2 probabilities written to HBM and kept for the backward.
enum class Attention { kFlash, kUnfused };

struct ModelConfig {
  Attention attention = Attention::kFlash;
  double attention_dropout = 0;  // probability; with `unfused` a mask and output per score
  LlmConfig llm;
  VisionConfig vision;
  GeneratorConfig generator;
  bool operator==(const ModelConfig&) const = default;
};

// One virtual pipeline stage (global index chunk*pp + pp rank): its LLM layers and whether
// it holds the embedding (E) or the output layer and loss (L).
struct StageSpan {
  int layer_begin = 0, layer_end = 0;
  bool embedding = false, loss = false;
  bool operator==(const StageSpan&) const = default;
};

struct ParallelConfig {
  int tp = 1, pp = 1, vp = 1, dp = 0, cp = 1, ep = 1;  // dp = 0: derived from world size
  int microbatch_group_size_per_vp_stage = 0;          // 0: pp (or PyTorch's rounds rule)
  // Uneven stages: Megatron's layout string (e.g. "Et*3|t*4|t*4|t*3L"), or the layer
  // counts of the first and last pipeline rank (the rest split evenly over the other
  // ranks; each rank's layers split evenly over its vp chunks); 0 / empty: even.
  std::string layout;
  int first_stage_layers = 0, last_stage_layers = 0;
  // Megatron's account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split:
  // the embedding (the loss) counted as one layer where the layers are split evenly over
  // the pp x vp virtual stages, so the first (the last) virtual stage holds one layer fewer.
  bool account_for_embedding = false, account_for_loss = false;
  int layers_per_virtual_stage = 0;  // Megatron's alternative to vp; 0: vp as given
  std::vector<StageSpan> stages;     // derived: pp*vp entries in global stage order
  bool operator==(const ParallelConfig&) const = default;
};

// Parses Megatron's pipeline_model_parallel_layout: stages separated by '|', in global
// order; 'E' embedding, 't' a transformer layer, 'L' output layer and loss; "X*n" and
// "(...)*n" repeat. Errors name the offending character.
StatusOr<std::vector<StageSpan>> ParseStageLayout(std::string_view layout);

// The stages of first / last pipeline-rank layer counts (0: the rest's share) under a
// placement, as Megatron-core splits them (get_transformer_layer_offset): rank 0 holds
// `first_stage_layers`, rank pp - 1 `last_stage_layers`, the other ranks the rest evenly,
// each rank's layers split evenly over its vp chunks (under a V placement rank 0 holds the
// first and the last virtual stage). With the embedding or the loss accounted for, the
// layers plus one for each split evenly over the pp x vp virtual stages, the first (the
// last) virtual stage one layer fewer. `p` as ParseConfig validates it.
std::vector<StageSpan> RankStageSpans(const ParallelConfig& p, int layers,
                                      StagePlacement placement);

std::string_view RecomputeName(Recompute r);
std::string_view ActStorageName(ActStorage s);
std::string_view ActPlaceName(ActPlace p);

// Precision of the GEMMs: bf16 / fp16 at the catalog's 16-bit rate; fp8 runs the linear
// layers' GEMMs (not attention, router, embedding or output layer) at the FP8 rate with
// Transformer Engine's cast overheads.
enum class Precision { kBf16, kFp16, kFp8 };
enum class GradDtype { kFp32, kBf16, kFp16 };

struct TrainingConfig {
  int seq_length = 0;
  int micro_batch_size = 1;
  int global_batch_size = 0;  // 0: given by microbatches
  int microbatches = 0;       // per DP replica; derived from global_batch_size if 0
  Recompute recompute = Recompute::kSelective;
  // training.recompute given as a list: one mode per pipeline rank (all its chunks), or one
  // per virtual stage (pp * vp entries in stage order: the layers' order; the *_by_rank
  // lists below hold either); empty when one mode applies everywhere. `stage`: the global stage of
  // the rank's chunk in question.
  std::vector<Recompute> recompute_by_rank;
  Recompute RecomputeOf(int pp_rank, int stage) const {
    return Entry(recompute_by_rank, recompute, pp_rank, stage);
  }
  // Full recompute as Megatron's --recompute-method / --recompute-num-layers: `uniform`
  // recomputes every layer and keeps the input of each group of `recompute_num_layers`
  // layers of a chunk; `block` recomputes only each chunk's first `recompute_num_layers`
  // layers and keeps all activations of the others.
  RecomputeMethod recompute_method = RecomputeMethod::kUniform;
  int recompute_num_layers = 1;
  // training.recompute_modules: what `selective` recompute covers (RecomputeModule bits).
  uint8_t recompute_modules = kRecCoreAttn;
  // training.saved_activations, like recompute: one storage, one per pipeline rank or one
  // per virtual stage.
  ActStorage saved_activations = ActStorage::kBf16;
  std::vector<ActStorage> saved_activations_by_rank;
  ActStorage StorageOf(int pp_rank, int stage) const {
    return Entry(saved_activations_by_rank, saved_activations, pp_rank, stage);
  }
  // training.offload (none | host | remote), like recompute: one place, one per pipeline
  // rank or one per virtual stage.
  ActPlace offload = ActPlace::kDevice;
  std::vector<ActPlace> offload_by_rank;
  ActPlace OffloadOf(int pp_rank, int stage) const {
    return Entry(offload_by_rank, offload, pp_rank, stage);
  }
  // The entry of a list for the chunk of pipeline rank `pp_rank` that is global stage
  // `stage`: per rank (pp entries) or per virtual stage.
  int pp = 1;  // parallelism.pp (set by ParseConfig)
  template <typename E>
  E Entry(const std::vector<E>& list, E one, int pp_rank, int stage) const {
    if (list.empty()) return one;
    return static_cast<int>(list.size()) == pp ? list[pp_rank] : list[stage];
  }
  // training.offload_modules / fp8_modules: the tensor classes (TensorClass bits) of the
  // LLM layers that offload moves and FP8 storage quantises; 0: every saved tensor.
  uint8_t offload_modules = 0, fp8_modules = 0;
  // training.overlap_moe_recompute: under `moe` recompute, the recomputed dispatch
  // all-to-all runs beside the experts' data-gradient GEMMs (planner/workload.cc).
  bool overlap_moe_recompute = false;
  // training.memory: auto: the planner chooses recompute and storage per pipeline rank
  // (and of the encoder and generator) from the configured ones (none / bf16 where not
  // given) until the plan fits (planner/plan.h: BuildPlan), using the policies of
  // training.memory_policies (recompute; fp8, offload and gradients only when listed;
  // gradients: ZeRO-2, then host gradients, for the whole job).
  bool memory_auto = false;
  bool memory_recompute = true, memory_fp8 = false, memory_offload = false;
  bool memory_gradients = false;
  int zero_stage =
      1;  // 0: none, 1: optimizer states, 2: + gradients (Megatron distributed optimizer = 1)
  bool sequence_parallel = true;  // Megatron sequence parallelism with TP
  Precision precision = Precision::kBf16;
  GradDtype grad_reduce_dtype = GradDtype::kFp32;  // dtype of the DP gradient reduction
  double GradBytes() const { return grad_reduce_dtype == GradDtype::kFp32 ? 4 : 2; }
  // training.optimizer: adam, or muon for the LLM layers' 2-D weights (the rest stays on
  // Adam); muon_gather: how each matrix's owner gets it whole for Newton-Schulz (p2p: only
  // the matrices it owns, and their updates back; all_gather: the whole buffer everywhere).
  // training.grad_offload: host (pipeline ZeRO-2 with host gradients): after each
  // micro-batch's weight gradients a chunk's gradients are reduce-scattered over DP and the
  // GPU's shard copied into its host partition (accumulated there); the GPU keeps a double
  // buffer of one chunk's fp32 gradients; the shards come back before the optimizer step.
  bool grad_offload = false;
  static constexpr int kMaxGradMicroBatches = 1 << 15;  // per-micro-batch reductions' tags
  bool muon = false;
  bool muon_all_gather = false;
  int muon_ns_steps = 5;
  // Megatron's overlap_grad_reduce: gradients reduced in buckets of `grad_bucket_size`
  // parameters as the last micro-batch's backward produces them; overlap_param_gather: the
  // ZeRO parameter all-gather of the next step runs under the forward, per bucket.
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  int grad_bucket_size = 40000000;  // parameters per bucket (Megatron's ddp_bucket_size)
  // Megatron's scatter/gather of p2p tensors without sequence parallelism: each TP GPU sends
  // 1/tp of the activation and the receivers all-gather it over NVLink.
  bool scatter_gather_p2p = true;
  double comm_reserve_gb = 0;  // reserved for communication buffers and allocator slack, GiB
  bool operator==(const TrainingConfig&) const = default;
};

struct ImageClass {
  int height = 0, width = 0;  // pixels
  double weight = 1;          // relative frequency
  int frames = 1;             // > 1: a video clip of that many frames
  bool operator==(const ImageClass&) const = default;
};

// Order of each replica's micro-batches in the step: as drawn (or read), or by encoder
// FLOPs with the lightest at both ends and the heaviest in the middle (the first
// micro-batch's encoder forward and the last one's backward have no text work to hide
// behind; the others run in the pipeline's bubbles). kAuto: the plan is built with both
// and keeps the faster (BuildPlan); the plan's config names the one kept.
enum class MicrobatchOrder { kDrawn, kLightEnds, kAuto };

struct DataConfig {
  uint64_t seed = 0;
  MicrobatchOrder order = MicrobatchOrder::kDrawn;
  int text_tokens = 0;             // text tokens per sample; 0 = fill seq_length
  int images_per_sample = 0;       // images (or clips) drawn per sample, at most (those that
                                   // would overflow seq_length are dropped)
  std::vector<ImageClass> images;  // image-size distribution
  std::string manifest;            // JSON Lines file of real samples (overrides images)
  int generate_height = 0, generate_width = 0;  // generation target per sample, pixels
  bool operator==(const DataConfig&) const = default;
};

enum class PipelineKind {
  kGpipe,
  k1F1B,
  kInterleaved1F1B,
  kZbH1,           // zero-bubble H1: I and W split, pp micro-batches pending (1F1B's memory)
  kZbH2,           // zero-bubble H2: 2 pp pending
  kZbv,            // ZB-V: two chunks per rank in V placement
  kDualPipeV,      // DeepSeek's DualPipeV (V placement, overlapped F/B pairs)
  kInterleavedZb,  // PyTorch's interleaved zero bubble (loop placement)
  kCsv,            // per-rank orders read from a PyTorch pipeline-order CSV (schedule.csv)
};
// The stage placement a schedule needs (V for zbv and dualpipev).
StagePlacement PlacementOf(PipelineKind k);
// Whether the schedule splits the backward into I and W.
bool SplitsBackward(PipelineKind k);
enum class ModalityPolicy { kInline, kDecoupled, kNested, kBubbleFill, kOptimus };

struct ScheduleConfig {
  PipelineKind pipeline = PipelineKind::k1F1B;
  ModalityPolicy modality = ModalityPolicy::kInline;
  bool decoupled_recompute = false;  // decoupled: keep only encoder outputs, recompute (K2.5 DEP)
  // nested: a micro-batch's encoder forward may start once its consumer has started the
  // text forward of the micro-batch `modality_window` earlier (text rounds); 0 = 2 pp.
  int modality_window = 0;
  // nested: encoder activations a rank may hold, GiB per GPU; 0 = automatic (plan.cc).
  double modality_budget_gib = 0;
  // zb-h1 / zb-h2 / zbv: micro-batches (zbv: chunk activations) a rank may hold between an
  // F and its W; 0 = pp for zb-h1, 2 pp for zb-h2 and zbv.
  int zb_max_pending = 0;
  std::string csv;  // schedule.pipeline: csv: the PyTorch pipeline-order CSV to read
  bool operator==(const ScheduleConfig&) const = default;
};

struct Config {
  ClusterConfig cluster;
  ModelConfig model;
  ParallelConfig parallel;
  TrainingConfig training;
  DataConfig data;
  ScheduleConfig schedule;

  std::string source;      // file name the config came from
  YamlText resolved_yaml;  // the YAML after --set overrides (stored in plans)
  int world() const { return cluster.nodes * cluster.gpus_per_node; }
};

std::string_view PipelineName(PipelineKind k);
std::string_view ModalityName(ModalityPolicy p);
// Whether any module on any pipeline rank offloads its saved activations (host or remote).
bool OffloadsAny(const Config& c);

// The memory a plan may take while it is built and simulated (checked against an estimate
// before building); default half of the machine's physical memory.
inline constexpr double kBytesPerOp = 160;
void SetMemoryBudgetBytes(double bytes);
double MemoryBudgetBytes();

// Parses and checks a config; `sets` are "key.path=value" overrides applied first.
StatusOr<Config> LoadConfig(const std::string& path, const std::vector<std::string>& sets = {});
// Takes the document over: the config keeps its tree (resolved_yaml), which must not change.
StatusOr<Config> ParseConfig(YamlDoc&& doc);

}  // namespace pipeplan
