// pipeplan tune CONFIG [--gpus N] [--objective tokens_per_s|step_time|mfu]
//   [--memory-headroom GiB] [--budget SECONDS] [--top K] [--only KEY=V1,...] [--no-prune]
//   [--jobs N] [--set K=V]... [-o best.yaml] [--json]
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "apps/common.h"
#include "core/files.h"
#include "planner/tune.h"

namespace pipeplan {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

// The objective's value of a point, with its unit.
std::string ObjectiveText(TuneObjective o, const Metrics& m) {
  switch (o) {
    case TuneObjective::kTokensPerS:
      return fmt::format("{:.6g} tokens/s", m.tokens_per_s);
    case TuneObjective::kStepTime:
      return fmt::format("{:.5g} s per step", m.step_time_s);
    case TuneObjective::kMfu:
      return fmt::format("{:.2f} % MFU", 100 * m.mfu);
  }
  return "";
}

// A column's name: the key without its section, five long ones shortened.
std::string ColumnName(const std::string& key) {
  std::string name = key.substr(key.find('.') + 1);
  if (name == "micro_batch_size") return "mbs";
  if (name == "num_layers_in_first_pipeline_stage") return "first";  // 0: even stages
  if (name == "num_layers_in_last_pipeline_stage") return "last";
  if (name == "account_for_embedding_in_pipeline_split") return "emb";
  if (name == "account_for_loss_in_pipeline_split") return "loss";
  return name;
}

// "I/N", or "slurm" (this task's SLURM_PROCID of SLURM_NTASKS).
Status ParseShard(const std::string& spec, int* shard, int* shards) {
  std::string text = spec;
  if (spec == "slurm") {
    const char* id = std::getenv("SLURM_PROCID");
    const char* n = std::getenv("SLURM_NTASKS");
    if (!id || !n) return InvalidInput("--shard slurm: SLURM_PROCID / SLURM_NTASKS are not set");
    text = fmt::format("{}/{}", id, n);
  }
  const size_t slash = text.find('/');
  char* end = nullptr;
  const long i = std::strtol(text.c_str(), &end, 10);
  const bool i_ok = slash != std::string::npos && end == text.c_str() + slash;
  const long n = i_ok ? std::strtol(text.c_str() + slash + 1, &end, 10) : 0;
  if (!i_ok || *end != '\0' || n < 1 || n > 100000 || i < 0 || i >= n)
    return InvalidInput(fmt::format("--shard {}: expected I/N with 0 <= I < N, or slurm", spec));
  *shard = static_cast<int>(i), *shards = static_cast<int>(n);
  return Status::Ok();
}

// Runs `srun --ntasks=N` of this binary's `tune ... --shard slurm`; returns the exit code
// (0 when every shard ended well).
template <typename Options>
int RunShards(const Options& o) {
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) return Report(Internal("--slurm: cannot find this program's path"));
  std::vector<std::string> args = {"srun",
                                   fmt::format("--ntasks={}", o.slurm),
                                   "--kill-on-bad-exit=1",
                                   self,
                                   "tune",
                                   o.config,
                                   "--shard",
                                   "slurm",
                                   "--results",
                                   o.results,
                                   "--objective",
                                   o.objective,
                                   "--top",
                                   std::to_string(o.top)};
  if (o.gpus > 0) args.insert(args.end(), {"--gpus", std::to_string(o.gpus)});
  if (o.jobs > 0) args.insert(args.end(), {"--jobs", std::to_string(o.jobs)});
  if (o.headroom_gib > 0)
    args.insert(args.end(), {"--memory-headroom", fmt::format("{}", o.headroom_gib)});
  if (o.budget_s > 0) args.insert(args.end(), {"--budget", fmt::format("{}", o.budget_s)});
  if (o.no_prune) args.push_back("--no-prune");
  for (const std::string& x : o.only) args.insert(args.end(), {"--only", x});
  for (const std::string& x : o.sets) args.insert(args.end(), {"--set", x});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return Report(Internal("--slurm: fork failed"));
  if (pid == 0) {
    execvp("srun", argv.data());
    fmt::print(stderr, "pipeplan: error: --slurm: cannot run srun: {}\n", std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return Report(Internal("--slurm: waitpid failed"));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return Report(Internal(fmt::format("--slurm: srun of {} shards failed (status {})", o.slurm,
                                       WIFEXITED(status) ? WEXITSTATUS(status) : -1)));
  return 0;
}

}  // namespace

Command MakeTuneCommand() {
  struct Options {
    std::string config, output, objective = "tokens_per_s", results, shard;
    std::vector<std::string> sets, only, resume;
    int gpus = 0, top = 5, jobs = 0, slurm = 0;
    double headroom_gib = 0, budget_s = 0;
    bool json = false, no_prune = false;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("config", o->config, "YAML config (model, data, cluster, global batch)")
        ->required();
    app->add_option("--gpus", o->gpus, "GPUs to plan for (default: the config's cluster)");
    app->add_option("--objective", o->objective, "tokens_per_s (default), step_time or mfu");
    app->add_option("--memory-headroom", o->headroom_gib,
                    "GiB per GPU to leave free beyond the config's reserve");
    app->add_option("--budget", o->budget_s, "stop simulating after this many seconds");
    app->add_option("--top", o->top, "how many of the best points to list (default 5)");
    app->add_option("--only", o->only, "KEY=V1,V2,... restrict an axis (repeatable)");
    app->add_flag("--no-prune", o->no_prune, "simulate every valid point (exhaustive)");
    app->add_option("--jobs", o->jobs, "points simulated at once (default: number of cores)");
    app->add_option("--set", o->sets, "override for every point: key.path=value");
    app->add_option("-o,--output", o->output, "write the best point as a YAML config");
    app->add_flag("--json", o->json, "print every point as JSON");
    app->add_option("--results", o->results,
                    "JSON Lines of the simulated points: read first (resume), appended to");
    app->add_option("--resume", o->resume,
                    "more results files to read (another run's, or shards' to merge)");
    app->add_option("--shard", o->shard,
                    "I/N: simulate only shard I of N (`slurm`: SLURM_PROCID of SLURM_NTASKS)");
    app->add_option("--slurm", o->slurm,
                    "run N shards as one srun step (with --results on a shared file system), "
                    "then merge them");
  };
  c.run = [o]() -> int {
    TuneOptions t;
    auto objective = ParseTuneObjective(o->objective);
    if (!objective.ok()) return Report(objective.status());
    t.objective = *objective;
    if (o->gpus < 0) return Report(InvalidInput(fmt::format("--gpus {}: expected >= 1", o->gpus)));
    if (o->headroom_gib < 0 || o->budget_s < 0)
      return Report(InvalidInput("--memory-headroom and --budget: expected >= 0"));
    t.gpus = o->gpus, t.top_k = o->top, t.prune = !o->no_prune;
    t.headroom_bytes = o->headroom_gib * kGiB, t.budget_s = o->budget_s;
    t.jobs =
        o->jobs > 0 ? o->jobs : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (o->jobs < 0) return Report(InvalidInput(fmt::format("--jobs {}: expected >= 1", o->jobs)));
    for (const std::string& spec : o->only) {
      auto a = ParseVary(spec);
      if (!a.ok()) return Report(a.status());
      t.only.push_back(*a);
    }
    if (!o->shard.empty()) {
      if (Status s = ParseShard(o->shard, &t.shard, &t.shards); !s.ok()) return Report(s);
      if (!o->output.empty() || o->slurm > 0 || o->json)
        return Report(InvalidInput(
            "--shard: a shard's results are merged (--resume or --slurm), not printed with "
            "--json or written with -o or run with --slurm"));
      if (o->results.empty())
        return Report(
            InvalidInput("--shard needs --results FILE: the shard writes FILE.shardIofN"));
    }
    if (o->slurm < 0) return Report(InvalidInput("--slurm N: expected N >= 1"));
    t.results_path = o->results;
    t.resume_from = o->resume;
    if (t.shards > 1 && !o->results.empty())
      t.results_path = fmt::format("{}.shard{}of{}", o->results, t.shard, t.shards);
    if (o->slurm > 0) {
      if (o->results.empty())
        return Report(InvalidInput(
            "--slurm needs --results FILE (on a file system the nodes share): the shards write "
            "FILE.shardIofN, merged into FILE"));
      if (int rc = RunShards(*o); rc != 0) return rc;
      for (int i = 0; i < o->slurm; ++i)
        t.resume_from.push_back(fmt::format("{}.shard{}of{}", o->results, i, o->slurm));
    }
    t.progress = t.shards > 1 ? nullptr : PointProgress("points simulated");
    t.bound_progress = t.shards > 1 ? nullptr : PointProgress("groups of points bounded");
    auto r = RunTune(o->config, o->sets, t);
    if (!r.ok()) return Report(r.status());
    if (t.shards > 1) {
      fmt::print(
          "shard {} of {}: {} simulated, {} pruned by the memory bound, {} by the time bound, "
          "{} not reached within the budget{}\n",
          t.shard, t.shards, r->count(TuneState::kSimulated), r->count(TuneState::kPrunedMemory),
          r->count(TuneState::kPrunedTime), r->count(TuneState::kOverBudget),
          t.results_path.empty() ? "" : "; results in " + t.results_path);
      return 0;
    }
    if (!o->output.empty() && !r->top.empty()) {
      auto yaml = TunedConfigYaml(o->config, o->sets, *r, r->points[r->top[0]]);
      if (!yaml.ok()) return Report(yaml.status());
      const std::string text =
          fmt::format("# pipeplan tune {}: the fastest point that fits ({})\n{}\n", o->config,
                      ObjectiveText(t.objective, r->points[r->top[0]].metrics), *yaml);
      if (Status s = WriteFileAtomic(o->output, text); !s.ok()) return Report(s);
    }
    if (o->json) {
      nlohmann::json points = nlohmann::json::array();
      for (const TunePoint& p : r->points) points.push_back(TunePointJson(r->keys, p));
      nlohmann::json top = nlohmann::json::array();
      for (size_t i : r->top) top.push_back(i);
      nlohmann::json out = {{"gpus", r->gpus},
                            {"global_batch", r->global_batch},
                            {"objective", TuneObjectiveName(t.objective)},
                            {"keys", r->keys},
                            {"top", top},
                            {"configured", TunePointJson(r->keys, r->configured)},
                            {"time_bound_misses", r->time_bound_misses},
                            {"memory_bound_misses", r->memory_bound_misses},
                            {"points", points}};
      fmt::print("{}\n", DumpJson(out));
      return 0;
    }
    fmt::print("tune: {} on {} GPUs, global batch {} samples, objective {}\n", o->config, r->gpus,
               r->global_batch, TuneObjectiveName(t.objective));
    fmt::print(
        "points: {} candidates, {} refused by the config rules; simulated {} ({} read from "
        "results); pruned {} by the memory bound, {} by the time bound; not reached within the "
        "budget {}; failed {}\n"
        "measured: bounds {:.1f} s, simulations {:.1f} s (wall-clock)\n",
        r->points.size(), r->count(TuneState::kInvalid), r->count(TuneState::kSimulated),
        r->resumed, r->count(TuneState::kPrunedMemory), r->count(TuneState::kPrunedTime),
        r->count(TuneState::kOverBudget), r->count(TuneState::kFailed), r->bound_wall_s,
        r->simulate_wall_s);
    if (const PlanShare::Reused& s = r->shared; s.timelines + s.sizings + s.choices > 0)
      fmt::print(
          "shared between plans: {} text-only timelines, {} sizings of the images, {} placements\n",
          s.timelines, s.sizings, s.choices);
    if (r->time_bound_misses + r->memory_bound_misses > 0)
      fmt::print(
          "warning: {} time and {} memory bounds above their simulated values: pruning may have "
          "dropped a better point (please report)\n",
          r->time_bound_misses, r->memory_bound_misses);
    const double capacity = (r->hbm_bytes - r->headroom_bytes) / kGiB;
    if (r->configured.state == TuneState::kSimulated)
      fmt::print("configured: {} (step {:.5g} s, peak {:.2f} GiB of {:.2f} GiB{})\n",
                 ObjectiveText(t.objective, r->configured.metrics),
                 r->configured.metrics.step_time_s, r->configured.metrics.peak_memory_bytes / kGiB,
                 capacity, r->configured.fits ? "" : ": does not fit");
    else
      fmt::print("configured: not simulated: {}\n", r->configured.error);
    if (r->top.empty()) {
      if (r->count(TuneState::kSimulated) == 0 && r->count(TuneState::kOverBudget) > 0)
        fmt::print("no point simulated within the budget of {} s\n", o->budget_s);
      else
        fmt::print("no point fits in {:.2f} GiB per GPU\n", capacity);
      return 1;
    }
    // Columns: each axis as wide as its name (without the section) or its widest value.
    std::vector<size_t> width;
    std::string head = fmt::format("{:>3} ", "#");
    for (size_t a = 0; a < r->keys.size(); ++a) {
      const std::string name = ColumnName(r->keys[a]);
      width.push_back(name.size());
      for (size_t i : r->top) width[a] = std::max(width[a], r->points[i].values[a].size());
      head += fmt::format("{:>{}} ", name, width[a]);
    }
    const bool accounted =
        std::find(r->keys.begin(), r->keys.end(),
                  "parallelism.account_for_embedding_in_pipeline_split") != r->keys.end();
    fmt::print(
        "top {} (of the points that fit; first, last: layers of the first and last pipeline rank, "
        "0 = even{}):\n{}{:>10} {:>12} {:>6} {:>9} {:>9}  {}\n",
        r->top.size(),
        accounted ? "; emb, loss: the embedding, the loss counted as a layer of the split" : "",
        head, "step s", "tokens/s", "MFU %", "peak GiB", "bound s", "Pareto");
    for (size_t n = 0; n < r->top.size(); ++n) {
      const TunePoint& p = r->points[r->top[n]];
      std::string row = fmt::format("{:>3} ", n + 1);
      for (size_t a = 0; a < p.values.size(); ++a)
        row += fmt::format("{:>{}} ", p.values[a], width[a]);
      const Metrics& m = p.metrics;
      fmt::print("{}{:>10.5g} {:>12.6g} {:>6.2f} {:>9.2f} {:>9.4g}  {}\n", row, m.step_time_s,
                 m.tokens_per_s, 100 * m.mfu, m.peak_memory_bytes / kGiB, p.time_bound_s,
                 p.pareto ? "*" : "");
    }
    if (r->configured.state == TuneState::kSimulated && r->configured.metrics.step_time_s > 0)
      fmt::print("best: {:.3f}x the configured step's speed\n",
                 r->configured.metrics.step_time_s / r->points[r->top[0]].metrics.step_time_s);
    size_t front = 0;
    for (const TunePoint& p : r->points) front += p.pareto;
    fmt::print(
        "Pareto frontier (tokens/s vs peak memory, among the simulated points that fit): {} "
        "points; --json lists them\n",
        front);
    if (!o->output.empty()) fmt::print("wrote {}\n", o->output);
    return 0;
  };
  return c;
}

}  // namespace pipeplan
