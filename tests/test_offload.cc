// Host offload of saved activations (training.offload, model.<module>.offload): the
// OFFLOAD / RELOAD ops, their cost, what they save, their validation and their replay.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "core/files.h"
#include "core/table_io.h"
#include "executor/check.h"
#include "helpers.h"
#include "planner/plan.h"
#include "planner/validate.h"
#include "simulator/memory.h"
#include "simulator/metrics.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// 1F1B over 4 stages, 8 micro-batches: stage 0 runs F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4
// B5 B6 B7, so each forward's backward comes 4 to 7 compute ops later (offloaded where the
// copies fit); the last stage runs F_k B_k (its activations stay).
Config OneF1B(std::vector<std::string> sets) {
  return SmallConfig(PipelineKind::k1F1B, 4, 1, 8, 1, std::move(sets));
}

SimResult Simulated(const Config& c, const Table& t) {
  auto r = RunSimulation(t, SimOptionsFor(c));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  return std::move(*r);
}

std::vector<OpId> OfKind(const Table& t, int32_t rank, OpKind kind) {
  return RankOps(t, rank, [&](OpId i) { return t.kind(i) == kind; });
}

}  // namespace

TEST_CASE(
    "host offload: each forward's activations leave the device and return before their "
    "backward") {
  // A host link fast enough that every copy fits in the op it overlaps.
  const std::vector<std::string> fast = {"cluster.hardware.host_link_bw=1e15"};
  std::vector<std::string> on = fast;
  on.push_back("training.offload=host");
  const Config c = OneF1B(on), base = OneF1B(fast);
  const Table t = Plan(c), plain = Plan(base);
  REQUIRE(ValidatePlan(t).ok());
  const std::vector<OpId> out = OfKind(t, 0, OpKind::kOffload), in = OfKind(t, 0, OpKind::kReload);
  CHECK(out.size() == 8);
  CHECK(in.size() == 8);
  CHECK(OfKind(t, 3, OpKind::kOffload).empty());  // the last stage's backward follows at once
  const double act = t.work(OfKind(t, 0, OpKind::kF)[0]).mem_delta_bytes;
  for (OpId o : out) {
    CAPTURE(t.str(o));
    CHECK(t.work(o).payload_bytes == act);  // everything the forward saved
    CHECK(t.work(o).mem_delta_bytes == -act);
  }
  // A copy takes launch + bytes / (host link x efficiency): H100, 3 us + act / (1e15 x 0.8).
  const SimResult r = Simulated(c, t), p = Simulated(base, plain);
  CHECK(r.durations[out[0]] == doctest::Approx(3e-6 + act / (1e15 * 0.80)).epsilon(1e-12));
  // 1F1B keeps pp = 4 micro-batches' activations on stage 0. With offload, each backward
  // waits for its gradient longer than a copy takes, so each RELOAD is posted after the
  // compute op just before its backward: stage 0 holds at most the forward that just ended
  // (until its OFFLOAD ends) and what a RELOAD brings back for the next backward. As F3
  // ends, F0-F3's activations are all on the host (F3's OFFLOAD starts with B0's RELOAD).
  CHECK(p.memory[0].peak_by_cat[kActText] == doctest::Approx(4 * act));
  CHECK(r.memory[0].peak_by_cat[kActText] == doctest::Approx(2 * act));
  CHECK(r.memory[0].host_peak_bytes == doctest::Approx(4 * act));
  // The copies hide behind compute: the step is the same, and none of it waits for them.
  CHECK(r.metrics.step_time_s == doctest::Approx(p.metrics.step_time_s).epsilon(1e-12));
  CHECK(r.metrics.copy_exposed_s == doctest::Approx(0).epsilon(1e-12));
  CHECK(r.metrics.copy_seconds == doctest::Approx(16 * r.durations[out[0]]));
}

