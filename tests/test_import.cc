// import-megatron: a Megatron-LM launch script becomes a config that loads, with every
// argument mapped or reported.
#include <doctest/doctest.h>

#include "helpers.h"
#include "planner/megatron_import.h"
#include "planner/yaml_doc.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

constexpr const char* kScript = R"(#!/bin/bash
#SBATCH --nodes=64 --ntasks-per-node=8
TP=8
GBS=${GBS:-1024}
MODEL_ARGS=(
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672
    --num-attention-heads 64 --group-query-attention --num-query-groups 8
    --seq-length 8192 --swiglu --padded-vocab-size 128256
)
options=" \
  --tensor-model-parallel-size $TP --pipeline-model-parallel-size 4 \
  --num-layers-per-virtual-pipeline-stage 5 --micro-batch-size 1 \
  --global-batch-size $GBS --use-distributed-optimizer --sequence-parallel --bf16 \
  --recompute-granularity=selective --lr 1.0e-4"
torchrun --nproc_per_node 8 pretrain_gpt.py ${MODEL_ARGS[@]} $options
)";

}  // namespace

TEST_CASE("import-megatron: a launch script becomes a config with the same model and layout") {
  auto r = ImportMegatron(kScript, "run.sh", {});
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  auto doc = YamlDoc::FromString("run.yaml", r->yaml);
  REQUIRE(doc.ok());
  auto c = ParseConfig(std::move(*doc));
  REQUIRE_MESSAGE(c.ok(), c.status().message());
  CHECK(c->cluster.nodes == 64);
  CHECK(c->cluster.gpus_per_node == 8);
  CHECK(c->model.llm.layers == 80);
  CHECK(c->model.llm.kv_heads == 8);
  CHECK(c->model.llm.gated_ffn);
  CHECK(c->parallel.tp == 8);
  CHECK(c->parallel.pp == 4);
  CHECK(c->parallel.vp == 4);  // 80 layers / pp 4 / 5 per virtual stage
  CHECK(c->parallel.dp == 16);
  CHECK(c->schedule.pipeline == PipelineKind::kInterleaved1F1B);
  CHECK(c->training.global_batch_size == 1024);  // ${GBS:-1024}
  CHECK(c->training.zero_stage == 1);
  CHECK(c->training.sequence_parallel);
  CHECK(c->training.recompute == Recompute::kSelective);
  REQUIRE(r->ignored.size() == 1);
  CHECK(r->ignored[0] == "--lr 1.0e-4");
  CHECK(r->yaml.find("#   --lr 1.0e-4") != std::string::npos);
}

TEST_CASE(
    "import-megatron: bad values name the file and the argument, and the CLI writes a config "
    "that plans") {
  auto bad = ImportMegatron("python pretrain_gpt.py --num-layers $L --hidden-size 64", "x.sh", {});
  REQUIRE(!bad.ok());
  CHECK(bad.status().message() ==
        "x.sh: --num-layers: '$L' is not a whole number (an unset variable)");
  const std::string dir = TempDir();
  REQUIRE(RunShell("printf '%s' '" + std::string("--num-layers 8 --hidden-size 1024 ") +
                   "--num-attention-heads 8 --seq-length 2048 --micro-batch-size 1 " +
                   "--global-batch-size 64 --pipeline-model-parallel-size 2 --padded-vocab-size " +
                   "32000 --ffn-hidden-size 4096' > " + dir + "/args.txt")
              .exit_code == 0);
  RunResult r = RunCli("import-megatron " + dir + "/args.txt --nodes 1 -o " + dir + "/c.yaml");
  CHECK_MESSAGE(r.exit_code == 0, r.out);
  CHECK(RunCli("simulate " + dir + "/c.yaml").exit_code == 0);
  // The README's example script.
  RunResult readme = RunCli("import-megatron " + std::string(PIPEPLAN_SOURCE_DIR) +
                            "/configs/megatron/llama3_70b.sh -o " + dir + "/l.yaml");
  CHECK_MESSAGE(readme.exit_code == 0, readme.out);
  CHECK(readme.out.find("ignored (3 arguments") != std::string::npos);
  CHECK(RunCli("plan " + dir + "/l.yaml").exit_code == 0);
  // A config that does not load is not written.
  RunResult missing =
      RunCli("import-megatron " + dir + "/args.txt --nodes 1 --gpu Z9 -o " + dir + "/bad.yaml");
  CHECK(missing.exit_code == 2);
  CHECK(!Exists(dir + "/bad.yaml"));
}

