// pipeplan plan CONFIG [-o FILE] [--format pb|json|torch-csv|torch-csv-comms|chakra]
//                     [--replica D]
//                     [--set K=V]...
#include <fmt/format.h>

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

Command MakePlanCommand() {
  struct Options {
    std::string config, output, format;
    std::vector<std::string> sets;
    bool json = false;
    int replica = 0;
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
    app->add_option("--set", o->sets, "override a config key: key.path=value (repeatable)");
    app->add_flag("--json", o->json, "print the summary as JSON");
  };
  c.run = [o]() -> int {
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