TEST_CASE("host offload of named tensor classes: only their bytes travel, the rest stays") {
  // SmallConfig: hidden 256, 128 tokens, 2 layers per stage. core_attn and attn_proj are
  // Q, K, V and the projection's input: 8*h bf16 bytes per token and layer.
  const std::vector<std::string> sets = {"cluster.hardware.host_link_bw=1e15",
                                         "training.recompute=none", "training.offload=host",
                                         "training.offload_modules=[core_attn, attn_proj]"};
  const Config c = OneF1B(sets), whole = OneF1B({sets[0], sets[1], sets[2]});
  const Table t = Plan(c), w = Plan(whole);
  REQUIRE(ValidatePlan(t).ok());
  const double off = 2 * 128 * 8 * 256.0;
  const double act = t.work(OfKind(t, 0, OpKind::kF)[0]).mem_delta_bytes;
  REQUIRE(act > off);
  const std::vector<OpId> out = OfKind(t, 0, OpKind::kOffload);
  CHECK(out.size() == 8);
  for (OpId o : out) CHECK(t.work(o).payload_bytes == doctest::Approx(off));
  for (OpId o : OfKind(t, 0, OpKind::kReload))
    CHECK(t.work(o).payload_bytes == doctest::Approx(off));
  // As in the whole-forward case above, the copies are placed the same way: as F3 ends,
  // stage 0 holds what stays of F0-F3 and the offloaded part of two forwards (F3's, on
  // its way out, and F0's, back for B0).
  const SimResult r = Simulated(c, t), all = Simulated(whole, w);
  CHECK(all.memory[0].peak_by_cat[kActText] == doctest::Approx(2 * act));
  CHECK(r.memory[0].peak_by_cat[kActText] == doctest::Approx(4 * (act - off) + 2 * off));
  CHECK(r.memory[0].host_peak_bytes == doctest::Approx(4 * off));
  CHECK(r.metrics.copy_exposed_s == doctest::Approx(0).epsilon(1e-12));
}

TEST_CASE("host offload: a link too slow to hide the copies keeps the activations on the device") {
  // 1 MB/s: no copy fits between a forward and its backward.
  const Config c = OneF1B({"training.offload=host", "cluster.hardware.host_link_bw=1e6"});
  const Table t = Plan(c);
  for (int32_t r = 0; r < t.num_ranks(); ++r) CHECK(OfKind(t, r, OpKind::kOffload).empty());
  const SimResult s = Simulated(c, t);
  CHECK(s.metrics.copy_seconds == 0);
  CHECK(s.memory[0].host_peak_bytes == 0);
}

TEST_CASE("host offload per pipeline rank, errors name the key") {
  const Config c =
      OneF1B({"training.offload=[host, none, none, none]", "cluster.hardware.host_link_bw=1e15"});
  CHECK(c.training.OffloadOf(0, 0) == ActPlace::kHost);
  CHECK(c.training.OffloadOf(1, 1) == ActPlace::kDevice);
  const Table t = Plan(c);
  CHECK(OfKind(t, 0, OpKind::kOffload).size() == 8);
  CHECK(OfKind(t, 1, OpKind::kOffload).empty());  // stage 1 could, but keeps them
  auto doc = YamlDoc::FromString("cfg.yaml", c.resolved_yaml.str());
  REQUIRE(doc.ok());
  REQUIRE(doc->ApplySet("training.offload=[host, none]").ok());
  auto bad = ParseConfig(std::move(*doc));
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("'training.offload' has 2 entries; one per pipeline rank "
                                    "(pp = 4) is needed") != std::string::npos);
}

TEST_CASE(
    "validation: a backward that does not wait for its RELOAD, or reads offloaded "
    "activations") {
  const Table t = Plan(OneF1B({"training.offload=host", "cluster.hardware.host_link_bw=1e15"}));
  const std::string reload = t.str(OfKind(t, 0, OpKind::kReload)[0]);
  auto broken = [&](bool drop_reload) {
    auto j = nlohmann::json::parse(ToJson(t));
    auto& ops = j["ops"];
    size_t at = 0;
    while (ops[at]["op"] != reload) ++at;
    if (drop_reload) {  // the RELOAD gone: B0 reads what is on the host
      for (auto& op : ops)
        if (op.contains("deps")) {
          auto& d = op["deps"];
          d.erase(std::remove(d.begin(), d.end(), at), d.end());
          for (auto& x : d)
            if (x > at) x = x.get<size_t>() - 1;
        }
      ops.erase(at);
    } else {  // B0 no longer depends on it
      for (auto& op : ops)
        if (op["op"] == "r0 B c0 m0") op["deps"].clear();
    }
    auto b = FromJson(j.dump());
    REQUIRE_MESSAGE(b.ok(), b.status().message());
    return ValidatePlan(*b);
  };
  Status s = broken(false);
  CHECK(s.message() == fmt::format("r0 B c0 m0: does not wait for {}", reload));
  s = broken(true);
  CHECK(s.message() == "r0 B c0 m0: reads activations that r0 OFFLOAD c0 m0 moved to host memory");
}

