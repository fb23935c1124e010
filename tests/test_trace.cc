#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/printf.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "core/chrome_trace.h"
#include "core/trace_lanes.h"
#include "helpers.h"
#include "planner/plan.h"
#include "simulator/compare.h"

using namespace pipeplan;
using namespace pipeplan::test;
using nlohmann::json;

TEST_CASE(
    "Chrome trace: valid JSON, named processes, paired flows, nested slices, memory counters") {
  Config c = SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4, 2);
  Table t = Plan(c);
  SimOptions o = SimOptionsFor(c, false);
  o.memory_curves = true;
  auto r = RunSimulation(t, o);
  REQUIRE(r.ok());
  TraceOptions to;
  to.source = "simulated";
  to.predicted_s = &r->durations;
  const std::string text = ChromeTrace(t, r->timeline, MemoryCounters(r->memory), to);
  CHECK(TraceRuleBroken(text) == "");
  json j = json::parse(text);

  REQUIRE(j.contains("traceEvents"));
  CHECK(j["otherData"]["tool"] == "pipeplan");
  CHECK(j["otherData"]["config"].get<std::string>().find("pipeline: interleaved-1f1b") !=
        std::string::npos);
  std::map<int, int> tid_pid;
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> slices;
  std::map<long, int> flow_s, flow_f;
  std::set<int> named_pids;
  int counters = 0, complete = 0;
  for (const json& e : j["traceEvents"]) {
    std::string ph = e["ph"];
    if (e.contains("ts")) CHECK(e["ts"].get<double>() >= 0);
    if (ph == "M" && e["name"] == "process_name") named_pids.insert(e["pid"].get<int>());
    if (ph == "X") {
      ++complete;
      CHECK(e["dur"].get<double>() >= 0);
      CHECK(e.contains("name"));
      CHECK(e["args"].contains("module"));
      CHECK(e["args"].contains("predicted_us"));
      int tid = e["tid"], pid = e["pid"];
      if (tid_pid.count(tid)) CHECK(tid_pid[tid] == pid);  // tids unique across the file
      tid_pid[tid] = pid;
      slices[{pid, tid}].push_back(
          {e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()});
    }
    if (ph == "s") ++flow_s[e["id"].get<long>()];
    if (ph == "f") {
      ++flow_f[e["id"].get<long>()];
      CHECK(e["bp"] == "e");
    }
    if (ph == "C") {
      ++counters;
      CHECK(e["args"].contains("act_text"));
      CHECK(e["args"].contains("total"));
    }
  }
  CHECK(complete == static_cast<int>(t.size()));
  CHECK(named_pids.size() == static_cast<size_t>(t.num_ranks()));
  CHECK(counters > 0);
  // Every SEND/RECV pair is one arrow.
  size_t pairs = 0;
  for (OpId i = 0; i < t.size(); ++i) pairs += IsRecv(t.kind(i));
  CHECK(flow_s.size() == pairs);
  CHECK(flow_s == flow_f);
  // Slices on one thread never partially overlap (they are sequential here).
  for (auto& [key, v] : slices) {
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i) CHECK(v[i].first >= v[i - 1].second - 1e-6);
  }
}

TEST_CASE("Chrome trace can be limited to some ranks or replicas") {
  Config c = SmallConfig(PipelineKind::k1F1B, 2, 1, 2, 2);
  Table t = Plan(c);
  auto r = RunSimulation(t, SimOptionsFor(c, true));
  REQUIRE(r.ok());
  TraceOptions to;
  to.dp_replicas = {1};
  const std::string text = ChromeTrace(t, r->timeline, {}, to);
  CHECK(TraceRuleBroken(text) == "");
  json j = json::parse(text);
  for (const json& e : j["traceEvents"])
    if (e.contains("pid")) CHECK(t.ranks()[e["pid"].get<int>()].dp == 1);
}

TEST_CASE("traces keep Perfetto's importer rules: zero-bubble and V schedules, many lanes, gzip") {
  const std::string dir = TempDir();
  for (std::string sets : {std::string("--set schedule.pipeline=zbv --set parallelism.vp=2"),
                           std::string("--set schedule.pipeline=dualpipev --set parallelism.vp=2"),
                           std::string("--set schedule.modality=nested")}) {
    CAPTURE(sets);
    const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
    REQUIRE(RunCli("simulate " + cfg + " " + sets + " --trace " + dir + "/t.json").exit_code == 0);
    CHECK(TraceFileRuleBroken(dir + "/t.json") == "");
  }
  // Decoupled puts every encoder transfer of a rank at one time: RECVs need many lanes.
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/qwen3_30b_a3b_vit.yaml";
  REQUIRE(RunCli("simulate " + cfg +
                 " --set schedule.modality=decoupled --trace-ranks 0,1 --trace " + dir +
                 "/d.json.gz")
              .exit_code == 0);
  CHECK(Slurp(dir + "/d.json.gz").substr(0, 2) == "\x1f\x8b");  // gzip magic
  CHECK(TraceFileRuleBroken(dir + "/d.json.gz") == "");
}

