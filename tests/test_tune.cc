#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/files.h"
#include "helpers.h"
#include "planner/data.h"
#include "planner/plan.h"
#include "planner/tune.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// 8 GPUs, 8 layers: small enough to simulate every point of a restricted space.
constexpr const char* kSmall = R"(cluster: {gpu: H100, nodes: 1, gpus_per_node: 8}
model:
  llm: {layers: 8, hidden: 1024, ffn: 4096, heads: 8, vocab: 32000}
parallelism: {tp: 2, pp: 2}
training: {seq_length: 2048, micro_batch_size: 1, microbatches: 8, recompute: full}
)";

std::string SmallConfig(const std::string& extra = "") {
  const std::string path = TempDir() + "/tune.yaml";
  REQUIRE(WriteFileAtomic(path, std::string(kSmall) + extra).ok());
  return path;
}

TuneOptions Restricted(bool prune, int top) {
  TuneOptions o;
  o.prune = prune;
  o.top_k = top;
  o.jobs = 2;
  o.only = {*ParseVary("parallelism.cp=1,2"), *ParseVary("training.micro_batch_size=1,2")};
  return o;
}

std::string Key(const TunePoint& p) {
  std::string k;
  for (const std::string& v : p.values) k += v + " ";
  return k;
}

// A point's config, parsed from the YAML `tune -o` would write for it.
StatusOr<Config> PointConfig(const std::string& cfg, const TuneResult& r, const TunePoint& p) {
  auto yaml = TunedConfigYaml(cfg, {}, r, p);
  REQUIRE(yaml.ok());
  auto doc = YamlDoc::FromString("point", *yaml);
  REQUIRE(doc.ok());
  return ParseConfig(std::move(*doc));
}

}  // namespace