TEST_CASE(
    "host offload: the CPU backend moves the saved tensors out and back, and the check "
    "passes") {
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"}) {
    CAPTURE(policy);
    const Table t =
        Plan(MultimodalConfig(policy, {"training.offload=host", "model.vision.offload=host",
                                       "cluster.hardware.host_link_bw=1e15"}));
    size_t copies = 0;
    for (OpId i = 0; i < t.size(); ++i) copies += IsCopy(t.kind(i));
    CHECK(copies > 0);
    Timeline tl;
    auto r = RunCpuLocal(t, RunOptions{}, true, &tl);
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    CHECK(r->passed());
  }
}

TEST_CASE("memory: auto reaches host offload when it is allowed and the plan does not fit") {
  const std::vector<std::string> fast = {"cluster.hardware.host_link_bw=1e15"};
  const Config base = OneF1B(fast);
  const Table plain = Plan(base);
  const SimResult p = Simulated(base, plain);
  const double act = plain.work(OfKind(plain, 0, OpKind::kF)[0]).mem_delta_bytes;
  // HBM for stage 0's peak less half a micro-batch's activations: 1F1B's 4 do not fit, the
  // 2 of offload do (the first test).
  const double hbm = p.memory[0].peak_bytes - act / 2;
  std::vector<std::string> sets = fast;
  for (std::string s :
       {std::string("training.memory=auto"), std::string("training.memory_policies=[offload]"),
        fmt::format("cluster.hardware.hbm_bytes={}", hbm)})
    sets.push_back(s);
  const Config c = OneF1B(sets);
  MemoryChoice choice;
  auto t = BuildPlan(c, &choice);
  REQUIRE_MESSAGE(t.ok(), t.status().message());
  CHECK(choice.fits);
  CHECK(MemoryModeName(choice.text[0]) == "none+host");
  CHECK(OfKind(*t, 0, OpKind::kOffload).size() == 8);
  // Only what had to move moved: the other stages' plans fit as they were.
  for (int r = 1; r < 4; ++r) CHECK(choice.text[r].place == ActPlace::kDevice);
}

