// Benchmarks (not tests): plan generation, validation, plan file I/O, engine and simulator
// throughput, replanning, CLI start-up, trace writing, memory per op (measured RSS).
//   build/bench/pipeplan_bench [--benchmark_filter=...]
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <malloc.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/chrome_trace.h"
#include "core/table_io.h"
#include "executor/process_map.h"
#include "executor/runner.h"
#include "planner/plan.h"
#include "planner/validate.h"
#include "simulator/engine.h"
#include "simulator/metrics.h"

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

const std::string kK3 = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/k3_scale.yaml";

Config K3Config(std::vector<std::string> sets = {}) {
  auto c = LoadConfig(kK3, sets);
  if (!c.ok()) throw std::runtime_error(c.status().message());
  return *c;
}

// Memory as the kernel counts it: resident set now, and its peak since the last reset.
size_t StatusKiB(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stoul(line.substr(std::strlen(field)));
  return 0;
}
size_t RssBytes() {
  return StatusKiB("VmRSS:") * 1024;
}
size_t PeakRssBytes() {
  return StatusKiB("VmHWM:") * 1024;
}
void ResetPeakRss() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

// Peak RSS above the resident set before `f` ran, per op. Freed memory is handed back to
// the system first, so that what `f` allocates shows in the resident set.
template <typename F>
double MeasuredBytesPerOp(size_t ops, F&& f) {
  malloc_trim(0);
  const size_t before = RssBytes();
  ResetPeakRss();
  f();
  return static_cast<double>(PeakRssBytes() - std::min(before, PeakRssBytes())) / ops;
}

// Runs a command; returns its wall seconds and peak RSS (bytes). A child inherits the
// peak RSS of the process it was spawned from, so the command is started by a fresh,
// small copy of this program (`--run-measured`, see main) that reports both numbers.
std::pair<double, double> RunProcess(const std::vector<std::string>& argv) {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) throw std::runtime_error("cannot find this program");
  std::string cmd = std::string(self, len) + " --run-measured";
  for (const std::string& a : argv) cmd += " '" + a + "'";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot start " + argv[0]);
  double s = 0, rss = 0;
  const int n = std::fscanf(p, "%lf %lf", &s, &rss);
  if (pclose(p) != 0 || n != 2) throw std::runtime_error(argv[0] + " " + argv[1] + " failed");
  return {s, rss};
}

// The measuring side of RunProcess: runs argv, prints "seconds peak_rss_bytes"; exit 1 when
// the command fails.
int RunMeasured(char** argv) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  const auto t0 = std::chrono::steady_clock::now();
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[0], &fa, nullptr, argv, environ) != 0) return 1;
  int status = 0;
  rusage ru{};
  wait4(pid, &status, 0, &ru);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%.9f %.0f\n", s, ru.ru_maxrss * 1024.0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

// A scratch file in the temporary directory ($TMPDIR, else /tmp): where it lies is what
// the writers' rows measure besides formatting (a disk's page cache, or tmpfs).
std::string BenchFile(std::string_view ext) {
  return (std::filesystem::temp_directory_path() /
          fmt::format("pipeplan_bench_{}{}", getpid(), ext))
      .string();
}

void SetOpsRate(benchmark::State& state, size_t ops) {
  state.counters["ops"] = static_cast<double>(ops);
  state.counters["ops_per_s"] =
      benchmark::Counter(static_cast<double>(ops), benchmark::Counter::kIsIterationInvariantRate);
}

