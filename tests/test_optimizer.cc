// training.optimizer: muon — Newton-Schulz FLOPs, the gather of each matrix for its owner
// (targeted p2p or a naive all-gather), and their place in the plan.
#include <doctest/doctest.h>

#include "core/table_io.h"
#include "executor/check.h"
#include "helpers.h"
#include "planner/plan.h"
#include "planner/validate.h"
#include "planner/workload.h"
#include "simulator/memory.h"
#include "simulator/metrics.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// SmallConfig's model: hidden 256 (4 heads of 64, as many KV heads), gated FFN of 1024, 2
// layers per chunk; 1F1B over 4 stages, 4 micro-batches, dp 2, tp 1.
Config Muon(std::vector<std::string> sets = {}) {
  sets.push_back("training.optimizer=muon");
  return SmallConfig(PipelineKind::k1F1B, 4, 1, 4, 2, sets);
}

std::vector<OpId> Ops(const Table& t, int32_t rank, Module module) {
  return RankOps(t, rank, [&](OpId i) { return t.module(i) == module; });
}

}  // namespace

TEST_CASE("muon: Newton-Schulz FLOPs and parameters of a stage, by hand") {
  const Config c = Muon();
  const MuonCost m = MuonOfStage(c, c.parallel.stages[0]);
  // Per layer, (m, n) with m <= n and 5 steps of 4 m^2 n + 2 m^3: fused QKV 256 x 768,
  // output 256 x 256, FFN up (gate and up fused) 256 x 2048, down 1024 x 256 (m = 256).
  auto ns = [](double lo, double hi) { return 5 * (4 * lo * lo * hi + 2 * lo * lo * lo); };
  const double per_layer = ns(256, 768) + ns(256, 256) + ns(256, 2048) + ns(256, 1024);
  CHECK(m.ns_flops_per_gpu == doctest::Approx(2 * per_layer / 2));  // 2 layers, dp 2 owners
  CHECK(m.params_per_gpu == 2 * (256 * 768 + 256 * 256 + 256 * 2048 + 1024 * 256));
}