TEST_CASE("tune: pruning keeps the exhaustive search's top K, and every bound holds") {
  const std::string cfg = SmallConfig();
  // HBM small enough that the memory bound prunes some points (tp 1 x pp 1 holds all).
  const std::vector<std::string> sets = {"cluster.hardware.hbm_bytes=3e9"};
  auto full = RunTune(cfg, sets, Restricted(false, 3));
  REQUIRE(full.ok());
  auto pruned = RunTune(cfg, sets, Restricted(true, 3));
  REQUIRE(pruned.ok());
  REQUIRE(full->points.size() == pruned->points.size());
  REQUIRE(full->top.size() == 3);
  // The same best points, in the same order.
  REQUIRE(pruned->top.size() == full->top.size());
  for (size_t n = 0; n < full->top.size(); ++n)
    CHECK(Key(full->points[full->top[n]]) == Key(pruned->points[pruned->top[n]]));
  CHECK(pruned->count(TuneState::kSimulated) < full->count(TuneState::kSimulated));
  CHECK(pruned->count(TuneState::kPrunedMemory) > 0);
  CHECK(pruned->count(TuneState::kPrunedTime) > 0);
  // Every point pruned would not have entered the top K: the exhaustive run simulated it.
  const double kth = full->points[full->top.back()].metrics.step_time_s;
  size_t checked = 0;
  for (size_t i = 0; i < full->points.size(); ++i) {
    const TunePoint& p = pruned->points[i];
    const TunePoint& q = full->points[i];
    if (p.state != TuneState::kPrunedMemory && p.state != TuneState::kPrunedTime) continue;
    if (q.state != TuneState::kSimulated) continue;  // the config rules refuse it anyway
    ++checked;
    CHECK((!q.fits || q.metrics.step_time_s >= kth));
    if (p.state == TuneState::kPrunedMemory) CHECK(!q.fits);
  }
  CHECK(checked > 0);
  // The bounds against every simulation of the exhaustive run, checked here rather than
  // through the run's own counters.
  size_t simulated = 0;
  for (const TunePoint& q : full->points) {
    if (q.state != TuneState::kSimulated) continue;
    ++simulated;
    CHECK(q.time_bound_s <= q.metrics.step_time_s * (1 + 1e-9));
    CHECK(q.memory_bound_bytes <= q.metrics.peak_memory_bytes * (1 + 1e-9));
    CHECK(q.time_bound_s > 0);
  }
  CHECK(simulated > 50);
  // Uneven stages are in the space and planned as such. By hand, 8 layers with the first
  // and/or last pipeline rank k = 1 or 2 layers per chunk lighter than each other rank:
  // - vp 1: pp 2 as 3 + 5 or 5 + 3; pp 4 as 1 + 3 + 3 + 1 (first and last both 2 lighter);
  //   pp 8 cannot (8 + 1 or 2 or 3 or 4 is not a multiple of 8);
  // - vp 2 (ranks 2k lighter, every rank's count even): pp 2 as 2 + 6 or 6 + 2, 1 + 3
  //   layers per chunk; pp 4 cannot (8 + 2 or 4 layers over 4 ranks is odd per rank, and 8 + 8
  //   leaves the lighter ranks none);
  // - vp 4 and 8: a lighter rank would hold 4k fewer of at most 8: none left.
  // A loop placement runs virtual stage g on rank g % pp; a V placement also runs stage
  // 2pp - 1 - g on rank g.
  auto axis = [&](const char* key) {
    const size_t a = std::find(full->keys.begin(), full->keys.end(), key) - full->keys.begin();
    REQUIRE(a < full->keys.size());
    return a;
  };
  const size_t first_axis = axis("parallelism.num_layers_in_first_pipeline_stage");
  const size_t last_axis = axis("parallelism.num_layers_in_last_pipeline_stage");
  const size_t pp_axis = axis("parallelism.pp"), vp_axis = axis("parallelism.vp");
  using Layers = std::vector<int>;
  const std::map<std::string, std::pair<Layers, Layers>> expected = {
      // {loop, V}
      {"2 1 3 0", {{3, 5}, {}}},
      {"2 1 0 3", {{5, 3}, {}}},
      {"4 1 1 1", {{1, 3, 3, 1}, {}}},
      {"2 2 2 0", {{1, 3, 1, 3}, {1, 3, 3, 1}}},
      {"2 2 0 2", {{3, 1, 3, 1}, {3, 1, 1, 3}}}};
  std::set<std::string> uneven;
  bool v_placed = false;
  for (const TunePoint& q : full->points) {
    if (q.state != TuneState::kSimulated) continue;
    if (q.values[first_axis] == "0" && q.values[last_axis] == "0") continue;
    const std::string shape = q.values[pp_axis] + " " + q.values[vp_axis] + " " +
                              q.values[first_axis] + " " + q.values[last_axis];
    uneven.insert(shape);
    REQUIRE(expected.count(shape) == 1);
    auto k = PointConfig(cfg, *full, q);
    REQUIRE(k.ok());
    std::vector<int> layers;
    for (const StageSpan& st : k->parallel.stages) layers.push_back(st.layer_end - st.layer_begin);
    const bool v = PlacementOf(k->schedule.pipeline) == StagePlacement::kV;
    v_placed = v_placed || v;
    CHECK(layers == (v ? expected.at(shape).second : expected.at(shape).first));
  }
  CHECK(v_placed);
  CHECK(uneven.size() == expected.size());
  // With virtual stages the embedding and the loss may each count as a layer of the split
  // (Megatron's account_for_embedding_in_pipeline_split and ..._loss_...): 8 + 2 = 10 layers
  // over pp 2 x vp 5, the first and the last virtual stage with the embedding or the loss
  // alone; 8 + 1 = 9 splits over no pp x vp of the space (pp 1, 2, 4, 8; vp >= 2; pp 1 runs
  // no virtual stages).
  const size_t embedding_axis = axis("parallelism.account_for_embedding_in_pipeline_split");
  const size_t loss_axis = axis("parallelism.account_for_loss_in_pipeline_split");
  size_t accounted = 0;
  for (const TunePoint& q : full->points) {
    if (q.state != TuneState::kSimulated) continue;
    if (q.values[embedding_axis] == "false" && q.values[loss_axis] == "false") continue;
    ++accounted;
    CHECK(q.values[embedding_axis] == "true");
    CHECK(q.values[loss_axis] == "true");
    CHECK(q.values[pp_axis] == "2");
    CHECK(q.values[vp_axis] == "5");
    auto k = PointConfig(cfg, *full, q);
    REQUIRE(k.ok());
    std::vector<int> layers;
    for (const StageSpan& st : k->parallel.stages) layers.push_back(st.layer_end - st.layer_begin);
    CHECK(layers == std::vector<int>{0, 1, 1, 1, 1, 1, 1, 1, 1, 0});
  }
  CHECK(accounted > 0);
  CHECK(full->time_bound_misses == 0);
  CHECK(full->memory_bound_misses == 0);
}

