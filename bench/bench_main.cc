// Benchmarks (not tests): plan generation, plan file I/O, engine throughput.
//   build/bench/pipeplan_bench [--benchmark_filter=...]
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "core/table_io.h"
#include "executor/process_map.h"
#include "executor/runner.h"
#include "planner/plan.h"
#include "simulator/engine.h"

using namespace pipeplan;

namespace {

// A text-only config sized by (pp, dp, m): ops ~ dp * pp * m * 2 * vp * 3.
Config BenchConfig(int pp, int vp, int dp, int m) {
  std::string yaml =
      fmt::format(R"(
cluster: {{gpu: H100, nodes: {}, gpus_per_node: 8}}
model:
  llm: {{layers: {}, hidden: 4096, ffn: 11008, heads: 32, vocab: 32000}}
parallelism: {{tp: 8, pp: {}, vp: {}}}
training: {{seq_length: 4096, microbatches: {}}}
schedule: {{pipeline: {}}}
)",
                  pp * dp, 2 * pp * vp, pp, vp, m, vp > 1 ? "interleaved-1f1b" : "1f1b");
  auto doc = YamlDoc::FromString("bench.yaml", yaml);
  auto c = ParseConfig(std::move(*doc));
  if (!c.ok()) throw std::runtime_error(c.status().message());
  return *c;
}

Table MustPlan(const Config& c) {
  auto t = BuildPlan(c);
  if (!t.ok()) throw std::runtime_error(t.status().message());
  return std::move(t).value();
}

