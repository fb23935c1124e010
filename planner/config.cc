#include "planner/config.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "planner/data.h"
#include "planner/schedules.h"

namespace pipeplan {
namespace {

constexpr int kMaxInt = 1 << 24;       // any integer key
constexpr int kMaxParallel = 1 << 16;  // tp, pp, vp, cp, ep, dp
// Physical bounds (config reference): pixels per image side, frames per clip, GPUs.
constexpr int kMaxWorld = 1 << 20;  // GPUs
constexpr int64_t kMaxTokensPerMicroBatch = int64_t{1} << 26;
constexpr std::string_view kPipelineNames[] = {"gpipe",     "1f1b",           "interleaved-1f1b",
                                               "zb-h1",     "zb-h2",          "zbv",
                                               "dualpipev", "interleaved-zb", "csv"};
constexpr std::string_view kModalityNames[] = {"inline", "decoupled", "nested", "bubble-fill",
                                               "optimus"};
constexpr std::string_view kRecomputeNames[] = {"none", "selective", "full"};
constexpr std::string_view kStorageNames[] = {"bf16", "fp8"};
constexpr std::string_view kPlaceNames[] = {"none", "host", "remote"};
constexpr std::string_view kAttentionNames[] = {"flash", "unfused"};
constexpr std::string_view kOrderNames[] = {"drawn", "light_ends", "auto"};
constexpr std::string_view kPlacementNames[] = {"fsdp", "replicated"};
constexpr std::string_view kPrecisionNames[] = {"bf16", "fp16", "fp8"};
constexpr std::string_view kGradDtypeNames[] = {"fp32", "bf16", "fp16"};

// Shared state of one parse: the document, the first error, and where each key was.
struct Ctx {
  const YamlDoc& doc;
  std::optional<Status> error;
  std::map<std::string, YAML::Node> seen;  // key path -> value node (for later checks)
  std::set<std::string> known_paths;       // every key path a reader asked for
  // Unknown keys with no near name in their own section: reported once every section has
  // been read, with a hint from any section.
  struct Unknown {
    YAML::Node node;
    std::string path, key;
  };
  std::vector<Unknown> unknown;

  // Every error of reading the keys is reported (up to kMaxErrors), in the order found;
  // consistency checks run only when reading found none, and stop at their first.
  static constexpr size_t kMaxErrors = 20;
  std::vector<std::string> messages;
  void Add(std::string m) {
    if (!error) error = InvalidInput(m);
    if (messages.size() < kMaxErrors &&
        std::find(messages.begin(), messages.end(), m) == messages.end())
      messages.push_back(std::move(m));
  }
  void Fail(const YAML::Node& node, const std::string& path, std::string_view msg) {
    Add(doc.ErrorAt(node, path, msg));
  }
  // Error about a key that was read earlier (consistency checks).
  void FailAt(const std::string& path, std::string_view msg) {
    auto it = seen.find(path);
    if (error) return;  // derived from values that already failed
    if (it != seen.end()) return Fail(it->second, path, msg);
    Add(fmt::format("{}: {}: {}", doc.name(), path, msg));
  }
  Status Result() const {
    std::string all;
    for (const std::string& m : messages) all += (all.empty() ? "" : "\n") + m;
    return InvalidInput(all);
  }
};

// A YAML mapping being read against a fixed set of keys. Every key read is marked used;
// Finish() reports the first unused one with a "did you mean" hint.
class MapReader {
 public:
  MapReader(Ctx* ctx, YAML::Node node, std::string path)
      : ctx_(ctx), node_(node), path_(std::move(path)) {
    if (node_.IsDefined() && !node_.IsNull() && !node_.IsMap())
      ctx_->Fail(node_, path_, fmt::format("'{}' must be a mapping", path_));
    // The keys once, in order: walking the yaml-cpp map on every lookup (node handles,
    // reference counts, a copy of every key) was most of a config's parse.
    if (node_.IsMap())
      for (auto it = node_.begin(); it != node_.end(); ++it)
        if (it->first.IsScalar()) entries_.push_back({it->first.Scalar(), it->first, it->second});
  }

  // Finds a key by its canonical name or an alias; nullopt if absent.
  std::optional<YAML::Node> Find(std::initializer_list<std::string_view> names, bool required) {
    for (auto n : names) known_.insert(std::string(n)), ctx_->known_paths.insert(Path(n));
    std::optional<YAML::Node> found;
    std::string found_name;
    for (const Entry& e : entries_) {  // non-scalar keys are reported by Finish()
      for (auto n : names) {
        if (e.key != n) continue;
        if (found) {
          // A key and its alias: --set by either name overrides the file's.
          const bool mine = ctx_->doc.FromSet(Path(e.key)),
                     theirs = ctx_->doc.FromSet(Path(found_name));
          if (mine != theirs) {
            if (mine) found = e.value, found_name = e.key;
            continue;
          }
          ctx_->Fail(e.key_node, Path(n),
                     fmt::format("'{}' and '{}' set the same value", found_name, e.key));
          return std::nullopt;
        }
        found = e.value, found_name = e.key;
      }
    }
    if (found) ctx_->seen[Path(*names.begin())] = *found;
    // A missing key of a missing (or broken) mapping is not reported again.
    if (!found && required && (path_.empty() || node_.IsMap()))
      ctx_->Fail(node_, path_.empty() ? std::string(*names.begin()) : path_,
                 fmt::format("missing required key '{}'", Path(*names.begin())));
    return found;
  }

  // Integers are bounded (kMaxInt unless given) so that products of them cannot overflow.
  void Int(std::initializer_list<std::string_view> names, int* out, int min, bool required = false,
           int max = kMaxInt) {
    auto n = Find(names, required);
    if (!n) return;
    std::string path = Path(*names.begin());
    long long v = 0;
    try {
      v = n->as<long long>();
    } catch (const YAML::Exception&) {
      return ctx_->Fail(*n, path,
                        fmt::format("'{}' must be an integer, got '{}'", path, Scalar(*n)));
    }
    if (v < min)
      return ctx_->Fail(*n, path, fmt::format("'{}' must be >= {}, got {}", path, min, v));
    if (v > max)
      return ctx_->Fail(*n, path, fmt::format("'{}' must be <= {}, got {}", path, max, v));
    *out = static_cast<int>(v);
  }

  void U64(std::initializer_list<std::string_view> names, uint64_t* out) {
    auto n = Find(names, false);
    if (!n) return;
    try {
      *out = n->as<uint64_t>();
    } catch (const YAML::Exception&) {
      std::string path = Path(*names.begin());
      ctx_->Fail(*n, path,
                 fmt::format("'{}' must be a non-negative integer, got '{}'", path, Scalar(*n)));
    }
  }

  void Double(std::initializer_list<std::string_view> names, double* out, double min) {
    auto n = Find(names, false);
    if (!n) return;
    std::string path = Path(*names.begin());
    try {
      *out = n->as<double>();
    } catch (const YAML::Exception&) {
      return ctx_->Fail(*n, path, fmt::format("'{}' must be a number, got '{}'", path, Scalar(*n)));
    }
    if (!std::isfinite(*out) || *out < min)
      ctx_->Fail(*n, path,
                 fmt::format("'{}' must be a finite number >= {}, got {}", path, min, Scalar(*n)));
  }

  void Bool(std::initializer_list<std::string_view> names, bool* out) {
    auto n = Find(names, false);
    if (!n) return;
    try {
      *out = n->as<bool>();
    } catch (const YAML::Exception&) {
      std::string path = Path(*names.begin());
      ctx_->Fail(*n, path, fmt::format("'{}' must be true or false, got '{}'", path, Scalar(*n)));
    }
  }

