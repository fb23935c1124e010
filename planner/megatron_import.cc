#include "planner/megatron_import.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <sstream>

#include "planner/config.h"

namespace pipeplan {
namespace {

// A shell-like reader: statements (split at newlines and ; outside quotes) of words, with
// quotes, backslashes, comments and variable expansion ($V, ${V}, ${V:-default}); unquoted
// expansions are split into words.
class Shell {
 public:
  explicit Shell(std::string_view text) : s_(text) {}

  // Calls on(statement words) for each statement; handles VAR=value assignments itself.
  template <typename F>
  void Run(F on) {
    std::vector<std::string> words;
    auto end_statement = [&] {
      if (!words.empty()) Statement(&words, on);
      words.clear();
    };
    while (p_ < s_.size()) {
      const char c = s_[p_];
      if (c == '\\' && p_ + 1 < s_.size() && s_[p_ + 1] == '\n') {
        p_ += 2;  // line continuation
      } else if (c == '\n' || c == ';') {
        ++p_;
        end_statement();
      } else if (c == ' ' || c == '\t' || c == '\r') {
        ++p_;
      } else if (c == '#') {
        const size_t eol = s_.find('\n', p_);
        std::string_view line = s_.substr(p_, eol == std::string_view::npos ? s_.npos : eol - p_);
        if (line.rfind("#SBATCH", 0) == 0) sbatch_.push_back(std::string(line.substr(7)));
        p_ = eol == std::string_view::npos ? s_.size() : eol;
      } else {
        Word(&words);
      }
    }
    end_statement();
  }
  const std::vector<std::string>& sbatch() const { return sbatch_; }

 private:
  template <typename F>
  void Statement(std::vector<std::string>* words, F on) {
    size_t first = 0;
    if ((*words)[0] == "export") first = 1;
    if (first < words->size()) {
      const std::string& w = (*words)[first];
      const size_t eq = w.find('=');
      if (eq != std::string::npos && eq > 0 && w.compare(0, 2, "--") != 0 &&
          (std::isalpha(static_cast<unsigned char>(w[0])) || w[0] == '_')) {
        bool name = true;
        for (size_t i = 0; i < eq; ++i)
          name = name && (std::isalnum(static_cast<unsigned char>(w[i])) || w[i] == '_');
        if (name && words->size() == first + 1) {
          vars_[w.substr(0, eq)] = w.substr(eq + 1);
          return;
        }
      }
    }
    on(*words);
  }

  // Expands a variable at s_[p_] == '$'; returns its value.
  std::string Expand() {
    ++p_;
    std::string name, fallback;
    bool has_fallback = false;
    if (p_ < s_.size() && s_[p_] == '{') {
      const size_t close = s_.find('}', p_);
      std::string_view body =
          s_.substr(p_ + 1, close == std::string_view::npos ? s_.npos : close - p_ - 1);
      p_ = close == std::string_view::npos ? s_.size() : close + 1;
      const size_t dash = body.find(":-");
      name = std::string(body.substr(0, dash));
      if (dash != std::string_view::npos) has_fallback = true, fallback = body.substr(dash + 2);
    } else {
      while (p_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[p_])) || s_[p_] == '_'))
        name += s_[p_++];
    }
    // A bash array (NAME=( ... ) over several lines): its words were read as statements
    // of their own, so its expansion adds nothing.
    for (const char* all : {"[@]", "[*]"})
      if (name.size() > 3 && name.compare(name.size() - 3, 3, all) == 0)
        name.resize(name.size() - 3);
    auto it = vars_.find(name);
    if (it != vars_.end() && it->second == "(") return "";
    if (it != vars_.end() && !it->second.empty()) return it->second;
    if (has_fallback) return fallback;
    unresolved_.insert(name);
    return "$" + name;
  }

  void Word(std::vector<std::string>* words) {
    std::string w;
    bool any = false;
    auto split_into = [&](const std::string& value) {
      // An unquoted expansion: its words join the current one at the edges.
      size_t i = 0;
      while (i < value.size()) {
        if (std::isspace(static_cast<unsigned char>(value[i]))) {
          if (any) words->push_back(w), w.clear(), any = false;
          ++i;
        } else {
          w += value[i++], any = true;
        }
      }
    };
    while (p_ < s_.size()) {
      const char c = s_[p_];
      if (c == ' ' || c == '\t' || c == '\n' || c == ';' || c == '\r') break;
      if (c == '\\' && p_ + 1 < s_.size()) {
        if (s_[p_ + 1] == '\n') {
          p_ += 2;
          break;
        }
        w += s_[p_ + 1], p_ += 2, any = true;
      } else if (c == '\'') {
        const size_t close = s_.find('\'', p_ + 1);
        w += s_.substr(p_ + 1, close == std::string_view::npos ? s_.npos : close - p_ - 1);
        p_ = close == std::string_view::npos ? s_.size() : close + 1;
        any = true;
      } else if (c == '"') {
        ++p_;
        while (p_ < s_.size() && s_[p_] != '"') {
          if (s_[p_] == '$') {
            w += Expand();
          } else if (s_[p_] == '\\' && p_ + 1 < s_.size()) {
            if (s_[p_ + 1] != '\n') w += s_[p_ + 1];
            p_ += 2;
          } else {
            w += s_[p_++];
          }
        }
        ++p_;
        any = true;
      } else if (c == '$') {
        split_into(Expand());
      } else {
        w += c, ++p_, any = true;
      }
    }
    if (any) words->push_back(w);
  }

  std::string_view s_;
  size_t p_ = 0;
  std::map<std::string, std::string> vars_;
  std::vector<std::string> sbatch_;

 public:
  std::set<std::string> unresolved_;
};

