// The typed config: parsed once from YAML (strictly: unknown keys, wrong types and bad
// enum values are errors with FILE:LINE:COL), then checked for consistency.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "planner/yaml_doc.h"
#include "simulator/hardware.h"

namespace pipeplan {

struct ClusterConfig {
  std::string gpu = "H100";
  int nodes = 1;
  int gpus_per_node = 8;
  GpuSpec spec;  // catalog entry with cluster.hardware overrides applied
};

struct MoeConfig {
  int experts = 0;  // 0 = dense model
  int top_k = 0;
  int expert_ffn = 0;      // FFN hidden size of one expert
  int shared_experts = 0;  // shared experts, each of size expert_ffn
  int dense_layers = 0;    // leading layers that stay dense (e.g. DeepSeek/Qwen-style first layers)
};

struct LlmConfig {
  int layers = 0, hidden = 0, ffn = 0, heads = 0, kv_heads = 0, vocab = 0;
  int head_dim = 0;       // 0 = hidden / heads
  bool gated_ffn = true;  // SwiGLU-style 3-matrix FFN
  MoeConfig moe;
};

enum class Recompute { kNone, kSelective, kFull };

struct VisionConfig {
  bool enabled = false;
  Recompute recompute = Recompute::kSelective;  // activations kept for the encoder backward
  int layers = 0, hidden = 0, mlp = 0, heads = 0;
  int patch = 14;  // patch side, pixels
  int merge = 2;   // spatial merge (2 = 2x2 pixel-shuffle -> patches / 4 tokens)
  // Dynamic context parallelism: images above `cp_threshold_patches` are split along
  // patches over a sub-group of up to `cp_max_group` GPUs (gather-KV per layer).
  bool cp = true;
  int cp_threshold_patches = 16384;
  int cp_max_group = 8;
};

struct GeneratorConfig {
  bool enabled = false;
  int layers = 0, hidden = 0, mlp = 0, heads = 0;
  int latent_patch = 16;  // pixels per latent token side (VAE 8x downsampling x 2x2 patchify)
  Recompute recompute = Recompute::kSelective;
};

struct ModelConfig {
  LlmConfig llm;
  VisionConfig vision;
  GeneratorConfig generator;
};

struct ParallelConfig {
  int tp = 1, pp = 1, vp = 1, dp = 0, cp = 1, ep = 1;  // dp = 0: derived from world size
  int microbatch_group_size_per_vp_stage = 0;          // 0: pp (or PyTorch's rounds rule)
};

struct TrainingConfig {
  int seq_length = 0;
  int micro_batch_size = 1;
  int global_batch_size = 0;  // 0: given by microbatches
  int microbatches = 0;       // per DP replica; derived from global_batch_size if 0
  Recompute recompute = Recompute::kSelective;
  int zero_stage =
      1;  // 0: none, 1: optimizer states, 2: + gradients (Megatron distributed optimizer = 1)
  bool sequence_parallel = true;  // Megatron sequence parallelism with TP
  double comm_reserve_gb = 0;     // reserved for communication buffers and allocator slack, GiB
};

struct ImageClass {
  int height = 0, width = 0;  // pixels
  double weight = 1;          // relative frequency
  int frames = 1;             // > 1: a video clip of that many frames
};

struct DataConfig {
  uint64_t seed = 0;
  int text_tokens = 0;             // text tokens per sample; 0 = fill seq_length
  int images_per_sample = 0;       // images (or clips) drawn per sample, at most (those that
                                   // would overflow seq_length are dropped)
  std::vector<ImageClass> images;  // image-size distribution
  std::string manifest;            // JSON Lines file of real samples (overrides images)
  int generate_height = 0, generate_width = 0;  // generation target per sample, pixels
};

enum class PipelineKind { kGpipe, k1F1B, kInterleaved1F1B };
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
};

struct Config {
  ClusterConfig cluster;
  ModelConfig model;
  ParallelConfig parallel;
  TrainingConfig training;
  DataConfig data;
  ScheduleConfig schedule;

  std::string source;         // file name the config came from
  std::string resolved_yaml;  // the YAML after --set overrides (stored in plans)
  int world() const { return cluster.nodes * cluster.gpus_per_node; }
};

std::string_view PipelineName(PipelineKind k);
std::string_view ModalityName(ModalityPolicy p);

// Parses and checks a config; `sets` are "key.path=value" overrides applied first.
StatusOr<Config> LoadConfig(const std::string& path, const std::vector<std::string>& sets = {});
StatusOr<Config> ParseConfig(YamlDoc doc);

}  // namespace pipeplan