  void String(std::initializer_list<std::string_view> names, std::string* out,
              bool required = false) {
    auto n = Find(names, required);
    if (!n) return;
    if (!n->IsScalar())
      return ctx_->Fail(*n, Path(*names.begin()),
                        fmt::format("'{}' must be a string", Path(*names.begin())));
    *out = n->as<std::string>();
  }

  template <typename E, size_t N>
  void Enum(std::initializer_list<std::string_view> names, E* out,
            const std::string_view (&values)[N]) {
    auto n = Find(names, false);
    if (!n) return;
    std::string path = Path(*names.begin());
    if (!n->IsScalar())
      return ctx_->Fail(*n, path, fmt::format("'{}' takes one value, not a list or mapping", path));
    std::string v = n->as<std::string>();
    for (size_t i = 0; i < N; ++i)
      if (v == values[i]) return void(*out = static_cast<E>(i));
    std::string list;
    for (size_t i = 0; i < N; ++i) list += fmt::format("{}{}", i ? ", " : "", values[i]);
    ctx_->Fail(*n, path,
               fmt::format("bad value '{}' for '{}' (expected one of: {})", v, path, list));
  }

  // A value of `values`, or a list of them (into `list`, one entry per item).
  template <typename E, size_t N>
  void EnumOrList(std::initializer_list<std::string_view> names, E* out, std::vector<E>* list,
                  const std::string_view (&values)[N]) {
    auto n = Find(names, false);
    if (!n || !n->IsSequence()) return Enum(names, out, values);
    const std::string path = Path(*names.begin());
    if (n->size() == 0) return ctx_->Fail(*n, path, fmt::format("'{}' is an empty list", path));
    list->clear();
    for (const YAML::Node& item : *n) {
      const std::string v = item.IsScalar() ? item.as<std::string>() : "";
      size_t i = 0;
      while (i < N && v != values[i]) ++i;
      if (i == N) {
        std::string known;
        for (size_t k = 0; k < N; ++k) known += fmt::format("{}{}", k ? ", " : "", values[k]);
        return ctx_->Fail(
            item, path,
            fmt::format("bad value '{}' in the list '{}' (expected one of: {})", v, path, known));
      }
      list->push_back(static_cast<E>(i));
    }
  }

  // A nested mapping; an absent key gives an empty reader (all defaults).
  MapReader Sub(std::initializer_list<std::string_view> names, bool required = false) {
    auto n = Find(names, required);
    return MapReader(ctx_, n ? *n : YAML::Node(), Path(*names.begin()));
  }
  bool Has(std::initializer_list<std::string_view> names) { return Find(names, false).has_value(); }

  // Reports the first key that no reader asked for.
  void Finish() {
    if (!node_.IsMap()) return;
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      if (!it->first.IsScalar()) return ctx_->Fail(it->first, path_, "keys must be plain names");
      std::string key = it->first.as<std::string>();
      if (known_.count(key)) continue;
      std::string hint;
      size_t best = std::max<size_t>(2, key.size() / 3) + 1;
      for (const std::string& k : known_) {
        size_t d = EditDistance(key, k);
        if (k.rfind(key, 0) == 0 || key.rfind(k, 0) == 0) d = std::min<size_t>(d, 1);  // prefix
        if (d < best) best = d, hint = fmt::format(" (did you mean '{}'?)", k);
      }
      if (hint.empty()) {
        ctx_->unknown.push_back({it->first, Path(key), key});
        return;
      }
      return ctx_->Fail(it->first, Path(key), fmt::format("unknown key '{}'{}", Path(key), hint));
    }
  }

  const YAML::Node& node() const { return node_; }
  const std::string& path() const { return path_; }
  Ctx* ctx() const { return ctx_; }

 private:
  std::string Path(std::string_view key) const {
    return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
  }
  static std::string Scalar(const YAML::Node& n) {
    return n.IsScalar() ? n.Scalar() : "<non-scalar>";
  }

