#include <doctest/doctest.h>

#include <algorithm>

#include "helpers.h"
#include "planner/config.h"
#include "planner/plan.h"
#include "planner/validate.h"
#include "planner/workload.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

const char* kBase = R"(cluster:
  gpu: H100
  nodes: 1
  gpus_per_node: 8
model:
  llm:
    layers: 8
    hidden: 256
    ffn: 1024
    heads: 4
    vocab: 1000
parallelism:
  tp: 2
  pp: 4
training:
  seq_length: 128
  microbatches: 4
)";

std::string Error(const std::string& yaml, std::vector<std::string> sets = {}) {
  auto doc = YamlDoc::FromString("cfg.yaml", yaml);
  if (!doc.ok()) return doc.status().message();
  for (auto& s : sets)
    if (Status st = doc->ApplySet(s); !st.ok()) return st.message();
  auto c = ParseConfig(std::move(*doc));
  REQUIRE(!c.ok());
  CHECK(c.status().code() == ErrorCode::kInvalidInput);
  return c.status().message();
}

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  size_t at = s.find(from);
  REQUIRE(at != std::string::npos);
  return s.replace(at, from.size(), to);
}

}  // namespace

TEST_CASE("a valid config derives dp and micro-batches") {
  Config c = ParseYaml(kBase);
  CHECK(c.parallel.dp == 1);
  CHECK(c.training.microbatches == 4);
  CHECK(c.training.global_batch_size == 4);
  Config g = ParseYaml(
      Replace(kBase, "  microbatches: 4", "  global_batch_size: 16\n  micro_batch_size: 2"),
      {"cluster.nodes=4"});
  CHECK(g.parallel.dp == 4);
  CHECK(g.training.microbatches == 2);  // 16 / (2 x 4)
}

TEST_CASE("Megatron long names are aliases") {
  Config c = ParseYaml(Replace(Replace(kBase, "  tp: 2", "  tensor_model_parallel_size: 2"),
                               "  pp: 4", "  pipeline_model_parallel_size: 4"));
  CHECK(c.parallel.tp == 2);
  CHECK(c.parallel.pp == 4);
  CHECK(Error(Replace(kBase, "  tp: 2", "  tp: 2\n  tensor_model_parallel_size: 2")) ==
        "cfg.yaml:14:3: 'tp' and 'tensor_model_parallel_size' set the same value\n"
        "    tensor_model_parallel_size: 2\n"
        "    ^");
}

TEST_CASE("unknown key names the file, line, column and a suggestion") {
  CHECK(Error(Replace(kBase, "  microbatches: 4", "  microbatchs: 4")) ==
        "cfg.yaml:17:3: unknown key 'training.microbatchs' (did you mean 'microbatches'?)\n"
        "    microbatchs: 4\n"
        "    ^");
  CHECK(Error(std::string(kBase) + "extra: 1\n") ==
        "cfg.yaml:18:1: unknown key 'extra'\n  extra: 1\n  ^");
}

TEST_CASE("wrong type, bad enum, missing key") {
  CHECK(Error(Replace(kBase, "  pp: 4", "  pp: four")) ==
        "cfg.yaml:14:7: 'parallelism.pp' must be an integer, got 'four'\n    pp: four\n        ^");
  CHECK(Error(std::string(kBase) + "schedule:\n  pipeline: 2f2b\n") ==
        "cfg.yaml:19:13: bad value '2f2b' for 'schedule.pipeline' (expected one of: gpipe, 1f1b, "
        "interleaved-1f1b, zb-h1, zb-h2, zbv, dualpipev, interleaved-zb, csv)\n    pipeline: "
        "2f2b\n              ^");
  CHECK(Error(std::string(kBase) + "data:\n  microbatch_order: heavy\n") ==
        "cfg.yaml:19:21: bad value 'heavy' for 'data.microbatch_order' (expected one of: "
        "drawn, light_ends, auto)\n    microbatch_order: heavy\n                      ^");
  CHECK(Error(Replace(kBase, "    hidden: 256\n", "")) ==
        "cfg.yaml:7:5: missing required key 'model.llm.hidden'\n      layers: 8\n      ^");
  CHECK(Error(Replace(kBase, "  pp: 4", "  pp: 0")) ==
        "cfg.yaml:14:7: 'parallelism.pp' must be >= 1, got 0\n    pp: 0\n        ^");
}