TEST_CASE("import-megatron: --recompute-method and --recompute-num-layers") {
  auto r = ImportMegatron(
      "python pretrain_gpt.py --num-layers 8 --hidden-size 1024 --num-attention-heads 8 "
      "--seq-length 2048 --micro-batch-size 1 --global-batch-size 64 "
      "--pipeline-model-parallel-size 2 --padded-vocab-size 32000 --ffn-hidden-size 4096 "
      "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
      "run.sh", {});
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->ignored.empty());
  auto doc = YamlDoc::FromString("run.yaml", r->yaml);
  REQUIRE(doc.ok());
  auto c = ParseConfig(std::move(*doc));
  REQUIRE_MESSAGE(c.ok(), c.status().message());
  CHECK(c->training.recompute == Recompute::kFull);
  CHECK(c->training.recompute_method == RecomputeMethod::kBlock);
  CHECK(c->training.recompute_num_layers == 2);
}

TEST_CASE("import-megatron: --recompute-modules and --offload-modules take lists") {
  const std::string base =
      "python pretrain_gpt.py --num-layers 8 --hidden-size 1024 --num-attention-heads 8 "
      "--seq-length 2048 --micro-batch-size 1 --global-batch-size 64 "
      "--pipeline-model-parallel-size 2 --padded-vocab-size 32000 --ffn-hidden-size 4096 ";
  auto load = [](const MegatronImport& r) {
    auto doc = YamlDoc::FromString("run.yaml", r.yaml);
    REQUIRE(doc.ok());
    auto c = ParseConfig(std::move(*doc));
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    return *c;
  };
  auto r = ImportMegatron(base +
                              "--recompute-granularity selective --recompute-modules core_attn "
                              "layernorm mla_up_proj --fine-grained-activation-offloading "
                              "--offload-modules core_attn attn_proj --bf16",
                          "run.sh", {});
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->ignored.empty());
  const Config c = load(*r);
  CHECK(c.training.recompute_modules == (kRecCoreAttn | kRecLayernorm));
  CHECK(c.training.offload == ActPlace::kHost);
  CHECK(c.training.offload_modules == (kTcCoreAttn | kTcAttnProj));
  CHECK(c.training.precision == Precision::kBf16);  // the flag after the list is read
  CHECK(std::count(r->notes.begin(), r->notes.end(),
                   "--recompute-modules mla_up_proj: not modelled, left out") == 1);
  // Megatron offloads only the named modules: the flag alone, or with names pipeplan does
  // not model or (a dense model) expert classes only, offloads nothing.
  for (const char* mods : {"", "--offload-modules dense_mlp", "--offload-modules expert_fc1"}) {
    CAPTURE(mods);
    auto only = ImportMegatron(base + "--fine-grained-activation-offloading " + mods, "run.sh", {});
    REQUIRE(only.ok());
    CHECK(load(*only).training.offload == ActPlace::kDevice);
  }
  auto dense = ImportMegatron(
      base + "--fine-grained-activation-offloading --offload-modules expert_fc1 attn_proj",
      "run.sh", {});
  REQUIRE(dense.ok());
  CHECK(load(*dense).training.offload_modules == kTcAttnProj);
  // Without the flags that enable them, the lists are dropped with a note.
  auto bare = ImportMegatron(base + "--recompute-modules layernorm --offload-modules core_attn",
                             "run.sh", {});
  REQUIRE(bare.ok());
  const Config b = load(*bare);
  CHECK(b.training.recompute_modules == kRecCoreAttn);
  CHECK(b.training.offload == ActPlace::kDevice);
  CHECK(std::count(bare->notes.begin(), bare->notes.end(),
                   "--offload-modules without --fine-grained-activation-offloading: nothing is "
                   "offloaded") == 1);
}

TEST_CASE("import-megatron: the embedding and the loss accounted for in the pipeline split") {
  MegatronImportOptions o;
  o.nodes = 1;
  auto r = ImportMegatron(
      "torchrun pretrain_gpt.py --num-layers 78 --hidden-size 1024 --num-attention-heads 8 "
      "--seq-length 2048 --micro-batch-size 1 --global-batch-size 64 "
      "--pipeline-model-parallel-size 4 --padded-vocab-size 32000 --ffn-hidden-size 4096 "
      "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
      "x.sh", o);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->ignored.empty());
  auto doc = YamlDoc::FromString("x.yaml", r->yaml);
  REQUIRE(doc.ok());
  auto c = ParseConfig(std::move(*doc));
  REQUIRE_MESSAGE(c.ok(), c.status().message());
  // 78 layers + the embedding + the loss = 80 over pp 4: 20 per stage, the first and the
  // last stage one transformer layer fewer.
  std::vector<int> layers;
  for (const StageSpan& s : c->parallel.stages) layers.push_back(s.layer_end - s.layer_begin);
  CHECK(layers == std::vector<int>{19, 20, 20, 19});
}