TEST_CASE(
    "remote offload: stages with the highest peaks lend activations to those with the "
    "lowest, evening the peaks") {
  // Interleaved 1F1B: the first stages hold the most chunks in flight.
  const std::vector<std::string> base_sets = {"training.seq_length=4096"};
  auto config = [&](const std::string& offload) {
    std::vector<std::string> sets = base_sets;
    sets.push_back("training.offload=" + offload);
    return SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8, 1, sets);
  };
  const Config none = config("none"), remote = config("[remote, remote, none, none]");
  const Table plain = Plan(none), t = Plan(remote);
  REQUIRE(ValidatePlan(t).ok());
  const SimResult p = Simulated(none, plain), r = Simulated(remote, t);
  auto peaks = [](const SimResult& s) {
    std::vector<double> v;
    for (const RankMemory& m : s.memory) v.push_back(m.peak_bytes);
    return v;
  };
  const std::vector<double> before = peaks(p), after = peaks(r);
  // Holders: the stages that do not offload, lowest peak first, for the offloading stages
  // from the highest peak down, while the holder's peak is the lower.
  std::vector<int32_t> from = {0, 1}, to = {2, 3};
  std::sort(from.begin(), from.end(), [&](int32_t x, int32_t y) { return before[x] > before[y]; });
  std::sort(to.begin(), to.end(), [&](int32_t x, int32_t y) { return before[x] < before[y]; });
  for (int i = 0; i < 2; ++i) {
    CAPTURE(i);
    const int32_t src = from[i], holder = to[i];
    for (OpId o : OfKind(t, src, OpKind::kOffload)) {
      CHECK(t.peer(o) == (before[holder] < before[src] ? holder : -1));
      // Over NVLink (one node): 8 us + bytes / (450 GB/s x 0.80), H100's catalog numbers.
      CHECK(r.durations[o] ==
            doctest::Approx(8e-6 + t.work(o).payload_bytes / (450e9 * 0.80)).epsilon(1e-12));
    }
    // The holder takes at most half the two peaks' difference.
    const double cap = (before[src] - before[holder]) / 2;
    CHECK(r.memory[holder].peak_by_cat[kActHeld] <= cap * (1 + 1e-12));
    CHECK(after[src] <= before[src]);
  }
  const auto [lo0, hi0] = std::minmax_element(before.begin(), before.end());
  const auto [lo1, hi1] = std::minmax_element(after.begin(), after.end());
  CHECK(*hi1 / *lo1 < *hi0 / *lo0);  // more even
  CHECK(*hi1 < *hi0);
  CHECK(r.metrics.held_peak_bytes > 0);
  Timeline tl;
  auto run = RunCpuLocal(t, RunOptions{}, true, &tl);
  REQUIRE_MESSAGE(run.ok(), run.status().message());
  CHECK(run->passed());
}

TEST_CASE("simulate --memory-timeline: each rank's memory at every op, host included") {
  const Config c = OneF1B({"training.offload=host", "cluster.hardware.host_link_bw=1e15"});
  const std::string cfg = fmt::format("/tmp/pipeplan_test_{}_mt.yaml", getpid());
  const std::string out = fmt::format("/tmp/pipeplan_test_{}_mt.json", getpid());
  REQUIRE(WriteFileAtomic(cfg, c.resolved_yaml.str()).ok());
  const RunResult r =
      RunCli(fmt::format("simulate {} --memory-timeline {} --trace-ranks 0", cfg, out));
  REQUIRE_MESSAGE(r.exit_code == 0, r.out);
  const auto j = nlohmann::json::parse(Slurp(out));
  std::remove(cfg.c_str());
  std::remove(out.c_str());
  REQUIRE(j["ranks"].size() == 1);
  const auto& keys = j["keys"];
  REQUIRE(keys.back() == "host");
  REQUIRE(keys[keys.size() - 2] == "total");
  const auto& rank = j["ranks"][0];
  double peak = 0, host_before = 0;
  int offloads = 0;
  std::set<std::string> seen;
  for (const auto& s : rank["samples"]) {
    const std::vector<double> b = s["bytes"];
    double sum = 0;
    for (size_t k = 0; k + 2 < b.size(); ++k) sum += b[k];
    CHECK(b[b.size() - 2] == doctest::Approx(sum));  // the device total
    peak = std::max(peak, sum);
    const std::string op = s["op"];
    // Host memory grows as an OFFLOAD starts (its first sample; the second, at its end,
    // frees the device copy).
    if (op.find("OFFLOAD") != std::string::npos && seen.insert(op).second) {
      CHECK(b.back() > host_before);
      ++offloads;
    }
    host_before = b.back();
  }
  CHECK(offloads == 8);
  CHECK(rank["peak_bytes"].get<double>() == doctest::Approx(peak));
}