TEST_CASE("inconsistent parallelism points at the key to change") {
  CHECK(Error(Replace(kBase, "    layers: 8", "    layers: 10")) ==
        "cfg.yaml:7:13: 10 layers cannot be split into pp*vp = 4 equal chunks (or set "
        "parallelism.pipeline_model_parallel_layout)\n      layers: 10\n  "
        "            ^");
  CHECK(Error(Replace(kBase, "  pp: 4", "  pp: 3")) ==
        "cfg.yaml:14:7: world size 8 GPUs (1 nodes x 8) is not divisible by tp*pp*cp = 6\n    pp: "
        "3\n        ^");
  std::string inter =
      Replace(kBase, "  pp: 4", "  pp: 4\n  vp: 2") + "schedule:\n  pipeline: interleaved-1f1b\n";
  // PyTorch's rounds rule: rounds = max(1, m / pp) must divide m (m = 6 is fine: 1 round).
  CHECK(Error(Replace(inter, "  microbatches: 4", "  microbatches: 9")) ==
        "cfg.yaml:18:17: 9 micro-batches per replica is not a multiple of the 2 rounds of pp = 4 "
        "(interleaved-1f1b)\n    microbatches: 9\n                  ^");
  CHECK(Error(Replace(inter, "  microbatches: 4", "  microbatches: 2")) ==
        "cfg.yaml:18:17: interleaved-1f1b needs at least pp = 4 micro-batches per replica, got 2\n"
        "    microbatches: 2\n                  ^");
  // DualPipeV needs 2 pp micro-batches (one per stage of the V); interleaved zero bubble
  // has interleaved-1f1b's rounds rule. Both are found when the config is read, at the key.
  const std::string v =
      Replace(kBase, "  pp: 4", "  pp: 4\n  vp: 2") + "schedule:\n  pipeline: dualpipev\n";
  CHECK(Error(Replace(v, "  microbatches: 4", "  microbatches: 7")) ==
        "cfg.yaml:18:17: dualpipev needs at least as many micro-batches per replica as stages "
        "(2 pp = 8), got 7\n    microbatches: 7\n                  ^");
  auto parses = [](const std::string& yaml) {
    auto doc = YamlDoc::FromString("cfg.yaml", yaml);
    return doc.ok() && ParseConfig(std::move(*doc)).ok();
  };
  CHECK(parses(Replace(v, "  microbatches: 4", "  microbatches: 8")));
  const std::string zb =
      Replace(kBase, "  pp: 4", "  pp: 4\n  vp: 2") + "schedule:\n  pipeline: interleaved-zb\n";
  CHECK(Error(Replace(zb, "  microbatches: 4", "  microbatches: 9")) ==
        "cfg.yaml:18:17: 9 micro-batches per replica is not a multiple of the 2 rounds of pp = 4 "
        "(interleaved-zb)\n    microbatches: 9\n                  ^");
  CHECK(parses(Replace(zb, "  microbatches: 4", "  microbatches: 6")));
  // ZB-V holds 1F1B's activation memory, pp micro-batches = 2 pp chunk activations per
  // rank (its default limit): with pp 4 a limit of 2 cannot be kept, 8 can. The schedule is
  // built when the config is read to find out, and the error is at the key.
  const std::string zbv = Replace(kBase, "  pp: 4", "  pp: 4\n  vp: 2") +
                          "schedule:\n  pipeline: zbv\n  zb_max_pending: 2\n";
  CHECK(Error(zbv) ==
        "cfg.yaml:21:19: no zbv schedule keeps at most 2 chunk activations pending per rank\n"
        "    zb_max_pending: 2\n                    ^");
  CHECK(parses(Replace(zbv, "zb_max_pending: 2", "zb_max_pending: 8")));
  CHECK(
      Error(Replace(kBase, "  microbatches: 4", "  global_batch_size: 6\n  micro_batch_size: 4")) ==
      "cfg.yaml:17:22: global_batch_size 6 is not divisible by micro_batch_size*dp = 4*1\n"
      "    global_batch_size: 6\n                       ^");
}

