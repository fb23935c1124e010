// The cost model's config keys: each test changes one key and checks that the right term
// moves by the amount the cited formula gives, computed here by hand.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include "helpers.h"
#include "planner/data.h"
#include "planner/modality.h"
#include "planner/plan.h"
#include "planner/validate.h"
#include "planner/workload.h"
#include "simulator/contention.h"
#include "simulator/cost_model.h"
#include "simulator/engine.h"
#include "simulator/metrics.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// SmallConfig's model: hidden 256, 4 heads of 64, gated FFN 1024, vocab 1000, seq 128,
// micro-batch 1, 2 layers per stage; pp = 2 here, one GPU per rank.
constexpr double kH = 256, kHeads = 4, kQ = 256, kFfn = 1024, kS = 128, kT = 128, kV = 1000;

Config Small(std::vector<std::string> sets) {
  return SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1, std::move(sets));
}

StatusOr<Config> LoadConfigFromString(const std::string& yaml) {
  auto doc = YamlDoc::FromString("cfg.yaml", yaml);
  if (!doc.ok()) return doc.status();
  return ParseConfig(std::move(doc).value());
}

// The first op of `kind` and `module` on rank r (collectives: their group ids vary).
OpId FindOn(const Table& t, int32_t r, OpKind kind, Module module) {
  for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i)
    if (t.kind(i) == kind && t.module(i) == module) return i;
  FAIL("no such op on rank " << r);
  return 0;
}

const Work& FirstWork(const Table& t, const std::string& op) {
  return t.work(Find(t, op));
}

}  // namespace

TEST_CASE("model.attention: unfused computes the masked half and moves the scores through HBM") {
  // Scores and values: 4*T*s*(heads*head_dim) FLOPs per layer (reference.md); FlashAttention
  // skips the causal half, unfused multiplies the whole matrix. Unfused also writes and reads
  // the a*s*T probabilities: scale-mask-softmax 4 bytes per score forward, 6 backward.
  const double scores = 4 * kT * kS * kQ, elems = kHeads * kS * kT;
  for (const char* rc : {"none", "selective", "full"}) {
    CAPTURE(rc);
    auto flash = BuildTextWorkload(Small({std::string("training.recompute=") + rc}));
    auto unfused = BuildTextWorkload(
        Small({std::string("training.recompute=") + rc, "model.attention=unfused"}));
    const Work &ff = flash.f[0], &uf = unfused.f[0];
    CHECK(uf.flops - ff.flops == doctest::Approx(2 * 0.5 * scores));
    CHECK(ff.attn_flops == doctest::Approx(2 * 0.5 * scores));  // at the attention rate
    CHECK(uf.attn_flops == 0);                                  // batched GEMMs
    CHECK(uf.model_flops == doctest::Approx(ff.model_flops));   // MFU counts the same work
    CHECK(uf.hbm_bytes - ff.hbm_bytes == doctest::Approx(2 * 4 * elems));
    // Backward: FlashAttention 2.5x its forward (the scores recomputed inside), unfused 2x;
    // selective recompute adds one core forward, full the whole forward.
    const double core_f = 0.5 * scores, core_u = scores;
    const double extra = std::string(rc) == "none" ? 0 : 1;
    CHECK(unfused.b[0].flops - flash.b[0].flops ==
          doctest::Approx(2 * ((2 + extra) * core_u - (2.5 + extra) * core_f)));
    // Memory kept for the backward: without recompute unfused keeps the 2-byte softmax
    // output, FlashAttention only its fp32 log-sum-exp (4 bytes per head and token).
    const double dmem = unfused.f[0].mem_delta_bytes - flash.f[0].mem_delta_bytes;
    if (std::string(rc) == "none")
      CHECK(dmem == doctest::Approx(2 * (2 * elems - 4 * kHeads * kT)));
    else
      CHECK(dmem == 0);
  }
}

TEST_CASE("model.attention_dropout: the 5*a*s^2*b of Korthikanti et al. with unfused attention") {
  // Korthikanti et al. (2022) section 4.1: softmax output 2*a*s^2*b, dropout mask a*s^2*b,
  // dropout output 2*a*s^2*b. Traffic: dropout reads 2 and writes 2 + 1 bytes per score in
  // the forward, reads 2 + 1 and writes 2 in the backward.
  const double elems = kHeads * kS * kT;
  auto plain = BuildTextWorkload(Small({"training.recompute=none", "model.attention=unfused"}));
  auto drop = BuildTextWorkload(
      Small({"training.recompute=none", "model.attention=unfused", "model.attention_dropout=0.1"}));
  CHECK(drop.f[0].mem_delta_bytes - plain.f[0].mem_delta_bytes ==
        doctest::Approx(2 * 3 * elems));  // 2 layers x (5 - 2) bytes per score
  CHECK(drop.f[0].hbm_bytes - plain.f[0].hbm_bytes == doctest::Approx(2 * 5 * elems));
  CHECK(drop.b[0].hbm_bytes - plain.b[0].hbm_bytes == doctest::Approx(2 * 5 * elems));
  // FlashAttention applies dropout inside the kernel: nothing moves.
  auto flash = BuildTextWorkload(Small({"training.recompute=none"}));
  auto flash_drop =
      BuildTextWorkload(Small({"training.recompute=none", "model.attention_dropout=0.1"}));
  CHECK(flash_drop.f[0] == flash.f[0]);
}