TEST_CASE("muon: the owners' gather, targeted or naive, around the optimizer step") {
  const Config p2p = Muon(), naive = Muon({"training.muon_gather=all_gather"});
  const Config adam = SmallConfig(PipelineKind::k1F1B, 4, 1, 4, 2);
  const Table tp = Plan(p2p), tn = Plan(naive), ta = Plan(adam);
  REQUIRE(ValidatePlan(tp).ok());
  REQUIRE(ValidatePlan(tn).ok());
  const double params = MuonOfStage(p2p, p2p.parallel.stages[0]).params_per_gpu;
  // p2p: an all-to-all of the 1/dp share it owns (fp32), Adam's step over the rest (it
  // needs no gather), the chunk's Newton-Schulz step, the updates back.
  const std::vector<OpId> a = Ops(tp, 0, Module::kOptimizer);
  REQUIRE(a.size() == 4);
  CHECK(tp.str(a[0]) == "r0 optimizer.ALL_TO_ALL c0 @g0");
  CHECK(tp.str(a[1]) == "r0 OPT_STEP");
  CHECK(tp.str(a[2]) == "r0 OPT_STEP c0");
  CHECK(tp.str(a[3]) == "r0 optimizer.ALL_TO_ALL c0 p1 @g0");
  CHECK(tp.work(a[0]).payload_bytes == 4 * params / 2);
  auto waits = [](const Table& t, OpId i, OpId d) {
    return std::find(t.deps(i).begin(), t.deps(i).end(), d) != t.deps(i).end();
  };
  CHECK(!waits(tp, a[1], a[0]));
  CHECK(waits(tp, a[2], a[0]));
  CHECK(waits(tp, a[3], a[2]));
  // all_gather: the whole buffer before the step, nothing after.
  const std::vector<OpId> g = Ops(tn, 0, Module::kOptimizer);
  REQUIRE(g.size() == 2);
  CHECK(tn.kind(g[0]) == OpKind::kAllGather);
  CHECK(tn.work(g[0]).payload_bytes == 4 * params);
  // The step: Adam's 34 bytes per parameter become 22 on the Muon ones, plus Newton-Schulz
  // (ZeRO-1 over dp 2: the GPU updates half of its parameters).
  const std::vector<OpId> o = Ops(ta, 0, Module::kOptimizer);
  const Work &rest = tp.work(a[1]), &ns = tp.work(a[2]), &adam_step = ta.work(o.back());
  CHECK(adam_step.hbm_bytes - rest.hbm_bytes - ns.hbm_bytes == doctest::Approx(12 * params / 2));
  CHECK(ns.hbm_bytes == doctest::Approx(22 * params / 2));
  CHECK(rest.flops + ns.flops - adam_step.flops ==
        doctest::Approx(MuonOfStage(p2p, p2p.parallel.stages[0]).ns_flops_per_gpu));
  CHECK(tn.work(g[1]).flops == doctest::Approx(rest.flops + ns.flops));
  // Times (one node, NVLink): 8 us + (n - 1) / n x bytes / (450 GB/s x 0.80); the naive
  // gather moves dp times the bytes of the targeted one, which also sends them back.
  auto r = RunSimulation(tp, SimOptionsFor(p2p));
  auto n = RunSimulation(tn, SimOptionsFor(naive));
  REQUIRE(r.ok());
  REQUIRE(n.ok());
  CHECK(r->durations[a[0]] == doctest::Approx(8e-6 + 0.5 * 4 * params / 2 / (450e9 * 0.8)));
  CHECK(n->durations[g[0]] == doctest::Approx(8e-6 + 0.5 * 4 * params / (450e9 * 0.8)));
  // The tiny model's check still passes (the exchanges carry nothing it compares).
  Timeline tl;
  auto run = RunCpuLocal(tp, RunOptions{}, true, &tl);
  REQUIRE_MESSAGE(run.ok(), run.status().message());
  CHECK(run->passed());
}