TEST_CASE(
    "pipeline ZeRO-2 with host gradients: a reduction and a copy per micro-batch, a double "
    "buffer on the GPU") {
  auto config = [](PipelineKind kind, int vp, std::vector<std::string> sets) {
    sets.push_back("training.zero_stage=2");
    return SmallConfig(kind, 2, vp, 4, 2, sets);
  };
  const Config c = config(PipelineKind::kInterleaved1F1B, 2, {"training.grad_offload=host"});
  const Config plain =
      config(PipelineKind::kInterleaved1F1B, 2, {"training.grad_bucket_size=100000"});
  const Table t = Plan(c);
  REQUIRE(ValidatePlan(t).ok());
  // Rank 0 (stage 0 of replica 0): per chunk, 4 reductions (one per micro-batch) and as many
  // shard copies, then one copy back per chunk before the optimizer step.
  int reduces = 0, out = 0, in = 0;
  double shard = 0;
  OpId step = 0;
  const double params = t.ranks()[0].params[0];  // text parameters per GPU
  for (OpId i = t.rank_begin(0); i < t.rank_end(0); ++i) {
    if (t.kind(i) == OpKind::kReduceScatter) {
      CHECK(t.mb(i) >= 0);  // no reduction at the end of the step
      ++reduces;
    }
    if (t.module(i) == Module::kOptimizer && t.kind(i) == OpKind::kOffload) {
      ++out;
      if (t.mb(i) == 0) shard += t.work(i).payload_bytes;
    }
    if (t.module(i) == Module::kOptimizer && t.kind(i) == OpKind::kReload) ++in;
    if (t.kind(i) == OpKind::kOptStep) step = i;
  }
  CHECK(reduces == 2 * 4);
  CHECK(out == 2 * 4);
  CHECK(shard == doctest::Approx(4 * params / 2));  // fp32, the GPU's 1/dp of both chunks
  CHECK(in == 2);
  CHECK(t.deps(step).size() >= 2);
  // Memory: the GPU keeps two buffers of its largest chunk's fp32 gradients where ZeRO-2
  // keeps its fp32 shard (4 x params / dp) and two buckets (here of 100,000 parameters);
  // the shard lives in host memory. Rank 0's two chunks have the same layers, and the
  // first also the embedding (vocab 1000 x hidden 256): the largest holds
  // (params + 1000 x 256) / 2.
  auto r = RunSimulation(t, SimOptionsFor(c));
  auto p = RunSimulation(Plan(plain), SimOptionsFor(plain));
  REQUIRE(r.ok());
  REQUIRE(p.ok());
  const double largest = (params + 1000 * 256) / 2;
  CHECK(r->memory[0].peak_by_cat[kGrads] - p->memory[0].peak_by_cat[kGrads] ==
        doctest::Approx(2 * 4 * largest - 4 * params / 2 - 2 * 4 * 100000));
  CHECK(r->memory[0].host_peak_bytes == doctest::Approx(4 * params / 2));
  // The tiny model: each micro-batch's reduction carries that micro-batch's gradients, the
  // host partitions sum them, the copies back give the step's gradients.
  for (PipelineKind kind : {PipelineKind::k1F1B, PipelineKind::kZbH1, PipelineKind::kGpipe}) {
    CAPTURE(PipelineName(kind));
    Timeline tl;
    auto run =
        RunCpuLocal(Plan(config(kind, 1, {"training.grad_offload=host"})), RunOptions{}, true, &tl);
    REQUIRE_MESSAGE(run.ok(), run.status().message());
    CHECK(run->passed());
  }
  Timeline tl;
  auto run = RunCpuLocal(t, RunOptions{}, true, &tl);
  REQUIRE_MESSAGE(run.ok(), run.status().message());
  CHECK(run->passed());
}