TEST_CASE("training.precision: fp8 runs the linear layers' GEMMs at the FP8 rate") {
  Config bf16 = Small({}), fp8 = Small({"training.precision=fp8"});
  auto wb = BuildTextWorkload(bf16), w8 = BuildTextWorkload(fp8);
  // Linear layers per layer: QKV + projection 2*T*(h*(q+2kv) + q*h), gated FFN 2*T*h*f*3.
  const double linear = 2 * kT * (kH * 3 * kQ + kQ * kH) + 2 * kT * kH * kFfn * 3;
  CHECK(w8.f[0].fp8_flops == doctest::Approx(2 * linear));
  CHECK(w8.b[0].fp8_flops == doctest::Approx(2 * 2 * linear));  // dgrad + wgrad
  CHECK(w8.f[0].flops == doctest::Approx(wb.f[0].flops));
  // Cast-transpose, 4 bytes per element of each FP8 GEMM input (forward: h + q + h + f)
  // and output gradient (backward: 3q + h + 2f + h).
  CHECK(w8.f[0].hbm_bytes - wb.f[0].hbm_bytes ==
        doctest::Approx(2 * 4 * (kH + kQ + kH + kFfn) * kT));
  CHECK(w8.b[0].hbm_bytes - wb.b[0].hbm_bytes ==
        doctest::Approx(2 * 4 * (3 * kQ + kH + 2 * kFfn + kH) * kT));
  // Time: the FP8 FLOPs move from the 16-bit rate to the FP8 rate (both at the GEMM
  // efficiency), the casts add their bytes at the HBM rate.
  const GpuSpec& s = bf16.cluster.spec;
  CostModel cost = CostModel::Real(s);
  Work only_gemm = wb.f[0], only_gemm8 = w8.f[0];
  only_gemm8.hbm_bytes = only_gemm.hbm_bytes;
  const double d =
      cost.ComputeSeconds(only_gemm, 1, 1, 1, 8) - cost.ComputeSeconds(only_gemm8, 1, 1, 1, 8);
  CHECK(d ==
        doctest::Approx(2 * linear * (1 / s.bf16_flops - 1 / s.fp8_flops) / s.compute_efficiency));
  // fp16 costs what bf16 costs (same tensor-core rate on every catalog GPU).
  Config fp16 = Small({"training.precision=fp16"});
  CHECK(CostModel::Real(s).Durations(Plan(fp16)) == CostModel::Real(s).Durations(Plan(bf16)));
  // A GPU without an FP8 rate is an error naming the key.
  auto a100 = LoadConfigFromString(
      "cluster: {gpu: A100, nodes: 1}\nmodel: {llm: {layers: 2, hidden: 256, ffn: 1024, heads: "
      "4, vocab: 1000}}\ntraining: {seq_length: 128, microbatches: 1, precision: fp8}\n");
  REQUIRE(!a100.ok());
  CHECK(a100.status().message().find("training.precision") != std::string::npos);
}

TEST_CASE("training.grad_reduce_dtype: the gradient reduction carries 4 or 2 bytes per parameter") {
  for (auto [dtype, bytes] : {std::pair{"fp32", 4.0}, {"bf16", 2.0}, {"fp16", 2.0}}) {
    CAPTURE(dtype);
    Config c = SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 2,
                           {std::string("training.grad_reduce_dtype=") + dtype});
    Table t = Plan(c);
    const double params = BuildTextWorkload(c).params_per_gpu[0];
    CHECK(FirstWork(t, "r0 REDUCE_SCATTER c0 @g0").payload_bytes ==
          doctest::Approx(params * bytes));
  }
}

