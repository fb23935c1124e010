// Work that runs on threads of its own in the planner, simulator and trace writer (also run
// under ThreadSanitizer: scripts/test_sanitizers.sh).
#include <doctest/doctest.h>

#include <atomic>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/chrome_trace.h"
#include "core/parallel.h"
#include "helpers.h"
#include "planner/plan.h"
#include "simulator/metrics.h"

using namespace pipeplan;
using namespace pipeplan::test;

TEST_CASE("RunParallel runs every index once, within its thread limit, and rethrows") {
  for (size_t most : {0, 1, 3}) {
    CAPTURE(most);
    std::vector<std::atomic<int>> runs(1000);
    RunParallel(
        runs.size(), [&](size_t i) { ++runs[i]; }, most);
    for (const auto& r : runs) CHECK(r == 1);
  }
  std::atomic<int> after{0};
  CHECK_THROWS_AS(RunParallel(
                      100,
                      [&](size_t i) {
                        if (i == 7) throw std::runtime_error("seven");
                        ++after;
                      },
                      2),
                  std::runtime_error);
  CHECK(after < 100);  // the others stop taking work once one has thrown
}

TEST_CASE("Chrome trace streams in pieces, and the sink's first error stops it") {
  // Enough ops for several pieces of about 1 MiB (a few hundred bytes per op).
  Config c = SmallConfig(PipelineKind::k1F1B, 4, 1, 64, 16);
  Table t = Plan(c);
  auto r = RunSimulation(t, SimOptionsFor(c, true));
  REQUIRE(r.ok());
  const std::string whole = ChromeTrace(t, r->timeline, {}, {});
  REQUIRE(whole.size() > 3 * (size_t{1} << 20));
  std::vector<size_t> sizes;
  std::string joined;
  const std::function<Status(std::string_view)> keep = [&](std::string_view piece) {
    sizes.push_back(piece.size());
    joined.append(piece);
    return Status::Ok();
  };
  REQUIRE(StreamChromeTrace(t, r->timeline, {}, {}, keep).ok());
  CHECK(joined == whole);
  CHECK(sizes.size() >= 3);
  int calls = 0;
  const std::function<Status(std::string_view)> full = [&](std::string_view) {
    return ++calls == 2 ? InvalidInput("disk full") : Status::Ok();
  };
  const Status s = StreamChromeTrace(t, r->timeline, {}, {}, full);
  CHECK(!s.ok());
  CHECK(s.message() == "disk full");
  CHECK(calls == 2);  // nothing handed over after the error
}

TEST_CASE("simulate: a table large enough for both cores gives the same result every time") {
  // dp 64 x pp 4 x 64 micro-batches: above kParallelFromOps ops and transfers, so the
  // contention sweep runs in parts and the exposure pass beside memory and metrics.
  Config c = SmallConfig(PipelineKind::k1F1B, 4, 1, 64, 64,
                         {"cluster.nodes=32", "cluster.gpus_per_node=8"});
  const Table t = Plan(c);
  REQUIRE(t.size() >= kParallelFromOps);
  auto a = RunSimulation(t, SimOptionsFor(c));
  auto b = RunSimulation(t, SimOptionsFor(c));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->durations == b->durations);
  CHECK(a->timeline.start == b->timeline.start);
  CHECK(a->timeline.end == b->timeline.end);
  CHECK(MetricsJson(a->metrics) == MetricsJson(b->metrics));
  // Transfers between nodes contended: some durations moved off their uncontended values.
  const std::vector<double> base = SimOptionsFor(c).cost.Durations(t);
  size_t stretched = 0;
  for (OpId i = 0; i < t.size(); ++i) stretched += a->durations[i] > base[i];
  CHECK(stretched > 0);
}