// Engine passes as `simulate` runs them: the table's index built once, each pass reusing the
// previous pass's timeline. Memory (measured): the index, and one pass from fresh buffers.
void RunEngine(benchmark::State& state, const Table& t, const std::vector<double>& dur) {
  StatusOr<EngineIndex> index = Internal("not built");
  state.counters["index_bytes_per_op"] =
      MeasuredBytesPerOp(t.size(), [&] { index = IndexForEngine(t); });
  if (!index.ok()) return state.SkipWithError(index.status().message().c_str());
  state.counters["engine_bytes_per_op"] = MeasuredBytesPerOp(t.size(), [&] {
    auto tl = Simulate(t, dur, *index);
    benchmark::DoNotOptimize(tl);
  });
  Timeline tl;
  for (auto _ : state) {
    auto next = Simulate(t, dur, *index, std::move(tl));
    if (!next.ok()) return state.SkipWithError("simulation failed");
    tl = std::move(next).value();
  }
  SetOpsRate(state, t.size());
  state.counters["table_bytes_per_op"] = static_cast<double>(t.MemoryBytes()) / t.size();
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

// JSON plan files (save to disk, load back), on a plan of about 1.4 M ops; s_per_Mop is
// the time per million ops.
void BM_PlanSaveJson(benchmark::State& state) {
  const Table t = MustPlan(BenchConfig(8, 1, 64, 512));
  const std::string out = BenchFile(".json");
  for (auto _ : state)
    if (Status s = SavePlan(t, out, PlanFormat::kJson); !s.ok())
      state.SkipWithError(s.message().c_str());
  std::remove(out.c_str());
  state.counters["ops"] = static_cast<double>(t.size());
  state.counters["s_per_Mop"] = benchmark::Counter(
      t.size() / 1e6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_PlanSaveJson)->Unit(benchmark::kMillisecond)->MinTime(2);

void BM_PlanLoadJson(benchmark::State& state) {
  const Table t = MustPlan(BenchConfig(8, 1, 64, 512));
  const std::string out = BenchFile(".json");
  if (Status s = SavePlan(t, out, PlanFormat::kJson); !s.ok())
    return state.SkipWithError(s.message().c_str());
  for (auto _ : state) {
    auto back = LoadPlan(out);
    if (!back.ok() || back->size() != t.size()) state.SkipWithError("load failed");
    benchmark::DoNotOptimize(back);
  }
  std::remove(out.c_str());
  state.counters["ops"] = static_cast<double>(t.size());
  state.counters["s_per_Mop"] = benchmark::Counter(
      t.size() / 1e6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_PlanLoadJson)->Unit(benchmark::kMillisecond)->MinTime(2);

void BM_Engine(benchmark::State& state) {
  Config c = BenchConfig(16, 2, 128, 256);  // about 6.2M ops
  Table t = MustPlan(c);
  std::vector<double> dur = SimOptionsFor(c).cost.Durations(t);
  RunEngine(state, t, dur);
}
BENCHMARK(BM_Engine)->Unit(benchmark::kMillisecond)->MinTime(2);

// The engine alone on the K3-scale multimodal plan (4,096 GPUs).
void BM_EngineK3(benchmark::State& state) {
  const Config c = K3Config();
  const Table t = MustPlan(c);
  RunEngine(state, t, SimOptionsFor(c).cost.Durations(t));
}
BENCHMARK(BM_EngineK3)->Unit(benchmark::kMillisecond)->MinTime(2);

// What `simulate` computes: durations, engine passes (link contention), memory, metrics,
// the hidden fractions.
void BM_SimulateK3(benchmark::State& state) {
  const Config c = K3Config();
  const Table t = MustPlan(c);
  const SimOptions o = SimOptionsFor(c);
  for (auto _ : state) {
    auto r = RunSimulation(t, o);
    if (!r.ok()) state.SkipWithError("simulation failed");
    benchmark::DoNotOptimize(r);
  }
  SetOpsRate(state, t.size());
}
// Rates over wall time: parts of the work run on both cores.
BENCHMARK(BM_SimulateK3)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();

// What `plan` computes before writing: the table, then its validation.
void BM_PlanK3(benchmark::State& state) {
  const Config c = K3Config();
  size_t ops = 0;
  double validate_s = 0;
  for (auto _ : state) {
    Table t = MustPlan(c);
    const auto t0 = std::chrono::steady_clock::now();
    if (!ValidatePlan(t).ok()) state.SkipWithError("validation failed");
    validate_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ops = t.size();
  }
  SetOpsRate(state, ops);
  state.counters["validate_ops_per_s"] =
      static_cast<double>(ops) * state.iterations() / std::max(validate_s, 1e-9);
}
BENCHMARK(BM_PlanK3)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();

// Validation alone, on the K3-scale plan.
void BM_ValidateK3(benchmark::State& state) {
  const Table t = MustPlan(K3Config());
  for (auto _ : state)
    if (!ValidatePlan(t).ok()) return state.SkipWithError("validation failed");
  SetOpsRate(state, t.size());
}
BENCHMARK(BM_ValidateK3)->Unit(benchmark::kMillisecond)->MinTime(2);

// The engine's time per op as the K3-scale plan grows (nodes x1/2 to x16): the slope of
// log(time) over log(ops) by least squares (1 = linear).
void BM_EngineScalingK3(benchmark::State& state) {
  std::vector<double> x, y;
  for (int nodes : {256, 512, 1024, 2048, 4096, 8192}) {
    const Config c = K3Config({fmt::format("cluster.nodes={}", nodes)});
    const Table t = MustPlan(c);
    const std::vector<double> dur = SimOptionsFor(c).cost.Durations(t);
    auto index = IndexForEngine(t);
    if (!index.ok()) return state.SkipWithError(index.status().message().c_str());
    double best = 1e30;  // the fastest of 3 passes, reusing the timeline as simulate does
    Timeline tl;
    for (int k = 0; k < 4; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      auto next = Simulate(t, dur, *index, std::move(tl));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!next.ok()) return state.SkipWithError("simulation failed");
      tl = std::move(next).value();
      if (k > 0) best = std::min(best, s);
    }
    x.push_back(std::log(static_cast<double>(t.size())));
    y.push_back(std::log(best));
    state.counters[fmt::format("ns_per_op_{}n", nodes)] = best / t.size() * 1e9;
  }
  for (auto _ : state) {
  }
  const double n = x.size();
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i)
    sx += x[i], sy += y[i], sxx += x[i] * x[i], sxy += x[i] * y[i];
  state.counters["slope"] = (n * sxy - sx * sy) / (n * sxx - sx * sx);
}
BENCHMARK(BM_EngineScalingK3)->Unit(benchmark::kMillisecond)->Iterations(1);

// Planning one step of the K3-scale config on 1,024 GPUs with a fresh batch of images and
// every search `plan` runs: the config, data, balancing, dynamic CP sub-groups, the
// sizings and bubble-fill's rule sets (with its text timeline), lowering. One new seed per
// iteration.
void BM_SearchK3Step(benchmark::State& state) {
  uint64_t seed = 0;
  size_t ops = 0;
  for (auto _ : state) {
    auto c = LoadConfig(kK3, {fmt::format("cluster.nodes={}", state.range(0)),
                              fmt::format("data.seed={}", ++seed)});
    if (!c.ok()) return state.SkipWithError(c.status().message().c_str());
    Table t = MustPlan(*c);
    ops = t.size();
    benchmark::DoNotOptimize(t);
  }
  state.counters["ops"] = static_cast<double>(ops);
}
BENCHMARK(BM_SearchK3Step)
    ->Arg(128)
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2)
    ->UseRealTime();