TEST_CASE("training.scatter_gather_p2p: 1/tp over the NIC, the rest all-gathered over NVLink") {
  // Narayanan et al. (SC21) section 4.1. Two nodes of 2 GPUs, tp = 2, pp = 2: the stages
  // sit on different nodes. Without sequence parallelism each TP GPU holds the whole
  // activation, T*h*2 bytes.
  auto make = [](bool sg) {
    return ParseYaml(fmt::format(R"(
cluster: {{gpu: H100, nodes: 2, gpus_per_node: 2}}
model: {{llm: {{layers: 4, hidden: 256, ffn: 1024, heads: 4, vocab: 1000}}}}
parallelism: {{tp: 2, pp: 2}}
training: {{seq_length: 128, microbatches: 4, sequence_parallel: false,
           scatter_gather_p2p: {}}}
)",
                                 sg ? "true" : "false"));
  };
  const double full = kT * kH * 2;
  Table on = Plan(make(true)), off = Plan(make(false));
  const Work& w_on = FirstWork(on, "r0 SEND_F c0 m0 ->r1");
  const Work& w_off = FirstWork(off, "r0 SEND_F c0 m0 ->r1");
  CHECK(w_off.payload_bytes == doctest::Approx(full));
  CHECK(w_on.payload_bytes == doctest::Approx(full / 2));
  CHECK(w_on.tp_bytes == doctest::Approx(full / 2));  // (tp-1)/tp of it, gathered
  const GpuSpec& s = make(true).cluster.spec;
  CostModel cost = CostModel::Real(s);
  CHECK(cost.P2PSeconds(w_on, false) ==
        doctest::Approx(s.inter_latency_s + full / 2 / (s.nic_bw * s.nic_efficiency) +
                        s.intra_latency_s + full / 2 / (s.nvlink_bw * s.nvlink_efficiency)));
  CHECK(cost.P2PSeconds(w_off, false) ==
        doctest::Approx(s.inter_latency_s + full / (s.nic_bw * s.nic_efficiency)));
}