TEST_CASE("muon: p2p pipelined per model chunk, the next chunk's gather under this one's step") {
  // Interleaved 1F1B, pp 2, vp 2, dp 2: each rank holds two chunks of two layers each.
  auto interleaved = [](std::vector<std::string> sets) {
    sets.push_back("training.optimizer=muon");
    return SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4, 2, sets);
  };
  const Config pc = interleaved({}), nc = interleaved({"training.muon_gather=all_gather"});
  const Table t = Plan(pc), tn = Plan(nc);
  REQUIRE(ValidatePlan(t).ok());
  REQUIRE(ValidatePlan(tn).ok());
  const std::vector<OpId> a = Ops(t, 0, Module::kOptimizer);
  REQUIRE(a.size() == 7);
  std::vector<std::string> names;
  for (OpId i : a) names.push_back(t.str(i));
  CHECK(names == std::vector<std::string>{"r0 optimizer.ALL_TO_ALL c0 @g0", "r0 OPT_STEP",
                                          "r0 optimizer.ALL_TO_ALL c1 @g0", "r0 OPT_STEP c0",
                                          "r0 optimizer.ALL_TO_ALL c0 p1 @g0", "r0 OPT_STEP c1",
                                          "r0 optimizer.ALL_TO_ALL c1 p1 @g0"});
  // Chunks 0 and 1 of rank 0 are global stages 0 and 2 (two layers each).
  const double p0 = MuonOfStage(pc, pc.parallel.stages[0]).params_per_gpu;
  const double p1 = MuonOfStage(pc, pc.parallel.stages[2]).params_per_gpu;
  CHECK(t.work(a[0]).payload_bytes == 4 * p0 / 2);
  CHECK(t.work(a[2]).payload_bytes == 4 * p1 / 2);
  // ZeRO-1's parameter all-gather of a chunk waits for that chunk's updates back.
  for (OpId i : RankOps(t, 0, [&](OpId i) {
         return t.kind(i) == OpKind::kAllGather && t.module(i) == Module::kText;
       })) {
    CAPTURE(t.str(i));
    const OpId back = t.chunk(i) == 0 ? a[4] : a[6];
    CHECK(std::find(t.deps(i).begin(), t.deps(i).end(), back) != t.deps(i).end());
  }
  auto r = RunSimulation(t, SimOptionsFor(pc));
  auto n = RunSimulation(tn, SimOptionsFor(nc));
  REQUIRE(r.ok());
  REQUIRE(n.ok());
  const Timeline& tl = r->timeline;
  // Chunk 1's matrices arrive while chunk 0's Newton-Schulz runs; chunk 0's updates go back
  // once both its step and chunk 1's gather (the collective stream's order) are done.
  CHECK(tl.start[a[2]] == tl.end[a[0]]);
  CHECK(tl.start[a[2]] < tl.end[a[3]]);
  CHECK(tl.start[a[3]] == std::max(tl.end[a[0]], tl.end[a[1]]));
  CHECK(tl.start[a[4]] == std::max(tl.end[a[2]], tl.end[a[3]]));
  CHECK(tl.start[a[5]] == std::max(tl.end[a[2]], tl.end[a[3]]));
  // Buffers: each owner's matrices of both chunks are held at once (chunk 1 arrives before
  // chunk 0's updates leave), 4 bytes x (p0 + p1) / dp, against the naive gather's whole
  // buffer, 4 x (p0 + p1), on top of the same optimizer states.
  double host = 0;
  const double states =
      StaticMemory(t.ranks()[0], 2, 0, SimOptionsFor(pc).memory, &host)[kOptimizer];
  CHECK(r->memory[0].peak_by_cat[kOptimizer] == doctest::Approx(states + 4 * (p0 + p1) / 2));
  CHECK(n->memory[0].peak_by_cat[kOptimizer] == doctest::Approx(states + 4 * (p0 + p1)));
  // The CPU replay runs the pipelined exchanges in every rank's order.
  Timeline replay;
  auto run = RunCpuLocal(t, RunOptions{}, true, &replay);
  REQUIRE_MESSAGE(run.ok(), run.status().message());
  CHECK(run->passed());
}

TEST_CASE("muon: its keys need training.optimizer: muon") {
  const Config plain = SmallConfig(PipelineKind::k1F1B, 4, 1, 4, 2);
  auto doc = YamlDoc::FromString("cfg.yaml", plain.resolved_yaml.str());
  REQUIRE(doc.ok());
  REQUIRE(doc->ApplySet("training.muon_gather=all_gather").ok());
  auto bad = ParseConfig(std::move(*doc));
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find(
            "'training.muon_gather' applies only with 'training.optimizer: muon'") !=
        std::string::npos);
}

TEST_CASE("muon: its weights keep one fp32 momentum, not Adam's two moments") {
  // Optimizer states per GPU (ZeRO-1 over dp 2): Adam 12 bytes per parameter (fp32 master,
  // two moments); Muon's 2-D weights 8 (master, momentum). Stage 0's Muon weights: the
  // by-hand count of the test above.
  const double muon = 2 * (256 * 768 + 256 * 256 + 256 * 2048 + 1024 * 256);
  auto optimizer = [](const Config& c) {  // the states, before the step's exchanges
    double host = 0;
    return StaticMemory(Plan(c).ranks()[0], 1, 0, SimOptionsFor(c).memory, &host)[kOptimizer];
  };
  const Config adam = SmallConfig(PipelineKind::k1F1B, 4, 1, 4, 2), m = Muon();
  const Table t = Plan(m);
  CHECK(t.ranks()[0].muon_params == muon);
  CHECK(Plan(adam).ranks()[0].muon_params == 0);
  CHECK(optimizer(adam) - optimizer(m) == doctest::Approx(4 * muon / 2));
  // The plan file keeps it.
  auto back = FromJson(ToJson(t));
  REQUIRE(back.ok());
  CHECK(back->ranks()[0].muon_params == muon);
  auto pb = ParsePb(SerializePb(t));
  REQUIRE(pb.ok());
  CHECK(*pb == t);
}