// Replanning one step of the same (Replanner): the first step's searches kept, the step's
// own images placed with its sizing and rule set. One new seed per iteration. /0: the
// placement alone (Replanner::Options::check off); /1: with the step's simulation and its
// fallbacks where it runs out of memory, as `plan --steps` runs it.
// The replanner keeps what a step frees (Replanner::Options::keep_memory): the process
// does from here on (benchmarks after this one that measure memory trim it themselves,
// MeasuredBytesPerOp, or run in a process of their own).
void BM_ReplanK3Step(benchmark::State& state) {
  const Config c = K3Config({fmt::format("cluster.nodes={}", state.range(0))});
  auto r = Replanner::Start(c, {.check = state.range(1) != 0});
  if (!r.ok()) return state.SkipWithError(r.status().message().c_str());
  uint64_t seed = 0;
  size_t ops = 0;
  for (auto _ : state) {
    auto t = r->Plan(++seed);
    if (!t.ok()) return state.SkipWithError(t.status().message().c_str());
    ops = t->size();
    benchmark::DoNotOptimize(t);
  }
  state.counters["ops"] = static_cast<double>(ops);
  // Steps planned again: the list scheduler's second pass, run beside the lowering of the
  // first's placement, was faster (Replanner::lowered_again).
  state.counters["lowered_again"] = static_cast<double>(r->lowered_again());
  state.counters["steps"] = static_cast<double>(seed);
}
BENCHMARK(BM_ReplanK3Step)
    ->Args({128, 0})
    ->Args({512, 0})
    ->Args({128, 1})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2)
    ->UseRealTime();