TEST_CASE("uneven stages: Megatron's layout string and first/last stage layer counts") {
  auto spans = ParseStageLayout("Et*3|(t*4|)*2t*3L");
  REQUIRE_MESSAGE(spans.ok(), spans.status().message());
  REQUIRE(spans->size() == 4);
  const int expect[4][2] = {{0, 3}, {3, 7}, {7, 11}, {11, 14}};
  for (int g = 0; g < 4; ++g) {
    CHECK((*spans)[g].layer_begin == expect[g][0]);
    CHECK((*spans)[g].layer_end == expect[g][1]);
    CHECK((*spans)[g].embedding == (g == 0));
    CHECK((*spans)[g].loss == (g == 3));
  }
  CHECK(ParseStageLayout("E|t|L").ok());
  CHECK(ParseStageLayout("t|E|L").status().message().find("E must open") != std::string::npos);
  CHECK(ParseStageLayout("Et|tx|L").status().message().find("character 5") != std::string::npos);
  CHECK(!ParseStageLayout("Et|t(").ok());
  CHECK(!ParseStageLayout("Et|Lt").ok());

  // 8 layers on pp = 4: "E|t*3|t*3|t*2L" puts the embedding alone on stage 0.
  Config c = SmallConfig(PipelineKind::k1F1B, 4, 1, 4, 1,
                         {"parallelism.pipeline_model_parallel_layout=E|t*3|t*3|t*2L"});
  TextWorkload w = BuildTextWorkload(c);
  TextWorkload even = BuildTextWorkload(SmallConfig(PipelineKind::k1F1B, 4, 1, 4));
  const double layer_f = even.f[1].flops / 2;  // stage 1 of the even split: 2 plain layers
  CHECK(w.f[1].flops == doctest::Approx(3 * layer_f));
  CHECK(w.f[2].flops == doctest::Approx(3 * layer_f));
  // The last stage: 2 layers + the output layer 2*T*h*V.
  CHECK(w.f[3].flops == doctest::Approx(2 * layer_f + 2 * kT * kH * kV));
  // The embedding stage: no GEMMs, the lookup writes and reads T*h bf16 values; its
  // parameters are the V*h table.
  CHECK(w.f[0].flops == 0);
  CHECK(w.f[0].hbm_bytes == doctest::Approx(2 * kT * kH * 2));
  CHECK(w.params_per_gpu[0] == doctest::Approx(kV * kH));
  // The memory of the stages follows their layers.
  CHECK(w.f[1].mem_delta_bytes == doctest::Approx(1.5 * even.f[1].mem_delta_bytes));

  Config fl = SmallConfig(PipelineKind::k1F1B, 4, 1, 4, 1,
                          {"parallelism.num_layers_in_first_pipeline_stage=1",
                           "parallelism.num_layers_in_last_pipeline_stage=1"});
  const int counts[4] = {1, 3, 3, 1};
  for (int g = 0; g < 4; ++g)
    CHECK(fl.parallel.stages[g].layer_end - fl.parallel.stages[g].layer_begin == counts[g]);
  // With virtual stages (Megatron-core's get_transformer_layer_offset): the counts are
  // pipeline ranks', each split evenly over the rank's vp chunks. 20 layers, pp 4, vp 2,
  // 2 on the first rank: the other 3 ranks hold 18 / 3 = 6, 3 per chunk; rank 0 1 per chunk.
  // Loop placement: virtual stage g is on rank g % 4; V placement: g and 7 - g share rank.
  auto chunks = [](const Config& k) {
    std::vector<int> n;
    for (const StageSpan& s : k.parallel.stages) n.push_back(s.layer_end - s.layer_begin);
    return n;
  };
  const std::vector<std::string> first2 = {"model.llm.layers=20",
                                           "parallelism.num_layers_in_first_pipeline_stage=2"};
  CHECK(chunks(SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8, 1, first2)) ==
        std::vector<int>{1, 3, 3, 3, 1, 3, 3, 3});
  CHECK(chunks(SmallConfig(PipelineKind::kZbv, 4, 2, 8, 1, first2)) ==
        std::vector<int>{1, 3, 3, 3, 3, 3, 3, 1});
  // 16 layers, 2 on the first and 2 on the last rank: 12 / 2 = 6 on each other rank.
  CHECK(chunks(SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8, 1,
                           {"parallelism.num_layers_in_first_pipeline_stage=2",
                            "parallelism.num_layers_in_last_pipeline_stage=2"})) ==
        std::vector<int>{1, 3, 3, 1, 1, 3, 3, 1});
  auto uneven = [](std::string_view sets) {
    return LoadConfigFromString(fmt::format(
        "cluster: {{gpu: H100, nodes: 1, gpus_per_node: 4}}\nmodel: {{llm: {{layers: 16, "
        "hidden: 256, ffn: 1024, heads: 4, vocab: 1000}}}}\nparallelism: {{pp: 4, vp: 2, {}}}\n"
        "training: {{seq_length: 128, microbatches: 8}}\n"
        "schedule: {{pipeline: interleaved-1f1b}}\n",
        sets));
  };
  auto odd = uneven("num_layers_in_last_pipeline_stage: 3");  // 3 layers over 2 chunks
  REQUIRE(!odd.ok());
  // The error points at the key's value (line 3) and quotes its line.
  CHECK(odd.status().message().find("cfg.yaml:3:") != std::string::npos);
  CHECK(odd.status().message().find("num_layers_in_last_pipeline_stage: 3") != std::string::npos);
  CHECK(odd.status().message().find("3 layers do not split evenly over vp = 2") !=
        std::string::npos);
  auto rest = uneven("num_layers_in_first_pipeline_stage: 2");  // 14 over 3 ranks x 2 chunks
  REQUIRE(!rest.ok());
  CHECK(rest.status().message().find("the other 3 stages' 6 chunks") != std::string::npos);
  auto bad = LoadConfigFromString(
      "cluster: {gpu: H100, nodes: 1, gpus_per_node: 4}\nmodel: {llm: {layers: 8, hidden: 256, "
      "ffn: 1024, heads: 4, vocab: 1000}}\nparallelism: {pp: 4, pipeline_model_parallel_layout: "
      "\"Et*3|t*3|t*2L\"}\ntraining: {seq_length: 128, microbatches: 4}\n");
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("3 stages, pp*vp = 4") != std::string::npos);

  // Megatron's account_for_embedding_in_pipeline_split / ..._loss_...: the embedding and the
  // loss count as one layer each, the 14 + 2 = 16 "layers" split evenly over pp 4 x vp 2 =
  // 8 virtual stages of 2, the first virtual stage (rank 0's chunk 0) and the last (loop:
  // rank 3's chunk 1; V: rank 0's chunk 1) one layer fewer; in global order the same for
  // both placements.
  const std::vector<std::string> both = {"model.llm.layers=14",
                                         "parallelism.account_for_embedding_in_pipeline_split=true",
                                         "parallelism.account_for_loss_in_pipeline_split=true"};
  CHECK(chunks(SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8, 1, both)) ==
        std::vector<int>{1, 2, 2, 2, 2, 2, 2, 1});
  CHECK(chunks(SmallConfig(PipelineKind::kZbv, 4, 2, 8, 1, both)) ==
        std::vector<int>{1, 2, 2, 2, 2, 2, 2, 1});
  // What the stages cost follows: a middle virtual stage's 2 layers, the first's 1 layer and
  // the embedding (no GEMMs), the last's 1 layer and the output layer (2*T*h*V, as above).
  const Config accounted = SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8, 1, both);
  const TextWorkload aw = BuildTextWorkload(accounted);
  const double one_layer = aw.f[1].flops / 2;
  CHECK(one_layer == doctest::Approx(layer_f));
  CHECK(aw.f[0].flops == doctest::Approx(one_layer));
  CHECK(aw.f[7].flops == doctest::Approx(one_layer + 2 * kT * kH * kV));
  // The embedding alone: 15 + 1 over 8; with vp 1, 7 + 1 over 4: the first rank 1 of 2.
  CHECK(chunks(SmallConfig(
            PipelineKind::kInterleaved1F1B, 4, 2, 8, 1,
            {"model.llm.layers=15", "parallelism.account_for_embedding_in_pipeline_split=true"})) ==
        std::vector<int>{1, 2, 2, 2, 2, 2, 2, 2});
  CHECK(chunks(SmallConfig(
            PipelineKind::k1F1B, 4, 1, 4, 1,
            {"model.llm.layers=7", "parallelism.account_for_loss_in_pipeline_split=true"})) ==
        std::vector<int>{2, 2, 2, 1});
  auto counted = uneven("account_for_embedding_in_pipeline_split: true");  // 17 over 8
  REQUIRE(!counted.ok());
  CHECK(counted.status().message().find("cfg.yaml:3:") != std::string::npos);
  CHECK(counted.status().message().find("(17) cannot be split into pp*vp = 8") !=
        std::string::npos);
  auto mixed =
      uneven("account_for_loss_in_pipeline_split: true, num_layers_in_first_pipeline_stage: 2");
  REQUIRE(!mixed.ok());
  CHECK(mixed.status().message().find("set either the embedding or loss accounting") !=
        std::string::npos);
}