TEST_CASE("a trace journal keeps every op that ended, readable when its process died mid-write") {
  const Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  const std::string path = TempDir() + "/journal.json";
  auto j = TraceJournal::Open(path, t, 0);
  REQUIRE(j.ok());
  const OpId a = t.rank_begin(0), b = a + 1;
  (*j)->Append(a, 0.001, 0.002);
  (*j)->Append(b, 0.002, 0.0035);
  // As a killed process leaves it: no closing bracket (the file is not closed), and then a
  // last line cut short.
  const std::string text = Slurp(path);
  for (const std::string& left : {text, text + R"({"ph":"X","name":"r0 F c0)"}) {
    auto ops = ReadTraceOps(left);
    REQUIRE_MESSAGE(ops.ok(), ops.status().message());
    REQUIRE(ops->size() == 2);
    CHECK(ops->at(t.str(a)).start_us == doctest::Approx(1000));
    CHECK(ops->at(t.str(a)).dur_us == doctest::Approx(1000));
    CHECK(ops->at(t.str(b)).start_us == doctest::Approx(2000));
    CHECK(ops->at(t.str(b)).dur_us == doctest::Approx(1500));
    CHECK(ops->at(t.str(b)).kind == std::string(KindName(t.kind(b))));
  }
  (*j)->Remove();
  CHECK(!std::ifstream(path).good());
}

TEST_CASE("Perfetto protobuf trace: the Chrome trace's slices and flows, by Perfetto's rules") {
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  for (const char* sets :
       {"--set schedule.modality=nested", "--set schedule.pipeline=zbv --set parallelism.vp=2"}) {
    CAPTURE(sets);
    REQUIRE(RunCli(fmt::format("simulate {} {} --trace {}/t.pftrace", cfg, sets, dir)).exit_code ==
            0);
    REQUIRE(RunCli(fmt::format("simulate {} {} --trace {}/t.json", cfg, sets, dir)).exit_code == 0);
    PftraceCounts pc;
    CHECK(PftraceRuleBroken(dir + "/t.pftrace", &pc) == "");
    // The JSON trace of the same run: the same op slices and as many flow arrows.
    const json j = json::parse(Slurp(dir + "/t.json"));
    std::multiset<std::string> json_names, pf_names(pc.names.begin(), pc.names.end());
    size_t flows = 0, counter_events = 0;
    for (const json& e : j["traceEvents"]) {
      if (e["ph"] == "X") json_names.insert(e["name"].get<std::string>());
      if (e["ph"] == "f") ++flows;
      if (e["ph"] == "C") ++counter_events;
    }
    CHECK(pc.slices == json_names.size());
    CHECK(pf_names == json_names);
    CHECK(pc.flows == flows);
    CHECK(flows > 0);
    CHECK(pc.counter_values >= counter_events);  // every sample's changed keys, at least one
    // About a third of the JSON's size.
    CHECK(Slurp(dir + "/t.pftrace").size() < Slurp(dir + "/t.json").size() / 2);
  }
  // Gzipped by name, like the JSON trace.
  REQUIRE(RunCli(fmt::format("simulate {} --trace {}/t.pftrace.gz", cfg, dir)).exit_code == 0);
  CHECK(Slurp(dir + "/t.pftrace.gz").substr(0, 2) == "\x1f\x8b");
}

TEST_CASE(
    "k3-scale traces keep the importer rules: Perfetto protobuf of every rank, JSON of one "
    "replica") {
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/k3_scale.yaml";
  const RunResult r = RunCli(fmt::format("simulate {} --trace {}/k3.pftrace", cfg, dir));
  REQUIRE(r.exit_code == 0);
  PftraceCounts pc;
  CHECK(PftraceRuleBroken(dir + "/k3.pftrace", &pc) == "");
  // Every op of the 2,048 ranks: as many slices as the summary counts ops.
  const size_t at = r.out.find("\nops ");
  REQUIRE(at != std::string::npos);
  const long ops = std::stol(r.out.substr(at + 5));
  CHECK(ops > 800000);
  CHECK(pc.slices == static_cast<size_t>(ops));
  CHECK(pc.flows > 100000);
  std::remove((dir + "/k3.pftrace").c_str());
  REQUIRE(RunCli(fmt::format("simulate {} --trace-dp 0 --trace {}/k3.json", cfg, dir)).exit_code ==
          0);
  CHECK(TraceFileRuleBroken(dir + "/k3.json") == "");
}

TEST_CASE("trace numbers: six significant digits as printf's %.6g and fmt's {:.6g} write them") {
  // The writer's own conversion against fmt (the reference the traces were written with):
  // values where %.6g changes notation or rounds a tie, then random bit patterns of every
  // magnitude.
  auto check = [](double v) {
    char text[32];
    const std::string mine(text, trace::General6(v, text));
    const std::string printf_text = fmt::sprintf("%.6g", v);
    REQUIRE_MESSAGE(mine == fmt::format("{:.6g}", v), v);
    REQUIRE_MESSAGE(mine == printf_text, v);
  };
  for (double v : {0.0, -0.0, 1.0, 0.0001, 0.00001, 123456.0, 1234567.0, 999999.4, 999999.5,
                   9.999995e5, 1.0000005, 0.000123456789, 1e-300, 4.9e-324, 1.7976931348623157e308,
                   6212.041, 2.5e-5, 1e15, 3.0e9})
    check(v), check(-v);
  std::mt19937_64 rng(11);
  for (int k = 0; k < 200000; ++k) {
    const double v = std::bit_cast<double>(rng());
    if (std::isfinite(v)) check(v);
    check(std::ldexp(static_cast<double>(rng() >> 11), -40 + static_cast<int>(rng() % 120)));
  }
}
