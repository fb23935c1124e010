// pipeplan plan CONFIG [-o FILE] [--format pb|json|torch-csv|torch-csv-comms|chakra]
//                     [--replica D] [--steps N [--manifests PATTERN]]
//                     [--set K=V]...
#include <fmt/format.h>

#include <chrono>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "apps/common.h"
#include "core/chakra.h"
#include "core/files.h"
#include "core/table_io.h"
#include "core/torch_csv.h"
#include "planner/plan.h"
#include "planner/validate.h"

namespace pipeplan {

namespace {

std::string WithStep(std::string pattern, int step) {
  const size_t at = pattern.find("{step}");
  if (at != std::string::npos) pattern.replace(at, 6, std::to_string(step));
  return pattern;
}

// `plan --steps N`: step k's plan (k = 0 .. N-1) from the Replanner, validated, written to
// the output pattern with {step} = k; one line (or JSON object) per step.
template <typename Options>
int PlanSteps(const Options& o) {
  const bool many = o.steps > 1;
  if (many && !o.output.empty() && o.output.find("{step}") == std::string::npos)
    return Report(
        InvalidInput(fmt::format("--steps {}: -o {} has no {{step}}", o.steps, o.output)));
  if (!o.manifests.empty() && o.manifests.find("{step}") == std::string::npos && many)
    return Report(InvalidInput(fmt::format("--manifests {} has no {{step}}", o.manifests)));
  std::vector<std::string> sets = o.sets;
  if (!o.manifests.empty()) sets.push_back("data.manifest=" + WithStep(o.manifests, 0));
  auto config = LoadConfig(o.config, sets);
  if (!config.ok()) return Report(config.status());
  PlanFormat format = PlanFormat::kPb;
  if (!o.output.empty()) {
    auto pf = o.format.empty() ? FormatFromPath(WithStep(o.output, 0)) : ParsePlanFormat(o.format);
    if (!pf.ok()) return Report(pf.status());
    if (*pf != PlanFormat::kPb && *pf != PlanFormat::kJson)
      return Report(InvalidInput("--steps writes plan files: .pb or .json"));
    format = *pf;
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto replanner = Replanner::Start(*config, {.check = true});
  if (!replanner.ok()) return Report(replanner.status());
  double searched_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  FILE* out = o.output == "-" ? stderr : stdout;
  nlohmann::json steps = nlohmann::json::array();
  for (int k = 0; k < o.steps; ++k) {
    const uint64_t seed = config->data.seed + static_cast<uint64_t>(k);
    const std::string manifest = o.manifests.empty() ? "" : WithStep(o.manifests, k);
    const auto t0 = Clock::now();
    StatusOr<Table> planned =
        k == 0 ? StatusOr<Table>(replanner->first()) : replanner->Plan(seed, manifest);
    if (!planned.ok()) return Report(planned.status());
    const double ms =
        k == 0 ? searched_ms : std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (Status v = ValidatePlan(*planned); !v.ok()) return Report(v);
    const std::string path = WithStep(o.output, k);
    if (!path.empty())
      if (Status s = SavePlan(*planned, path, format); !s.ok()) return Report(s);
    const std::string images =
        manifest.empty() ? fmt::format("seed {}", seed) : fmt::format("manifest {}", manifest);
    const ReplanStep& sim = *replanner->last();  // each step simulated (check)
    if (o.json) {
      steps.push_back({{"step", k},
                       {"images", images},
                       {"ops", planned->size()},
                       {"planned_ms", ms},
                       {"searched", k == 0},
                       {"predicted_step_s", sim.step_s},
                       {"oom", sim.oom},
                       {"searched_again", sim.searched},
                       {"output", path}});
    } else {
      const std::string how = k == 0 ? "searched"
                              : sim.searched
                                  ? "searched again (out of memory with step 0's choices)"
                                  : "placed with step 0's choices";
      fmt::print(out, "step {} ({}): {} ops, {}, predicted {:.3f} s{}, measured {:.1f} ms{}\n", k,
                 images, planned->size(), how, sim.step_s, sim.oom ? " OUT OF MEMORY" : "", ms,
                 path.empty() ? "" : ", wrote " + path);
      std::fflush(out);
    }
  }
  if (o.json) fmt::print(out, "{}\n", DumpJson({{"steps", steps}}));
  return 0;
}

}  // namespace

Command MakePlanCommand() {
  struct Options {
    std::string config, output, format;
    std::vector<std::string> sets;
    bool json = false;
    int replica = 0;
    int steps = 0;
    std::string manifests;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("config", o->config, "YAML config")->required();
    app->add_option("-o,--output", o->output,
                    "plan file to write (.pb, .json or .csv), or with chakra the prefix of the "
                    "per-rank files PREFIX.<rank>.et");
    app->add_option("--format", o->format,
                    "pb | json | torch-csv | torch-csv-comms | chakra (default: from the file "
                    "name; .csv is torch-csv, .et chakra)");
    app->add_option("--replica", o->replica,
                    "torch-csv: the DP replica whose ranks are written (one row per pp rank)")
        ->default_val(0);
    app->add_option(
           "--steps", o->steps,
           "plan this many training steps one after another, each with its own images "
           "(data.seed + step, or --manifests): the first with every search, the later "
           "ones with the first's choices (a warm start; each step simulated, and searched again "
           "where it runs out of memory with them); -o is then a pattern with {step}")
        ->check(CLI::PositiveNumber);
    app->add_option("--manifests", o->manifests,
                    "with --steps: each step's samples from this manifest, a path with {step}");
    app->add_option("--set", o->sets, "override a config key: key.path=value (repeatable)");
    app->add_flag("--json", o->json, "print the summary as JSON");
  };
  c.run = [o]() -> int {
    if (o->steps > 0) return PlanSteps(*o);
    if (!o->manifests.empty()) return Report(InvalidInput("--manifests goes with --steps"));
    auto config = LoadConfig(o->config, o->sets);
    if (!config.ok()) return Report(config.status());
    MemoryChoice memory;
    auto table = BuildPlan(*config, &memory);
    if (!table.ok()) return Report(table.status());
    if (Status v = ValidatePlan(*table); !v.ok()) return Report(v);
    std::string wrote = o->output;
    if (!o->output.empty()) {
      auto pf = o->format.empty() ? FormatFromPath(o->output) : ParsePlanFormat(o->format);
      if (!pf.ok()) return Report(pf.status());
      const PlanFormat f = *pf;
      const bool csv_format = f == PlanFormat::kTorchCsv || f == PlanFormat::kTorchCsvComms;
      if (o->replica != 0 && !csv_format)
        return Report(InvalidInput("--replica applies to torch-csv and torch-csv-comms only"));
      if (csv_format) {
        size_t left_out = 0;
        auto csv = ToTorchCsv(*table, o->replica, f == PlanFormat::kTorchCsvComms, &left_out);
        if (!csv.ok()) return Report(csv.status());
        if (Status s = WriteFileAtomic(o->output, *csv); !s.ok()) return Report(s);
        if (left_out > 0)
          fmt::print(stderr,
                     "warning: {} vision, generator and host copy ops are not in {} "
                     "(PyTorch's schedule has no action for them)\n",
                     left_out, o->output);
      } else if (f == PlanFormat::kChakra) {
        std::string prefix = o->output;
        if (std::string_view(prefix).ends_with(".et")) prefix.resize(prefix.size() - 3);
        if (prefix == "-") return Report(InvalidInput("chakra: -o names a file prefix, not -"));
        // Compute durations from the cost model (no contention: a network simulator such as
        // ASTRA-sim times the communication itself).
        auto written = WriteChakraTraces(
            *table, prefix, SimOptionsFor(WithChoice(*config, memory)).cost.Durations(*table));
        if (!written.ok()) return Report(written.status());
        wrote = fmt::format("{}.<rank>.et ({} files, {:.1f} MiB)", prefix, table->num_ranks(),
                            *written / 1048576.0);
      } else if (Status s = SavePlan(*table, o->output, f); !s.ok()) {
        return Report(s);
      }
    }
    // The summary goes to stderr when the plan itself goes to stdout (-o -).
    FILE* out = o->output == "-" ? stderr : stdout;
    const Table& t = *table;
    const PlanMeta& m = t.meta();
    std::map<std::string, size_t> by_kind;
    for (OpId i = 0; i < t.size(); ++i) {
      std::string k(KindName(t.kind(i)));
      if (t.module(i) != Module::kText && t.module(i) != Module::kOptimizer)
        k = fmt::format("{}.{}", ModuleName(t.module(i)), k);
      ++by_kind[k];
    }
    if (o->json) {
      nlohmann::json j = {{"schedule", m.schedule},
                          {"modality", m.modality},
                          {"ranks", t.num_ranks()},
                          {"dp", m.dp},
                          {"pp", m.pp},
                          {"vp", m.vp},
                          {"tp", m.tp},
                          {"cp", m.cp},
                          {"ep", m.ep},
                          {"gpus", config->world()},
                          {"microbatches_per_replica", m.microbatches},
                          {"ops", t.size()},
                          {"ops_by_kind", by_kind},
                          {"output", wrote}};
      if (config->training.memory_auto) j["memory_auto"] = MemoryChoiceJson(memory);
      fmt::print(out, "{}\n", DumpJson(j));
      return 0;
    }
    fmt::print(out, "plan: {} ({} ranks = dp {} x pp {}; vp {}, tp {}, cp {}, ep {}; {} GPUs)\n",
               m.schedule, t.num_ranks(), m.dp, m.pp, m.vp, m.tp, m.cp, m.ep, config->world());
    fmt::print(out, "micro-batches: {} per replica, {} per step\n", m.microbatches,
               m.microbatches * m.dp);
    fmt::print(out, "ops: {}\n", t.size());
    for (auto& [k, n] : by_kind) fmt::print(out, "  {:<22} {}\n", k, n);
    if (config->training.memory_auto)
      fmt::print(out, "memory auto: {}\n", MemoryChoiceText(memory));
    if (!wrote.empty()) fmt::print(out, "wrote {}\n", wrote);
    return 0;
  };
  return c;
}

}  // namespace pipeplan