TEST_CASE("model TFLOP/s per GPU is eq. (3) of Narayanan et al. (SC21)") {
  // GPT (4h GELU FFN, multi-head attention): 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)).
  Config c = SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1, {"model.llm.gated_ffn=false"});
  const double B = 4, l = 4;
  const double eq3 = 96 * B * kS * l * kH * kH * (1 + kS / (6 * kH) + kV / (16 * l * kH));
  CHECK(MegatronFlopsPerStep(c) == doctest::Approx(eq3));
  // Gated FFN (Megatron's swiglu: 3/2 of the FFN term) and query groups (kv/heads of one
  // projection): per layer 16*B*s*h^2*((1 + g/a + s/h) + 1.5*f/h).
  Config g = SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1, {"model.llm.kv_heads=2"});
  const double per_layer = 16 * B * kS * kH * kH * ((1 + 0.5 + kS / kH) + 1.5 * kFfn / kH);
  CHECK(MegatronFlopsPerStep(g) == doctest::Approx(l * per_layer + 6 * B * kS * kH * kV));
  auto r = RunSimulation(Plan(c), SimOptionsFor(c, false));
  REQUIRE(r.ok());
  CHECK(r->metrics.model_flops_per_gpu ==
        doctest::Approx(eq3 / (r->metrics.step_time_s * r->metrics.world_gpus)));
  // Megatron's MFU (Korthikanti et al. 2022): 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)), no
  // recompute forward, over the bf16 peak.
  const double model = 72 * B * kS * l * kH * kH * (1 + kS / (6 * kH) + kV / (12 * l * kH));
  CHECK(MegatronFlopsPerStep(c, false) == doctest::Approx(model));
  CHECK(r->metrics.megatron_mfu ==
        doctest::Approx(
            model / (r->metrics.step_time_s * r->metrics.world_gpus * c.cluster.spec.bf16_flops)));
}

TEST_CASE(
    "training.overlap_grad_reduce: each bucket is reduced as soon as its layers' backward ran") {
  // One GPU per node, dp = 2, pp = 1: the reduction crosses the NIC. 2 layers, buckets of
  // one parameter: one bucket per layer (a bucket holds whole layers), so the last
  // micro-batch's backward runs as 2 pieces and each piece's gradients are reduced on the
  // collective stream while the next piece computes (Megatron's overlap_grad_reduce).
  const std::vector<std::string> base = {"cluster.gpus_per_node=1", "cluster.nodes=2"};
  auto sets = base;
  sets.insert(sets.end(), {"training.overlap_grad_reduce=true", "training.grad_bucket_size=1"});
  Config c = SmallConfig(PipelineKind::k1F1B, 1, 1, 2, 2, sets);
  Config plain = SmallConfig(PipelineKind::k1F1B, 1, 1, 2, 2, base);
  Table t = Plan(c), t0 = Plan(plain);
  REQUIRE(ValidatePlan(t).ok());
  CostModel cost = CostModel::Real(c.cluster.spec);
  auto d = cost.Durations(t), d0 = cost.Durations(t0);
  auto tl = Simulate(t, d), tl0 = Simulate(t0, d0);
  REQUIRE(tl.ok());
  REQUIRE(tl0.ok());
  // The pieces are the whole backward, split by layers; the buckets' payloads add up to
  // the chunk's gradients (fp32).
  const OpId p0 = Find(t, "r0 B c0 m1 p0"), p1 = Find(t, "r0 B c0 m1 p1");
  const OpId rs0 = Find(t, "r0 REDUCE_SCATTER c0 p0 @g0"),
             rs1 = Find(t, "r0 REDUCE_SCATTER c0 p1 @g0");
  CHECK(t.work(p0).flops + t.work(p1).flops ==
        doctest::Approx(t0.work(Find(t0, "r0 B c0 m1")).flops));
  CHECK(t.work(rs0).payload_bytes + t.work(rs1).payload_bytes ==
        doctest::Approx(t0.work(Find(t0, "r0 REDUCE_SCATTER c0 @g0")).payload_bytes));
  // The runtime's order, computed here: bucket k starts when its piece has ended and the
  // collective stream is free; the optimizer waits for both, the all-gather for it.
  const double e0 = tl->end[p0] + d[rs0];
  const double e1 = std::max(tl->end[p1], e0) + d[rs1];
  const OpId opt = Find(t, "r0 OPT_STEP"), ag = Find(t, "r0 ALL_GATHER c0 @g0");
  CHECK(tl->start[rs0] == doctest::Approx(tl->end[p0]));
  CHECK(tl->end[rs1] == doctest::Approx(e1));
  CHECK(tl->Makespan() == doctest::Approx(std::max(e1, tl->end[p1]) + d[opt] + d[ag]));
  // Without overlap the whole reduction follows the whole backward.
  const OpId b = Find(t0, "r0 B c0 m1"), rs = Find(t0, "r0 REDUCE_SCATTER c0 @g0");
  CHECK(tl0->start[rs] == doctest::Approx(tl0->end[b]));
  CHECK(tl->Makespan() < tl0->Makespan());
}