TEST_CASE(
    "ZeRO-2 on the GPU: every micro-batch's gradients reduce-scattered, the shard and two "
    "buckets in memory") {
  // As DeepSpeed's ZeRO-2: each rank keeps only its shard of the gradients, so it cannot
  // wait for the end of the step to reduce them.
  auto config = [](int zero, std::vector<std::string> sets) {
    sets.push_back(fmt::format("training.zero_stage={}", zero));
    return SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4, 2, sets);
  };
  const Config z2 = config(2, {"training.grad_bucket_size=100000"}), z1 = config(1, {});
  const Table t = Plan(z2), t1 = Plan(z1);
  REQUIRE(ValidatePlan(t).ok());
  // Rank 0: a reduction after each of its 2 chunks x 4 micro-batches' backwards, each of
  // the whole chunk's gradients (fp32), no copy; ZeRO-1 reduces once per chunk at the end.
  std::vector<OpId> reduces, reduces1;
  for (OpId i : OfKind(t, 0, OpKind::kReduceScatter))
    if (t.module(i) == Module::kText) reduces.push_back(i);
  for (OpId i : OfKind(t1, 0, OpKind::kReduceScatter))
    if (t1.module(i) == Module::kText) reduces1.push_back(i);
  REQUIRE(reduces.size() == 2 * 4);
  REQUIRE(reduces1.size() == 2);
  for (OpId i : reduces) {
    CAPTURE(t.str(i));
    CHECK(t.mb(i) >= 0);
    // After that micro-batch's backward of the chunk.
    auto deps = t.deps(i);
    CHECK(std::any_of(deps.begin(), deps.end(), [&](OpId d) {
      return t.kind(d) == OpKind::kB && t.mb(d) == t.mb(i) && t.chunk(d) == t.chunk(i);
    }));
    for (OpId whole : reduces1)
      if (t1.chunk(whole) == t.chunk(i))
        CHECK(t.work(i).payload_bytes == t1.work(whole).payload_bytes);
  }
  CHECK(OfKind(t, 0, OpKind::kOffload).empty());
  // Memory: gradients 4 x params / dp (the fp32 shard) + 2 x 4 x 100,000 (two buckets)
  // against ZeRO-1's 4 x params.
  auto r = RunSimulation(t, SimOptionsFor(z2));
  auto r1 = RunSimulation(t1, SimOptionsFor(z1));
  REQUIRE(r.ok());
  REQUIRE(r1.ok());
  const double params = t.ranks()[0].params[0];
  CHECK(r->memory[0].peak_by_cat[kGrads] == doctest::Approx(4 * params / 2 + 2 * 4 * 100000));
  CHECK(r1->memory[0].peak_by_cat[kGrads] == doctest::Approx(4 * params));
  // With buckets larger than a chunk (the default 40M), a bucket is the largest chunk: rank
  // 0's first chunk also holds the embedding (vocab 1000 x hidden 256), (params + 1000 x
  // 256) / 2 parameters, read from the plan's per-micro-batch reductions.
  const Config wide = config(2, {});
  auto rw = RunSimulation(Plan(wide), SimOptionsFor(wide));
  REQUIRE(rw.ok());
  CHECK(rw->memory[0].peak_by_cat[kGrads] ==
        doctest::Approx(4 * params / 2 + 2 * 4 * (params + 1000 * 256) / 2));
  // The tiny model: the shard sums each micro-batch's reduced gradients; at the optimizer
  // step they are the step's gradients.
  for (PipelineKind kind : {PipelineKind::k1F1B, PipelineKind::kInterleaved1F1B}) {
    CAPTURE(PipelineName(kind));
    Timeline tl;
    auto run = RunCpuLocal(Plan(SmallConfig(kind, 2, kind == PipelineKind::k1F1B ? 1 : 2, 4, 2,
                                            {"training.zero_stage=2"})),
                           RunOptions{}, true, &tl);
    REQUIRE_MESSAGE(run.ok(), run.status().message());
    CHECK(run->passed());
  }
  // Megatron's overlapped reduction is ZeRO 0/1's: an error names the key.
  auto doc = YamlDoc::FromString("cfg.yaml", z1.resolved_yaml.str());
  REQUIRE(doc.ok());
  REQUIRE(doc->ApplySet("training.zero_stage=2").ok());
  REQUIRE(doc->ApplySet("training.overlap_grad_reduce=true").ok());
  auto bad = ParseConfig(std::move(*doc));
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("training.overlap_grad_reduce") != std::string::npos);
  CHECK(bad.status().message().find("reduces every micro-batch's gradients") != std::string::npos);
}