// What the warm start costs in step time: over ten steps (seeds 1-10), each step's
// replanned plan against its own full search (simulated step times; ratio > 1: the
// replanned step is slower), and in how many steps the search kept the first step's
// choice. On the K3-scale config (1,024 GPUs) and the understanding workload under nested
// and bubble-fill.
void ReplanQuality(benchmark::State& state, const std::string& path,
                   std::vector<std::string> sets) {
  auto c = LoadConfig(path, sets);
  if (!c.ok()) return state.SkipWithError(c.status().message().c_str());
  // The first step's choices on every step; the allocator left as it is (the quality
  // alone is measured here).
  auto r = Replanner::Start(*c, {.check = false, .keep_memory = false});
  if (!r.ok()) return state.SkipWithError(r.status().message().c_str());
  auto step_s = [&](const Table& t) {
    SimOptions o = SimOptionsFor(*c);
    o.exposure = false;
    auto sim = RunSimulation(t, o);
    if (!sim.ok()) throw std::runtime_error(sim.status().message());
    return sim->metrics.step_time_s;
  };
  double sum = 0, worst = 0;
  int same = 0, steps = 0;
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    auto replanned = r->Plan(seed);
    sets.push_back(fmt::format("data.seed={}", seed));
    auto k = LoadConfig(path, sets);
    sets.pop_back();
    if (!k.ok()) return state.SkipWithError(k.status().message().c_str());
    auto searched = Replanner::Start(*k, {.keep_memory = false});
    if (!replanned.ok() || !searched.ok()) return state.SkipWithError("plan failed");
    const double ratio = step_s(*replanned) / step_s(searched->first());
    sum += ratio, worst = std::max(worst, ratio), ++steps;
    same += searched->choice() == r->choice();
  }
  for (auto _ : state) {
  }
  state.counters["step_ratio_mean"] = sum / steps;
  state.counters["step_ratio_max"] = worst;
  state.counters["same_choice"] = same;
}
const std::string kQwen = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/qwen3_30b_a3b_vit.yaml";
BENCHMARK_CAPTURE(ReplanQuality, k3_1024gpus, kK3, {"cluster.nodes=128"})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_CAPTURE(ReplanQuality, qwen_nested, kQwen, {"schedule.modality=nested"})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);
BENCHMARK_CAPTURE(ReplanQuality, qwen_bubble_fill, kQwen, {"schedule.modality=bubble-fill"})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

// CLI start-up: `pipeplan --version` as a process (wall time and peak RSS).
void BM_CliStartup(benchmark::State& state) {
  double rss = 0;
  for (auto _ : state) {
    auto [s, peak] = RunProcess({PIPEPLAN_BIN, "--version"});
    state.SetIterationTime(s);
    rss = peak;
  }
  state.counters["peak_rss_MiB"] = rss / (1 << 20);
}
BENCHMARK(BM_CliStartup)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(1);

// Memory of `plan` on the K3-scale config: the process's peak RSS above start-up, per op.
void BM_PlanProcessMemoryK3(benchmark::State& state) {
  const std::string out = fmt::format("/tmp/pipeplan_bench_{}.pb", getpid());
  double bytes_per_op = 0;
  for (auto _ : state) {
    const double startup = RunProcess({PIPEPLAN_BIN, "--version"}).second;
    auto [s, peak] = RunProcess({PIPEPLAN_BIN, "plan", kK3, "-o", out});
    state.SetIterationTime(s);
    auto t = LoadPlan(out);
    if (!t.ok()) return state.SkipWithError("cannot read the plan back");
    bytes_per_op = (peak - startup) / t->size();
    state.counters["ops"] = static_cast<double>(t->size());
  }
  std::remove(out.c_str());
  state.counters["bytes_per_op"] = bytes_per_op;
}
BENCHMARK(BM_PlanProcessMemoryK3)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(3);

// The Chrome trace of the simulated K3-scale step: ops/s and the peak memory it takes
// above the plan and timeline, per op.
void BM_TraceK3(benchmark::State& state) {
  const Config c = K3Config();
  const Table t = MustPlan(c);
  auto sim = RunSimulation(t, SimOptionsFor(c));
  if (!sim.ok()) return state.SkipWithError("simulation failed");
  const std::string out = BenchFile(".json");
  auto write = [&] {
    auto s = WriteChromeTrace(out, t, sim->timeline, {}, TraceOptions{});
    if (!s.ok()) state.SkipWithError(s.status().message().c_str());
  };
  state.counters["held_bytes_per_op"] = MeasuredBytesPerOp(t.size(), write);
  for (auto _ : state) write();
  std::remove(out.c_str());
  SetOpsRate(state, t.size());
}
// Over wall time: the file is written on a thread of its own.
BENCHMARK(BM_TraceK3)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();

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
  auto c = LoadConfig(kK3, {"cluster.nodes=128"});
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

int main(int argc, char** argv) {
  if (argc > 2 && std::string_view(argv[1]) == "--run-measured") return RunMeasured(argv + 2);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
