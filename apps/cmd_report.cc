// pipeplan report CONFIG|PLAN|SWEEP.csv [-o report.html] [--set K=V]...
#include <fmt/format.h>

#include <filesystem>
#include <memory>

#include "apps/common.h"
#include "core/files.h"
#include "planner/plan.h"
#include "report/html_report.h"

namespace pipeplan {

Command MakeReportCommand() {
  struct Options {
    std::string input, output = "report.html";
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("input", o->input,
                    "YAML config or plan file (a simulated step), or a sweep's CSV")
        ->required();
    app->add_option("-o,--output", o->output, "HTML file to write");
    app->add_option("--set", o->sets, "override a config key: key.path=value (repeatable)");
  };
  c.run = [o]() -> int {
    const std::string title = std::filesystem::path(o->input).filename().string();
    std::string html;
    std::string what;
    if (std::string_view(o->input).ends_with(".csv")) {
      if (!o->sets.empty())
        return Report(InvalidInput("--set applies to a config, not a sweep CSV"));
      auto csv = ReadFile(o->input);
      if (!csv.ok()) return Report(csv.status());
      auto page = SweepReportHtml(o->input, *csv);
      if (!page.ok()) return Report(page.status());
      html = std::move(*page);
      what = "sweep";
    } else {
      auto in = LoadInput(o->input, o->sets);
      if (!in.ok()) return Report(in.status());
      SimOptions so = SimOptionsFor(in->config);
      so.memory_curves = true;
      auto sim = RunSimulation(in->table, so);
      if (!sim.ok()) return Report(sim.status());
      StepReportInput ri;
      ri.title = title;
      ri.table = &in->table;
      ri.sim = &*sim;
      ri.config_yaml = in->table.meta().config_yaml;
      html = StepReportHtml(ri);
      what = fmt::format("step of {:.4f} s, {} ops{}", sim->metrics.step_time_s, in->table.size(),
                         in->table.size() > kMaxDrawnOps ? " (schedule drawn aggregated)" : "");
    }
    if (Status s = WriteFileAtomic(o->output, html); !s.ok()) return Report(s);
    fmt::print("wrote {} ({}; {:.0f} KiB)\n", o->output, what, html.size() / 1024.0);
    return 0;
  };
  return c;
}

}  // namespace pipeplan
