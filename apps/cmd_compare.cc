// pipeplan compare SIMULATED.json MEASURED.json [--calibrate OUT.yaml]
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "apps/common.h"
#include "core/files.h"
#include "planner/yaml_doc.h"
#include "simulator/compare.h"

namespace pipeplan {

Command MakeCompareCommand() {
  struct Options {
    std::string simulated, measured, calibrate;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("simulated", o->simulated, "Chrome trace from simulate --trace")->required();
    app->add_option("measured", o->measured, "Chrome trace from execute --trace")->required();
    app->add_option("--calibrate", o->calibrate, "write fitted efficiency factors (YAML) here");
    app->add_flag("--json", o->json, "print the comparison as JSON");
  };
  c.run = [o]() -> int {
    std::map<std::string, TraceOp> ops[2];
    std::string config;
    for (int k = 0; k < 2; ++k) {
      const std::string& path = k == 0 ? o->simulated : o->measured;
      auto text = ReadFile(path);
      if (!text.ok()) return Report(text.status());
      auto parsed = ReadTraceOps(*text);
      if (!parsed.ok())
        return Report(InvalidInput(fmt::format("{}: {}", path, parsed.status().message())));
      ops[k] = std::move(*parsed);
      if (k == 0) {  // the simulated trace's config (for --calibrate), where it has one
        const auto j = nlohmann::json::parse(*text, nullptr, false);
        if (j.is_object() && j.contains("otherData") && j["otherData"].is_object() &&
            j["otherData"].contains("config") && j["otherData"]["config"].is_string())
          config = j["otherData"]["config"].get<std::string>();
      }
    }
    if (!o->calibrate.empty() && config.empty())
      return Report(InvalidInput(
          fmt::format("{}: --calibrate needs a trace written by simulate (its otherData.config)",
                      o->simulated)));
    Comparison cmp = Compare(ops[0], ops[1]);
    if (cmp.matched == 0)
      return Report(InvalidInput("the two traces have no op in common (not the same plan?)"));
    if (o->json) {
      auto stats = [](const std::map<std::string, ErrorStats>& m) {
        nlohmann::json out = nlohmann::json::object();
        for (const auto& [name, e] : m)
          out[name] = {{"ops", e.ops},
                       {"predicted_s", e.predicted_s},
                       {"measured_s", e.measured_s},
                       {"mean_abs_rel_error", e.mean_abs_rel_error}};
        return out;
      };
      nlohmann::json worst = nlohmann::json::array();
      for (const auto& [op, d] : cmp.worst)
        worst.push_back({{"op", op}, {"measured_minus_predicted_s", d}});
      fmt::print("{}\n", DumpJson(nlohmann::json{{"matched", cmp.matched},
                                                 {"only_simulated", cmp.only_simulated},
                                                 {"only_measured", cmp.only_measured},
                                                 {"predicted_step_s", cmp.predicted_step_s},
                                                 {"measured_step_s", cmp.measured_step_s},
                                                 {"by_module", stats(cmp.by_module)},
                                                 {"by_kind", stats(cmp.by_kind)},
                                                 {"worst", std::move(worst)}}));
    } else {
      fmt::print("{}", ComparisonText(cmp));
    }
    if (!o->calibrate.empty()) {
      auto doc = YamlDoc::FromString(o->simulated + " (config)", config);
      if (!doc.ok()) return Report(doc.status());
      auto cfg = ParseConfig(std::move(*doc));
      if (!cfg.ok()) return Report(cfg.status());
      auto fitted = Calibrate(cfg->cluster.spec, cmp);
      if (!fitted.ok()) return Report(fitted.status());
      if (Status s = WriteFileAtomic(o->calibrate, CalibrationYaml(*fitted, cmp)); !s.ok())
        return Report(s);
      if (!o->json) fmt::print("calibration: {}\n", o->calibrate);
    }
    return 0;
  };
  return c;
}

}  // namespace pipeplan