TEST_CASE(
    "ZeRO-2: data-parallel ranks issue their reductions in one order where their W passes differ") {
  // ZBV with a nested encoder: the list scheduler runs W passes early in a rank's gaps, and
  // the gaps differ between the two replicas (their images differ), so a stage's two ranks
  // run their W passes in different orders. Reductions issued in those orders would have
  // each DP member wait in a collective the other issues later (the plan's own validation
  // found the deadlock); every member now issues them in replica 0's order.
  for (const char* host : {"training.grad_offload=none", "training.grad_offload=host"}) {
    CAPTURE(host);
    auto c = LoadConfig(std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml",
                        {"schedule.pipeline=zbv", "parallelism.vp=2", "schedule.modality=nested",
                         "training.microbatches=6", "data.seed=1", "training.zero_stage=2", host});
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    const Table t = Plan(*c);
    REQUIRE(ValidatePlan(t).ok());
    const int pp = t.meta().pp;
    REQUIRE(t.num_ranks() == 2 * pp);
    auto in_order = [&](int32_t r, auto&& pick) {
      std::vector<std::pair<int, int>> out;  // (chunk, micro-batch) in sequence order
      for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i)
        if (t.module(i) == Module::kText && pick(t.kind(i))) out.push_back({t.chunk(i), t.mb(i)});
      return out;
    };
    auto weight = [](OpKind k) { return k == OpKind::kW || k == OpKind::kB; };
    auto reduce = [](OpKind k) { return k == OpKind::kReduceScatter; };
    int differ = 0;
    for (int32_t s = 0; s < pp; ++s) {
      CAPTURE(s);
      differ += in_order(s, weight) != in_order(s + pp, weight);
      CHECK(in_order(s, reduce).size() == in_order(s, weight).size());
      CHECK(in_order(s, reduce) == in_order(s + pp, reduce));
    }
    CHECK(differ > 0);  // the case this test is about
    Timeline tl;
    auto run = RunCpuLocal(t, RunOptions{}, true, &tl);
    REQUIRE_MESSAGE(run.ok(), run.status().message());
    CHECK(run->passed());
  }
}

TEST_CASE("pipeline ZeRO-2 with host gradients: errors name the key") {
  const Config plain = SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 2);
  auto error = [&](std::vector<std::string> sets) {
    auto doc = YamlDoc::FromString("cfg.yaml", plain.resolved_yaml.str());
    REQUIRE(doc.ok());
    for (const std::string& s : sets) REQUIRE(doc->ApplySet(s).ok());
    auto c = ParseConfig(std::move(*doc));
    REQUIRE(!c.ok());
    return c.status().message();
  };
  CHECK(
      error({"training.grad_offload=host"})
          .find("'training.grad_offload: host' (pipeline ZeRO-2) needs 'training.zero_stage: 2'") !=
      std::string::npos);
  CHECK(error({"training.grad_offload=host", "training.zero_stage=2",
               "training.overlap_grad_reduce=true"})
            .find("overlap_grad_reduce applies to zero_stage 0 and 1") != std::string::npos);
}

TEST_CASE("memory: auto lends a stage's activations to another before it offloads to host") {
  // Interleaved 1F1B, no recompute: stage 0 peaks highest; HBM just below its peak.
  auto config = [](std::vector<std::string> sets) {
    sets.push_back("training.seq_length=4096");
    return SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8, 1, sets);
  };
  const Config base = config({});
  auto p = RunSimulation(Plan(base), SimOptionsFor(base));
  REQUIRE(p.ok());
  std::vector<double> peak;
  for (const RankMemory& m : p->memory) peak.push_back(m.peak_bytes);
  const size_t top = std::max_element(peak.begin(), peak.end()) - peak.begin();
  std::vector<double> rest = peak;
  rest.erase(rest.begin() + top);
  const double hbm = (peak[top] + *std::max_element(rest.begin(), rest.end())) / 2;
  const Config c = config({"training.memory=auto", "training.memory_policies=[offload]",
                           fmt::format("cluster.hardware.hbm_bytes={}", hbm)});
  MemoryChoice choice;
  auto t = BuildPlan(c, &choice);
  REQUIRE_MESSAGE(t.ok(), t.status().message());
  CHECK(choice.fits);
  CHECK(choice.peak_bytes <= hbm);
  // The ladder after no recompute: remote (the first rung), for the stage over HBM only.
  for (size_t r = 0; r < peak.size(); ++r)
    CHECK(MemoryModeName(choice.text[r]) == (r == top ? "none+remote" : "none"));
}