  struct Entry {
    std::string key;
    YAML::Node key_node, value;
  };
  Ctx* ctx_;
  YAML::Node node_;
  std::vector<Entry> entries_;  // scalar keys, in the file's order
  std::string path_;
  std::set<std::string> known_;
};

void ReadCluster(MapReader m, ClusterConfig* c) {
  m.String({"gpu"}, &c->gpu, true);
  m.Int({"nodes"}, &c->nodes, 1, true, kMaxWorld);
  m.Int({"gpus_per_node"}, &c->gpus_per_node, 1, false, 1024);
  auto found = FindGpu(c->gpu);
  if (!found.ok()) {
    std::string list;
    for (auto& n : GpuNames()) list += (list.empty() ? "" : ", ") + n;
    m.ctx()->FailAt("cluster.gpu", fmt::format("unknown GPU '{}' (catalog: {})", c->gpu, list));
  } else {
    c->spec = *found;
  }
  MapReader hw = m.Sub({"hardware"});
  for (const std::string& name : GpuSpecFieldNames()) {
    double* field = GpuSpecField(&c->spec, name);
    hw.Double({name}, field, 0);
    // Rates, capacities and efficiencies divide: they must be positive.
    const bool may_be_zero =
        name == "fp8_flops" || name.find("latency") != std::string::npos || name == "launch_s";
    if (!may_be_zero && *field <= 0 && hw.Has({name}))
      m.ctx()->FailAt("cluster.hardware." + name,
                      fmt::format("'cluster.hardware.{}' must be > 0", name));
  }
  hw.Finish();
  m.Finish();
}

void ReadModel(MapReader m, ModelConfig* c) {
  m.Enum({"attention"}, &c->attention, kAttentionNames);
  m.Double({"attention_dropout"}, &c->attention_dropout, 0);
  if (c->attention_dropout >= 1)
    m.ctx()->FailAt("model.attention_dropout", "'model.attention_dropout' must be below 1");
  MapReader llm = m.Sub({"llm"}, true);
  LlmConfig& l = c->llm;
  llm.Int({"layers", "num_layers"}, &l.layers, 1, true);
  llm.Int({"hidden", "hidden_size"}, &l.hidden, 1, true);
  llm.Int({"ffn", "ffn_hidden_size"}, &l.ffn, 1, true);
  llm.Int({"heads", "num_attention_heads"}, &l.heads, 1, true);
  l.kv_heads = 0;
  llm.Int({"kv_heads", "num_query_groups"}, &l.kv_heads, 1);
  // Megatron's switch for num_query_groups: without it, attention is multi-head.
  bool gqa = false;
  llm.Bool({"group_query_attention"}, &gqa);
  if (m.ctx()->seen.count("model.llm.group_query_attention")) {
    if (gqa && l.kv_heads == 0)
      m.ctx()->FailAt("model.llm.group_query_attention",
                      "group_query_attention needs num_query_groups (model.llm.kv_heads)");
    if (!gqa && l.kv_heads != 0 && l.kv_heads != l.heads)
      m.ctx()->FailAt("model.llm.kv_heads",
                      fmt::format("kv_heads = {} but group_query_attention is false (Megatron "
                                  "then ignores num_query_groups): drop one of them",
                                  l.kv_heads));
  }
  if (l.kv_heads == 0) l.kv_heads = l.heads;
  llm.Int({"vocab", "vocab_size"}, &l.vocab, 1, true);
  llm.Int({"head_dim", "kv_channels"}, &l.head_dim, 1);
  if (l.head_dim == 0 && l.heads > 0) l.head_dim = l.hidden / l.heads;
  if (l.head_dim == 0 && l.heads > 0)
    m.ctx()->FailAt("model.llm.hidden",
                    fmt::format("hidden {} is smaller than heads {} (set model.llm.head_dim)",
                                l.hidden, l.heads));
  llm.Bool({"gated_ffn", "swiglu"}, &l.gated_ffn);
  llm.Bool({"tie_embeddings"}, &l.tie_embeddings);
  bool untie = !l.tie_embeddings;
  llm.Bool({"untie_embeddings_and_output_weights"}, &untie);  // Megatron's name, negated
  if (m.ctx()->seen.count("model.llm.untie_embeddings_and_output_weights")) {
    if (m.ctx()->seen.count("model.llm.tie_embeddings") && untie == l.tie_embeddings)
      m.ctx()->FailAt("model.llm.untie_embeddings_and_output_weights",
                      "contradicts model.llm.tie_embeddings");
    l.tie_embeddings = !untie;
  }
  MapReader moe = llm.Sub({"moe"});
  moe.Int({"experts", "num_experts"}, &l.moe.experts, 0);
  moe.Int({"top_k", "moe_router_topk"}, &l.moe.top_k, 0);
  moe.Int({"expert_ffn", "moe_ffn_hidden_size"}, &l.moe.expert_ffn, 0);
  moe.Int({"shared_experts"}, &l.moe.shared_experts, 0);
  moe.Int({"dense_layers"}, &l.moe.dense_layers, 0);
  moe.Finish();
  llm.Finish();
  if (m.Has({"vision"})) {
    MapReader v = m.Sub({"vision"});
    VisionConfig& vc = c->vision;
    vc.enabled = true;
    v.Int({"layers"}, &vc.layers, 1, true);
    v.Int({"hidden"}, &vc.hidden, 1, true);
    v.Int({"mlp"}, &vc.mlp, 1, true);
    v.Int({"heads"}, &vc.heads, 1, true);
    v.Int({"patch"}, &vc.patch, 1, false, 4096);
    v.Int({"merge"}, &vc.merge, 1, false, 64);
    v.Enum({"recompute"}, &vc.recompute, kRecomputeNames);
    v.Enum({"saved_activations"}, &vc.saved_activations, kStorageNames);
    v.Enum({"offload"}, &vc.offload, kPlaceNames);
    v.Bool({"cp"}, &vc.cp);
    v.Int({"cp_threshold_patches"}, &vc.cp_threshold_patches, 1);
    v.Int({"cp_max_group"}, &vc.cp_max_group, 1);
    v.Enum({"placement"}, &vc.placement, kPlacementNames);
    v.Int({"tp"}, &vc.tp, 1, false, kMaxParallel);
    v.Finish();
  }
  if (m.Has({"generator"})) {
    MapReader g = m.Sub({"generator"});
    GeneratorConfig& gc = c->generator;
    gc.enabled = true;
    g.Int({"layers"}, &gc.layers, 1, true);
    g.Int({"hidden"}, &gc.hidden, 1, true);
    g.Int({"mlp"}, &gc.mlp, 1, true);
    g.Int({"heads"}, &gc.heads, 1, true);
    g.Int({"latent_patch"}, &gc.latent_patch, 1, false, 4096);
    g.Enum({"recompute"}, &gc.recompute, kRecomputeNames);
    g.Enum({"saved_activations"}, &gc.saved_activations, kStorageNames);
    g.Enum({"offload"}, &gc.offload, kPlaceNames);
    g.Enum({"placement"}, &gc.placement, kPlacementNames);
    g.Finish();
  }
  m.Finish();
}

void ReadParallel(MapReader m, ParallelConfig* c) {
  m.Int({"tp", "tensor_model_parallel_size"}, &c->tp, 1, false, kMaxParallel);
  m.Int({"pp", "pipeline_model_parallel_size"}, &c->pp, 1, false, kMaxParallel);
  m.Int({"vp", "virtual_pipeline_model_parallel_size"}, &c->vp, 1, false, kMaxParallel);
  m.Int({"dp", "data_parallel_size"}, &c->dp, 1, false, kMaxParallel);
  m.Int({"cp", "context_parallel_size"}, &c->cp, 1, false, kMaxParallel);
  m.Int({"ep", "expert_model_parallel_size"}, &c->ep, 1, false, kMaxParallel);
  m.Int({"microbatch_group_size_per_vp_stage"}, &c->microbatch_group_size_per_vp_stage, 1);
  m.String({"pipeline_model_parallel_layout", "layout"}, &c->layout);
  m.Int({"num_layers_in_first_pipeline_stage", "first_stage_layers"}, &c->first_stage_layers, 1);
  m.Int({"num_layers_in_last_pipeline_stage", "last_stage_layers"}, &c->last_stage_layers, 1);
  m.Int({"num_layers_per_virtual_pipeline_stage"}, &c->layers_per_virtual_stage, 1);
  m.Bool({"account_for_embedding_in_pipeline_split"}, &c->account_for_embedding);
  m.Bool({"account_for_loss_in_pipeline_split"}, &c->account_for_loss);
  m.Finish();
}

void ReadTraining(MapReader m, TrainingConfig* c) {
  m.Int({"seq_length", "seq_len"}, &c->seq_length, 1, true);
  m.Int({"micro_batch_size", "mbs"}, &c->micro_batch_size, 1);
  m.Int({"global_batch_size", "gbs"}, &c->global_batch_size, 1);
  m.Int({"microbatches", "num_microbatches"}, &c->microbatches, 1, false, 1 << 20);
  m.EnumOrList({"recompute"}, &c->recompute, &c->recompute_by_rank, kRecomputeNames);
  constexpr std::string_view kMemoryNames[] = {"manual", "auto"};
  int memory = 0;
  m.Enum({"memory"}, &memory, kMemoryNames);
  c->memory_auto = memory == 1;
  // Under memory: auto the recompute not given starts at none.
  if (c->memory_auto && !m.Has({"recompute"})) c->recompute = Recompute::kNone;
  constexpr std::string_view kMethodNames[] = {"uniform", "block"};
  m.Enum({"recompute_method"}, &c->recompute_method, kMethodNames);
  m.Int({"recompute_num_layers"}, &c->recompute_num_layers, 1);
  int module = 0;
  std::vector<int> modules;
  m.EnumOrList({"recompute_modules"}, &module, &modules, kRecomputeModuleNames);
  if (modules.empty()) modules.push_back(module);
  c->recompute_modules = 0;
  for (int k : modules) c->recompute_modules |= static_cast<uint8_t>(1 << k);
  m.EnumOrList({"saved_activations"}, &c->saved_activations, &c->saved_activations_by_rank,
               kStorageNames);
  m.EnumOrList({"offload"}, &c->offload, &c->offload_by_rank, kPlaceNames);
  for (auto [key, bits] : {std::pair{"offload_modules", &c->offload_modules},
                           std::pair{"fp8_modules", &c->fp8_modules}}) {
    int one = 0;
    std::vector<int> classes;
    m.EnumOrList({key}, &one, &classes, kTensorClassNames);
    if (!m.Has({key})) continue;
    if (classes.empty()) classes.push_back(one);
    for (int k : classes) *bits |= static_cast<uint8_t>(1 << k);
  }
  constexpr std::string_view kPolicyNames[] = {"recompute", "fp8", "offload", "gradients"};
  int policy = 0;
  std::vector<int> policies;
  m.EnumOrList({"memory_policies"}, &policy, &policies, kPolicyNames);
  if (policies.empty()) policies.push_back(policy);
  c->memory_recompute = std::count(policies.begin(), policies.end(), 0) > 0;
  c->memory_fp8 = std::count(policies.begin(), policies.end(), 1) > 0;
  c->memory_offload = std::count(policies.begin(), policies.end(), 2) > 0;
  c->memory_gradients = std::count(policies.begin(), policies.end(), 3) > 0;
  if (m.Has({"memory_policies"}) && !c->memory_auto)
    m.ctx()->FailAt("training.memory_policies",
                    "'training.memory_policies' applies only with 'training.memory: auto'");
  m.Int({"zero_stage"}, &c->zero_stage, 0);
  // Megatron's distributed optimizer shards the optimizer state over DP: ZeRO-1.
  bool distributed = false;
  m.Bool({"use_distributed_optimizer"}, &distributed);
  if (m.ctx()->seen.count("training.use_distributed_optimizer")) {
    if (!m.ctx()->seen.count("training.zero_stage"))
      c->zero_stage = distributed ? 1 : 0;
    else if (distributed != (c->zero_stage >= 1))
      m.ctx()->FailAt("training.use_distributed_optimizer",
                      fmt::format("use_distributed_optimizer: {} contradicts zero_stage: {}",
                                  distributed, c->zero_stage));
  }
  m.Bool({"sequence_parallel"}, &c->sequence_parallel);
  m.Enum({"precision"}, &c->precision, kPrecisionNames);
  m.Enum({"grad_reduce_dtype"}, &c->grad_reduce_dtype, kGradDtypeNames);
  constexpr std::string_view kOptimizerNames[] = {"adam", "muon"};
  m.Enum({"optimizer"}, &c->muon, kOptimizerNames);
  constexpr std::string_view kGatherNames[] = {"p2p", "all_gather"};
  m.Enum({"muon_gather"}, &c->muon_all_gather, kGatherNames);
  m.Int({"muon_ns_steps"}, &c->muon_ns_steps, 1, false, 100);
  for (const char* key : {"muon_gather", "muon_ns_steps"})
    if (m.Has({key}) && !c->muon)
      return m.ctx()->FailAt(
          fmt::format("training.{}", key),
          fmt::format("'training.{}' applies only with 'training.optimizer: muon'", key));
  m.Bool({"overlap_grad_reduce"}, &c->overlap_grad_reduce);
  m.Bool({"overlap_moe_recompute"}, &c->overlap_moe_recompute);
  constexpr std::string_view kGradPlaceNames[] = {"none", "host"};
  m.Enum({"grad_offload"}, &c->grad_offload, kGradPlaceNames);
  m.Bool({"overlap_param_gather"}, &c->overlap_param_gather);
  m.Int({"grad_bucket_size", "ddp_bucket_size"}, &c->grad_bucket_size, 1, false, 1 << 30);
  m.Bool({"scatter_gather_p2p", "scatter_gather_tensors_in_pipeline"}, &c->scatter_gather_p2p);
  m.Double({"comm_reserve_gb"}, &c->comm_reserve_gb, 0);
  m.Finish();
}

void ReadData(MapReader m, DataConfig* c) {
  m.U64({"seed"}, &c->seed);
  m.Enum({"microbatch_order"}, &c->order, kOrderNames);
  m.Int({"text_tokens"}, &c->text_tokens, 0);
  m.Int({"images_per_sample"}, &c->images_per_sample, 0);
  m.String({"manifest"}, &c->manifest);
  if (m.Has({"generate"})) {
    MapReader gen = m.Sub({"generate"});
    gen.Int({"height"}, &c->generate_height, 1, true, kMaxImageSide);
    gen.Int({"width"}, &c->generate_width, 1, true, kMaxImageSide);
    gen.Finish();
  }
  if (auto list = m.Find({"images"}, false)) {
    if (!list->IsSequence()) {
      m.ctx()->Fail(*list, "data.images",
                    "'data.images' must be a list of {height, width, weight}");
    } else {
      for (size_t i = 0; i < list->size(); ++i) {
        MapReader e(m.ctx(), (*list)[i], fmt::format("data.images[{}]", i));
        ImageClass ic;
        e.Int({"height"}, &ic.height, 1, true, kMaxImageSide);
        e.Int({"width"}, &ic.width, 1, true, kMaxImageSide);
        e.Double({"weight"}, &ic.weight, 0);
        e.Int({"frames"}, &ic.frames, 1, false, kMaxFrames);
        e.Finish();
        c->images.push_back(ic);
      }
    }
  }
  m.Finish();
}

void ReadSchedule(MapReader m, ScheduleConfig* c) {
  m.Enum({"pipeline"}, &c->pipeline, kPipelineNames);
  m.Enum({"modality"}, &c->modality, kModalityNames);
  m.Bool({"decoupled_recompute"}, &c->decoupled_recompute);
  m.Int({"modality_window"}, &c->modality_window, 0);
  m.Double({"modality_budget_gib"}, &c->modality_budget_gib, 0);
  m.Int({"zb_max_pending"}, &c->zb_max_pending, 0);
  m.String({"csv"}, &c->csv);
  m.Finish();
}

// Expands "X*n" and "(...)*n" of a layout string; commas and spaces are cosmetic.
class LayoutExpander {
 public:
  explicit LayoutExpander(std::string_view s) : s_(s) {}
  StatusOr<std::string> Run() {
    std::string out;
    RETURN_IF_ERROR(Sequence(&out, 0));
    if (pos_ < s_.size()) return Error("unmatched ')'");
    return out;
  }