TEST_CASE("tune: the best point is the fastest of a sweep of the same space, its YAML replans") {
  const std::string cfg = SmallConfig();
  TuneOptions o = Restricted(true, 1);
  o.only.push_back(*ParseVary("training.recompute=none,full"));
  o.only.push_back(*ParseVary("parallelism.tp=1,2,4"));
  auto r = RunTune(cfg, {}, o);
  REQUIRE(r.ok());
  REQUIRE(r->top.size() == 1);
  const TunePoint& best = r->points[r->top[0]];
  // Independently: every point of the space planned and simulated from its own YAML.
  double fastest = 1e300;
  for (const TunePoint& p : r->points) {
    auto k = PointConfig(cfg, *r, p);
    if (!k.ok()) continue;
    auto t = BuildPlan(*k);
    if (!t.ok()) continue;
    auto sim = RunSimulation(*t, SimOptionsFor(*k));
    REQUIRE(sim.ok());
    if (!sim->metrics.oom) fastest = std::min(fastest, sim->metrics.step_time_s);
    if (&p == &best) CHECK(sim->metrics.step_time_s == doctest::Approx(best.metrics.step_time_s));
  }
  CHECK(best.metrics.step_time_s == doctest::Approx(fastest));
  // The configured point (tp 2, pp 2, 1F1B, full recompute) is in the space: the best is
  // at least as fast.
  REQUIRE(r->configured.state == TuneState::kSimulated);
  CHECK(best.metrics.step_time_s <= r->configured.metrics.step_time_s);
  // The global batch stays 8 x 1 x dp 2 = 16 samples at every point.
  CHECK(r->global_batch == 16);
}

TEST_CASE("tune: 1F1B's time bound is the text step with the textbook bubble") {
  // No communication to speak of (one GPU per stage, one replica): the bound of pp 4 x
  // 1F1B over even stages is (m + pp - 1) x (F + B) of a stage, F and B read from the plan's
  // durations.
  const std::string cfg = SmallConfig();
  TuneOptions o;
  o.only = {*ParseVary("parallelism.tp=2"),
            *ParseVary("parallelism.cp=1"),
            *ParseVary("parallelism.pp=4"),
            *ParseVary("parallelism.vp=1"),
            *ParseVary("training.micro_batch_size=1"),
            *ParseVary("training.recompute=full"),
            *ParseVary("parallelism.num_layers_in_first_pipeline_stage=0"),
            *ParseVary("parallelism.num_layers_in_last_pipeline_stage=0"),
            *ParseVary("schedule.pipeline=1f1b")};
  o.gpus = 8;
  auto r = RunTune(cfg, {}, o);
  REQUIRE(r.ok());
  REQUIRE(r->points.size() == 1);
  const TunePoint& p = r->points[0];
  REQUIRE(p.state == TuneState::kSimulated);
  auto k = PointConfig(cfg, *r, p);
  REQUIRE(k.ok());
  auto t = BuildPlan(*k);
  REQUIRE(t.ok());
  const std::vector<double> d = SimOptionsFor(*k).cost.Durations(*t);
  double f = 0, b = 0;  // stage 1 (no embedding or loss): every stage is at least this long
  for (OpId i = 0; i < t->size(); ++i)
    if (t->rank(i) == 1 && t->kind(i) == OpKind::kF)
      f = d[i];
    else if (t->rank(i) == 1 && t->kind(i) == OpKind::kB)
      b = d[i];
  REQUIRE(f > 0);
  REQUIRE(b > 0);
  const int m = k->training.microbatches, pp = 4;
  CHECK(p.time_bound_s >= (m + pp - 1) * (f + b) * (1 - 1e-9));
  CHECK(p.time_bound_s <= p.metrics.step_time_s);
}