TEST_CASE(
    "training.overlap_param_gather: the all-gathers open the step, each chunk's forward waits") {
  Config c =
      SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4, 2,
                  {"training.overlap_grad_reduce=true", "training.overlap_param_gather=true"});
  Table t = Plan(c);
  REQUIRE(ValidatePlan(t).ok());
  auto tl = Simulate(t, CostModel::Real(c.cluster.spec).Durations(t));
  REQUIRE(tl.ok());
  for (int chunk : {0, 1}) {
    const OpId ag = Find(t, fmt::format("r0 ALL_GATHER c{} @g0", chunk));
    const OpId f = Find(t, fmt::format("r0 F c{} m0", chunk));
    CHECK(ag < f);
    CHECK(tl->start[f] >= tl->end[ag]);
  }
  // It needs the distributed optimizer and the overlapped reduction, as in Megatron.
  auto bad = LoadConfigFromString(
      "cluster: {gpu: H100, nodes: 1}\nmodel: {llm: {layers: 2, hidden: 256, ffn: 1024, heads: "
      "4, vocab: 1000}}\ntraining: {seq_length: 128, microbatches: 1, overlap_param_gather: "
      "true}\n");
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("overlap_grad_reduce") != std::string::npos);
}

TEST_CASE("model.vision.placement: FSDP over the job, or a copy on the ranks that run it") {
  // MultimodalConfig: pp = 4, dp = 2, one GPU per rank (8 GPUs). Encoder parameters P.
  const double P =
      BuildModalityWork(MultimodalConfig("inline"), StepBatch{}, VisionPool{}, false).vision_params;
  REQUIRE(P > 0);
  {  // FSDP: a 1/8 shard per GPU; full gradients reduce-scattered over all 8 ranks; the
     // full bf16 parameters gathered before the rank's first encoder forward.
    Table t = Plan(MultimodalConfig("inline"));
    REQUIRE(ValidatePlan(t).ok());
    for (const RankInfo& r : t.ranks()) CHECK(r.params[1] == doctest::Approx(P / 8));
    const OpId rs = FindOn(t, 0, OpKind::kReduceScatter, Module::kVision),
               ag = FindOn(t, 0, OpKind::kAllGather, Module::kVision);
    CHECK(t.group(t.peer(rs)).size() == 8);
    CHECK(t.work(rs).payload_bytes == doctest::Approx(4 * P));
    CHECK(t.work(ag).payload_bytes == doctest::Approx(2 * P));
    CHECK(ag == t.rank_begin(0));  // opens the step
    auto tl = Simulate(t, CostModel::Real(MultimodalConfig("inline").cluster.spec).Durations(t));
    REQUIRE(tl.ok());
    for (OpId i = t.rank_begin(0); i < t.rank_end(0); ++i)
      if (t.module(i) == Module::kVision && t.kind(i) == OpKind::kF)
        CHECK(tl->start[i] >= tl->end[ag]);
  }
  {  // Replicated under inline: a copy on each first stage (ranks 0 and 4), its gradients
     // reduce-scattered over those two (ZeRO-1, bf16 here), the shards gathered after the
     // optimizer step; the optimizer states of the copy split over the two.
    Config c = MultimodalConfig(
        "inline", {"model.vision.placement=replicated", "training.grad_reduce_dtype=bf16"});
    Table t = Plan(c);
    REQUIRE(ValidatePlan(t).ok());
    for (const RankInfo& r : t.ranks()) {
      CAPTURE(r.pp);
      CHECK(r.params[1] == doctest::Approx(r.pp == 0 ? P : 0));
      if (r.pp == 0) CHECK(r.state_shard[1] == 2);
    }
    const OpId rs = FindOn(t, 0, OpKind::kReduceScatter, Module::kVision);
    CHECK(t.group(t.peer(rs)).size() == 2);
    CHECK(t.work(rs).payload_bytes == doctest::Approx(2 * P));
    CHECK(FindOn(t, 0, OpKind::kAllGather, Module::kVision) > Find(t, "r0 OPT_STEP"));
    auto r = RunSimulation(t, SimOptionsFor(c, false));
    REQUIRE(r.ok());
    const RankMemory& m0 = r->memory[0];
    const double text = t.ranks()[0].params[0];
    CHECK(m0.peak_by_cat[kWeights] == doctest::Approx(2 * (text + P)));
    CHECK(m0.peak_by_cat[kOptimizer] == doctest::Approx(12 * text / 2 + 12 * P / 2));
    // Nested places encoder work on every rank: every rank holds a copy.
    Table n = Plan(MultimodalConfig("nested", {"model.vision.placement=replicated"}));
    for (const RankInfo& ri : n.ranks()) CHECK(ri.params[1] == doctest::Approx(P));
  }
  {  // A replicated generator: on the last stages under inline (tp = 1: a whole copy), on
     // every rank when nested splits it over the replica.
    const std::vector<std::string> gen = {
        "model.generator={layers: 2, hidden: 512, mlp: 2048, heads: 8, placement: replicated}",
        "data.generate={height: 256, width: 256}"};
    const double G =
        BuildModalityWork(MultimodalConfig("inline", gen), StepBatch{}, VisionPool{}, false)
            .generator_params;
    for (std::string policy : {"inline", "nested"}) {
      Table g = Plan(MultimodalConfig(policy, gen));
      REQUIRE(ValidatePlan(g).ok());
      for (const RankInfo& ri : g.ranks())
        CHECK(ri.params[2] == doctest::Approx(policy == "nested" || ri.pp == 3 ? G : 0));
    }
  }
}

