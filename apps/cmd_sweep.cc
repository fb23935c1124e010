// pipeplan sweep CONFIG --vary KEY=V1,V2,... [--vary ...] [--set K=V]... [-o results.csv] [--jobs
// N]
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "apps/common.h"
#include "core/files.h"
#include "planner/sweep.h"

namespace pipeplan {

Command MakeSweepCommand() {
  struct Options {
    std::string config, output;
    std::vector<std::string> vary, sets;
    int jobs = 0;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("config", o->config, "YAML config")->required();
    app->add_option("--vary", o->vary, "KEY=V1,V2,... (repeatable; cartesian product)")->required();
    app->add_option("--set", o->sets, "fixed override for every point: key.path=value");
    app->add_option("-o,--output", o->output, "CSV file to write");
    app->add_option("--jobs", o->jobs, "parallel points (default: number of cores)");
    app->add_flag("--json", o->json, "print the points as JSON");
  };
  c.run = [o]() -> int {
    std::vector<VaryAxis> axes;
    for (const std::string& v : o->vary) {
      auto a = ParseVary(v);
      if (!a.ok()) return Report(a.status());
      axes.push_back(*a);
    }
    if (auto n = GridSize(axes); !n.ok()) return Report(n.status());
    if (o->jobs < 0) return Report(InvalidInput(fmt::format("--jobs {}: expected >= 1", o->jobs)));
    // The base config must load: a broken file is an error, not a sweep of failed rows.
    if (auto base = LoadConfig(o->config, o->sets); !base.ok()) return Report(base.status());
    int jobs =
        o->jobs > 0 ? o->jobs : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    auto points = RunSweep(o->config, o->sets, axes, jobs, PointProgress());
    if (!o->output.empty())
      if (Status s = WriteFileAtomic(o->output, SweepCsv(axes, points)); !s.ok()) return Report(s);
    if (o->json) {
      nlohmann::json out = nlohmann::json::array();
      for (const SweepPoint& p : points) {
        nlohmann::json values = nlohmann::json::object();
        for (size_t a = 0; a < axes.size(); ++a) values[axes[a].key] = p.values[a];
        nlohmann::json row = {{"values", values}, {"ok", p.ok}, {"error", p.error}};
        if (p.ok)
          row.update({{"step_time_s", p.metrics.step_time_s},
                      {"bubble_fraction", p.metrics.bubble_fraction},
                      {"mfu", p.metrics.mfu},
                      {"tokens_per_s", p.metrics.tokens_per_s},
                      {"peak_memory_bytes", p.metrics.peak_memory_bytes},
                      {"oom", p.metrics.oom},
                      {"pareto", p.pareto}});
        out.push_back(std::move(row));
      }
      fmt::print("{}\n", DumpJson(out));
      return 0;
    }
    std::string head;
    for (const VaryAxis& a : axes) head += fmt::format("{:>24} ", a.key);
    fmt::print("{}{:>12} {:>8} {:>7} {:>14} {:>10}  {}\n", head, "step s", "bubble%", "MFU%",
               "tokens/s", "peak GiB", "pareto / error");
    for (const SweepPoint& p : points) {
      std::string row;
      for (const std::string& v : p.values) row += fmt::format("{:>24} ", v);
      if (p.ok) {
        const Metrics& m = p.metrics;
        row += fmt::format("{:>12.5g} {:>8.2f} {:>7.2f} {:>14.6g} {:>10.2f}  {}", m.step_time_s,
                           100 * m.bubble_fraction, 100 * m.mfu, m.tokens_per_s,
                           m.peak_memory_bytes / (1024.0 * 1024 * 1024), p.pareto ? "*" : p.error);
      } else {
        row += fmt::format("{:>12} {:>8} {:>7} {:>14} {:>10}  error: {}", "-", "-", "-", "-", "-",
                           p.error);
      }
      fmt::print("{}\n", row);
    }
    fmt::print("* = Pareto-optimal in (tokens/s, peak memory) among points that fit in memory\n");
    if (!o->output.empty()) fmt::print("wrote {}\n", o->output);
    return 0;
  };
  return c;
}

}  // namespace pipeplan