 private:
  static constexpr size_t kMaxExpanded = 1 << 20;
  Status Error(std::string_view what) const {
    return InvalidInput(fmt::format("{} at character {} of \"{}\"", what, pos_ + 1, s_));
  }
  Status Sequence(std::string* out, int depth) {
    if (depth > 16) return Error("parentheses nested too deep");
    while (pos_ < s_.size() && s_[pos_] != ')') {
      const char ch = s_[pos_];
      if (ch == ',' || ch == ' ') {
        ++pos_;
        continue;
      }
      std::string item;
      if (ch == '(') {
        ++pos_;
        RETURN_IF_ERROR(Sequence(&item, depth + 1));
        if (pos_ >= s_.size()) return Error("missing ')'");
        ++pos_;
      } else if (ch == 'E' || ch == 't' || ch == 'L' || ch == '|') {
        item = ch, ++pos_;
      } else {
        return Error(fmt::format("unexpected '{}' (expected E, t, L, |, ( or ))", ch));
      }
      size_t times = 1;
      if (pos_ < s_.size() && s_[pos_] == '*') {
        ++pos_;
        const size_t digits = pos_;
        times = 0;
        while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_])) &&
               times <= kMaxExpanded)
          times = times * 10 + (s_[pos_++] - '0');
        if (pos_ == digits) return Error("'*' needs a count");
      }
      if (out->size() + item.size() * times > kMaxExpanded)
        return Error("the layout expands to more than 2^20 characters");
      for (size_t k = 0; k < times; ++k) *out += item;
    }
    return Status::Ok();
  }

  std::string_view s_;
  size_t pos_ = 0;
};

}  // namespace