TEST_CASE("model.vision.tp: the copy split over tp GPUs, 2 all-reduces per layer each way") {
  // tp = 2 (dp 1): ranks of 2 GPUs. With vision.tp = 2 a replicated copy is P/2 per GPU
  // and each encoder layer adds 2 all-reduces of 2(t-1)/t x (the pair's patches) x d x 2
  // bytes per GPU in the forward (and in the backward).
  const std::vector<std::string> tp2 = {"parallelism.tp=2", "model.vision.placement=replicated"};
  Config one = MultimodalConfig("inline", tp2);
  auto with = tp2;
  with.push_back("model.vision.tp=2");
  Config two = MultimodalConfig("inline", with);
  const ModalityWork w1 = BuildModalityWork(one, StepBatch{}, VisionPool{}, false);
  Table t = Plan(two);
  REQUIRE(ValidatePlan(t).ok());
  CHECK(t.ranks()[0].params[1] == doctest::Approx(w1.vision_params / 2));
  auto batch = MakeStepBatch(one);
  REQUIRE(batch.ok());
  VisionPool pool;
  pool.consumer_only = true;
  const ModalityWork a = BuildModalityWork(one, *batch, pool, false);
  const ModalityWork b = BuildModalityWork(two, *batch, pool, false);
  REQUIRE(a.vision.size() == b.vision.size());
  REQUIRE(!a.vision.empty());
  const VisionConfig& v = one.model.vision;
  for (size_t i = 0; i < a.vision.size(); ++i) {
    const VisionTask &x = a.vision[i], &y = b.vision[i];
    // The task's patches per GPU from its HBM traffic: patches/gpus x layers x (20d + 4 mlp).
    const double per_gpu = x.f.hbm_bytes / (v.layers * (20.0 * v.hidden + 4.0 * v.mlp));
    const double ar = 2 * (2 - 1) / 2.0 * (per_gpu * 2) * v.hidden * 2;
    CHECK(y.f.tp_bytes - x.f.tp_bytes == doctest::Approx(2 * v.layers * ar));
    CHECK(y.f.tp_calls - x.f.tp_calls == 2 * v.layers);
    CHECK(y.b.tp_bytes - x.b.tp_bytes == doctest::Approx(2 * v.layers * ar));
    CHECK(y.f.flops == doctest::Approx(x.f.flops));
  }
  RunResult bad = RunCli(std::string("plan ") + PIPEPLAN_SOURCE_DIR +
                         "/configs/default.yaml --set model.vision.tp=3 -o /dev/null");
  CHECK(bad.exit_code != 0);
  CHECK(bad.out.find("model.vision.tp") != std::string::npos);
}