TEST_CASE("--set overrides any key, and its errors name the --set") {
  Config c =
      ParseYaml(kBase, {"parallelism.pp=2", "model.llm.layers=4", "training.recompute=full"});
  CHECK(c.parallel.pp == 2);
  CHECK(c.parallel.dp == 2);
  CHECK(c.training.recompute == Recompute::kFull);
  CHECK(Error(kBase, {"parallelism.ppp=2"}) ==
        "--set parallelism.ppp=2: unknown key 'parallelism.ppp' (did you mean 'pp'?)");
  CHECK(Error(kBase, {"training.recompute=sometimes"}) ==
        "--set training.recompute=sometimes: bad value 'sometimes' for 'training.recompute' "
        "(expected one of: "
        "none, selective, full)");
  CHECK(Error(kBase, {"nonsense"}) == "--set nonsense: expected KEY.PATH=VALUE");
}

TEST_CASE("unreadable file and YAML syntax errors") {
  auto missing = LoadConfig("/nonexistent/x.yaml");
  CHECK(missing.status().code() == ErrorCode::kInvalidInput);
  CHECK(missing.status().message() ==
        "/nonexistent/x.yaml: cannot read file: No such file or directory");
  CHECK(Error("cluster: [1, 2\n").rfind("cfg.yaml:2:1: YAML syntax error: ", 0) == 0);
}

TEST_CASE("hardware overrides apply to the catalog entry") {
  Config c = ParseYaml(
      Replace(kBase, "  gpus_per_node: 8", "  gpus_per_node: 8\n  hardware: {hbm_bytes: 1e9}"));
  CHECK(c.cluster.spec.hbm_bytes == 1e9);
  CHECK(c.cluster.spec.bf16_flops == 989e12);
  CHECK(Error(Replace(kBase, "  gpus_per_node: 8", "  gpus_per_node: 8\n  hardware: {hbm: 1}"))
            .rfind("cfg.yaml:5:14: unknown key 'cluster.hardware.hbm' (did you mean 'hbm_bw'?)",
                   0) == 0);
  CHECK(Error(Replace(kBase, "gpu: H100", "gpu: V100"))
            .rfind("cfg.yaml:2:8: unknown GPU 'V100' (catalog: H100, H200, H800, H20, A100)", 0) ==
        0);
}

TEST_CASE("hostile values are errors, not crashes") {
  CHECK(Error("") ==
        "cfg.yaml: cluster: missing required key 'cluster'\n"
        "cfg.yaml: model: missing required key 'model'\n"
        "cfg.yaml: training: missing required key 'training'");
  CHECK(Error(kBase, {"model=3"}) == "--set model=3: 'model' must be a mapping");
  CHECK(Error(kBase, {"parallelism.tp=100000"}) ==
        "--set parallelism.tp=100000: 'parallelism.tp' must be <= 65536, got 100000");
  CHECK(Error(kBase, {"cluster.nodes=2147483647"}) ==
        "--set cluster.nodes=2147483647: 'cluster.nodes' must be <= 1048576, got 2147483647");
  CHECK(Error(kBase, {"training.comm_reserve_gb=.nan"}) ==
        "--set training.comm_reserve_gb=.nan: 'training.comm_reserve_gb' must be a finite number "
        ">= 0, got .nan");
  CHECK(Error(kBase, {"cluster.hardware.hbm_bw=0"}) ==
        "--set cluster.hardware.hbm_bw=0: 'cluster.hardware.hbm_bw' must be > 0");
  CHECK(Error(kBase, {"model.llm.hidden=2", "model.llm.heads=4"})
            .find("hidden 2 is smaller than heads 4") != std::string::npos);
  CHECK(Error(std::string(kBase) + "[a, b]: 1\n")
            .rfind("cfg.yaml:18:1: keys must be plain names", 0) == 0);
}

TEST_CASE("an unknown key gets a hint from another section, --set overrides by an alias") {
  CHECK(Error(std::string(kBase) + "  sequence_parallel_x: true\n")
            .rfind("cfg.yaml:18:3: unknown key 'training.sequence_parallel_x' (did you mean "
                   "'sequence_parallel'?)",
                   0) == 0);
  CHECK(Error(Replace(kBase, "  pp: 4", "  pp: 4\n  sequence_parallel: true"))
            .rfind("cfg.yaml:15:3: unknown key 'parallelism.sequence_parallel' (did you mean "
                   "'training.sequence_parallel'?)",
                   0) == 0);
  // The file says pp, --set says pipeline_model_parallel_size: the --set wins.
  Config c = ParseYaml(kBase, {"parallelism.pipeline_model_parallel_size=2"});
  CHECK(c.parallel.pp == 2);
  Config d = ParseYaml(Replace(kBase, "  pp: 4", "  pipeline_model_parallel_size: 4"),
                       {"parallelism.pp=2"});
  CHECK(d.parallel.pp == 2);
  // Both names in the file remain an error.
  CHECK(Error(Replace(kBase, "  pp: 4", "  pp: 4\n  pipeline_model_parallel_size: 4"))
            .find("set the same value") != std::string::npos);
}