StatusOr<std::vector<StageSpan>> ParseStageLayout(std::string_view layout) {
  ASSIGN_OR_RETURN(std::string flat, LayoutExpander(layout).Run());
  std::vector<StageSpan> stages(1);
  int layer = 0;
  for (char ch : flat) {
    StageSpan& st = stages.back();
    if (ch == '|') {
      stages.push_back({layer, layer, false, false});
    } else if (ch == 't') {
      if (st.loss) return InvalidInput(fmt::format("a layer after L in stage {}", stages.size()));
      st.layer_end = ++layer;
    } else if (ch == 'E') {
      if (stages.size() > 1 || st.embedding || st.layer_end > 0)
        return InvalidInput("E must open the first stage, once");
      st.embedding = true;
    } else {  // 'L'
      if (st.loss) return InvalidInput("L appears twice");
      st.loss = true;
    }
  }
  for (size_t i = 0; i + 1 < stages.size(); ++i)
    if (stages[i].loss) return InvalidInput("L must close the last stage");
  if (!stages.front().embedding) return InvalidInput("the first stage must hold E");
  if (!stages.back().loss) return InvalidInput("the last stage must hold L");
  return stages;
}

std::vector<StageSpan> RankStageSpans(const ParallelConfig& p, int layers,
                                      StagePlacement placement) {
  const int first = p.first_stage_layers, last = p.last_stage_layers, n = p.pp * p.vp;
  const int middle = p.pp - (first ? 1 : 0) - (last ? 1 : 0);
  const int rest = layers - first - last;
  const int embedding = p.account_for_embedding, loss = p.account_for_loss;
  const int even = (layers + embedding + loss) / n;  // virtual stages, the accounted ones too
  std::vector<StageSpan> stages;
  int layer = 0;
  for (int g = 0; g < n; ++g) {
    const int rank = HomeOf(placement, p.pp, g).pp_rank;
    int held = first && rank == 0         ? first / p.vp
               : last && rank == p.pp - 1 ? last / p.vp
                                          : (middle > 0 ? rest / middle / p.vp : 0);
    if (embedding || loss) held = even - (g == 0 ? embedding : 0) - (g == n - 1 ? loss : 0);
    stages.push_back({layer, layer + held, g == 0, g == n - 1});
    layer += held;
  }
  return stages;
}