TEST_CASE("muon over TP: each owner also takes the other TP shards of its matrices") {
  // tp 2 (16 GPUs on one node): every matrix of SmallConfig's model is split over the TP
  // group, so an owner's matrices are whole only with its TP peer's halves.
  const std::vector<std::string> tp2{"parallelism.tp=2", "cluster.gpus_per_node=16"};
  std::vector<std::string> naive_sets = tp2;
  naive_sets.push_back("training.muon_gather=all_gather");
  const Config p2p = Muon(tp2), naive = Muon(naive_sets);
  const MuonCost m = MuonOfStage(p2p, p2p.parallel.stages[0]);
  const double whole = 2 * (256 * 768 + 256 * 256 + 256 * 2048 + 1024 * 256);  // 2 layers
  CHECK(m.params_per_gpu == whole / 2);
  CHECK(m.tp_sharded_per_gpu == whole / 2);
  const Table tp = Plan(p2p), tn = Plan(naive);
  REQUIRE(ValidatePlan(tp).ok());
  REQUIRE(ValidatePlan(tn).ok());
  // p2p: the DP leg brings the GPU its half of the matrices its TP group owns (1/dp of its
  // shards, fp32); the TP leg gives each owner the other half of its own: 4 x whole / 2 /
  // dp / tp x (tp - 1) bytes, both ways.
  const std::vector<OpId> a = Ops(tp, 0, Module::kOptimizer);
  REQUIRE(a.size() == 4);
  const double dp_leg = 4 * (whole / 2) / 2, tp_leg = 4 * (whole / 2) / 2 * 0.5;
  for (OpId i : {a[0], a[3]}) {
    CHECK(tp.work(i).payload_bytes == dp_leg);
    CHECK(tp.work(i).tp_bytes == tp_leg);
    CHECK(tp.work(i).tp_calls == 1);
  }
  // Times (one node, NVLink at 450 GB/s x 0.80, 8 us per call): the DP all-to-all's
  // (n - 1) / n of its bytes, then the TP leg's.
  auto r = RunSimulation(tp, SimOptionsFor(p2p));
  REQUIRE(r.ok());
  const double nvl = 450e9 * 0.8;
  CHECK(r->durations[a[0]] == doctest::Approx(8e-6 + 0.5 * dp_leg / nvl + 8e-6 + tp_leg / nvl));
  // all_gather: every matrix whole on every GPU, its own half over DP then the other half
  // from the TP peer: twice the shard's bytes held until the step.
  const std::vector<OpId> g = Ops(tn, 0, Module::kOptimizer);
  REQUIRE(g.size() == 2);
  CHECK(tn.work(g[0]).payload_bytes == 4 * whole / 2);
  CHECK(tn.work(g[0]).tp_bytes == 4 * whole / 2);
  auto n = RunSimulation(tn, SimOptionsFor(naive));
  REQUIRE(n.ok());
  double host = 0;
  const double states =
      StaticMemory(tn.ranks()[0], 1, 0, SimOptionsFor(naive).memory, &host)[kOptimizer];
  CHECK(n->memory[0].peak_by_cat[kOptimizer] == doctest::Approx(states + 4 * whole));
  // Routed experts are held whole by their EP rank: no TP leg for them.
  const Config moe = Muon({"parallelism.tp=2", "cluster.gpus_per_node=16",
                           "model.llm.moe={experts: 4, top_k: 2, expert_ffn: 512}"});
  const MuonCost e = MuonOfStage(moe, moe.parallel.stages[0]);
  const double experts = 2 * 4 * (256 * 1024 + 512 * 256);  // 2 layers, gated up + down
  CHECK(e.params_per_gpu - e.tp_sharded_per_gpu == experts);
}