TEST_CASE("tune: bad options name what is wrong") {
  const std::string cfg = SmallConfig();
  TuneOptions o;
  o.only = {*ParseVary("parallelism.dp=1,2")};
  auto r = RunTune(cfg, {}, o);
  REQUIRE(!r.ok());
  CHECK(r.status().message().find("--only parallelism.dp: not an axis") != std::string::npos);
  o.only = {*ParseVary("parallelism.tp=two")};
  r = RunTune(cfg, {}, o);
  REQUIRE(!r.ok());
  CHECK(r.status().message() == "parallelism.tp=two: expected a positive integer");
  o.only = {*ParseVary("training.recompute=some")};
  r = RunTune(cfg, {}, o);
  REQUIRE(!r.ok());
  CHECK(r.status().message() == "training.recompute=some: expected one of none, selective, full");
  // A --set of an axis (here by its Megatron name) fixes that axis instead of being
  // overridden by every point.
  o.only = {*ParseVary("parallelism.cp=1"), *ParseVary("training.micro_batch_size=1")};
  r = RunTune(cfg, {"parallelism.tensor_model_parallel_size=4"}, o);
  REQUIRE(r.ok());
  for (const TunePoint& p : r->points) CHECK(p.values[0] == "4");
  CHECK(!ParseTuneObjective("speed").ok());
  CHECK(*ParseTuneObjective("mfu") == TuneObjective::kMfu);
  o.only.clear();
  o.gpus = 12;
  r = RunTune(cfg, {}, o);
  REQUIRE(!r.ok());
  CHECK(r.status().message().find("--gpus 12") != std::string::npos);
}