namespace {

// The stages' layer ranges: a layout string, first/last stage counts, or even.
void SetStages(Config* c, Ctx* ctx) {
  ParallelConfig& p = c->parallel;
  const int layers = c->model.llm.layers, n = p.pp * p.vp;
  if (!p.layout.empty()) {
    if (p.first_stage_layers || p.last_stage_layers || p.account_for_embedding ||
        p.account_for_loss)
      return ctx->FailAt("parallelism.pipeline_model_parallel_layout",
                         "set either the layout or the first/last stage layer counts (or the "
                         "embedding and loss accounting)");
    auto st = ParseStageLayout(p.layout);
    if (!st.ok())
      return ctx->FailAt("parallelism.pipeline_model_parallel_layout", st.status().message());
    if (static_cast<int>(st->size()) != n)
      return ctx->FailAt("parallelism.pipeline_model_parallel_layout",
                         fmt::format("the layout has {} stages, pp*vp = {}", st->size(), n));
    if (st->back().layer_end != layers)
      return ctx->FailAt("parallelism.pipeline_model_parallel_layout",
                         fmt::format("the layout places {} layers, the model has {}",
                                     st->back().layer_end, layers));
    p.stages = std::move(*st);
    return;
  }
  const int first = p.first_stage_layers, last = p.last_stage_layers;
  if (p.account_for_embedding || p.account_for_loss) {
    const char* key = p.account_for_embedding
                          ? "parallelism.account_for_embedding_in_pipeline_split"
                          : "parallelism.account_for_loss_in_pipeline_split";
    if (first || last)
      return ctx->FailAt(key,
                         "set either the embedding or loss accounting or the first/last "
                         "stage layer counts");
    const int counted = layers + p.account_for_embedding + p.account_for_loss;
    if (counted % n != 0)
      return ctx->FailAt(key, fmt::format("{} layers with the embedding or loss counted as one "
                                          "each ({}) cannot be split into pp*vp = {} equal "
                                          "chunks",
                                          layers, counted, n));
  } else if (first || last) {
    const char* first_key = "parallelism.num_layers_in_first_pipeline_stage";
    const char* last_key = "parallelism.num_layers_in_last_pipeline_stage";
    const char* key = first ? first_key : last_key;
    const int middle = p.pp - (first ? 1 : 0) - (last ? 1 : 0);
    const int rest = layers - first - last;
    for (auto [k, count] : {std::pair{first_key, first}, std::pair{last_key, last}})
      if (count % p.vp != 0)
        return ctx->FailAt(
            k, fmt::format("{} layers do not split evenly over vp = {} chunks", count, p.vp));
    if (middle < 0 || rest < 0 || (middle == 0 ? rest != 0 : rest % (middle * p.vp) != 0)) {
      const int others = std::max(middle, 0);
      return ctx->FailAt(
          key, fmt::format("{} layers minus the first ({}) and last ({}) stages do not split "
                           "evenly over the other {} stages{}",
                           layers, first, last, others,
                           p.vp > 1 ? fmt::format("' {} chunks", others * p.vp) : ""));
    }
  } else if (layers % n != 0) {
    return ctx->FailAt("model.llm.layers",
                       fmt::format("{} layers cannot be split into pp*vp = {} equal chunks "
                                   "(or set parallelism.pipeline_model_parallel_layout)",
                                   layers, n));
  }
  p.stages = RankStageSpans(p, layers, PlacementOf(c->schedule.pipeline));
}

// Consistency of derived values; errors point at the key to change.
void CheckConsistency(Config* c, Ctx* ctx) {
  ParallelConfig& p = c->parallel;
  TrainingConfig& t = c->training;
  const LlmConfig& l = c->model.llm;
  if (l.tie_embeddings && p.pp > 1 && PlacementOf(c->schedule.pipeline) == StagePlacement::kV)
    return ctx->FailAt(
        ctx->seen.count("model.llm.tie_embeddings")
            ? "model.llm.tie_embeddings"
            : "model.llm.untie_embeddings_and_output_weights",
        "tied embeddings with a V placement (the first and last stage on one rank, in two "
        "chunks) are not modelled: untie them, or use a loop schedule");
  if (p.layers_per_virtual_stage > 0) {  // Megatron's way of giving vp
    const int64_t per_stage = static_cast<int64_t>(p.pp) * p.layers_per_virtual_stage;
    const char* key = "parallelism.num_layers_per_virtual_pipeline_stage";
    if (l.layers % per_stage != 0)
      return ctx->FailAt(key, fmt::format("{} layers are not divisible by pp * {} = {}", l.layers,
                                          p.layers_per_virtual_stage, per_stage));
    const int vp = static_cast<int>(l.layers / per_stage);
    if (ctx->seen.count("parallelism.vp") && p.vp != vp)
      return ctx->FailAt(key, fmt::format("{} layers / (pp {} * {}) give vp = {}, but vp = {}",
                                          l.layers, p.pp, p.layers_per_virtual_stage, vp, p.vp));
    p.vp = vp;
  }
  if (static_cast<int64_t>(c->cluster.nodes) * c->cluster.gpus_per_node > kMaxWorld)
    return ctx->FailAt("cluster.nodes", fmt::format("more than {} GPUs in all", kMaxWorld));
  if (static_cast<int64_t>(p.pp) * p.vp > kMaxParallel)
    return ctx->FailAt("parallelism.vp", fmt::format("pp*vp above {}", kMaxParallel));
  if (static_cast<int64_t>(t.micro_batch_size) * t.seq_length > kMaxTokensPerMicroBatch)
    return ctx->FailAt(
        "training.micro_batch_size",
        fmt::format("micro_batch_size*seq_length above {} tokens", kMaxTokensPerMicroBatch));
  const int world = c->world();
  const int64_t model_parallel = static_cast<int64_t>(p.tp) * p.pp * p.cp;  // bounded: no overflow
  if (world % model_parallel != 0)
    return ctx->FailAt(
        "parallelism.pp",
        fmt::format("world size {} GPUs ({} nodes x {}) is not divisible by tp*pp*cp = {}", world,
                    c->cluster.nodes, c->cluster.gpus_per_node, model_parallel));
  const int dp = static_cast<int>(world / model_parallel);
  if (p.dp != 0 && p.dp != dp)
    return ctx->FailAt("parallelism.dp", fmt::format("dp = {} but world {} / (tp*pp*cp = {}) = {}",
                                                     p.dp, world, model_parallel, dp));
  p.dp = dp;
  if (p.tp > c->cluster.gpus_per_node)
    return ctx->FailAt("parallelism.tp",
                       fmt::format("tp = {} spans more than one node ({} GPUs per node)", p.tp,
                                   c->cluster.gpus_per_node));
  if (l.heads % p.tp != 0 || (l.kv_heads % p.tp != 0 && p.tp % l.kv_heads != 0))
    return ctx->FailAt("parallelism.tp",
                       fmt::format("{} attention heads ({} KV heads) cannot be split over tp = {}",
                                   l.heads, l.kv_heads, p.tp));
  if (l.heads % l.kv_heads != 0)
    return ctx->FailAt(
        "model.llm.kv_heads",
        fmt::format("{} heads are not a multiple of {} KV heads", l.heads, l.kv_heads));
  if (l.moe.experts > 0) {
    if (l.moe.top_k < 1 || l.moe.top_k > l.moe.experts)
      return ctx->FailAt("model.llm.moe.top_k",
                         fmt::format("top_k must be in [1, {}]", l.moe.experts));
    if (l.moe.expert_ffn < 1)
      return ctx->FailAt("model.llm.moe.expert_ffn", "MoE needs expert_ffn >= 1");
    if (l.moe.experts % p.ep != 0)
      return ctx->FailAt("parallelism.ep", fmt::format("{} experts are not divisible by ep = {}",
                                                       l.moe.experts, p.ep));
  }
  if ((dp * p.cp) % p.ep != 0)
    return ctx->FailAt("parallelism.ep",
                       fmt::format("ep = {} must divide dp*cp = {}", p.ep, dp * p.cp));
  if (p.ep > 1 && l.moe.experts == 0)
    return ctx->FailAt("parallelism.ep", "ep > 1 needs an MoE model (model.llm.moe.experts)");
  const PipelineKind pk = c->schedule.pipeline;
  const bool interleaved = pk == PipelineKind::kInterleaved1F1B;
  const std::string_view pname = PipelineName(pk);
  if ((interleaved || pk == PipelineKind::kInterleavedZb) && p.vp < 2)
    return ctx->FailAt("schedule.pipeline", fmt::format("{} needs parallelism.vp >= 2", pname));
  if (PlacementOf(pk) == StagePlacement::kV && p.vp != 2)
    return ctx->FailAt(
        ctx->seen.count("parallelism.vp") ? "parallelism.vp" : "schedule.pipeline",
        fmt::format("{} runs two chunks per rank in a V: set parallelism.vp: 2", pname));
  if (p.vp > 1 && (pk == PipelineKind::kGpipe || pk == PipelineKind::k1F1B ||
                   pk == PipelineKind::kZbH1 || pk == PipelineKind::kZbH2))
    return ctx->FailAt("parallelism.vp",
                       fmt::format("vp = {} needs an interleaved or V-shaped schedule.pipeline "
                                   "(interleaved-1f1b, interleaved-zb, zbv, dualpipev, csv)",
                                   p.vp));
  if ((pk == PipelineKind::kCsv) != !c->schedule.csv.empty())
    return ctx->FailAt(pk == PipelineKind::kCsv ? "schedule.pipeline" : "schedule.csv",
                       pk == PipelineKind::kCsv
                           ? "schedule.pipeline: csv needs schedule.csv: PATH"
                           : "schedule.csv is read only with schedule.pipeline: csv");
  if (c->schedule.zb_max_pending > 0 && pk != PipelineKind::kZbH1 && pk != PipelineKind::kZbH2 &&
      pk != PipelineKind::kZbv)
    return ctx->FailAt(
        "schedule.zb_max_pending",
        fmt::format("zb_max_pending applies to zb-h1, zb-h2 and zbv, not {}", pname));
  SetStages(c, ctx);
  if (ctx->error) return;
  if (t.seq_length % p.cp != 0 ||
      (t.sequence_parallel && p.tp > 1 && t.seq_length % (p.tp * p.cp) != 0))
    return ctx->FailAt(
        "training.seq_length",
        fmt::format("seq_length {} is not divisible by tp*cp = {}", t.seq_length, p.tp * p.cp));
  // Micro-batches per replica = gbs / (mbs * dp).
  if (t.global_batch_size > 0) {
    const int64_t per_step = static_cast<int64_t>(t.micro_batch_size) * dp;
    if (t.global_batch_size % per_step != 0)
      return ctx->FailAt(
          "training.global_batch_size",
          fmt::format("global_batch_size {} is not divisible by micro_batch_size*dp = {}*{}",
                      t.global_batch_size, t.micro_batch_size, dp));
    const int m = static_cast<int>(t.global_batch_size / per_step);
    if (t.microbatches != 0 && t.microbatches != m)
      return ctx->FailAt(
          "training.microbatches",
          fmt::format("microbatches = {} but global_batch_size / (micro_batch_size*dp) = {}",
                      t.microbatches, m));
    t.microbatches = m;
  } else if (t.microbatches == 0) {
    return ctx->FailAt("training", "set training.global_batch_size or training.microbatches");
  } else {
    t.global_batch_size = t.microbatches * t.micro_batch_size * dp;
  }
  const int m = t.microbatches;
  const char* m_key = ctx->seen.count("training.microbatches") ? "training.microbatches"
                                                               : "training.global_batch_size";
  // The schedules' own rules on the micro-batch count (planner/schedules.cc,
  // planner/zero_bubble.cc), at the key that sets it.
  if (pk == PipelineKind::kDualPipeV && m < 2 * p.pp)
    return ctx->FailAt(m_key, fmt::format("dualpipev needs at least as many micro-batches per "
                                          "replica as stages (2 pp = {}), got {}",
                                          2 * p.pp, m));
  // PyTorch's rounds rule: rounds = max(1, m // pp), m must be a multiple of rounds.
  auto rounds_rule = [&](const char* schedule) {
    const int rounds = std::max(1, m / p.pp);
    if (m % rounds == 0) return true;
    ctx->FailAt(m_key, fmt::format("{} micro-batches per replica is not a multiple of the {} "
                                   "rounds of pp = {} ({})",
                                   m, rounds, p.pp, schedule));
    return false;
  };
  if (pk == PipelineKind::kInterleavedZb && !rounds_rule("interleaved-zb")) return;
  if (interleaved) {
    if (m < p.pp)
      return ctx->FailAt(
          m_key,
          fmt::format("interleaved-1f1b needs at least pp = {} micro-batches per replica, got {}",
                      p.pp, m));
    if (p.microbatch_group_size_per_vp_stage == 0 && !rounds_rule("interleaved-1f1b")) return;
  }
  if (p.microbatch_group_size_per_vp_stage > m)
    return ctx->FailAt("parallelism.microbatch_group_size_per_vp_stage",
                       fmt::format("group size {} exceeds the {} micro-batches",
                                   p.microbatch_group_size_per_vp_stage, m));
  if (p.microbatch_group_size_per_vp_stage != 0 && p.microbatch_group_size_per_vp_stage < p.pp)
    return ctx->FailAt("parallelism.microbatch_group_size_per_vp_stage",
                       fmt::format("group size must be >= pp = {}", p.pp));
  if (t.zero_stage > 2) return ctx->FailAt("training.zero_stage", "zero_stage must be 0, 1 or 2");
  if (t.memory_auto) {  // the encoder's and generator's recompute start at none too
    if (!ctx->seen.count("model.vision.recompute")) c->model.vision.recompute = Recompute::kNone;
    if (!ctx->seen.count("model.generator.recompute"))
      c->model.generator.recompute = Recompute::kNone;
  }
  t.pp = p.pp;
  const int stages = static_cast<int>(p.stages.size());
  for (auto [key, n] : {std::pair{"training.recompute", t.recompute_by_rank.size()},
                        std::pair{"training.saved_activations", t.saved_activations_by_rank.size()},
                        std::pair{"training.offload", t.offload_by_rank.size()}}) {
    if (n == 0 || static_cast<int>(n) == p.pp) continue;
    if (static_cast<int>(n) != stages)
      return ctx->FailAt(key, fmt::format("'{}' has {} entr{}; one per pipeline rank (pp = {}){} "
                                          "is needed",
                                          key, n, n == 1 ? "y" : "ies", p.pp,
                                          stages > p.pp ? fmt::format(" or one per virtual "
                                                                      "stage ({})",
                                                                      stages)
                                                        : ""));
    if (t.memory_auto)
      return ctx->FailAt(key, fmt::format("'training.memory: auto' chooses per pipeline rank; "
                                          "'{}' has one entry per virtual stage",
                                          key));
  }
  // Whether any entry (or the one mode) satisfies `pred`.
  auto any = [](const auto& list, auto one, auto pred) {
    return list.empty() ? pred(one) : std::any_of(list.begin(), list.end(), pred);
  };
  auto is = [](auto mode) { return [mode](auto x) { return x == mode; }; };
  const bool full = t.memory_auto ||  // the search may reach full recompute
                    any(t.recompute_by_rank, t.recompute, is(Recompute::kFull));
  const bool selective =
      t.memory_auto || any(t.recompute_by_rank, t.recompute, is(Recompute::kSelective));
  if (ctx->seen.count("training.recompute_modules") && !selective)
    return ctx->FailAt("training.recompute_modules",
                       "'training.recompute_modules' applies to selective recompute; no pipeline "
                       "rank has 'training.recompute: selective'");
  const bool offloads =
      (t.memory_auto && t.memory_offload) ||
      any(t.offload_by_rank, t.offload, [](ActPlace x) { return x != ActPlace::kDevice; });
  const bool fp8 = (t.memory_auto && t.memory_fp8) ||
                   any(t.saved_activations_by_rank, t.saved_activations, is(ActStorage::kFp8));
  const bool moe =
      c->model.llm.moe.experts > 0 && c->model.llm.moe.dense_layers < c->model.llm.layers;
  if (t.overlap_moe_recompute &&
      (!moe || p.ep < 2 || !(t.recompute_modules & kRecMoe) || !selective))
    return ctx->FailAt("training.overlap_moe_recompute",
                       "'training.overlap_moe_recompute' needs MoE layers over ep > 1 and "
                       "selective recompute of 'moe' (training.recompute_modules)");
  for (auto [key, bits, on, what] :
       {std::tuple{"training.offload_modules", t.offload_modules, offloads,
                   "no pipeline rank offloads ('training.offload')"},
        std::tuple{"training.fp8_modules", t.fp8_modules, fp8,
                   "no pipeline rank stores in FP8 ('training.saved_activations')"}}) {
    if (!ctx->seen.count(key)) continue;
    if (!on)
      return ctx->FailAt(
          key, fmt::format("'{}' applies to the LLM's saved activations, but {}", key, what));
    if (!moe && (bits & (kTcExpertFc1 | kTcMoeAct)))
      return ctx->FailAt(
          key, fmt::format("'{}' names expert_fc1 or moe_act, but the LLM has no MoE layers", key));
  }
  for (const char* key : {"training.recompute_method", "training.recompute_num_layers"})
    if (ctx->seen.count(key) && !full)
      return ctx->FailAt(key, fmt::format("'{}' applies to full recompute; no pipeline rank has "
                                          "'training.recompute: full'",
                                          key));
  if (t.precision == Precision::kFp8 && c->cluster.spec.fp8_flops <= 0)
    return ctx->FailAt("training.precision",
                       fmt::format("'training.precision: fp8' needs an FP8 rate; {} has none "
                                   "(set cluster.hardware.fp8_flops)",
                                   c->cluster.spec.name));
  if (t.memory_auto && t.memory_gradients) {
    if (p.dp < 2)
      return ctx->FailAt("training.memory_policies",
                         "'gradients' (ZeRO-2, host gradients) needs data parallelism (dp > 1)");
    if (t.overlap_grad_reduce)
      return ctx->FailAt("training.memory_policies",
                         "'gradients' (ZeRO-2, host gradients) does not go with "
                         "'training.overlap_grad_reduce'");
  }
  if (t.grad_offload) {
    auto fail = [&](const std::string& why) {
      return ctx->FailAt("training.grad_offload",
                         fmt::format("'training.grad_offload: host' (pipeline ZeRO-2) {}", why));
    };
    if (t.zero_stage != 2) return fail("needs 'training.zero_stage: 2'");
    if (p.dp < 2) return fail("needs data parallelism (dp > 1)");
  }
  if (t.zero_stage >= 2 && p.dp > 1) {  // a reduction per micro-batch (planner/plan.cc)
    if (t.overlap_grad_reduce)
      return ctx->FailAt("training.overlap_grad_reduce",
                         "'training.zero_stage: 2' reduces every micro-batch's gradients as its "
                         "backward produces them; overlap_grad_reduce applies to zero_stage 0 "
                         "and 1");
    if (t.microbatches >= TrainingConfig::kMaxGradMicroBatches)
      return ctx->FailAt("training.zero_stage",
                         fmt::format("'training.zero_stage: 2' takes fewer than {} micro-batches",
                                     TrainingConfig::kMaxGradMicroBatches));
  }
  if (t.overlap_param_gather && (t.zero_stage < 1 || !t.overlap_grad_reduce))
    return ctx->FailAt("training.overlap_param_gather",
                       "overlap_param_gather needs zero_stage >= 1 and overlap_grad_reduce");
  const int vtp = c->model.vision.tp;
  if (c->model.vision.enabled &&
      (vtp > p.tp * p.cp || (p.tp * p.cp) % vtp != 0 || c->model.vision.heads % vtp != 0))
    return ctx->FailAt("model.vision.tp",
                       fmt::format("vision tp = {} must divide the rank's tp*cp = {} GPUs and the "
                                   "encoder's {} heads",
                                   vtp, p.tp * p.cp, c->model.vision.heads));
  const bool multimodal = c->model.vision.enabled || c->model.generator.enabled;
  if (!multimodal &&
      (!c->data.images.empty() || !c->data.manifest.empty() || c->data.images_per_sample > 0))
    return ctx->FailAt(c->data.manifest.empty() ? "data.images" : "data.manifest",
                       "image data needs model.vision");
  if (c->model.vision.enabled && c->data.manifest.empty() &&
      (c->data.images.empty() || c->data.images_per_sample == 0))
    return ctx->FailAt(
        "data",
        "model.vision needs data.images with data.images_per_sample >= 1, or data.manifest");
  if (c->model.generator.enabled && c->data.manifest.empty() && c->data.generate_height == 0)
    return ctx->FailAt("data",
                       "model.generator needs data.generate {height, width}, or data.manifest");
  double weights = 0;
  for (const ImageClass& ic : c->data.images) weights += ic.weight;
  if (!c->data.images.empty() && weights <= 0)
    return ctx->FailAt("data.images", "the image weights must add up to more than 0");
  // Keep plans within 32-bit op ids and the memory budget: about 8 ops per (replica,
  // stage, chunk, micro-batch), up to about 140 per drawn image (layer-group pieces, CP
  // shards, transfers), about kBytesPerOp bytes per op while planning and simulating.
  const int64_t images = c->data.manifest.empty() && c->model.vision.enabled
                             ? static_cast<int64_t>(t.global_batch_size) * c->data.images_per_sample
                             : 0;
  const int64_t ops = 8LL * dp * p.pp * p.vp * std::max(1, t.microbatches) + 140 * images;
  if (ops > (int64_t{1} << 31))
    return ctx->FailAt("training",
                       fmt::format("the plan would have about {} ops (limit 2^31)", ops));
  const double need = static_cast<double>(ops) * kBytesPerOp, budget = MemoryBudgetBytes();
  if (need > budget)
    return ctx->FailAt(
        "training",
        fmt::format("the plan would have about {} ops and need about {:.1f} GiB, above the memory "
                    "budget of {:.1f} GiB (--max-memory)",
                    ops, need / (1 << 30), budget / (1 << 30)));
  // A pending limit the zero-bubble schedules cannot keep to (found by building the
  // schedule, as planning does; once the plan's size is known to be within bounds).
  if (c->schedule.zb_max_pending > 0)
    if (auto orders = TextSchedule(pk, p.pp, p.vp, m, p.microbatch_group_size_per_vp_stage,
                                   c->schedule.zb_max_pending);
        !orders.ok())
      return ctx->FailAt("schedule.zb_max_pending", orders.status().message());
  for (size_t i = 0; i < c->data.images.size() && c->model.vision.enabled; ++i) {
    const ImageClass& ic = c->data.images[i];
    const int64_t mm = static_cast<int64_t>(c->model.vision.merge) * c->model.vision.merge;
    const int64_t patch = c->model.vision.patch;
    const int64_t tokens =
        ((ic.height + patch - 1) / patch * ((ic.width + patch - 1) / patch) * ic.frames + mm - 1) /
        mm;
    if (tokens + std::max(1, c->data.text_tokens) >
        static_cast<int64_t>(t.seq_length) * t.micro_batch_size)
      return ctx->FailAt(
          "data.images",
          fmt::format("data.images[{}] ({}x{}, {} frames) is {} visual tokens: it never fits a "
                      "micro-batch of seq_length*micro_batch_size = {} tokens",
                      i, ic.height, ic.width, ic.frames, tokens,
                      static_cast<int64_t>(t.seq_length) * t.micro_batch_size));
  }
  if (c->data.text_tokens > static_cast<int64_t>(t.seq_length) * t.micro_batch_size)
    return ctx->FailAt(
        "data.text_tokens",
        fmt::format("text_tokens {} exceed seq_length*micro_batch_size", c->data.text_tokens));
}

}  // namespace