// Megatron store_true flags we map or know to ignore: they never take a value.
const std::set<std::string> kBooleanFlags = {"bf16",
                                             "fp16",
                                             "sequence-parallel",
                                             "use-distributed-optimizer",
                                             "overlap-grad-reduce",
                                             "overlap-param-gather",
                                             "swiglu",
                                             "use-flash-attn",
                                             "group-query-attention",
                                             "untie-embeddings-and-output-weights",
                                             "use-mcore-models",
                                             "disable-bias-linear",
                                             "no-masked-softmax-fusion",
                                             "no-bias-gelu-fusion",
                                             "no-bias-dropout-fusion",
                                             "use-rotary-position-embeddings",
                                             "no-position-embedding",
                                             "tp-comm-overlap",
                                             "no-gradient-accumulation-fusion",
                                             "use-legacy-models",
                                             "moe-grouped-gemm",
                                             "use-checkpoint-args",
                                             "no-async-tensor-model-parallel-allreduce",
                                             "profile",
                                             "no-scatter-gather-tensors-in-pipeline",
                                             "fine-grained-activation-offloading"};

// Flags that take a list of words (argparse nargs='*'), and the values pipeplan models of
// each (training.recompute_modules, training.offload_modules).
const std::map<std::string, std::pair<std::string, std::set<std::string_view>>> kListFlags = {
    {"recompute-modules",
     {"training.recompute_modules",
      {std::begin(kRecomputeModuleNames), std::end(kRecomputeModuleNames)}}},
    {"offload-modules",
     {"training.offload_modules", {std::begin(kTensorClassNames), std::end(kTensorClassNames)}}},
};

}  // namespace