TEST_CASE("tune: shards merged give the single run's top K, results files resume a run") {
  const std::string cfg = SmallConfig();
  const std::string dir = TempDir();
  auto single = RunTune(cfg, {}, Restricted(true, 4));
  REQUIRE(single.ok());
  REQUIRE(single->top.size() == 4);
  // Three shards, each with its own results file, then a run that reads them all.
  std::vector<std::string> parts;
  size_t shard_points = 0;
  for (int i = 0; i < 3; ++i) {
    TuneOptions o = Restricted(true, 4);
    o.shard = i, o.shards = 3;
    o.results_path = fmt::format("{}/part{}.jsonl", dir, i);
    auto part = RunTune(cfg, {}, o);
    REQUIRE(part.ok());
    shard_points += part->points.size() - part->count(TuneState::kOtherShard);
    parts.push_back(o.results_path);
  }
  CHECK(shard_points == single->points.size());  // every point in exactly one shard
  TuneOptions merge = Restricted(true, 4);
  merge.resume_from = parts;
  merge.results_path = dir + "/merged.jsonl";
  auto merged = RunTune(cfg, {}, merge);
  REQUIRE(merged.ok());
  REQUIRE(merged->top.size() == single->top.size());
  for (size_t n = 0; n < single->top.size(); ++n) {
    CHECK(Key(merged->points[merged->top[n]]) == Key(single->points[single->top[n]]));
    CHECK(merged->points[merged->top[n]].metrics.step_time_s ==
          single->points[single->top[n]].metrics.step_time_s);
  }
  CHECK(merged->resumed == merged->count(TuneState::kSimulated));  // nothing simulated again
  // The merged file holds them all now: reading it alone simulates nothing either, even
  // with its last line cut short (a run killed while writing).
  std::string text = *ReadFile(dir + "/merged.jsonl");
  REQUIRE(WriteFileAtomic(dir + "/cut.jsonl", text.substr(0, text.size() - 20)).ok());
  TuneOptions again = Restricted(true, 4);
  again.results_path = dir + "/cut.jsonl";
  auto resumed = RunTune(cfg, {}, again);
  REQUIRE(resumed.ok());
  CHECK(resumed->resumed + 1 >= merged->resumed);  // at most the cut point is simulated again
  CHECK(Key(resumed->points[resumed->top[0]]) == Key(single->points[single->top[0]]));
  // The cut line was dropped before appending: the file reads whole again.
  auto third = RunTune(cfg, {}, again);
  REQUIRE(third.ok());
  CHECK(third->resumed == third->count(TuneState::kSimulated));
  // A finished line whose newline was not written yet counts as cut (it is dropped before
  // appending; its point is simulated again if the search still needs it).
  REQUIRE(WriteFileAtomic(dir + "/nonl.jsonl", text.substr(0, text.size() - 1)).ok());
  again.results_path = dir + "/nonl.jsonl";
  auto nonl = RunTune(cfg, {}, again);
  REQUIRE(nonl.ok());
  CHECK(nonl->resumed + 1 == merged->resumed);
  CHECK(Key(nonl->points[nonl->top[0]]) == Key(single->points[single->top[0]]));
  const std::string rewritten = *ReadFile(dir + "/nonl.jsonl");
  CHECK(rewritten.back() == '\n');
  auto reread = RunTune(cfg, {}, again);
  REQUIRE(reread.ok());
  CHECK(reread->resumed == reread->count(TuneState::kSimulated));
  again.results_path = dir + "/cut.jsonl";
  // A file that is not ours is an error and stays as it was; so is a missing --resume file.
  REQUIRE(WriteFileAtomic(dir + "/notes.txt", "hello").ok());
  TuneOptions foreign = Restricted(true, 4);
  foreign.results_path = dir + "/notes.txt";
  auto refused = RunTune(cfg, {}, foreign);
  REQUIRE(!refused.ok());
  CHECK(refused.status().message().find("notes.txt: not a tune results file") != std::string::npos);
  CHECK(*ReadFile(dir + "/notes.txt") == "hello");
  foreign.results_path.clear();
  foreign.resume_from = {dir + "/nowhere.jsonl"};
  refused = RunTune(cfg, {}, foreign);
  REQUIRE(!refused.ok());
  CHECK(refused.status().message().find("nowhere.jsonl: no such results file") !=
        std::string::npos);
  // Results of another search are refused, naming the file.
  auto other = RunTune(cfg, {"training.seq_length=1024"}, again);
  REQUIRE(!other.ok());
  CHECK(other.status().message().find("cut.jsonl:1: these results are of another search") !=
        std::string::npos);
  // A run out of budget, resumed without one, ends where the single run does.
  TuneOptions first = Restricted(true, 4);
  first.budget_s = 1e-9;
  first.results_path = dir + "/budget.jsonl";
  auto stopped = RunTune(cfg, {}, first);
  REQUIRE(stopped.ok());
  CHECK(stopped->count(TuneState::kOverBudget) > 0);
  first.budget_s = 0;
  auto finished = RunTune(cfg, {}, first);
  REQUIRE(finished.ok());
  for (size_t n = 0; n < single->top.size(); ++n)
    CHECK(Key(finished->points[finished->top[n]]) == Key(single->points[single->top[n]]));
}

TEST_CASE("tune: the configured point is simulated first, whatever its bound") {
  // The small config (tp 2, pp 2, micro-batch 1, full recompute, 1F1B) is one of the
  // restricted space's points, not the one with the lowest time bound: the results file,
  // written in simulation order, starts with it, so that a search its budget cuts short
  // still has the configured point's answer.
  const std::string cfg = SmallConfig();
  TuneOptions o = Restricted(false, 1);
  o.jobs = 1;
  o.results_path = TempDir() + "/order.jsonl";
  auto r = RunTune(cfg, {}, o);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  auto text = ReadFile(o.results_path);
  REQUIRE(text.ok());
  const std::string first_point = text->substr(text->find('\n') + 1);  // after the header
  const auto j = nlohmann::json::parse(first_point.substr(0, first_point.find('\n')));
  const auto& v = j.at("values");
  CHECK(v.at("parallelism.tp") == "2");
  CHECK(v.at("parallelism.pp") == "2");
  CHECK(v.at("parallelism.cp") == "1");
  CHECK(v.at("training.micro_batch_size") == "1");
  CHECK(v.at("training.recompute") == "full");
  CHECK(v.at("schedule.pipeline") == "1f1b");
  double lowest = j.at("time_bound_s").get<double>();
  for (const TunePoint& p : r->points)
    if (p.state == TuneState::kSimulated) lowest = std::min(lowest, p.time_bound_s);
  CHECK(lowest < j.at("time_bound_s").get<double>());
}