TEST_CASE("link contention: transfers on one NIC direction share its bandwidth") {
  // Two ranks on two nodes. Rank 0 posts two 1 GB SENDs at once (a batched run), rank 1
  // the two RECVs: each NIC direction carries two transfers for their whole length, so
  // each gets half the bandwidth: alpha + 2 * bytes / bw instead of alpha + bytes / bw.
  const double bytes = 1e9;
  auto make = [&](std::vector<std::vector<std::string>> ops) {
    Table t = TableFromOps(ops, 2, 1, 2);
    TableColumns cols(&t);
    cols.ranks()[1].node = 1;
    for (Work& w : cols.works()) w.payload_bytes = bytes;
    return t;
  };
  auto spec = FindGpu("H100");
  REQUIRE(spec.ok());
  const CostModel cost = CostModel::Real(*spec);
  const double alpha = spec->inter_latency_s, bw = spec->nic_bw * spec->nic_efficiency;
  SimOptions o;
  o.cost = cost;
  o.memory.hbm_bytes = spec->hbm_bytes;
  Table same = make({{"r0 SEND_F c0 m0 ->r1", "r0 SEND_F c0 m1 ->r1"},
                     {"r1 RECV_F c0 m0 <-r0", "r1 RECV_F c0 m1 <-r0"}});
  auto base = cost.Durations(same);
  CHECK(base[0] == doctest::Approx(alpha + bytes / bw));
  auto tl = Simulate(same, base);
  REQUIRE(tl.ok());
  auto contended = ContendedDurations(same, *tl, base, cost);
  REQUIRE(contended.ok());
  const std::vector<double>& d = *contended;
  for (OpId i = 0; i < same.size(); ++i) CHECK(d[i] == doctest::Approx(alpha + 2 * bytes / bw));
  // In place, as RunSimulation's passes run it: the first update stretches the transfers;
  // a second with the same timeline changes nothing (the passes stop there).
  LinkContention links(same, cost);
  std::vector<double> in_place = base;
  // Before the base is kept there is nothing to stretch from: an error, durations untouched.
  auto early = links.Update(*tl, &in_place);
  REQUIRE_FALSE(early.ok());
  CHECK(early.status().code() == ErrorCode::kInternal);
  CHECK(in_place == base);
  CHECK_FALSE(links.KeepBase({base[0]}).ok());  // one duration per op, or an error
  REQUIRE(links.KeepBase(base).ok());
  auto first = links.Update(*tl, &in_place);
  REQUIRE(first.ok());
  CHECK(*first);
  CHECK(in_place == d);
  auto second = links.Update(*tl, &in_place);
  REQUIRE(second.ok());
  CHECK_FALSE(*second);
  CHECK(in_place == d);
  std::vector<double> short_durations(base.begin(), base.end() - 1);
  CHECK_FALSE(links.Update(*tl, &short_durations).ok());
  auto r = RunSimulation(same, o);
  REQUIRE(r.ok());
  CHECK(r->metrics.step_time_s == doctest::Approx(alpha + 2 * bytes / bw));
  // A SEND and a RECV at once use opposite directions of the full-duplex NIC: no sharing.
  Table opposite = make({{"r0 SEND_F c0 m0 ->r1", "r0 RECV_B c0 m0 <-r1"},
                         {"r1 RECV_F c0 m0 <-r0", "r1 SEND_B c0 m0 ->r0"}});
  auto r2 = RunSimulation(opposite, o);
  REQUIRE(r2.ok());
  CHECK(r2->metrics.step_time_s == doctest::Approx(alpha + bytes / bw));
  // Inside one node nothing crosses a NIC.
  Table local = make({{"r0 SEND_F c0 m0 ->r1", "r0 SEND_F c0 m1 ->r1"},
                      {"r1 RECV_F c0 m0 <-r0", "r1 RECV_F c0 m1 <-r0"}});
  TableColumns(&local).ranks()[1].node = 0;
  auto base_local = cost.Durations(local);
  auto tl_local = Simulate(local, base_local);
  REQUIRE(tl_local.ok());
  auto contended_local = ContendedDurations(local, *tl_local, base_local, cost);
  REQUIRE(contended_local.ok());
  CHECK(*contended_local == base_local);
}

TEST_CASE("training.grad_bucket_size: ceil(parameters / bucket) buckets of whole layers") {
  // One stage of 8 layers, dp = 2; buckets of 3,000,000 parameters over the chunk's P:
  // ceil(P / 3e6) = 3 buckets, filled from the last layer: layers [6, 8), [3, 6), [0, 3)
  // (bounds k*L/n from the end), each reducing its layers' share of the fp32 gradients.
  Config c = SmallConfig(PipelineKind::k1F1B, 1, 1, 2, 2,
                         {"model.llm.layers=8", "training.overlap_grad_reduce=true",
                          "training.grad_bucket_size=3000000"});
  const double P = BuildTextWorkload(c).params_per_gpu[0];
  REQUIRE(std::ceil(P / 3e6) == 3);
  Table t = Plan(c);
  REQUIRE(ValidatePlan(t).ok());
  const int range[3][2] = {{6, 8}, {3, 6}, {0, 3}};
  for (int k = 0; k < 3; ++k) {
    CAPTURE(k);
    const Work& piece = FirstWork(t, fmt::format("r0 B c0 m1 p{}", k));
    CHECK(piece.layer_begin == range[k][0]);
    CHECK(piece.layer_end == range[k][1]);
    CHECK(FirstWork(t, fmt::format("r0 REDUCE_SCATTER c0 p{} @g0", k)).payload_bytes ==
          doctest::Approx(4 * P * (range[k][1] - range[k][0]) / 8));
  }
  for (OpId i = 0; i < t.size(); ++i) CHECK(t.str(i) != "r0 B c0 m1 p3");
}