namespace {
double g_memory_budget = 0;  // 0: half the machine's physical memory
}  // namespace

void SetMemoryBudgetBytes(double bytes) {
  g_memory_budget = bytes;
}

double MemoryBudgetBytes() {
  if (g_memory_budget > 0) return g_memory_budget;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? 0.5 * static_cast<double>(pages) * page : 8.0 * (1 << 30);
}

StagePlacement PlacementOf(PipelineKind k) {
  return k == PipelineKind::kZbv || k == PipelineKind::kDualPipeV ? StagePlacement::kV
                                                                  : StagePlacement::kLoop;
}

bool SplitsBackward(PipelineKind k) {
  return k == PipelineKind::kZbH1 || k == PipelineKind::kZbH2 || k == PipelineKind::kZbv ||
         k == PipelineKind::kDualPipeV || k == PipelineKind::kInterleavedZb ||
         k == PipelineKind::kCsv;
}

std::string_view PipelineName(PipelineKind k) {
  return kPipelineNames[static_cast<int>(k)];
}
std::string_view RecomputeName(Recompute r) {
  return kRecomputeNames[static_cast<int>(r)];
}
bool OffloadsAny(const Config& c) {
  const TrainingConfig& t = c.training;
  bool any = t.offload != ActPlace::kDevice;
  for (ActPlace p : t.offload_by_rank) any = any || p != ActPlace::kDevice;
  const ModelConfig& m = c.model;
  return any || (m.vision.enabled && m.vision.offload != ActPlace::kDevice) ||
         (m.generator.enabled && m.generator.offload != ActPlace::kDevice);
}

