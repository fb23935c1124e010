// The CLI end to end: exit codes, error text, no output on failure, every shipped config.
#include <dirent.h>
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "core/files.h"
#include "core/table_io.h"
#include "helpers.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

std::vector<std::string> ShippedConfigs() {
  std::vector<std::string> out;
  std::string dir = std::string(PIPEPLAN_SOURCE_DIR) + "/configs";
  DIR* d = opendir(dir.c_str());
  REQUIRE(d != nullptr);
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 5 && n.substr(n.size() - 5) == ".yaml") out.push_back(dir + "/" + n);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("every shipped config plans, and validate accepts the plan") {
  std::string dir = TempDir();
  auto configs = ShippedConfigs();
  CHECK(configs.size() >= 5);
  for (const std::string& c : configs) {
    CAPTURE(c);
    RunResult p = RunCli("plan " + c + " -o " + dir + "/p.pb");
    CHECK_MESSAGE(p.exit_code == 0, p.out);
    RunResult v = RunCli("validate " + dir + "/p.pb");
    CHECK_MESSAGE(v.exit_code == 0, v.out);
  }
}

TEST_CASE("plan output is byte-identical for the same config") {
  std::string dir = TempDir();
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  for (std::string ext : {"pb", "json", "csv"}) {
    REQUIRE(RunCli("plan " + cfg + " -o " + dir + "/a." + ext).exit_code == 0);
    REQUIRE(RunCli("plan " + cfg + " -o " + dir + "/b." + ext).exit_code == 0);
    CHECK(Slurp(dir + "/a." + ext) == Slurp(dir + "/b." + ext));
  }
  REQUIRE(RunCli("simulate " + cfg + " --trace " + dir + "/t1.json").exit_code == 0);
  REQUIRE(RunCli("simulate " + dir + "/a.pb --trace " + dir + "/t2.json").exit_code == 0);
  CHECK(Slurp(dir + "/t1.json") == Slurp(dir + "/t2.json"));
  CHECK(TraceFileRuleBroken(dir + "/t1.json") == "");
}

TEST_CASE("--format torch-csv writes the compute order") {
  std::string dir = TempDir();
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  REQUIRE(RunCli("plan " + cfg + " --format torch-csv -o " + dir + "/o.txt").exit_code == 0);
  std::string csv = Slurp(dir + "/o.txt");
  // pp = 4, vp = 2: rank 0 starts with stage 0 for the first group of 4 micro-batches.
  CHECK(csv.rfind("0F0,0F1,0F2,0F3,4F0,", 0) == 0);
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 4);
}

TEST_CASE("bad input: exit 2, a located message, and no output file") {
  std::string dir = TempDir();
  std::string cfg = dir + "/bad.yaml";
  REQUIRE(
      WriteFileAtomic(cfg,
                      "cluster: {gpu: H100, nodes: 1}\nmodel:\n  llm: {layers: 4, hidden: 64, ffn: "
                      "256, heads: 4, vocab: 10}\n"
                      "training: {seq_length: 64, microbatches: 2}\nschedule: {pipelin: 1f1b}\n")
          .ok());
  RunResult r = RunCli("plan " + cfg + " -o " + dir + "/out.pb");
  CHECK(r.exit_code == 2);
  CHECK(r.out == "pipeplan: error: " + cfg +
                     ":5:12: unknown key 'schedule.pipelin' (did you mean 'pipeline'?)\n"
                     "  schedule: {pipelin: 1f1b}\n"
                     "             ^\n");
  CHECK(!Exists(dir + "/out.pb"));
  RunResult s = RunCli("simulate " + cfg + " --trace " + dir + "/t.json");
  CHECK(s.exit_code == 2);
  CHECK(!Exists(dir + "/t.json"));
  CHECK(RunCli("plan " + dir + "/missing.yaml").exit_code == 2);
  CHECK(RunCli("plan").exit_code == 2);
  CHECK(RunCli("validate " + cfg).exit_code == 2);  // not a plan
}

TEST_CASE("an invalid plan file: exit 3 naming the op") {
  std::string dir = TempDir();
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  REQUIRE(RunCli("plan " + cfg + " -o " + dir + "/p.json").exit_code == 0);
  auto j = nlohmann::json::parse(Slurp(dir + "/p.json"));
  // Drop the dependency of the first RECV: it no longer has a SEND.
  for (auto& op : j["ops"])
    if (op["op"].get<std::string>().find("RECV_F") != std::string::npos) {
      op.erase("deps");
      break;
    }
  REQUIRE(WriteFileAtomic(dir + "/broken.json", j.dump()).ok());
  RunResult r = RunCli("validate " + dir + "/broken.json");
  CHECK(r.exit_code == 3);
  CHECK(r.out ==
        "pipeplan: error: " + dir + "/broken.json: r0 RECV_F c1 m0 <-r3: no matching SEND\n");
}

TEST_CASE("simulate --json has the documented fields") {
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  RunResult r = RunCli("simulate " + cfg + " --json");
  REQUIRE(r.exit_code == 0);
  auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"step_time_s", "bubble_fraction", "mfu", "tokens_per_s", "samples_per_s",
                        "peak_memory_bytes", "oom", "ops", "ranks"})
    CHECK_MESSAGE(j.contains(k), k);
  for (const char* k : {"rank", "pp", "dp", "busy_s", "idle_s", "bubble_fraction",
                        "peak_memory_bytes", "peak_memory_by_module", "memory_at_peak_bytes"})
    CHECK_MESSAGE(j["ranks"][0].contains(k), k);
  // The categories at the peak add up to the peak.
  for (const auto& rank : j["ranks"]) {
    double sum = 0;
    for (auto& [cat, bytes] : rank["memory_at_peak_bytes"].items()) sum += bytes.get<double>();
    CHECK(sum == doctest::Approx(rank["peak_memory_bytes"].get<double>()));
  }
  CHECK(!j.contains("memory_auto"));
}