TEST_CASE(
    "a rank that offloads the encoder to host and lends the LLM's activations: both kinds, "
    "the holder within its share") {
  const Config c = MultimodalConfig(
      "inline", {"training.offload=[remote, none, none, none]", "model.vision.offload=host",
                 "cluster.hardware.host_link_bw=1e15", "training.recompute=none"});
  const Table t = Plan(c);
  REQUIRE(ValidatePlan(t).ok());
  int host = 0, lent = 0;
  int32_t holder = -1;
  for (OpId o : OfKind(t, 0, OpKind::kOffload)) {
    if (t.peer(o) < 0) {
      CHECK(t.module(o) == Module::kVision);
      ++host;
    } else {
      CHECK(t.module(o) == Module::kText);
      holder = t.peer(o), ++lent;
    }
  }
  CHECK(host > 0);
  const Config none =
      MultimodalConfig("inline", {"model.vision.offload=host", "cluster.hardware.host_link_bw=1e15",
                                  "training.recompute=none"});
  auto p = RunSimulation(Plan(none), SimOptionsFor(none));
  auto r = RunSimulation(t, SimOptionsFor(c));
  REQUIRE(p.ok());
  REQUIRE(r.ok());
  REQUIRE(lent > 0);
  REQUIRE(holder > 0);
  // The holder takes at most half the two peaks' difference.
  CHECK(r->memory[holder].peak_by_cat[kActHeld] <=
        (p->memory[0].peak_bytes - p->memory[holder].peak_bytes) / 2 * (1 + 1e-12));
  CHECK(r->memory[0].peak_bytes <= p->memory[0].peak_bytes);
  Timeline tl;
  auto run = RunCpuLocal(t, RunOptions{}, true, &tl);
  REQUIRE_MESSAGE(run.ok(), run.status().message());
  CHECK(run->passed());
}

TEST_CASE(
    "remote offload of the encoder: under inline the first stage lends its encoder "
    "activations to the stage with the lowest peak") {
  const std::vector<std::string> common = {"cluster.hardware.host_link_bw=1e15",
                                           "training.recompute=none"};
  auto config = [&](const char* place) {
    std::vector<std::string> sets = common;
    sets.push_back(std::string("model.vision.offload=") + place);
    return MultimodalConfig("inline", sets);
  };
  const Config c = config("remote"), plain = config("none");
  const Table t = Plan(c);
  REQUIRE(ValidatePlan(t).ok());
  auto p = RunSimulation(Plan(plain), SimOptionsFor(plain));
  auto r = RunSimulation(t, SimOptionsFor(c));
  REQUIRE(p.ok());
  REQUIRE(r.ok());
  // Inline: only the first stage runs the encoder; the holder is the stage whose peak is
  // the lowest (without offload), and only encoder forwards are lent.
  int32_t lowest = 1;
  for (int32_t s = 2; s < 4; ++s)
    if (p->memory[s].peak_bytes < p->memory[lowest].peak_bytes) lowest = s;
  int lent = 0;
  for (OpId o : OfKind(t, 0, OpKind::kOffload)) {
    CHECK(t.module(o) == Module::kVision);
    CHECK(t.peer(o) == lowest);
    ++lent;
  }
  CHECK(lent > 0);
  for (int32_t s = 1; s < 4; ++s) CHECK(OfKind(t, s, OpKind::kOffload).empty());
  // The holder holds them (act_held) within half the two peaks' difference; the first
  // stage's peak is lower.
  CHECK(r->memory[lowest].peak_by_cat[kActHeld] > 0);
  CHECK(r->memory[lowest].peak_by_cat[kActHeld] <=
        (p->memory[0].peak_bytes - p->memory[lowest].peak_bytes) / 2 * (1 + 1e-12));
  CHECK(r->memory[0].peak_bytes < p->memory[0].peak_bytes);
  // The CPU replay moves the encoder's saved tensors to the holder's store and back.
  Timeline tl;
  auto run = RunCpuLocal(t, RunOptions{}, true, &tl);
  REQUIRE_MESSAGE(run.ok(), run.status().message());
  CHECK(run->passed());
}