std::string_view ActPlaceName(ActPlace p) {
  return kPlaceNames[static_cast<int>(p)];
}

std::string_view ActStorageName(ActStorage s) {
  return kStorageNames[static_cast<int>(s)];
}
std::string_view ModalityName(ModalityPolicy p) {
  return kModalityNames[static_cast<int>(p)];
}

StatusOr<Config> ParseConfig(YamlDoc&& doc) {
  Ctx ctx{doc, std::nullopt, {}};
  Config c;
  c.source = doc.name();
  MapReader root(&ctx, doc.root(), "");
  ReadCluster(root.Sub({"cluster"}, true), &c.cluster);
  ReadModel(root.Sub({"model"}, true), &c.model);
  ReadParallel(root.Sub({"parallelism", "parallel"}), &c.parallel);
  ReadTraining(root.Sub({"training"}, true), &c.training);
  ReadData(root.Sub({"data"}), &c.data);
  ReadSchedule(root.Sub({"schedule"}), &c.schedule);
  root.Finish();
  for (const Ctx::Unknown& u : ctx.unknown) {  // the same name (or a near one) elsewhere
    std::string hint;
    size_t best = std::max<size_t>(2, u.key.size() / 3) + 1;
    for (const std::string& k : ctx.known_paths) {
      const std::string last = k.substr(k.rfind('.') == std::string::npos ? 0 : k.rfind('.') + 1);
      const size_t d = EditDistance(u.key, last);
      if (d < best) best = d, hint = fmt::format(" (did you mean '{}'?)", k);
    }
    ctx.Fail(u.node, u.path, fmt::format("unknown key '{}'{}", u.path, hint));
  }
  if (!ctx.error) CheckConsistency(&c, &ctx);
  if (ctx.error) return ctx.Result();
  c.resolved_yaml = YamlText(doc);
  return c;
}

StatusOr<Config> LoadConfig(const std::string& path, const std::vector<std::string>& sets) {
  ASSIGN_OR_RETURN(YamlDoc doc, YamlDoc::FromFile(path));
  for (const std::string& s : sets) RETURN_IF_ERROR(doc.ApplySet(s));
  return ParseConfig(std::move(doc));
}

}  // namespace pipeplan