TEST_CASE("plan and simulate report what training.memory: auto chose, in text and JSON") {
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  const std::string sets = " --set training.memory=auto --set cluster.hardware.hbm_bytes=12e9";
  RunResult text = RunCli("simulate " + cfg + sets);
  REQUIRE(text.exit_code == 0);
  CHECK(text.out.find("\nmemory auto: LLM by pp rank [") != std::string::npos);
  RunResult js = RunCli("simulate " + cfg + sets + " --json");
  REQUIRE(js.exit_code == 0);
  auto j = nlohmann::json::parse(js.out);
  const auto& m = j.at("memory_auto");
  CHECK(m.at("fits") == true);
  CHECK(m.at("by_pp_rank").size() == 4);
  CHECK(m.at("peak_memory_bytes").get<double>() == j.at("peak_memory_bytes").get<double>());
  CHECK(m.at("step_time_s").get<double>() == j.at("step_time_s").get<double>());
  CHECK(m.at("start_peak_memory_bytes").get<double>() > 12e9);
  RunResult plan = RunCli("plan " + cfg + sets + " --json");
  REQUIRE(plan.exit_code == 0);
  CHECK(nlohmann::json::parse(plan.out).at("memory_auto") == m);
}

TEST_CASE("show prints a rank's sequence in the string form") {
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  RunResult r = RunCli("show " + cfg + " --rank 1");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.rfind("rank 1 (dp 0, pp 1): ", 0) == 0);
  CHECK(r.out.find("\n  r1 RECV_F c0 m0 <-r0\n  r1 F c0 m0\n  r1 SEND_F c0 m0 ->r2\n") !=
        std::string::npos);
}

TEST_CASE("plan, validate, show, sweep and compare print JSON with --json") {
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  RunResult plan = RunCli("plan " + cfg + " -o " + dir + "/p.pb --json");
  REQUIRE(plan.exit_code == 0);
  auto pj = nlohmann::json::parse(plan.out);
  const size_t ops = pj.at("ops");
  size_t by_kind = 0;
  for (auto& [kind, n] : pj.at("ops_by_kind").items()) by_kind += n.get<size_t>();
  CHECK(by_kind == ops);
  auto vj = nlohmann::json::parse(RunCli("validate " + dir + "/p.pb --json").out);
  CHECK(vj.at("valid") == true);
  CHECK(vj.at("ops") == ops);
  auto sj = nlohmann::json::parse(RunCli("show " + dir + "/p.pb --json").out);
  size_t shown = 0;
  for (auto& r : sj.at("ranks")) shown += r.at("ops").size();
  CHECK(shown == ops);
  auto sw = nlohmann::json::parse(
      RunCli("sweep " + cfg + " --vary training.microbatches=8,16 --json").out);
  REQUIRE(sw.size() == 2);
  CHECK(sw[0].at("values").at("training.microbatches") == "8");
  REQUIRE(RunCli("simulate " + dir + "/p.pb --trace " + dir + "/s.json").exit_code == 0);
  CHECK(TraceFileRuleBroken(dir + "/s.json") == "");
  auto cj =
      nlohmann::json::parse(RunCli("compare " + dir + "/s.json " + dir + "/s.json --json").out);
  CHECK(cj.at("matched") == ops);
  CHECK(cj.at("only_simulated") == 0);
  // An invalid plan: JSON still, with the error and the validator's exit code.
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  TableColumns cols(&t);
  cols.works()[t.work_id(Find(t, "r0 F c0 m0"))].layer_begin = -1;
  REQUIRE(SavePlan(t, dir + "/bad.pb", PlanFormat::kPb).ok());
  RunResult bad = RunCli("validate " + dir + "/bad.pb --json");
  CHECK(bad.exit_code == 3);
  auto bj = nlohmann::json::parse(bad.out);
  CHECK(bj.at("valid") == false);
  CHECK(bj.at("error").get<std::string>().find("no layer range") != std::string::npos);
}

TEST_CASE("tune writes the best point as a config that plans, and JSON with every point") {
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  const std::string only =
      " --only parallelism.cp=1 --only training.micro_batch_size=1 --only "
      "training.recompute=selective,full --only parallelism.tp=2,4";
  RunResult r = RunCli("tune " + cfg + only + " --top 2 -o " + dir + "/best.yaml");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("top 2 (of the points that fit") != std::string::npos);
  CHECK(r.out.find("configured: ") != std::string::npos);
  CHECK(r.out.find("wrote " + dir + "/best.yaml") != std::string::npos);
  RunResult again = RunCli("simulate " + dir + "/best.yaml --json");
  REQUIRE(again.exit_code == 0);
  auto j = nlohmann::json::parse(RunCli("tune " + cfg + only + " --top 2 --json").out);
  const size_t best = j.at("top")[0];
  CHECK(j.at("points")[best].at("step_time_s").get<double>() ==
        doctest::Approx(nlohmann::json::parse(again.out).at("step_time_s").get<double>()));
  for (const auto& p : j.at("points")) {
    if (p.at("state") != "simulated" || !p.at("fits").get<bool>()) continue;
    CHECK(p.at("step_time_s").get<double>() >=
          j.at("points")[best].at("step_time_s").get<double>());
  }
  RunResult shard = RunCli("tune " + cfg + " --shard 0/2");
  CHECK(shard.exit_code == 2);
  CHECK(shard.out.find("--shard needs --results FILE") != std::string::npos);
  RunResult bad = RunCli("tune " + cfg + " --objective speed");
  CHECK(bad.exit_code == 2);
  CHECK(bad.out.find("--objective speed") != std::string::npos);
}
