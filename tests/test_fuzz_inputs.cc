#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "core/chrome_trace.h"
#include "core/table_io.h"
#include "core/torch_csv.h"
#include "fuzz/targets.h"
#include "helpers.h"
#include "planner/plan.h"
#include "planner/sweep.h"
#include "simulator/metrics.h"

namespace fs = std::filesystem;

// Every input a fuzzer once crashed on (tests/fuzz/TARGET/*, added by scripts/fuzz.sh's
// user when fixing it) runs through its target again: under the sanitizer build, any
// memory error, undefined behaviour or escaping exception fails the suite.
TEST_CASE("fuzz: past crash inputs of every target run clean") {
  const fs::path root = fs::path(PIPEPLAN_SOURCE_DIR) / "tests" / "fuzz";
  size_t inputs = 0;
  for (const auto& [name, target] : pipeplan::fuzz::kTargets) {
    const fs::path dir = root / std::string(name);
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (!entry.is_regular_file()) continue;
      CAPTURE(entry.path().string());
      std::ifstream in(entry.path(), std::ios::binary);
      std::stringstream bytes;
      bytes << in.rdbuf();
      const std::string s = bytes.str();
      target(reinterpret_cast<const uint8_t*>(s.data()), s.size());
      ++inputs;
    }
  }
  MESSAGE(inputs << " inputs replayed");
}

// Each target accepts a valid input of its format (written by the project's own writers)
// and refuses the same bytes truncated, or another format's.
TEST_CASE("fuzz: each target accepts its format and refuses broken or foreign bytes") {
  using namespace pipeplan;
  const Config c = test::MultimodalConfig("nested");
  const Table t = test::Plan(c);
  auto sim = RunSimulation(t, SimOptionsFor(c));
  REQUIRE(sim.ok());
  const std::string dir = test::TempDir();
  REQUIRE(SavePlan(t, dir + "/p.pb", PlanFormat::kPb).ok());
  REQUIRE(SavePlan(t, dir + "/p.json", PlanFormat::kJson).ok());
  size_t left = 0;
  const std::vector<VaryAxis> axes = {{"parallelism.pp", {"2", "4"}}};
  std::vector<SweepPoint> points = ExpandGrid(axes);
  for (SweepPoint& p : points) p.ok = true, p.metrics = sim->metrics;
  MarkPareto(&points);
  const std::map<std::string, std::string> valid = {
      {"config", test::Slurp(std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml")},
      {"manifest",
       "{\"id\": \"a\", \"text_tokens\": 512, \"images\": [[224, 224]]}\n"
       "{\"id\": \"b\", \"text_tokens\": 1500}\n{\"id\": \"c\", \"text_tokens\": 1500}\n"
       "{\"id\": \"d\", \"text_tokens\": 1500, \"videos\": [[2, 224, 224]]}\n"},
      {"calibration", "cluster:\n  hardware:\n    compute_efficiency: 0.5\n"},
      {"plan_pb", test::Slurp(dir + "/p.pb")},
      {"plan_json", test::Slurp(dir + "/p.json")},
      {"trace", ChromeTrace(t, sim->timeline, {}, {})},
      {"torch_csv",
       ToTorchCsv(test::Plan(test::SmallConfig(PipelineKind::k1F1B, 2, 1, 4)), 0, false, &left)
           .value()},
      {"megatron",
       test::Slurp(std::string(PIPEPLAN_SOURCE_DIR) + "/configs/megatron/llama3_70b.sh")},
      {"sweep_csv", SweepCsv(axes, points)},
  };
  auto run = [](fuzz::Target target, const std::string& bytes) {
    return target(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  };
  for (const auto& [name, target] : fuzz::kTargets) {
    CAPTURE(std::string(name));
    const std::string& good = valid.at(std::string(name));
    CHECK(run(target, good));
    CHECK(target(nullptr, 0) == (name == "calibration"));  // an empty calibration is no change
    CHECK(!run(target, good.substr(0, good.size() / 2) + "\x01{["));
    const std::string& foreign = valid.at(name == "plan_pb" ? "trace" : "plan_pb");
    CHECK(!run(target, foreign));
  }
}
