#include <doctest/doctest.h>

#include <sstream>

#include "core/files.h"
#include "helpers.h"
#include "planner/sweep.h"

using namespace pipeplan;
using namespace pipeplan::test;

TEST_CASE("sweep: grid order, CSV rows, failed points, Pareto marks") {
  std::string dir = TempDir();
  std::string cfg = dir + "/s.yaml";
  REQUIRE(WriteFileAtomic(cfg, R"(cluster: {gpu: H100, nodes: 1, gpus_per_node: 4}
model:
  llm: {layers: 8, hidden: 512, ffn: 2048, heads: 8, vocab: 1000}
parallelism: {pp: 2}
training: {seq_length: 512, microbatches: 4}
)")
              .ok());
  std::vector<VaryAxis> axes = {*ParseVary("parallelism.pp=1,2,3"),
                                *ParseVary("training.recompute=none,full")};
  auto points = RunSweep(cfg, {}, axes, 2, nullptr);
  REQUIRE(points.size() == 6);
  CHECK(points[0].values == std::vector<std::string>{"1", "none"});
  CHECK(points[1].values == std::vector<std::string>{"1", "full"});
  // pp = 3 does not divide 4 GPUs: an error row, not a crash.
  CHECK(!points[4].ok);
  CHECK(points[4].error.find("not divisible by tp*pp*cp") != std::string::npos);
  std::string csv = SweepCsv(axes, points);
  std::istringstream in(csv);
  std::string header;
  std::getline(in, header);
  CHECK(header ==
        "parallelism.pp,training.recompute,step_time_s,bubble_fraction,mfu,tokens_per_s,samples_"
        "per_s,"
        "peak_memory_bytes,oom,pareto,error");
  // Pareto marks checked against the CSV's own numbers: a feasible row is marked iff no
  // other feasible row is at least as good in both throughput and memory and better in one.
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> f;
    std::stringstream ls(line);
    for (std::string x; std::getline(ls, x, ',');) f.push_back(x);
    if (line.back() == ',') f.push_back("");
    rows.push_back(f);
  }
  REQUIRE(rows.size() == 6);
  int marked = 0;
  for (auto& a : rows) {
    if (a[2].empty()) {
      CHECK(a[9] == "0");
      continue;
    }
    bool dominated = false;
    for (auto& b : rows) {
      if (&a == &b || b[2].empty()) continue;
      double at = std::stod(a[5]), am = std::stod(a[7]), bt = std::stod(b[5]), bm = std::stod(b[7]);
      if (bt >= at && bm <= am && (bt > at || bm < am)) dominated = true;
    }
    CHECK(a[9] == (dominated ? "0" : "1"));
    marked += !dominated;
  }
  CHECK(marked >= 1);
  // Recompute trades time for memory at the same pp.
  CHECK(points[0].metrics.peak_memory_bytes > points[1].metrics.peak_memory_bytes);
  CHECK(points[0].metrics.step_time_s < points[1].metrics.step_time_s);
}

TEST_CASE("bad --vary specs") {
  CHECK(ParseVary("parallelism.pp").status().message() ==
        "--vary parallelism.pp: expected KEY=V1,V2,...");
  CHECK(ParseVary("a=1,,2").status().message() == "--vary a=1,,2: empty value");
}