TEST_CASE("tune: the memory bound holds the forwards a schedule keeps in flight") {
  // Nothing recomputed, one replica of four stages (the global batch of 16 samples in 16
  // micro-batches): 1F1B's stage s holds pp - s forwards' activations at its peak, GPipe's
  // all 16. The bound is the busiest
  // stage's static bytes plus those activations, each read from the point's own plan and
  // simulation (static bytes: weights, gradients, optimizer states, reserve).
  const std::string cfg = SmallConfig();
  TuneOptions o;
  o.only = {*ParseVary("parallelism.tp=2"),
            *ParseVary("parallelism.cp=1"),
            *ParseVary("parallelism.pp=4"),
            *ParseVary("parallelism.vp=1"),
            *ParseVary("training.micro_batch_size=1"),
            *ParseVary("training.recompute=none"),
            *ParseVary("parallelism.num_layers_in_first_pipeline_stage=0"),
            *ParseVary("parallelism.num_layers_in_last_pipeline_stage=0"),
            *ParseVary("schedule.pipeline=1f1b,gpipe")};
  o.gpus = 8;
  o.prune = false;
  auto r = RunTune(cfg, {}, o);
  REQUIRE(r.ok());
  REQUIRE(r->points.size() == 2);
  for (const TunePoint& p : r->points) {
    REQUIRE(p.state == TuneState::kSimulated);
    auto k = PointConfig(cfg, *r, p);
    REQUIRE(k.ok());
    REQUIRE(k->parallel.dp == 1);
    const int m = k->training.microbatches, pp = 4;
    REQUIRE(m == 16);
    auto t = BuildPlan(*k);
    REQUIRE(t.ok());
    auto sim = RunSimulation(*t, SimOptionsFor(*k));
    REQUIRE(sim.ok());
    const bool gpipe = k->schedule.pipeline == PipelineKind::kGpipe;
    double expected = 0;
    for (int s = 0; s < pp; ++s) {
      double act = 0;  // a forward's saved activations on stage s (rank s: dp 1, tp 2)
      for (OpId i = 0; i < t->size(); ++i)
        if (t->rank(i) == s && t->kind(i) == OpKind::kF && t->module(i) == Module::kText)
          act = t->work(i).mem_delta_bytes;
      REQUIRE(act > 0);
      const auto& cat = sim->memory[s].peak_by_cat;
      const double fixed = cat[kWeights] + cat[kGrads] + cat[kOptimizer] + cat[kReserve];
      expected = std::max(expected, fixed + (gpipe ? m : pp - s) * act);
    }
    CHECK(p.memory_bound_bytes == doctest::Approx(expected).epsilon(1e-9));
    CHECK(p.memory_bound_bytes <= p.metrics.peak_memory_bytes * (1 + 1e-9));
  }
}