StatusOr<MegatronImport> ImportMegatron(std::string_view script, const std::string& name,
                                        const MegatronImportOptions& o) {
  Shell sh(script);
  std::vector<std::pair<std::string, std::string>> args;  // (flag, value or "")
  sh.Run([&](const std::vector<std::string>& words) {
    for (size_t i = 0; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (w.size() < 3 || w.compare(0, 2, "--") != 0) continue;
      std::string flag = w.substr(2), value;
      if (const size_t eq = flag.find('='); eq != std::string::npos) {
        value = flag.substr(eq + 1), flag = flag.substr(0, eq);
      } else if (!kBooleanFlags.count(flag) && i + 1 < words.size() &&
                 words[i + 1].compare(0, 2, "--") != 0) {
        value = words[++i];
        // Megatron's nargs='*' flags take every word up to the next flag.
        std::string dashed = flag;
        std::replace(dashed.begin(), dashed.end(), '_', '-');
        if (kListFlags.count(dashed))
          while (i + 1 < words.size() && words[i + 1].compare(0, 2, "--") != 0)
            value += " " + words[++i];
      }
      for (char& c : flag)
        if (c == '_') c = '-';
      args.push_back({flag, value});
    }
  });
  MegatronImport out;
  std::map<std::string, std::string> yaml;  // "section.key" -> value (YAML scalar)
  auto bad = [&](const std::string& flag, const std::string& why) {
    return InvalidInput(fmt::format("{}: --{}: {}", name, flag, why));
  };
  auto integer = [&](const std::string& flag, const std::string& v) -> StatusOr<int64_t> {
    if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos || v.size() > 12)
      return bad(flag, fmt::format("'{}' is not a whole number{}", v,
                                   v.find('$') != std::string::npos ? " (an unset variable)" : ""));
    return std::stoll(v);
  };
  const std::map<std::string, std::string> ints = {
      {"num-layers", "model.llm.layers"},
      {"hidden-size", "model.llm.hidden"},
      {"ffn-hidden-size", "model.llm.ffn"},
      {"num-attention-heads", "model.llm.heads"},
      {"num-query-groups", "model.llm.kv_heads"},
      {"kv-channels", "model.llm.head_dim"},
      {"padded-vocab-size", "model.llm.vocab"},
      {"vocab-size", "model.llm.vocab"},
      {"num-experts", "model.llm.moe.experts"},
      {"moe-router-topk", "model.llm.moe.top_k"},
      {"moe-ffn-hidden-size", "model.llm.moe.expert_ffn"},
      {"tensor-model-parallel-size", "parallelism.tp"},
      {"pipeline-model-parallel-size", "parallelism.pp"},
      {"virtual-pipeline-model-parallel-size", "parallelism.vp"},
      {"context-parallel-size", "parallelism.cp"},
      {"expert-model-parallel-size", "parallelism.ep"},
      {"microbatch-group-size-per-vp-stage", "parallelism.microbatch_group_size_per_vp_stage"},
      {"decoder-first-pipeline-num-layers", "parallelism.num_layers_in_first_pipeline_stage"},
      {"decoder-last-pipeline-num-layers", "parallelism.num_layers_in_last_pipeline_stage"},
      {"num-layers-in-first-pipeline-stage", "parallelism.num_layers_in_first_pipeline_stage"},
      {"num-layers-in-last-pipeline-stage", "parallelism.num_layers_in_last_pipeline_stage"},
      {"seq-length", "training.seq_length"},
      {"micro-batch-size", "training.micro_batch_size"},
      {"global-batch-size", "training.global_batch_size"},
      {"ddp-bucket-size", "training.grad_bucket_size"},
  };
  const std::map<std::string, std::pair<std::string, std::string>> flags = {
      {"sequence-parallel", {"training.sequence_parallel", "true"}},
      {"use-distributed-optimizer", {"training.use_distributed_optimizer", "true"}},
      {"group-query-attention", {"model.llm.group_query_attention", "true"}},
      {"untie-embeddings-and-output-weights",
       {"model.llm.untie_embeddings_and_output_weights", "true"}},
      {"overlap-grad-reduce", {"training.overlap_grad_reduce", "true"}},
      {"overlap-param-gather", {"training.overlap_param_gather", "true"}},
      {"swiglu", {"model.llm.gated_ffn", "true"}},
      {"bf16", {"training.precision", "bf16"}},
      {"fp16", {"training.precision", "fp16"}},
      {"use-flash-attn", {"model.attention", "flash"}},
      {"no-scatter-gather-tensors-in-pipeline", {"training.scatter_gather_p2p", "false"}},
      {"account-for-embedding-in-pipeline-split",
       {"parallelism.account_for_embedding_in_pipeline_split", "true"}},
      {"account-for-loss-in-pipeline-split",
       {"parallelism.account_for_loss_in_pipeline_split", "true"}},
  };
  int nodes = o.nodes, gpus_per_node = o.gpus_per_node;
  int64_t layers_per_virtual = 0;
  bool flash = false;
  for (auto& [flag, value] : args) {
    if (auto it = ints.find(flag); it != ints.end()) {
      ASSIGN_OR_RETURN(int64_t v, integer(flag, value));
      yaml[it->second] = std::to_string(v);
    } else if (auto f = flags.find(flag); f != flags.end()) {
      yaml[f->second.first] = f->second.second;
      flash = flash || flag == "use-flash-attn";
    } else if (flag == "num-layers-per-virtual-pipeline-stage") {
      ASSIGN_OR_RETURN(layers_per_virtual, integer(flag, value));
    } else if (flag == "recompute-granularity") {
      if (value != "full" && value != "selective") return bad(flag, "expected full or selective");
      yaml["training.recompute"] = value;
    } else if (flag == "recompute-method") {
      if (value != "uniform" && value != "block") return bad(flag, "expected uniform or block");
      yaml["training.recompute_method"] = value;
    } else if (flag == "recompute-num-layers") {
      ASSIGN_OR_RETURN(int64_t v, integer(flag, value));
      yaml["training.recompute_num_layers"] = std::to_string(v);
    } else if (auto list = kListFlags.find(flag); list != kListFlags.end()) {
      std::string items;
      std::istringstream words(value);
      for (std::string v; words >> v;) {
        if (list->second.second.count(v))
          items += (items.empty() ? "" : ", ") + v;
        else
          out.notes.push_back(fmt::format("--{} {}: not modelled, left out", flag, v));
      }
      if (!items.empty()) yaml[list->second.first] = "[" + items + "]";
    } else if (flag == "fine-grained-activation-offloading") {
      yaml["training.offload"] = "host";
    } else if (flag == "fp8-format" || flag == "fp8") {
      yaml["training.precision"] = "fp8";
    } else if (flag == "attention-dropout") {
      yaml["model.attention_dropout"] = value;
    } else if (flag == "pipeline-model-parallel-layout") {
      yaml["parallelism.pipeline_model_parallel_layout"] = "\"" + value + "\"";
    } else if (flag == "nnodes" || flag == "nodes" || flag == "nproc-per-node") {
      // The launcher's shape; often from the scheduler's environment ($SLURM_NNODES).
      auto v = integer(flag, value);
      int& to = flag == "nproc-per-node" ? gpus_per_node : nodes;
      const int given = flag == "nproc-per-node" ? o.gpus_per_node : o.nodes;
      if (!v.ok()) {
        if (value.find('$') == std::string::npos)  // unset variables get a note below
          out.notes.push_back(fmt::format("--{} {}: not a number, not used", flag, value));
      } else if (given == 0 && to == 0) {
        to = static_cast<int>(*v);
      }
    } else {
      out.ignored.push_back(value.empty() ? "--" + flag : "--" + flag + " " + value);
    }
  }
  for (const std::string& line : sh.sbatch()) {  // #SBATCH --nodes=N | -N N
    Shell words(line);
    std::vector<std::string> w;
    words.Run([&](const std::vector<std::string>& s) { w = s; });
    for (size_t i = 0; i < w.size(); ++i) {
      std::string v;
      if (w[i].rfind("--nodes=", 0) == 0)
        v = w[i].substr(8);
      else if ((w[i] == "--nodes" || w[i] == "-N") && i + 1 < w.size())
        v = w[i + 1];
      if (!v.empty() && nodes == 0 && v.find_first_not_of("0123456789") == std::string::npos)
        nodes = std::stoi(v);
    }
  }
  if (yaml.count("training.recompute_modules") &&
      (!yaml.count("training.recompute") || yaml["training.recompute"] != "selective")) {
    yaml.erase("training.recompute_modules");
    out.notes.push_back("--recompute-modules without --recompute-granularity selective: not used");
  }
  // Megatron's expert classes apply to MoE layers only; a dense model has none to move.
  if (auto it = yaml.find("training.offload_modules");
      it != yaml.end() && !yaml.count("model.llm.moe.experts")) {
    std::string kept;
    bool dropped = false;
    std::istringstream items(it->second.substr(1, it->second.size() - 2));  // "[a, b]"
    for (std::string v; std::getline(items >> std::ws, v, ',');) {
      if (v == "expert_fc1" || v == "moe_act")
        dropped = true;
      else
        kept += (kept.empty() ? "" : ", ") + v;
    }
    if (dropped)
      out.notes.push_back("--offload-modules expert_fc1 / moe_act: no MoE layers, left out");
    if (kept.empty())
      yaml.erase(it);
    else
      it->second = "[" + kept + "]";
  }
  // Megatron offloads the modules named by --offload-modules (none by default): without a
  // class pipeplan models, nothing is offloaded.
  if (yaml.count("training.offload") && !yaml.count("training.offload_modules")) {
    yaml.erase("training.offload");
    out.notes.push_back(
        "--fine-grained-activation-offloading without a module pipeplan models in "
        "--offload-modules: nothing is offloaded");
  }
  if (yaml.count("training.offload_modules") && !yaml.count("training.offload")) {
    yaml.erase("training.offload_modules");
    out.notes.push_back(
        "--offload-modules without --fine-grained-activation-offloading: nothing is offloaded");
  }
  if (yaml.count("model.llm.group_query_attention") && yaml.count("model.llm.kv_heads") == 0) {
    yaml["model.llm.kv_heads"] = "1";  // Megatron's default --num-query-groups
    out.notes.push_back("--group-query-attention without --num-query-groups: 1 KV head");
  }
  if (yaml.count("model.llm.kv_heads") == 0 && yaml.count("model.llm.heads"))
    out.notes.push_back("no --num-query-groups: as many KV heads as attention heads");
  if (!yaml.count("model.llm.untie_embeddings_and_output_weights")) {
    // Megatron ties the output layer to the embedding unless told otherwise: with pp > 1
    // each copy lives on its stage and their gradients are all-reduced every step.
    yaml["model.llm.tie_embeddings"] = "true";
  }
  if (layers_per_virtual > 0) {
    // Megatron: vp = layers / pp / layers per virtual stage.
    const int64_t L = yaml.count("model.llm.layers") ? std::stoll(yaml["model.llm.layers"]) : 0;
    const int64_t pp = yaml.count("parallelism.pp") ? std::stoll(yaml["parallelism.pp"]) : 1;
    if (L == 0 || L % (pp * layers_per_virtual) != 0)
      return bad("num-layers-per-virtual-pipeline-stage",
                 fmt::format("{} layers do not split into pp {} x {} per virtual stage", L, pp,
                             layers_per_virtual));
    yaml["parallelism.vp"] = std::to_string(L / (pp * layers_per_virtual));
  }
  if (yaml.count("parallelism.vp") && std::stoll(yaml["parallelism.vp"]) > 1)
    yaml["schedule.pipeline"] = "interleaved-1f1b";
  if (!flash && yaml.count("model.attention") == 0) {
    yaml["model.attention"] = "flash";
    out.notes.push_back(
        "no --use-flash-attn: flash attention assumed (Megatron-core's default "
        "with Transformer Engine); set model.attention: unfused otherwise");
  }
  if (nodes == 0) {
    nodes = 1;
    out.notes.push_back("no node count (#SBATCH --nodes, torchrun --nnodes, --nodes): 1 node");
  }
  if (gpus_per_node == 0) gpus_per_node = 8;
  for (const std::string& v : sh.unresolved_)
    out.notes.push_back(fmt::format("${} is never set in the script", v));
  // YAML by section, in a fixed order.
  std::string text = fmt::format(
      "# Imported from {} by pipeplan import-megatron.\ncluster:\n  gpu: {}\n  nodes: {}\n  "
      "gpus_per_node: {}\n",
      name, o.gpu, nodes, gpus_per_node);
  std::string section, sub;
  for (const char* prefix : {"model.", "parallelism.", "training.", "schedule."}) {
    bool first = true;
    for (auto& [key, value] : yaml) {
      if (key.rfind(prefix, 0) != 0) continue;
      const std::string head(prefix, std::string_view(prefix).size() - 1);
      if (first) text += head + ":\n", first = false, sub.clear();
      std::string rest = key.substr(std::string_view(prefix).size());
      // model.llm.moe.x -> nested maps
      std::vector<std::string> parts;
      for (size_t a = 0, b; (b = rest.find('.', a)), true; a = b + 1) {
        parts.push_back(rest.substr(a, b == std::string::npos ? std::string::npos : b - a));
        if (b == std::string::npos) break;
      }
      std::string path;
      for (size_t i = 0; i + 1 < parts.size(); ++i) {
        path += parts[i] + ".";
        if (sub.rfind(path, 0) != 0) text += std::string(2 * (i + 1), ' ') + parts[i] + ":\n";
      }
      sub = path;
      text += std::string(2 * parts.size(), ' ') + parts.back() + ": " + value + "\n";
    }
  }
  if (!yaml.count("training.global_batch_size") && !yaml.count("training.microbatches")) {
    text += "  # no --global-batch-size: set training.global_batch_size\n";
    out.notes.push_back("no --global-batch-size: the config needs training.global_batch_size");
  }
  if (!out.ignored.empty()) {
    text += "# Ignored Megatron arguments (no pipeplan meaning):\n";
    for (const std::string& a : out.ignored) text += "#   " + a + "\n";
  }
  out.yaml = std::move(text);
  return out;
}

}  // namespace pipeplan