void BM_PlanGeneration(benchmark::State& state) {
  Config c = BenchConfig(8, 2, 64, 256);  // about 1.5M ops
  size_t ops = 0;
  for (auto _ : state) {
    Table t = MustPlan(c);
    ops = t.size();
    benchmark::DoNotOptimize(t);
  }
  state.counters["ops"] = static_cast<double>(ops);
  state.counters["ops_per_s"] =
      benchmark::Counter(static_cast<double>(ops), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PlanGeneration)->Unit(benchmark::kMillisecond)->MinTime(2);

void BM_PlanWritePb(benchmark::State& state) {
  Table t = MustPlan(BenchConfig(8, 1, 64, 512));  // about 1.4M ops
  for (auto _ : state) benchmark::DoNotOptimize(SerializePb(t));
  state.counters["ops"] = static_cast<double>(t.size());
  state.counters["bytes"] = static_cast<double>(SerializePb(t).size());
}
BENCHMARK(BM_PlanWritePb)->Unit(benchmark::kMillisecond);

void BM_PlanReadPb(benchmark::State& state) {
  Table t = MustPlan(BenchConfig(8, 1, 64, 512));
  std::string bytes = SerializePb(t);
  for (auto _ : state) {
    auto back = ParsePb(bytes);
    if (!back.ok()) state.SkipWithError("parse failed");
    benchmark::DoNotOptimize(back);
  }
  state.counters["ops"] = static_cast<double>(t.size());
}
BENCHMARK(BM_PlanReadPb)->Unit(benchmark::kMillisecond);

void BM_PlanWriteJson(benchmark::State& state) {
  Table t = MustPlan(BenchConfig(8, 1, 64, 512));
  for (auto _ : state) benchmark::DoNotOptimize(ToJson(t));
  state.counters["ops"] = static_cast<double>(t.size());
}
BENCHMARK(BM_PlanWriteJson)->Unit(benchmark::kMillisecond)->Iterations(1);

void BM_Engine(benchmark::State& state) {
  Config c = BenchConfig(16, 2, 128, 256);  // about 6.2M ops
  Table t = MustPlan(c);
  std::vector<double> dur = SimOptionsFor(c).cost.Durations(t);
  for (auto _ : state) {
    auto tl = Simulate(t, dur);
    if (!tl.ok()) state.SkipWithError("simulation failed");
    benchmark::DoNotOptimize(tl);
  }
  // Engine state per op: timeline (2 doubles), durations (1 double), state byte, send->recv map.
  double engine_bytes = 2 * sizeof(double) + sizeof(double) + 1 + sizeof(OpId);
  state.counters["ops"] = static_cast<double>(t.size());
  state.counters["ops_per_s"] = benchmark::Counter(static_cast<double>(t.size()),
                                                   benchmark::Counter::kIsIterationInvariantRate);
  state.counters["table_bytes_per_op"] = static_cast<double>(t.MemoryBytes()) / t.size();
  state.counters["engine_bytes_per_op"] = engine_bytes;
}
BENCHMARK(BM_Engine)->Unit(benchmark::kMillisecond)->MinTime(2);

// Replanning one step of the K3-scale config on 1,024 GPUs with a fresh batch of images:
// data, balancing, dynamic CP sub-groups, bubble-fill placement (with its text timeline),
// lowering. One new seed per iteration.
void BM_ReplanK3Step(benchmark::State& state) {
  const std::string path = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/k3_scale.yaml";
  uint64_t seed = 0;
  size_t ops = 0;
  for (auto _ : state) {
    auto c = LoadConfig(path, {"cluster.nodes=128", fmt::format("data.seed={}", ++seed)});
    if (!c.ok()) return state.SkipWithError(c.status().message().c_str());
    Table t = MustPlan(*c);
    ops = t.size();
    benchmark::DoNotOptimize(t);
  }
  state.counters["ops"] = static_cast<double>(ops);
}
BENCHMARK(BM_ReplanK3Step)->Unit(benchmark::kMillisecond)->MinTime(2);

// Executor overhead: the runner and in-process transport with a backend that does no work,
// so the time per op is what the executor adds (dispatch, timing, mailbox, wake-ups).
class NullBackend : public Backend {
 public:
  Status Compute(OpId) override { return Status::Ok(); }
  StatusOr<Tensor> Outgoing(OpId) override { return Tensor{}; }
  Status Incoming(OpId, Tensor) override { return Status::Ok(); }
  StatusOr<Tensor> Contribution(OpId) override { return Tensor{}; }
  Status Reduced(OpId, Tensor) override { return Status::Ok(); }
};

void BM_ExecutorOverhead(benchmark::State& state) {
  const int pp = static_cast<int>(state.range(0));
  Table t = MustPlan(BenchConfig(pp, 1, 1, 2048));
  for (auto _ : state) {
    std::vector<std::unique_ptr<Backend>> backends;
    for (int r = 0; r < t.num_ranks(); ++r) backends.push_back(std::make_unique<NullBackend>());
    Timeline tl;
    Status s = RunLocal(t, backends, RunOptions{}, &tl);
    if (!s.ok()) state.SkipWithError(s.message().c_str());
  }
  state.counters["ops"] = static_cast<double>(t.size());
  // Wall time per op of one rank's sequence (ranks run in parallel threads).
  state.counters["s_per_op"] = benchmark::Counter(
      static_cast<double>(t.size()) / t.num_ranks(),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_ExecutorOverhead)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// One process per GPU on the K3-scale plan (1,024 GPUs): the process map, every
// communicator the NCCL backend creates, and their split rounds (what each process
// computes before it joins NCCL).
void BM_CommunicatorPlanK3(benchmark::State& state) {
  const std::string path = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/k3_scale.yaml";
  auto c = LoadConfig(path, {"cluster.nodes=128"});
  if (!c.ok()) return state.SkipWithError(c.status().message().c_str());
  Table t = MustPlan(*c);
  int64_t gpus = 0;
  for (const RankInfo& r : t.ranks()) gpus += r.gpus;
  CommPlan cp;
  for (auto _ : state) {
    auto pm = MapProcesses(t, static_cast<int32_t>(gpus));
    if (!pm.ok()) return state.SkipWithError(pm.status().message().c_str());
    cp = PlanCommunicators(t, *pm);
    benchmark::DoNotOptimize(cp);
  }
  state.counters["gpus"] = static_cast<double>(gpus);
  state.counters["communicators"] = static_cast<double>(cp.members.size());
  state.counters["rounds"] = cp.rounds;
}
BENCHMARK(BM_CommunicatorPlanK3)->Unit(benchmark::kMillisecond);

// Baseline: a bare dependent pass over 10M pre-ordered ops (start = max(prev end, x)).
void BM_BarePass(benchmark::State& state) {
  const size_t n = 10'000'000;
  std::vector<double> dur(n, 1.0), start(n), end(n);
  for (auto _ : state) {
    double t = 0;
    for (size_t i = 0; i < n; ++i) {
      start[i] = t;
      t = end[i] = t + dur[i];
    }
    benchmark::DoNotOptimize(end.data());
  }
  state.counters["ops_per_s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_BarePass)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