TEST_CASE("tune: an encoder's GPU-seconds at the cost model's rates bound a multimodal step") {
  // A small LLM and an encoder whose images (896 x 896 pixels, 14-pixel patches: 64 x 64 =
  // 4,096 patches) dominate the step. The bound's encoder term, by hand from the cost
  // model's rates (simulator/cost_model.cc: GEMMs at bf16 x compute_efficiency, attention
  // at bf16 x attention_efficiency, HBM bytes at hbm_bw x hbm_efficiency, added) and the
  // encoder's work per image (planner/data.cc, VisionImageFlops; planner/modality.cc,
  // TaskFromLoad): per layer 2 P (4 d^2 + 2 d mlp) GEMM FLOPs and 4 P^2 d attention FLOPs,
  // the merger 2 (P/4)(4 d h + h^2) GEMM FLOPs, P (20 d + 4 mlp) HBM bytes per layer; the
  // backward twice each (no recompute). Every point's bound is at least the images'
  // seconds over the 8 GPUs (inline: a replica's images on its first stage) and at most its
  // simulated step, and pruning keeps the exhaustive search's top 3.
  const std::string path = TempDir() + "/tune_vision.yaml";
  REQUIRE(WriteFileAtomic(path, R"(cluster: {gpu: H100, nodes: 1, gpus_per_node: 8}
model:
  llm: {layers: 4, hidden: 256, ffn: 1024, heads: 4, vocab: 1024}
  vision: {layers: 4, hidden: 1024, mlp: 4096, heads: 16, recompute: none}
parallelism: {tp: 1, pp: 2}
training: {seq_length: 2048, micro_batch_size: 1, microbatches: 4}
data:
  seed: 3
  text_tokens: 256
  images_per_sample: 1
  images:
    - {height: 896, width: 896, weight: 1}
schedule: {pipeline: 1f1b, modality: nested}
)")
              .ok());
  TuneOptions o;
  o.top_k = 3;
  o.jobs = 2;
  o.only = {*ParseVary("parallelism.tp=1"), *ParseVary("parallelism.cp=1"),
            *ParseVary("parallelism.vp=1"), *ParseVary("training.recompute=none"),
            *ParseVary("schedule.pipeline=1f1b,gpipe")};
  o.prune = false;
  auto full = RunTune(path, {}, o);
  REQUIRE_MESSAGE(full.ok(), full.status().message());
  o.prune = true;
  auto pruned = RunTune(path, {}, o);
  REQUIRE(pruned.ok());
  const double P = 4096, L = 4, d = 1024, mlp = 4096, h = 256;
  const double gemm = L * 2 * P * (4 * d * d + 2 * d * mlp) + 2 * (P / 4) * (4 * d * h + h * h);
  const double attn = L * 4 * P * P * d, hbm = L * P * (20 * d + 4 * mlp);
  const double per_image = 3 * gemm / (989e12 * 0.75) + 3 * attn / (989e12 * 0.50) +
                           3 * hbm / (3.35e12 * 0.80);  // H100: catalog rates
  size_t simulated = 0, inline_points = 0;
  for (const TunePoint& p : full->points) {
    if (p.state != TuneState::kSimulated) continue;
    ++simulated;
    auto k = PointConfig(path, *full, p);
    REQUIRE(k.ok());
    auto batch = MakeStepBatch(*k);
    REQUIRE(batch.ok());
    double images = 0, replica_images = 0;  // all, and the most of one replica
    for (const auto& replica : batch->replicas) {
      double mine = 0;
      for (const MicroBatch& mb : replica)
        for (const Sample& s : mb.samples) mine += s.images.size();
      images += mine, replica_images = std::max(replica_images, mine);
    }
    REQUIRE(images > 0);
    CHECK(p.time_bound_s >= images * per_image / 8 * (1 - 1e-9));
    // Inline: a replica's first stage (tp x cp = 1 GPU) runs all of its images.
    if (k->schedule.modality == ModalityPolicy::kInline) {
      ++inline_points;
      CHECK(p.time_bound_s >= replica_images * per_image * (1 - 1e-9));
    }
    CHECK(p.time_bound_s <= p.metrics.step_time_s * (1 + 1e-9));
  }
  CHECK(simulated > 10);
  CHECK(inline_points > 0);
  CHECK(full->time_bound_misses == 0);
  REQUIRE(full->top.size() == 3);
  REQUIRE(pruned->top.size() == 3);
  for (size_t n = 0; n < 3; ++n)
    CHECK(Key(full->points[full->top[n]]) == Key(pruned->points[pruned->top[n]]));
  CHECK(pruned->count(TuneState::kSimulated) < full->count(TuneState::kSimulated));
}