TEST_CASE("every error of reading the keys is reported in one run") {
  const std::string msg =
      Error(Replace(kBase, "  tp: 2", "  tp: two\n  ppp: 4") + "schedule:\n  pipeline: 2f2b\n");
  CHECK(msg.find("'parallelism.tp' must be an integer, got 'two'") != std::string::npos);
  CHECK(msg.find("unknown key 'parallelism.ppp'") != std::string::npos);
  CHECK(msg.find("bad value '2f2b' for 'schedule.pipeline'") != std::string::npos);
}

TEST_CASE(
    "Megatron's switches: virtual stages by layers, distributed optimizer, GQA, tied "
    "embeddings") {
  // vp from layers per virtual stage: 8 layers / (pp 4 x 1) = 2.
  Config v = ParseYaml(kBase, {"parallelism.num_layers_per_virtual_pipeline_stage=1",
                               "schedule.pipeline=interleaved-1f1b"});
  CHECK(v.parallel.vp == 2);
  CHECK(
      ParseYaml(kBase, {"parallelism.num_layers_per_virtual_pipeline_stage=2", "parallelism.vp=1"})
          .parallel.vp == 1);
  CHECK(Error(kBase, {"parallelism.num_layers_per_virtual_pipeline_stage=3"})
            .find("8 layers are not divisible by pp * 3 = 12") != std::string::npos);
  CHECK(Error(kBase, {"parallelism.num_layers_per_virtual_pipeline_stage=1", "parallelism.vp=4"})
            .find("give vp = 2, but vp = 4") != std::string::npos);
  // The distributed optimizer is ZeRO-1; without it, none.
  CHECK(ParseYaml(kBase, {"training.use_distributed_optimizer=true"}).training.zero_stage == 1);
  CHECK(ParseYaml(kBase, {"training.use_distributed_optimizer=false"}).training.zero_stage == 0);
  CHECK(Error(kBase, {"training.use_distributed_optimizer=false", "training.zero_stage=1"})
            .find("use_distributed_optimizer: false contradicts zero_stage: 1") !=
        std::string::npos);
  // Grouped-query attention takes num_query_groups; without the switch, multi-head.
  CHECK(ParseYaml(kBase, {"model.llm.group_query_attention=true", "model.llm.num_query_groups=2"})
            .model.llm.kv_heads == 2);
  CHECK(ParseYaml(kBase, {"model.llm.group_query_attention=false"}).model.llm.kv_heads == 4);
  CHECK(Error(kBase, {"model.llm.group_query_attention=true"}).find("needs num_query_groups") !=
        std::string::npos);
  CHECK(Error(kBase, {"model.llm.group_query_attention=false", "model.llm.kv_heads=2"})
            .find("kv_heads = 2 but group_query_attention is false") != std::string::npos);
  // Tied embeddings: one copy of the vocab x hidden weights where one stage holds both.
  const std::vector<std::string> one_stage = {"parallelism.pp=1", "parallelism.tp=1",
                                              "cluster.gpus_per_node=1"};
  std::vector<std::string> tied = one_stage, untied = one_stage;
  tied.push_back("model.llm.untie_embeddings_and_output_weights=false");
  untied.push_back("model.llm.untie_embeddings_and_output_weights=true");
  const Config t = ParseYaml(kBase, tied), u = ParseYaml(kBase, untied);
  CHECK(t.model.llm.tie_embeddings);
  CHECK(!u.model.llm.tie_embeddings);
  const double saved =
      BuildTextWorkload(u).params_per_gpu[0] - BuildTextWorkload(t).params_per_gpu[0];
  CHECK(saved == doctest::Approx(1000.0 * 256));  // vocab x hidden
  // With a V placement the first and last stage share a rank in two chunks: refused.
  CHECK(Error(kBase, {"model.llm.tie_embeddings=true", "schedule.pipeline=zbv", "parallelism.vp=2"})
            .find("V placement") != std::string::npos);
  CHECK(Error(kBase, {"model.llm.tie_embeddings=true",
                      "model.llm.untie_embeddings_and_output_weights=true"})
            .find("contradicts model.llm.tie_embeddings") != std::string::npos);
}

