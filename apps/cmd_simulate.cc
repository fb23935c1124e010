// pipeplan simulate CONFIG|PLAN [--set K=V]... [--json] [--trace FILE] [--memory-timeline FILE]
// [--cost real|unit]
#include <fmt/format.h>

#include <memory>

#include "apps/common.h"
#include "core/chrome_trace.h"
#include "core/files.h"
#include "core/trace_lanes.h"
#include "planner/plan.h"
#include "planner/yaml_doc.h"

namespace pipeplan {

Command MakeSimulateCommand() {
  struct Options {
    std::string input, trace, cost = "real", calibration, memory_timeline;
    std::vector<std::string> sets;
    std::vector<int32_t> trace_ranks, trace_dp;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("input", o->input, "YAML config or plan file")->required();
    app->add_option("--set", o->sets, "override a config key: key.path=value (repeatable)");
    app->add_flag("--json", o->json, "print metrics as JSON");
    app->add_option("--trace", o->trace,
                    "write a trace: Chrome JSON (.json, .json.gz), or Perfetto protobuf "
                    "(.pftrace, .pftrace.gz)");
    app->add_option("--memory-timeline", o->memory_timeline,
                    "write each rank's memory at every op with a memory effect (JSON), by "
                    "category, device total and host");
    app->add_option("--trace-ranks", o->trace_ranks,
                    "limit the trace (and the memory timeline) to these ranks")
        ->delimiter(',');
    app->add_option("--trace-dp", o->trace_dp,
                    "limit the trace (and the memory timeline) to these DP replicas")
        ->delimiter(',');
    app->add_option("--calibration", o->calibration,
                    "a calibration file written by compare --calibrate");
    app->add_option("--cost", o->cost,
                    "real (hardware cost model) or unit (F = I = W = 1, B = 2, communication 0)")
        ->check(CLI::IsMember({"real", "unit"}));
  };
  c.run = [o]() -> int {
    std::vector<std::string> sets = o->sets;
    if (!o->calibration.empty()) {
      auto cal = YamlDoc::FromFile(o->calibration);
      if (!cal.ok()) return Report(cal.status());
      auto leaves = cal->LeafAssignments();
      if (!leaves.ok()) return Report(leaves.status());
      for (const std::string& s : *leaves) sets.push_back(s);
    }
    auto in = LoadInput(o->input, sets);
    if (!in.ok()) return Report(in.status());
    for (int32_t r : o->trace_ranks)
      if (r < 0 || r >= in->table.num_ranks())
        return Report(InvalidInput(fmt::format("--trace-ranks {}: the plan has ranks 0..{}", r,
                                               in->table.num_ranks() - 1)));
    for (int32_t d : o->trace_dp)
      if (d < 0 || d >= in->table.meta().dp)
        return Report(InvalidInput(
            fmt::format("--trace-dp {}: the plan has replicas 0..{}", d, in->table.meta().dp - 1)));
    SimOptions so = SimOptionsFor(in->config, o->cost == "unit");
    so.memory_curves = !o->trace.empty() || !o->memory_timeline.empty();
    auto sim = RunSimulation(in->table, so);
    if (!sim.ok()) return Report(sim.status());
    if (!o->trace.empty()) {
      TraceOptions to;
      to.ranks = o->trace_ranks, to.dp_replicas = o->trace_dp, to.source = "simulated";
      to.predicted_s = &sim->durations;
      if (Status s =
              WriteTrace(o->trace, in->table, sim->timeline, MemoryCounters(sim->memory), to);
          !s.ok())
        return Report(s);
    }
    if (!o->memory_timeline.empty()) {
      TraceOptions to;
      to.ranks = o->trace_ranks, to.dp_replicas = o->trace_dp;
      const nlohmann::json j =
          MemoryTimelineJson(in->table, sim->memory, trace::IncludedRanks(in->table, to));
      if (Status s = WriteFileAtomic(o->memory_timeline, DumpJson(j)); !s.ok()) return Report(s);
    }
    if (o->json) {
      nlohmann::json j = MetricsJson(sim->metrics);
      if (in->memory) j["memory_auto"] = MemoryChoiceJson(*in->memory);
      fmt::print("{}\n", DumpJson(j));
    } else {
      fmt::print("{}: {} on {} x {} ({} cost model)\n", o->input, in->table.meta().schedule,
                 in->config.cluster.nodes * in->config.cluster.gpus_per_node,
                 in->config.cluster.spec.name, o->cost);
      fmt::print("{}", MetricsText(sim->metrics));
      if (in->memory)  // the search itself always prices with the real cost model
        fmt::print("memory auto: {}{}\n", MemoryChoiceText(*in->memory),
                   o->cost == "unit" ? " (searched with the real cost model)" : "");
      if (!o->trace.empty()) fmt::print("trace: {}\n", o->trace);
    }
    return 0;
  };
  return c;
}

}  // namespace pipeplan