TEST_CASE("tied embeddings across stages: the embedding-gradient all-reduce of each replica") {
  // Megatron (finalize_model_grads, _allreduce_word_embedding_grads): the first stage's
  // word embedding and the last stage's output layer are two copies of one weight; after
  // the data-parallel reduction their gradient (vocab x hidden / tp, here in fp32) is
  // all-reduced over the pair, before the optimizer step.
  const Config tc = ParseYaml(kBase, {"model.llm.tie_embeddings=true", "parallelism.tp=1"});
  const Config uc = ParseYaml(kBase, {"parallelism.tp=1"});
  const Table tied = Plan(tc), untied = Plan(uc);
  REQUIRE(tied.meta().dp == 2);
  CHECK(ValidatePlan(tied).ok());
  CHECK(tied.size() == untied.size() + 4);  // one op on each stage of the pair, 2 replicas
  // Both copies stay: the same parameters per GPU as untied (each stage holds its copy).
  for (int32_t r = 0; r < tied.num_ranks(); ++r)
    CHECK(tied.ranks()[r].params[0] == untied.ranks()[r].params[0]);
  std::vector<int32_t> on;
  for (OpId i = 0; i < tied.size(); ++i) {
    if (tied.kind(i) != OpKind::kAllReduce || tied.module(i) != Module::kText || tied.chunk(i) >= 0)
      continue;
    const int32_t r = tied.rank(i);
    on.push_back(r);
    CAPTURE(tied.str(i));
    const auto g = tied.group(tied.peer(i));
    const int32_t d = r / 4;
    CHECK(std::vector<int32_t>(g.begin(), g.end()) == std::vector<int32_t>{4 * d, 4 * d + 3});
    CHECK(tied.work(i).payload_bytes == 1000.0 * 256 * 4);
    // After the rank's last text backward; the optimizer step waits for it.
    OpId last_b = 0, opt = 0;
    for (OpId j = tied.rank_begin(r); j < tied.rank_end(r); ++j) {
      if (tied.kind(j) == OpKind::kB && tied.module(j) == Module::kText) last_b = j;
      if (tied.kind(j) == OpKind::kOptStep) opt = j;
    }
    const auto deps = tied.deps(i);
    CHECK(std::find(deps.begin(), deps.end(), last_b) != deps.end());
    const auto opt_deps = tied.deps(opt);
    CHECK(std::find(opt_deps.begin(), opt_deps.end(), i) != opt_deps.end());
  }
  CHECK(on == std::vector<int32_t>{0, 3, 4, 7});
  // It takes time on the step: the simulated step grows.
  auto ts = RunSimulation(tied, SimOptionsFor(tc)), us = RunSimulation(untied, SimOptionsFor(uc));
  REQUIRE(ts.ok());
  REQUIRE(us.ok());
  CHECK(ts->metrics.step_time_s > us->metrics.step_time_s);
  // The executor runs it (after the vision syncs on every rank: no deadlock) and the
  // gradients still match the sequential reference.
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  REQUIRE(RunCli("plan " + cfg + " --set model.llm.tie_embeddings=true -o " + dir + "/t.pb")
              .exit_code == 0);
  const RunResult r = RunCli("execute " + dir + "/t.pb --local-ranks 8 --check");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("PASS") != std::string::npos);
}

TEST_CASE("a cloned YAML document takes overrides without changing the original") {
  auto doc = YamlDoc::FromString("c.yaml", "a: {b: 1, c: [1, 2]}\n");
  REQUIRE(doc.ok());
  YamlDoc copy = doc->Clone();
  REQUIRE(copy.ApplySet("a.b=2").ok());
  copy.Erase("a.c");
  CHECK(doc->root()["a"]["b"].as<int>() == 1);
  CHECK(doc->root()["a"]["c"].size() == 2);
  CHECK(copy.root()["a"]["b"].as<int>() == 2);
  CHECK(!copy.root()["a"]["c"].IsDefined());
  CHECK(copy.FromSet("a.b"));
  CHECK(!doc->FromSet("a.b"));
}
